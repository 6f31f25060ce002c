"""Save a fit's state to a file and restore it: no pickle, the same numbers.

A fit is its explicit state (:class:`~pymc_mcssvi.algorithms.state.KernelState`,
in the shared variables of :class:`~pymc_mcssvi.algorithms.state.SharedState`),
the iterate average of a ``pm.Minibatch`` fit, its history and the options the
inference was built with. :func:`snapshot` turns them into an
:class:`xarray.Dataset` (written as netCDF through ``h5netcdf``); :func:`restore`
puts them back into an inference built for the same model with the same
options, so that a resumed fit continues the original's trace. Everything
derived from the state (the compiled step, q(h) from the profile of the bound,
the locals' posteriors) is rebuilt, not stored.

A *fingerprint* of the model (its free and observed variables, their
distributions and shapes, a hash of the observed and ``pm.Data`` values) is
stored with the state; a state is only restored into a model with the same
fingerprint, and a mismatch names what differs.

Use it through ``approx.save(path)``, :func:`pymc_mcssvi.load` and
``pm.fit(method=..., start=path_or_approx)``.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib.metadata import PackageNotFoundError, version

import numpy as np
import xarray as xr
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Constant
from pytensor.graph.traversal import ancestors
from pytensor.tensor.random.type import RandomType

from pymc_mcssvi.algorithms.state import tree_leaves, tree_map

__all__ = [
    "FORMAT",
    "SavedFitError",
    "apply",
    "fingerprint",
    "options_from",
    "read",
    "snapshot",
    "write",
]

#: The format's name and version, stored in the file (a newer format is refused).
FORMAT = ("pymc-mcssvi fit", 1)


class SavedFitError(ValueError):
    """A saved fit cannot be restored here (another model, another format)."""


def _package_version() -> str:
    try:
        return version("pymc-mcssvi")
    except PackageNotFoundError:  # pragma: no cover  (a checkout on sys.path)
        return "unknown"


# ------------------------------------------------------------------ fingerprint
def _digest(value) -> str:
    arr = np.ascontiguousarray(np.asarray(value))
    h = hashlib.sha256(str((arr.dtype.str, arr.shape)).encode())
    h.update(arr.tobytes())
    return h.hexdigest()[:16]


def fingerprint(model) -> dict:
    """What identifies a model for a saved fit: ``{variable: description}``.

    Free variables by distribution and shape, observed variables by distribution,
    shape and a hash of their data, ``pm.Data`` containers by a hash of their
    values.

    Examples
    --------
    >>> import numpy as np, pymc as pm
    >>> with pm.Model() as m:
    ...     b = pm.Normal("b", 0, 1, shape=2)
    ...     _ = pm.Normal("y", b.sum(), 1, observed=np.zeros(3))
    >>> fp = fingerprint(m)
    >>> fp["free b"]
    'NormalRV (2,)'
    >>> sorted(fp)
    ['free b', 'observed y']
    """
    point = model.initial_point()
    out = {}
    for rv in model.free_RVs:
        value = model.rvs_to_values[rv]
        out[f"free {rv.name}"] = f"{type(rv.owner.op).__name__} {np.shape(point[value.name])}"
    for rv in model.observed_RVs:
        # the arrays the observed value is made of (a pm.Minibatch's whole data, not
        # the batch it draws)
        h = hashlib.sha256()
        for v in ancestors([model.rvs_to_values[rv]]):
            if isinstance(v, Constant):
                h.update(_digest(v.data).encode())
            elif isinstance(v, SharedVariable) and not isinstance(v.type, RandomType):
                h.update(_digest(v.get_value(borrow=True)).encode())
        out[f"observed {rv.name}"] = f"{type(rv.owner.op).__name__} {h.hexdigest()[:16]}"
    for v in model.data_vars:
        if isinstance(v, SharedVariable) and v.name and f"observed {v.name}" not in out:
            out[f"data {v.name}"] = _digest(v.get_value(borrow=True))
    return out


def _check_fingerprint(saved: dict, model) -> None:
    now = fingerprint(model)
    diffs = []
    for key in sorted(set(saved) | set(now)):
        if key not in now:
            diffs.append(f"{key} is not in this model")
        elif key not in saved:
            diffs.append(f"{key} was not in the saved fit's model")
        elif saved[key] != now[key]:
            what = "its data differ" if key.split()[0] in ("observed", "data") else "it differs"
            diffs.append(f"{key}: {what} ({saved[key]} saved, {now[key]} here)")
    if diffs:
        raise SavedFitError(
            "The saved fit belongs to another model: "
            + "; ".join(diffs[:5])
            + (f" and {len(diffs) - 5} more" if len(diffs) > 5 else "")
            + ". Build the model as it was when the fit was saved (the same variables and "
            "data), or fit this one from the start."
        )


# ---------------------------------------------------------------- the arrays
def _pack(named: dict, prefix: str) -> tuple[dict, list]:
    """Arrays by name -> one 1-D variable per dtype and an index
    ``[name, dtype, shape, offset]`` (so that empty arrays and any shapes survive the
    file format)."""
    by_dtype, index = {}, []
    for name, value in named.items():
        arr = np.asarray(value)
        parts = by_dtype.setdefault(arr.dtype.str, [])
        offset = sum(p.size for p in parts)
        parts.append(arr.ravel())
        index.append([name, arr.dtype.str, list(arr.shape), offset])
    data = {}
    for dt, parts in by_dtype.items():
        flat = np.concatenate(parts) if parts else np.zeros(0)
        if flat.size:
            key = f"{prefix}_{np.dtype(dt).name}"
            data[key] = xr.Variable((f"{key}_size",), flat)
    return data, index


def _unpack(ds: xr.Dataset, index: list, prefix: str) -> dict:
    out = {}
    for name, dt, shape, offset in index:
        dtype = np.dtype(dt)
        size = int(np.prod(shape, dtype=int))
        if size == 0:
            out[name] = np.zeros(shape, dtype=dtype)
            continue
        flat = ds[f"{prefix}_{dtype.name}"].values
        out[name] = flat[offset : offset + size].astype(dtype).reshape(shape)
    return out


def _average_arrays(avg) -> tuple[dict, dict]:
    """An :class:`~pymc_mcssvi.algorithms.averaging.IterateAverage` as arrays and facts."""
    if avg is None or avg.blocks is None:
        return {}, {"t": 0 if avg is None else avg.t, "blocks": 0, "hyper": None}
    arrays = {}
    for i, (P, h) in enumerate(avg.blocks):
        arrays[f"blocks.{i}.P"], arrays[f"blocks.{i}.h"] = P, h
    hyper_kind = None
    if avg.hyper is not None:
        hyper_kind = [avg.hyper[0], len(avg.hyper) - 1]
        for j, a in enumerate(avg.hyper[1:]):
            arrays[f"hyper.{j}"] = a
    return arrays, {"t": avg.t, "blocks": len(avg.blocks), "hyper": hyper_kind}


# ------------------------------------------------------------ save / restore
def snapshot(inference) -> xr.Dataset:
    """The inference's state, average, history and options as a dataset."""
    # the state the iterations left (the post-fit work rewrites q(h)'s precision, and
    # is done again on the restored state)
    state = inference.fitted_state
    if state is None:
        state = inference.store.get()
    arrays, generators = {}, {}
    for shared, value in zip(
        tree_leaves(inference.store.symbolic), tree_leaves(state), strict=True
    ):
        if isinstance(shared.type, RandomType):
            generators[shared.name] = value.bit_generator.state
        else:
            arrays[shared.name] = np.asarray(value)
    data, index = _pack(arrays, "state")
    avg_arrays, avg_facts = _average_arrays(getattr(inference, "_average", None))
    locations = getattr(inference, "_average_locations", [])
    for k, (m, sd) in enumerate(locations):
        avg_arrays[f"locations.{k}.mean"], avg_arrays[f"locations.{k}.sd"] = m, sd
    avg_facts["locations"] = len(locations)
    avg_data, avg_index = _pack(avg_arrays, "average")
    data.update(avg_data)
    hist = np.asarray(inference.hist, dtype="float64")
    if hist.size:
        data["hist"] = xr.Variable(("iteration",), hist)
    rej = inference._rejections
    approx = inference.approx
    attrs = {
        "format": FORMAT[0],
        "format_version": FORMAT[1],
        "pymc_mcssvi_version": _package_version(),
        "method": type(inference).__name__,
        "options": json.dumps(_jsonable(inference.options)),
        "fingerprint": json.dumps(fingerprint(inference.model)),
        "state_index": json.dumps(index),
        "average_index": json.dumps(avg_index),
        "average": json.dumps(avg_facts),
        "generators": json.dumps(generators),
        "n_iterations": len(hist),
        "converged": json.dumps(approx.converged),
        "last_call_iterations": json.dumps(inference.state),
        "rejections": json.dumps([rej.count, rej.shrinks, rej.jitters]),
    }
    return xr.Dataset(data, attrs=attrs)


def _jsonable(options: dict) -> dict:
    """The options JSON can hold; ``start`` (an initial point) is not needed to restore a
    state, and a random seed that is not an integer (a ``Generator``) is dropped."""
    out = {}
    for key, value in options.items():
        if key in ("start", "start_sigma"):
            continue
        if key == "random_seed" and not (value is None or isinstance(value, int | np.integer)):
            value = None
        try:
            json.dumps(value, default=_as_builtin)
        except TypeError as err:
            raise TypeError(
                f"the inference option {key}={value!r} cannot be saved: pass it as a number, "
                "a string, or a tuple of them"
            ) from err
        out[key] = json.loads(json.dumps(value, default=_as_builtin))
    return out


def _as_builtin(value):
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(type(value).__name__)


def options_from(ds: xr.Dataset, model) -> tuple[str, dict]:
    """``(method class name, options)`` of a saved fit, after checking its format and
    that ``model`` is the model it was fitted to."""
    if ds.attrs.get("format") != FORMAT[0]:
        raise SavedFitError("this file is not a saved pymc-mcssvi fit (approx.save writes one)")
    if int(ds.attrs["format_version"]) > FORMAT[1]:
        raise SavedFitError(
            f"the fit was saved in format {ds.attrs['format_version']} by pymc-mcssvi "
            f"{ds.attrs.get('pymc_mcssvi_version')}; this version reads format {FORMAT[1]} "
            "or older: upgrade pymc-mcssvi"
        )
    _check_fingerprint(json.loads(ds.attrs["fingerprint"]), model)
    options = json.loads(ds.attrs["options"])
    # JSON turns tuples (optimizer specs) into lists
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    return ds.attrs["method"], options


def apply(ds: xr.Dataset, inference) -> None:
    """Put a saved state, iterate average and history into ``inference`` (built with the
    saved options for the same model)."""
    arrays = _unpack(ds, json.loads(ds.attrs["state_index"]), "state")
    generators = json.loads(ds.attrs["generators"])

    def value_of(shared):
        if isinstance(shared.type, RandomType):
            state = generators[shared.name]
            gen = np.random.Generator(getattr(np.random, state["bit_generator"])())
            gen.bit_generator.state = state
            return gen
        if shared.name not in arrays:
            raise SavedFitError(
                f"the saved state has no {shared.name!r}: it was saved by another version "
                "or with other options"
            )
        return arrays[shared.name]

    values = tree_map(value_of, inference.store.symbolic)
    for shared, value in zip(
        tree_leaves(inference.store.symbolic), tree_leaves(values), strict=True
    ):
        if isinstance(shared.type, RandomType):
            shared.set_value(value)
            continue
        if value.shape != shared.type.shape:
            raise SavedFitError(
                f"the saved {shared.name!r} has shape {value.shape}, this fit's has "
                f"{shared.type.shape}: it was saved with other options"
            )
        shared.set_value(np.asarray(value, dtype=shared.dtype))
    _apply_average(ds, inference)
    hist = ds["hist"].values if "hist" in ds else np.zeros(0)
    inference.hist = np.asarray(hist, dtype="float64")
    approx = inference.approx
    approx.hist = inference.hist
    approx.n_iter = len(inference.hist)
    approx.converged = json.loads(ds.attrs["converged"])
    inference.state = json.loads(ds.attrs["last_call_iterations"])
    count, shrinks, jitters = json.loads(ds.attrs["rejections"])
    rej = inference._rejections
    rej.count, rej.shrinks, rej.jitters = count, shrinks, jitters


def _apply_average(ds, inference) -> None:
    facts = json.loads(ds.attrs["average"])
    avg = getattr(inference, "_average", None)
    if avg is None:
        return
    arrays = _unpack(ds, json.loads(ds.attrs["average_index"]), "average")
    avg.t = int(facts["t"])
    if facts["blocks"]:
        avg.blocks = [
            (arrays[f"blocks.{i}.P"], arrays[f"blocks.{i}.h"]) for i in range(facts["blocks"])
        ]
    if facts["hyper"] is not None:
        kind, n = facts["hyper"]
        avg.hyper = (kind, *(arrays[f"hyper.{j}"] for j in range(n)))
    inference._average_locations = [
        (arrays[f"locations.{k}.mean"], arrays[f"locations.{k}.sd"])
        for k in range(facts["locations"])
    ]


def write(ds: xr.Dataset, path) -> None:
    """Write a saved fit as netCDF (``h5netcdf``)."""
    ds.to_netcdf(os.fspath(path), engine="h5netcdf")


def read(path) -> xr.Dataset:
    """Read a file written by :func:`write` (into memory: the file is closed)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no saved fit at {path!r} (approx.save(path) writes one)")
    with xr.open_dataset(path, engine="h5netcdf") as ds:
        return ds.load()
