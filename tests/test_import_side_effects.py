"""Importing ``pymc_mcssvi`` (and fitting with it) leaves PyTensor and PyMC as they were.

The only change allowed is the registration of the three method names with
``pm.fit``. Each check runs in a fresh interpreter, so that nothing imported by
other tests is in the way: it records PyTensor's global rewrite database, its
dispatch tables (vectorization, the numba and JAX backends), its configuration and
PyMC's variational group registry, imports the package, and records them again.
"""

from __future__ import annotations

import json
import subprocess
import sys

SNAPSHOT = r"""
import json, sys
import pytensor
import pymc as pm
from pytensor.compile import optdb
from pytensor.graph.replace import _vectorize_node
from pytensor.graph.rewriting.db import RewriteDatabase
from pytensor.link.numba.dispatch import numba_funcify
from pymc.variational.opvi import Group

try:
    from pytensor.link.jax.dispatch import jax_funcify
except ImportError:  # JAX is optional
    jax_funcify = None


def rewrites():
    seen, out = set(), []

    def walk(db, path):
        if id(db) in seen:
            return
        seen.add(id(db))
        for name in sorted(getattr(db, "_names", ())):
            for r in list(db.__db__.get(name, ())):
                if isinstance(r, RewriteDatabase):
                    walk(r, f"{path}/{name}")
                else:
                    out.append(f"{path}/{name}:{type(r).__name__}:{getattr(r, 'name', '')}")
    walk(optdb, "optdb")
    return sorted(set(out))


def registry(dispatcher):
    return sorted(f"{k.__module__}.{k.__qualname__}" for k in dispatcher.registry)


def snapshot():
    return {
        "rewrites": rewrites(),
        "vectorize": registry(_vectorize_node),
        "numba": registry(numba_funcify),
        "jax": registry(jax_funcify) if jax_funcify is not None else [],
        "config": {k: str(getattr(pytensor.config, k)) for k in
                   ("mode", "linker", "optimizer", "floatX", "traceback__limit")},
        "groups": sorted(map(str, Group._Group__name_registry)),
    }


before = snapshot()
fit_before = pm.fit
import pymc_mcssvi  # noqa: E402
after = snapshot()
ACTION
final = snapshot()
json.dump({"before": before, "after": after, "final": final,
           "fit_replaced": pm.fit is not fit_before}, sys.stdout)
"""

FIT = r"""
import numpy as np
X = np.random.default_rng(0).normal(size=(100, 12))
y = (X[:, 0] > 0).astype(int)
with pm.Model():
    b = pm.Normal("b", 0, 1, shape=(20, 12))
    g = np.arange(100) % 20
    pm.Bernoulli("y", logit_p=(b[g] * X).sum(-1), observed=y)
    approx = pm.fit(method="hmcssvi", n=3, progressbar=False, backend="python")
    approx.sample(10)
    approx.std.eval()
"""


def _run(action: str) -> dict:
    code = SNAPSHOT.replace("ACTION", action)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600
    )
    return json.loads(out.stdout)


def _diff(a: dict, b: dict) -> dict:
    out = {}
    for key in a:
        if isinstance(a[key], list):
            added = sorted(set(b[key]) - set(a[key]))
            removed = sorted(set(a[key]) - set(b[key]))
            if added or removed:
                out[key] = {"added": added, "removed": removed}
        elif a[key] != b[key]:
            out[key] = {"before": a[key], "after": b[key]}
    return out


def test_import_changes_nothing_but_pm_fit():
    res = _run("")
    assert _diff(res["before"], res["after"]) == {}
    assert res["fit_replaced"]  # the one registration the package makes


def test_fitting_registers_nothing_globally():
    """A fit with the Python backend (its own modes, the block-diagonal q's stacked
    linear algebra), sampling and a user-compiled ``approx.std`` add no rewrite or
    dispatch rule to PyTensor's global tables."""
    res = _run(FIT)
    assert _diff(res["before"], res["final"]) == {}
