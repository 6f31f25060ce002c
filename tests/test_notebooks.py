"""The example notebooks run top to bottom (with ``MCSSVI_NB_QUICK=1``: small data, few draws).

Each notebook is executed by nbclient in a fresh ``python3`` kernel, a separate
process that ``tests/conftest.py``'s ``FAST_COMPILE`` setting does not reach. The
kernel keeps PyTensor's default mode on purpose: the notebooks run NUTS, which is
much slower with Python-level operations (all four notebooks took 79 s with a warm
compile cache and 178 s with a cold one on 2 cores; 137 s with ``FAST_COMPILE``).
The stored outputs in ``notebooks/`` come from full runs (``make notebooks``) and
are not touched.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))

#: Seconds a single cell may take before the test fails.
CELL_TIMEOUT = 600


def test_notebooks_found():
    assert len(NOTEBOOKS) >= 4, [p.name for p in NOTEBOOKS]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")

    nb = nbformat.read(path, as_version=4)
    env = dict(os.environ, MCSSVI_NB_QUICK="1")
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT,
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute(env=env)  # raises CellExecutionError, with the cell and traceback, on failure

    # every notebook prints quick=... in its first code cell: the flag must have reached the kernel
    first = next(c for c in nb.cells if c.cell_type == "code")
    text = "".join(o.get("text", "") for o in first.outputs if o.output_type == "stream")
    assert "quick=True" in text, text
