"""Terms restricted to a chunk of their observations.

A chunk (:class:`~pymc_mcssvi.terms.base.Chunk`) is ``index`` ``(C,)``, positions
along a term's observation axis (the leading axis of its predictor), and their
``weight``. Every array of the term that is aligned with that axis is gathered at
``index``; everything else (q, the hyperparameters, arrays that broadcast along the
axis) is left as it is. The chunk's statistics times the weights, summed over the
chunks, are the term's (:meth:`~pymc_mcssvi.bounds.structured.StructuredBound.evaluate`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import pytensor.tensor as pt
from pytensor.compile.builders import OpFromGraph
from pytensor.graph.basic import Constant
from pytensor.graph.traversal import io_toposort
from pytensor.tensor.shape import SpecifyShape

from pymc_mcssvi.estimators.predictor import PredictorGeometry
from pymc_mcssvi.recognize.affine import LinearTerm
from pymc_mcssvi.recognize.graph import holds_row_positions
from pymc_mcssvi.recognize.ir import PredictorTerm

__all__ = [
    "RestrictedPredictor",
    "aligned_inputs",
    "chunk_layout",
    "observation_axis",
    "observation_subset",
    "predictor_chunkable",
    "restrict_predictor",
    "static_rows",
]


def _row_positions(v, n, m):
    """``arange(m)`` shaped like ``v`` if the constant ``v`` is ``arange(n)`` along axis 0,
    else ``None`` (the row index of a ``take_along_axis``, folded to a constant)."""
    if not isinstance(v, Constant) or v.type.shape[0] != n or not holds_row_positions(v.data):
        return None
    data = np.asarray(v.data)
    pos = pt.arange(m).reshape((m,) + (1,) * (data.ndim - 1))
    return pt.broadcast_to(pos, (m, *data.shape[1:])).astype(v.dtype)


def aligned_inputs(logp, placeholder):
    """The inputs of the nodes between ``placeholder`` (one variable or several) and
    ``logp`` that do not depend on it and have at least one axis: the arrays a
    restriction to some observations may have to gather."""
    holders = list(placeholder) if isinstance(placeholder, tuple | list) else [placeholder]
    dependent = set(holders)
    out = []
    for node in io_toposort(holders, [logp]):
        if not any(i in dependent for i in node.inputs):
            continue
        dependent.update(node.outputs)
        for v in node.inputs:
            if v not in dependent and v.ndim > 0 and v not in out:
                out.append(v)
    return out


def observation_axis(v, ndim: int, n: int):
    """The axis of ``v`` that lines up with the leading (observation) axis of a
    placeholder of ``ndim`` axes under broadcasting (right-aligned: extra leading axes
    of ``v`` are batch axes, such as a marginalized local's quadrature nodes), when it
    has length ``n``; else the leading axis when that has length ``n`` (the data of
    ``take_along_axis``-style reads); else ``None``."""
    axis = v.ndim - ndim
    if axis >= 0 and v.type.shape[axis] == n:
        return axis
    if v.type.shape[0] == n:
        return 0
    return None


def static_rows(vars_, n) -> bool:
    """Whether every variable's leading length is known statically (``n`` or 1): only
    then is it clear which arrays a restriction gathers."""
    return all(v.type.shape[0] is not None for v in vars_)


def observation_subset(logp, placeholder, n: int, index):
    """``(logp, placeholder)`` restricted to the observations ``index`` along the
    placeholder's leading axis (of static length ``n``); ``placeholder`` may be a tuple
    of placeholders of the same shape (then a tuple is returned).

    The log density is elementwise in its placeholder, so every array of length ``n``
    along the observation axis that enters the computation from the placeholder
    onwards (the data, trials, offsets, constant-shape masks such as
    ``Alloc(False, n)``; the axis is found by :func:`observation_axis`) is gathered at
    ``index``; a constant that holds the positions ``0, ..., n - 1`` themselves (the
    row index of a ``take_along_axis``, folded from ``arange(n)``) becomes the
    subset's positions instead. The graph from the placeholder on is rebuilt node by
    node, without its ``SpecifyShape`` nodes and with its ``OpFromGraph`` nodes
    inlined (their inner inputs' static shapes): the static length ``n`` gives way to
    the subset's.
    """
    several = isinstance(placeholder, tuple | list)
    holders = list(placeholder) if several else [placeholder]
    new_holders = [
        pt.tensor(f"{p.name}_subset", dtype=p.dtype, shape=(None, *p.type.shape[1:]))
        for p in holders
    ]
    new = dict(zip(holders, new_holders, strict=True))
    ndim = holders[0].ndim
    dependent = set(holders)
    for node in io_toposort(holders, [logp]):
        if not any(i in dependent for i in node.inputs):
            continue
        dependent.update(node.outputs)
        inputs = []
        for v in node.inputs:
            if v in dependent:
                inputs.append(new.get(v, v))
                continue
            if v not in new and v.ndim > 0:
                axis = observation_axis(v, ndim, n)
                if axis == 0:
                    new[v] = _row_positions(v, n, index.shape[0])
                    if new[v] is None:
                        new[v] = v[index]
                elif axis is not None:
                    new[v] = v[(slice(None),) * axis + (index,)]
            inputs.append(new.get(v, v))
        if isinstance(node.op, SpecifyShape):
            new[node.outputs[0]] = inputs[0]
            continue
        if isinstance(node.op, OpFromGraph):
            # inlined: its inner inputs' static shapes would pin the subset's length
            outs = _rebuilt_inner_graph(node.op, inputs)
        else:
            outs = node.clone_with_new_inputs(inputs, strict=False).outputs
        for old, out in zip(node.outputs, outs, strict=True):
            new[old] = out
    out = new.get(logp, logp)
    return out, (tuple(new_holders) if several else new_holders[0])


def _rebuilt_inner_graph(op: OpFromGraph, inputs) -> list:
    """The outputs of an ``OpFromGraph``'s inner graph rebuilt node by node on
    ``inputs`` (types inferred from them, as a rebuilt outer node's are)."""
    frozen = op.fgraph
    new = dict(zip(frozen.inputs, inputs, strict=True))
    for node in io_toposort(list(frozen.inputs), list(frozen.outputs)):
        ins = [new.get(i, i) for i in node.inputs]
        if isinstance(node.op, SpecifyShape):
            new[node.outputs[0]] = ins[0]
            continue
        outs = (
            _rebuilt_inner_graph(node.op, ins)
            if isinstance(node.op, OpFromGraph)
            else node.op.make_node(*ins).outputs
        )
        for old, out in zip(node.outputs, outs, strict=True):
            new[old] = out
    return [new.get(o, o) for o in frozen.outputs]


class RestrictedPredictor(NamedTuple):
    """A predictor term restricted to a chunk: the term (its predictor of shape
    ``(C, ...)``), its geometry, and each predictor entry's weight (flat)."""

    term: PredictorTerm
    geometry: PredictorGeometry
    entry_weight: object


def _gather_rows(x, flat, n):
    """Rows ``flat`` of a ``(n | 1, ...)`` array (one that broadcasts along the rows is
    left as it is)."""
    if x is None or x.type.shape[0] == 1:
        return x
    if x.type.shape[0] != n:
        raise ValueError(f"an array of leading length {x.type.shape[0]} where {n} rows")
    return x[flat]


def restrict_predictor(
    term: PredictorTerm, geometry: PredictorGeometry, chunk, logp: bool = True
) -> RestrictedPredictor:
    """``term`` restricted to the observations ``chunk.index`` (along its predictor's
    leading axis): offset, linear terms (flattened rows) and, with ``logp``, log
    density gathered."""
    shape = tuple(int(d) for d in term.eta_shape)
    n = shape[0]
    inner = int(np.prod(shape[1:], dtype=int))
    index = chunk.index
    if inner == 1:
        flat, entry_weight = index, chunk.weight
    else:
        flat = (index[:, None] * inner + pt.arange(inner)[None, :]).reshape((-1,))
        entry_weight = pt.repeat(chunk.weight, inner)
    rows = n * inner
    offset = term.offset
    if offset is not None:
        offset = pt.broadcast_to(offset, shape).reshape((rows,))[flat]
    terms = [
        LinearTerm(t.source, _gather_rows(t.cols, flat, rows), _gather_rows(t.vals, flat, rows))
        for t in term.terms
    ]
    log_density, placeholder = term.logp, term.placeholder
    if logp and log_density is not None:
        log_density, placeholder = observation_subset(term.logp, term.placeholder, n, index)
    c = index.shape[0]
    eta_shape = (c, *shape[1:])
    restricted = dataclasses.replace(
        term,
        eta_shape=eta_shape,
        offset=offset.reshape(eta_shape) if offset is not None else None,
        terms=terms,
        placeholder=placeholder,
        logp=log_density,
    )
    geom = PredictorGeometry(
        restricted, geometry.segments, geometry.seg_of, pt.cast(c * inner, "int64")
    )
    return RestrictedPredictor(restricted, geom, entry_weight)


def predictor_chunkable(term: PredictorTerm, logp: bool = True) -> int | None:
    """The observations of a predictor term that can be split into chunks (its
    predictor's static leading length), or ``None``: a symbolic predictor shape
    (``pm.Data`` whose length can change), an array of unknown length among the
    ones a chunk gathers, or a random draw in its graphs (``pm.Minibatch`` data)."""
    shape = term.eta_shape
    if not shape or any(not isinstance(d, int | np.integer) for d in shape):
        return None
    n = int(shape[0])
    arrays = [t.cols for t in term.terms] + [t.vals for t in term.terms if t.vals is not None]
    if not static_rows(arrays, n):
        return None
    if logp and term.logp is not None:
        p = term.placeholder.ndim
        for v in aligned_inputs(term.logp, term.placeholder):
            axis = v.ndim - p
            if v.type.shape[0] is None or (axis >= 0 and v.type.shape[axis] is None):
                return None
        if not subset_is_clean(term.logp, term.placeholder, n):
            return None
    return n


def subset_is_clean(logp, placeholder, n: int) -> bool:
    """Whether :func:`observation_subset` leaves no trace of the ``n`` observations:
    no variable computed from the subset's placeholder keeps a static axis of length
    ``n`` (a reshape to a constant shape, an array allocated from constant sizes,
    which a restriction cannot follow)."""
    index = pt.vector("probe_index", dtype="int64", shape=(None,))
    sub, ph = observation_subset(logp, placeholder, n, index)
    holders = list(ph) if isinstance(ph, tuple) else [ph]
    dependent = set(holders)
    for node in io_toposort([*holders, index], [sub]):
        if not any(i in dependent for i in node.inputs):
            continue
        dependent.update(node.outputs)
        if any(n in (out.type.shape or ()) for out in node.outputs if out.ndim):
            return False
    return True


def chunk_layout(n: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(index, weight)`` of ``ceil(n / size)`` chunks of ``size`` observations,
    ``(chunks, size)`` each; the last chunk is padded with observation 0 at weight 0.

    Examples
    --------
    >>> index, weight = chunk_layout(5, 2)
    >>> index.tolist(), weight.tolist()
    ([[0, 1], [2, 3], [4, 0]], [[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    """
    chunks = -(-n // size)
    pad = chunks * size - n
    index = np.concatenate([np.arange(n), np.zeros(pad, dtype="int64")]).reshape(chunks, size)
    weight = np.concatenate([np.ones(n), np.zeros(pad)]).reshape(chunks, size)
    return index.astype("int64"), weight
