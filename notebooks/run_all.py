"""Execute the example notebooks with nbclient.

``python notebooks/run_all.py`` runs every notebook in this folder with the full
settings and stores the outputs in place (``make notebooks``). ``--quick`` sets
``MCSSVI_NB_QUICK=1`` for the kernel (small data, few iterations, as in CI) and
does not write the notebooks unless ``--inplace`` is given. Notebook names,
name prefixes (``01``) or paths restrict the run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: Seconds a single cell may run before the execution fails.
CELL_TIMEOUT = 1200


def notebook_paths(names=None) -> list[Path]:
    """The notebooks in this folder, in order, or those named in ``names``."""
    paths = sorted(HERE.glob("[0-9][0-9]_*.ipynb"))
    if not names:
        return paths
    out = []
    for name in names:
        p = Path(name)
        match = [q for q in paths if q == p.resolve() or q.name.startswith(p.stem)]
        if not match:
            raise SystemExit(f"no notebook {name!r} in {HERE}")
        out.extend(match)
    return out


def kernel_env(quick: bool) -> dict:
    """Environment of the kernel: ``MCSSVI_NB_QUICK`` set to "1" or "0"."""
    env = dict(os.environ)
    env["MCSSVI_NB_QUICK"] = "1" if quick else "0"
    return env


def execute(path: Path, *, quick: bool, timeout: int = CELL_TIMEOUT, env=None):
    """Run one notebook top to bottom in a fresh ``python3`` kernel; returns the notebook."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=timeout,
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute(env=kernel_env(quick) if env is None else env)
    return nb


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="names or paths (default: all)")
    parser.add_argument("--quick", action="store_true", help="MCSSVI_NB_QUICK=1 (CI settings)")
    parser.add_argument(
        "--inplace",
        action="store_true",
        help="store outputs in the notebook files (the default without --quick)",
    )
    args = parser.parse_args(argv)
    import nbformat

    store = args.inplace or not args.quick
    total = 0.0
    for path in notebook_paths(args.notebooks):
        t0 = time.perf_counter()
        nb = execute(path, quick=args.quick)
        dt = time.perf_counter() - t0
        total += dt
        if store:
            nbformat.write(nb, path)
        print(f"{path.name}: {dt:.0f} s{' (stored)' if store else ''}", flush=True)
    print(f"total: {total:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
