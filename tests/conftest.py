"""Test configuration.

Everything runs with Python-level PyTensor operations (``FAST_COMPILE``): the
models here are small, and compiling each graph with numba on a cold cache
would cost far more than running it. NUTS references are the exception (see
:func:`nuts_draws`).
"""

import hashlib
import os
import re
import warnings
from pathlib import Path

import numpy as np
import pytensor
import pytest

pytensor.config.mode = "FAST_COMPILE"
warnings.filterwarnings("ignore", message=".*could not link to a BLAS.*")

#: Chains of every NUTS reference (draws are per chain).
NUTS_CHAINS = 4


@pytest.fixture
def rng():
    return np.random.default_rng(20261122)


_NUTS_CACHE: dict = {}
#: Stored NUTS references: ``<key>.npz``, the draws of one :func:`nuts_draws` call.
REFERENCE_DIR = Path(__file__).parent / "references" / "nuts"
#: ``write``: (re)write a stored reference whenever NUTS runs; ``off``: never read them.
REFERENCE_ENV = "MCSSVI_NUTS_REFERENCES"


class StoredDraws:
    """NUTS draws read back from :data:`REFERENCE_DIR`: ``.posterior[name].values``
    with axes ``(chain, draw, ...)`` and ``.posterior.sizes``, as the tests read an
    ``InferenceData``."""

    def __init__(self, arrays):
        import xarray as xr

        self.posterior = xr.Dataset(
            {
                name: (("chain", "draw", *(f"{name}_dim_{i}" for i in range(a.ndim - 2))), a)
                for name, a in arrays.items()
            }
        )


def model_fingerprint(model, *settings) -> str:
    """A hash of what NUTS samples: the structure of the model's log density and
    deterministics (op types and properties, in topological order), the values of
    its constants and shared data (as float32: the last bits of data computed with
    another BLAS do not change it), and ``settings``. Any change to the model's
    data or code makes a stored reference stale (NUTS then runs again)."""
    from pytensor.graph.basic import Constant
    from pytensor.graph.traversal import io_toposort

    outputs = [model.logp(), *model.replace_rvs_by_values(model.deterministics)]
    h = hashlib.sha256(repr(settings).encode())
    ids: dict = {}

    def data_token(x):
        a = np.asarray(x)
        if a.dtype.kind in "fc":
            a = a.astype(np.complex64 if a.dtype.kind == "c" else np.float32)
        return f"{a.dtype.str}{a.shape}:{hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()}"

    def token(v):
        if v in ids:
            return ids[v]
        if isinstance(v, Constant):
            return data_token(v.data)
        if hasattr(v, "get_value"):
            return data_token(v.get_value())
        return f"{v.name}:{v.type}"

    for node in io_toposort([], outputs):
        props = node.op._props_dict() if hasattr(node.op, "_props_dict") else {}
        op = re.sub(r" at 0x[0-9a-f]+", "", f"{type(node.op).__name__}{sorted(props.items())}")
        h.update(f"{op}({','.join(token(i) for i in node.inputs)})".encode())
        for j, out in enumerate(node.outputs):
            ids[out] = f"n{len(ids)}.{j}"
    h.update(repr([v.name for v in model.deterministics]).encode())
    return h.hexdigest()


class StaleReferenceError(AssertionError):
    """A stored NUTS reference is missing or was drawn for another model or settings."""


#: How a missing or stale reference is regenerated (NUTS, compiled with numba).
REGENERATE = f"{REFERENCE_ENV}=write make test-all"


def nuts_draws(model, key, draws=2500, tune=1000, seed=1):
    """Posterior draws by NUTS (``NUTS_CHAINS`` chains of ``draws``), read from
    ``tests/references/nuts/<key>.npz`` and cached per session.

    A stored reference is used only while the model and the sampler's settings are the
    ones it was drawn for (:func:`model_fingerprint`). A missing or stale one fails the
    test with :class:`StaleReferenceError`, which names the command that regenerates
    it: ``MCSSVI_NUTS_REFERENCES=write`` runs NUTS and writes the draws of every
    reference it needs (how the files are made after changing a model), ``=off``
    ignores the files and always runs NUTS. The files hold a thinned copy of the draws,
    16-bit coded (:func:`store_reference`).

    PyMC's sampler on the numba backend, not the suite's ``FAST_COMPILE``: on a
    42-dimensional logistic GLMM 2 x 1000 draws took 188 s under ``FAST_COMPILE``
    and 4 x 2500 take 25-37 s compiled (cold or warm cache). The draws matter as
    much as the time: there two runs of 2 x 1000 draws put the intercept's
    posterior sd at 0.177 and 0.198 where runs of 10,000 give 0.189-0.193, so a
    reference of 2000 draws spent most of a 10% tolerance on sds. (NumPyro's
    sampler is not used: PyTensor's JAX gradient of a censored Weibull likelihood
    is NaN where PyTensor's own is finite, and three of four chains stuck silently.)
    """
    import pymc as pm

    if key in _NUTS_CACHE:
        return _NUTS_CACHE[key]
    mode = os.environ.get(REFERENCE_ENV, "read")
    if mode not in ("read", "write", "off"):
        raise ValueError(f"{REFERENCE_ENV} must be 'read', 'write' or 'off', got {mode!r}")
    path = REFERENCE_DIR / f"{key}.npz"
    if mode != "off":
        fingerprint = model_fingerprint(model, key, draws, tune, seed, NUTS_CHAINS)
    if mode == "read":
        if not path.exists():
            raise StaleReferenceError(
                f"no stored NUTS reference {path.relative_to(REFERENCE_DIR.parents[2])}: "
                f"write it with `{REGENERATE}`"
            )
        with np.load(path) as stored:
            if str(stored["__fingerprint__"]) != fingerprint:
                raise StaleReferenceError(
                    f"the stored NUTS reference {path.relative_to(REFERENCE_DIR.parents[2])} "
                    "was drawn for another model, data or sampler settings: regenerate it "
                    f"with `{REGENERATE}`"
                )
            _NUTS_CACHE[key] = StoredDraws(decoded(stored))
            return _NUTS_CACHE[key]
    with model:
        idata = pm.sample(
            draws,
            tune=tune,
            chains=NUTS_CHAINS,
            cores=1,
            random_seed=seed,
            progressbar=False,
            compute_convergence_checks=False,
            compile_kwargs={"mode": "NUMBA"},
        )
    _NUTS_CACHE[key] = idata
    if mode == "write":
        store_reference(path, fingerprint, idata.posterior, model)
    return _NUTS_CACHE[key]


#: Largest deterministic stored (values per draw): PyMC's automatic ones (an
#: ordered likelihood's ``y_probs``, one row per observation) are not read.
STORED_DETERMINISTIC_SIZE = 256
#: Target size of one stored reference: every second draw of each chain is kept,
#: every fourth where that is still larger (a random walk's 120-step path). 2500
#: of 10,000 NUTS draws put a posterior sd within about 2% of the full set's.
STORED_BYTES = 0.75e6
#: Levels of the stored 16-bit codes: a value's rounding error is at most its
#: element's range over twice this (about 1e-4 of a posterior sd).
LEVELS = 65000


def thinned(arrays: dict) -> dict:
    """Every second draw of ``(chain, draw, ...)`` arrays, or every fourth where that
    is larger than :data:`STORED_BYTES`, floats as 16-bit codes of their element's
    range (``<name>``, ``__lo__<name>``, ``__step__<name>``; :func:`decoded`)."""
    size = sum(np.prod(a.shape, dtype=float) * 2 for a in arrays.values())
    step = 2 if size / 2 <= STORED_BYTES else 4
    out = {}
    for k, a in arrays.items():
        a = a[:, ::step]
        if a.dtype.kind != "f":
            out[k] = a
            continue
        lo, hi = a.min(axis=(0, 1)), a.max(axis=(0, 1))
        width = np.where(hi > lo, (hi - lo) / LEVELS, 1.0)
        out[k] = np.rint((a - lo) / width - LEVELS / 2).astype(np.int16)
        out[f"__lo__{k}"], out[f"__step__{k}"] = lo, width
    return out


def decoded(stored) -> dict:
    """The arrays of a stored reference (:func:`thinned`), floats decoded."""
    out = {}
    for k in stored.files:
        if k.startswith("__"):
            continue
        a = stored[k]
        if f"__lo__{k}" in stored.files:
            a = stored[f"__lo__{k}"] + (a + LEVELS / 2) * stored[f"__step__{k}"]
        out[k] = a
    return out


def store_reference(path, fingerprint, posterior, model):
    """Write NUTS draws for :func:`nuts_draws`: the free variables and the
    deterministics up to :data:`STORED_DETERMINISTIC_SIZE` values per draw,
    :func:`thinned`."""
    REFERENCE_DIR.mkdir(parents=True, exist_ok=True)
    free = {rv.name for rv in model.free_RVs}
    arrays = {}
    for name in posterior.data_vars:
        a = np.asarray(posterior[name].values)
        if name not in free and np.prod(a.shape[2:], dtype=int) > STORED_DETERMINISTIC_SIZE:
            continue
        arrays[str(name)] = a
    np.savez_compressed(path, __fingerprint__=np.array(fingerprint), **thinned(arrays))
