"""Data in Dask arrays: the bound's data terms as a map-reduce over the chunks.

The natural-gradient step needs only sums over the observations: the bound, ``g``
and ``H``. With the data in a Dask array (in memory, in a Zarr store on disk, or on
the workers of a ``distributed`` cluster), each iteration maps one compiled
function, the terms' statistics on one chunk of rows, over the array's chunks and
sums the results on the Dask scheduler; q and the step stay on the driver.

:func:`dask_data` is the model-side half: a ``pm.Data`` container whose values are a
Dask array. The model is built, and recognized, on the array's first chunk (a
stand-in of the chunk's length); the fit then sums the data terms over every chunk.
:class:`DaskStatistics` is the fit-side half, and :class:`DaskStep` a compiled step
that takes its data terms' sums from it.

Dask is an optional dependency (``pip install "pymc-mcssvi[dask]"``); this module
imports it only when a model uses it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
from pytensor.graph.replace import graph_replace
from pytensor.graph.traversal import ancestors
from pytensor.tensor.random.type import RandomType

from pymc_mcssvi.algorithms.kernel import ExternalPart
from pymc_mcssvi.algorithms.state import StepInfo, tree_leaves
from pymc_mcssvi.backend.compile import StepFunction, jax_step_mode
from pymc_mcssvi.backend.modes import python_step_mode
from pymc_mcssvi.exceptions import UnsupportedModelError

__all__ = [
    "ChunkStatistics",
    "DaskStatistics",
    "DaskStep",
    "dask_data",
    "dask_statistics",
    "has_dask_data",
]

#: The Dask array behind each container made by :func:`dask_data`.
_ARRAYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: Compiled chunk functions of this process, by (token, backend, thread).
_FUNCTIONS: dict = {}
_TOKENS = itertools.count()
#: Held while a chunk function compiles (see :meth:`ChunkStatistics.function`).
_COMPILING = threading.Lock()

logger = logging.getLogger("pymc_mcssvi")


def _dask_array_module():
    try:
        import dask.array as da
    except ImportError as err:  # pragma: no cover - depends on the installation
        raise ImportError(
            'Dask data needs the optional dependencies: pip install "pymc-mcssvi[dask]"'
        ) from err
    return da


def dask_data(name: str, value, *, dims=None, model=None):
    """A ``pm.Data`` container whose values are a Dask array (or a Zarr array).

    The container holds the array's first chunk of rows (the model is built and
    recognized on it); a fit with ``pm.fit(method="hmcssvi")`` (or the other two
    methods) then sums the likelihood's statistics over every chunk of the array,
    on Dask's scheduler: threads by default, or the workers of a
    ``distributed.Client`` when one is active. Only the current chunk of each array
    is in memory at a time (per Dask worker thread), so the data may be larger than
    memory.

    All arrays of a model given this way are read chunk by chunk along their first
    axis, the observation axis: they must have the same length there, and are
    rechunked to the first one's chunks (and to one chunk along their other axes).
    A chunk of 10,000 to 1,000,000 rows suits most models.

    Parameters
    ----------
    name : str
        Name of the ``pm.Data`` container.
    value : dask.array.Array or zarr.Array
        The data; observations along the first axis.
    dims : sequence of str, optional
        As for ``pm.Data`` (the observation dimension's coordinates are those of
        the first chunk).
    model : pm.Model, optional
        The model (default: the one in context).

    Returns
    -------
    TensorSharedVariable
        The container, for the model's graph (e.g. ``X @ w``, ``observed=y``).

    Examples
    --------
    >>> import dask.array as da, numpy as np, pymc as pm
    >>> import pymc_mcssvi as mc
    >>> rng = np.random.default_rng(0)
    >>> X = da.from_array(rng.normal(size=(4000, 3)), chunks=(1000, 3))
    >>> y = da.from_array(rng.binomial(1, 0.5, size=4000), chunks=1000)
    >>> with pm.Model() as model:
    ...     Xd = mc.dask_data("X", X)
    ...     yd = mc.dask_data("y", y)
    ...     w = pm.Normal("w", 0, 1, shape=3)
    ...     _ = pm.Bernoulli("obs", logit_p=Xd @ w, observed=yd)
    >>> Xd.get_value().shape  # the first chunk
    (1000, 3)
    """
    da = _dask_array_module()
    if not isinstance(value, da.Array):
        if type(value).__module__.startswith("zarr"):
            value = da.from_zarr(value)
        else:
            raise TypeError(
                f"dask_data {name!r}: expected a dask.array.Array or a zarr.Array, got "
                f"{type(value).__name__}; use pm.Data for arrays in memory"
            )
    if value.ndim == 0:
        raise ValueError(f"dask_data {name!r}: a scalar has no observation axis; use pm.Data")
    if any(len(c) > 1 for c in value.chunks[1:]):
        value = value.rechunk({i: -1 for i in range(1, value.ndim)})
    model = pm.modelcontext(model)
    others = [(v, _ARRAYS[v]) for v in model.data_vars if v in _ARRAYS]
    if others:
        var0, first = others[0]
        if value.shape[0] != first.shape[0]:
            raise ValueError(
                f"dask_data {name!r} has {value.shape[0]} rows where {var0.name!r} has "
                f"{first.shape[0]}: the Dask arrays of a model are read chunk by chunk of "
                "rows together, so their first axes must agree"
            )
        if value.chunks[0] != first.chunks[0]:
            value = value.rechunk({0: first.chunks[0]})
    first = np.asarray(value.blocks[0].compute())
    var = pm.Data(name, first, dims=dims, shape=first.shape, model=model)
    _ARRAYS[var] = value
    return var


class ChunkStatistics:
    """The data terms' statistics on one chunk: a picklable callable that compiles
    its graph once per process and thread (a compiled PyTensor function is not safe
    to call from two threads at once).

    ``fn(state_values, scale, *arrays)`` pads a short last chunk (repeating its first
    row, at weight 0), weights the chunk's rows by ``scale`` and returns the flat
    statistics (:meth:`StepKernel.chunk_statistics`).
    """

    def __init__(self, inputs, outputs, size: int, backend: str = "python"):
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.size = int(size)
        #: ``"jax"`` or ``"python"`` (NumPy-level operations), chosen by the fit.
        self.backend = backend
        self.token = f"mcssvi-chunk-{next(_TOKENS)}-{id(self)}"
        # this process's compiled copies go with the object (workers keep theirs)
        weakref.finalize(self, _release, self.token)

    def __dask_tokenize__(self):
        return (self.token, self.backend)

    def function(self, backend=None):
        backend = backend or self.backend
        key = (self.token, backend, threading.get_ident())
        fn = _FUNCTIONS.get(key)
        if fn is None:
            # one compilation at a time: PyTensor sets its global ``config.mode`` while it
            # rewrites, and two threads' nested settings can leave the JAX mode behind
            # for every later compilation of the process
            with _COMPILING:
                mode = jax_step_mode() if backend == "jax" else python_step_mode()
                fn = pytensor.function(
                    self.inputs, self.outputs, mode=mode, on_unused_input="ignore"
                )
            _FUNCTIONS[key] = fn
        return fn

    def _run(self, *args):
        if self.backend != "jax":
            return self.function()(*args)
        try:  # JAX compiles, and traces on the first call
            return self.function()(*args)
        except Exception as err:  # noqa: BLE001  (JAX's errors share no base class)
            logger.info("JAX cannot run the chunk statistics (%s); using NumPy", err)
            _FUNCTIONS[(self.token, "jax", threading.get_ident())] = self.function("python")
            return self.function("python")(*args)

    def __call__(self, state_values, scale, *arrays):
        # PyMC's containers may narrow the dtype (integer data as int32); arrays that
        # a distributed worker received can be unaligned views of its network buffers
        arrays = [
            np.require(a, dtype=v.dtype, requirements="A")
            for a, v in zip(arrays, self.inputs[-1 - len(arrays) : -1], strict=True)
        ]
        state_values = [np.require(v, requirements="A") for v in state_values]
        rows = arrays[0].shape[0]
        weight = np.zeros(self.size)
        weight[:rows] = scale
        if rows < self.size:
            arrays = [
                np.concatenate([a, np.repeat(a[:1], self.size - rows, axis=0)]) for a in arrays
            ]
        out = self._run(*state_values, *arrays, weight)
        return [np.array(o) for o in out]


def _release(token):
    """Forget this process's compiled copies of the chunk function ``token``."""
    for key in [k for k in _FUNCTIONS if k[0] == token]:
        del _FUNCTIONS[key]


def _combine(a, b):
    """Two chunks' statistics combined: finiteness (int8) by minimum, the rest by sum."""
    return [np.minimum(x, y) if x.dtype == np.int8 else x + y for x, y in zip(a, b, strict=True)]


def _tree_sum(parts):
    """Pairwise reduction of delayed chunk statistics (a fixed order: the sums do not
    depend on which worker computes what)."""
    import dask

    while len(parts) > 1:
        pairs = [
            dask.delayed(_combine, pure=True)(parts[i], parts[i + 1])
            for i in range(0, len(parts) - 1, 2)
        ]
        if len(parts) % 2:
            pairs.append(parts[-1])
        parts = pairs
    return parts[0]


class DaskStatistics:
    """The terms of a fit that read Dask data, summed over the data's chunks.

    Built by :func:`dask_statistics`. ``external`` is the
    :class:`~pymc_mcssvi.algorithms.kernel.ExternalPart` the step reads (its values
    are shared variables that :meth:`update` sets); :meth:`update` maps
    :attr:`chunk` over the chunks at the store's current candidate and reduces.
    """

    def __init__(self, kernel, store, arrays: dict, batch=None, random_seed=None):
        self.store = store
        # dask_data gave every array the first one's length and row chunks
        self.data = list(arrays)
        first = arrays[self.data[0]]
        n, chunks = first.shape[0], first.chunks[0]
        size = int(self.data[0].type.shape[0])
        if max(chunks) > size:
            raise ValueError(
                f"dask_data {self.data[0].name!r}: a chunk of {max(chunks)} rows is longer than "
                f"the first ({size}); rechunk it to equal chunks, e.g. "
                f"array.rechunk({{0: {max(chunks)}}}), before dask_data"
            )
        self.n_rows, self.n_chunks, self.size = n, len(chunks), size
        self.rows = np.asarray(chunks)
        #: Chunks read per iteration (``None``: all of them).
        self.batch = None if batch is None or batch >= len(chunks) else int(batch)
        self.rng = np.random.default_rng(random_seed)
        self.blocks = [arrays[v].to_delayed().reshape(-1) for v in self.data]
        dask_vars = set(self.data)
        leaves = tree_leaves(store.symbolic)
        reads = []
        for i, term in enumerate(kernel.bound.terms):
            part = kernel._evaluate(store.symbolic, False, terms=[i])
            if dask_vars & set(ancestors([*part.outs, part.finite])):
                if term.n_obs != size:
                    raise UnsupportedModelError(
                        f"the likelihood term {term.name!r} reads Dask data "
                        f"({', '.join(v.name for v in self.data)}) but cannot be split into "
                        "chunks of its rows (observations): Dask data suits likelihoods "
                        "whose observations are the arrays' rows (GLMs, mixed models); "
                        "load the data with pm.Data instead"
                    )
                reads.append(i)
        if not reads:
            raise UnsupportedModelError(
                f"no likelihood term reads the Dask data {[v.name for v in self.data]}"
            )
        weight, flat, rebuild = kernel.chunk_statistics(store.symbolic, reads, size)
        inputs = set(ancestors(flat))
        if any(isinstance(v.type, RandomType) for v in inputs):
            # the state's generators and the terms' own
            raise UnsupportedModelError(
                "a likelihood term that reads Dask data draws random numbers "
                "(a Monte Carlo estimator): not supported with Dask data yet"
            )
        state_in = [leaf for leaf in leaves if leaf in inputs]
        state_vars = [leaf.type(name=leaf.name) for leaf in state_in]
        data_vars = [
            pt.tensor(f"{v.name}_chunk", dtype=v.dtype, shape=v.type.shape) for v in self.data
        ]
        replace = dict(zip(state_in, state_vars, strict=True))
        replace.update(zip(self.data, data_vars, strict=True))
        flat = graph_replace(flat, replace, strict=False)
        self.state_in = state_in
        self.chunk = ChunkStatistics([*state_vars, *data_vars, weight], flat, size)
        self.sums = [
            pytensor.shared(
                np.zeros(x.type.shape, dtype=x.dtype), name=f"dask_sum_{j}", shape=x.type.shape
            )
            for j, x in enumerate(flat)
        ]
        self.external = ExternalPart(tuple(reads), rebuild(self.sums))
        self.terms = tuple(kernel.bound.terms[i].name for i in reads)

    def compute(self, state_values):
        """The data terms' statistics summed over every chunk, at ``state_values``
        (the values of :attr:`state_in`), on Dask's current scheduler."""
        import dask

        state = dask.delayed(list(state_values), traverse=False)
        fn = dask.delayed(self.chunk, pure=True)
        if self.batch is None:
            chosen, scale = range(self.n_chunks), 1.0
        else:
            chosen = np.sort(self.rng.choice(self.n_chunks, self.batch, replace=False))
            scale = self.n_rows / float(self.rows[chosen].sum())
        parts = [fn(state, scale, *[b[k] for b in self.blocks]) for k in chosen]
        (total,) = dask.compute(_tree_sum(parts))
        return total

    def update(self):
        """Set :attr:`sums` to the statistics at the store's current state."""
        values = [leaf.get_value(borrow=True) for leaf in self.state_in]
        for shared, value in zip(self.sums, self.compute(values), strict=True):
            shared.set_value(np.asarray(value, dtype=shared.dtype))


class DaskStep(StepFunction):
    """A compiled step whose data terms are summed over Dask chunks first."""

    def __init__(self, stats: DaskStatistics, inner: StepFunction):
        self.stats = stats
        self.inner = inner

    def __call__(self) -> StepInfo:
        self.stats.update()
        return self.inner()

    @property
    def fn(self):
        return self.inner.fn

    @property
    def store(self):
        return self.stats.store


def has_dask_data(model) -> bool:
    """Whether ``model`` has :func:`dask_data` containers."""
    return any(v in _ARRAYS for v in model.data_vars)


def dask_statistics(kernel, store, model, batch=None, random_seed=None) -> DaskStatistics | None:
    """The :class:`DaskStatistics` of a fit whose model has :func:`dask_data`
    containers, else ``None`` (``batch``: chunks per iteration, see there)."""
    arrays = {v: _ARRAYS[v] for v in model.data_vars if v in _ARRAYS}
    if not arrays:
        return None
    return DaskStatistics(kernel, store, arrays, batch=batch, random_seed=random_seed)
