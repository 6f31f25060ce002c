"""Dense matrix products of two factors, read as matrix factorization.

Users of probabilistic PCA, factor analysis and fully observed matrix
factorization write the predictor of an ``(N, D)`` observed matrix densely:
``pm.math.dot(Z, W.T) + mu``, ``Z @ W.T``, ``(Z[:, None, :] * W[None]).sum(-1)``
or ``pt.einsum("nk,dk->nd", Z, W)``. Entry ``(n, d)`` of such a predictor is
``Z[n] . W[d]``: the bilinear form of paper section 3.5 with the row indices of
a fully observed matrix (or, when the matrix has missing entries and PyMC
observes ``Y[mask]``, of its observed entries). :func:`flatten_dense_product` rewrites the observed
log density into that form, one entry per observation, so that the matrix
factorization estimator (one ``K x K`` block per row of each factor) fits it
instead of Monte Carlo + autodiff over all the coordinates at once.
"""

from __future__ import annotations

import numpy as np
import pytensor.tensor as pt
from pytensor.compile.builders import OpFromGraph
from pytensor.compile.rewriting import inline_ofg_node
from pytensor.graph.basic import Constant, Variable
from pytensor.graph.replace import graph_replace
from pytensor.graph.traversal import ancestors, graph_inputs, io_toposort
from pytensor.scalar import basic as ps
from pytensor.tensor.basic import Alloc
from pytensor.tensor.blockwise import Blockwise
from pytensor.tensor.elemwise import DimShuffle, Elemwise
from pytensor.tensor.math import Dot, Sum
from pytensor.tensor.shape import SpecifyShape
from pytensor.tensor.subtensor import AdvancedSubtensor

from pymc_mcssvi.recognize.graph import depends_on_any, evaluate_static

__all__ = ["flatten_dense_product"]


def _current_shape(v, shapes) -> tuple[int, ...] | None:
    """The shape of ``v`` (its current value for ``dims`` and ``pm.Data``, as for the
    index arrays of gathers), given the ``shapes`` of the value variables."""
    if None not in v.type.shape:
        return tuple(int(s) for s in v.type.shape)
    known = {x: pt.specify_shape(x, shp) for x, shp in shapes.items() if x in ancestors([v])}
    try:
        return tuple(int(s) for s in evaluate_static([graph_replace(v.shape, known)])[0])
    except Exception:
        return None


def _inline_einsums(logp: Variable) -> Variable:
    """``logp`` with einsum's ``OpFromGraph`` nodes replaced by their inner graphs."""
    for _ in range(8):
        nodes = [
            v.owner
            for v in ancestors([logp])
            if v.owner is not None and isinstance(v.owner.op, OpFromGraph)
        ]
        if not nodes:
            return logp
        node = nodes[0]
        inner = inline_ofg_node(node)
        logp = graph_replace(logp, dict(zip(node.outputs, inner, strict=True)), strict=False)
    return logp


def _untranspose(v):
    """``W`` for ``W.T``; None for anything else."""
    node = v.owner
    if node is not None and isinstance(node.op, DimShuffle) and tuple(node.op.new_order) == (1, 0):
        return node.inputs[0]
    return None


def _drop_axis(x, axis):
    """``x`` without its broadcast ``axis``: ``Z`` for ``Z[:, None, :]``, ``mu`` for
    ``mu[None, :]``."""
    node = x.owner
    if node is not None and isinstance(node.op, DimShuffle):
        order = list(node.op.new_order)
        if order[axis] == "x":
            del order[axis]
            if order == list(range(node.inputs[0].ndim)):
                return node.inputs[0]
    return x[(slice(None),) * axis + (0,)]


def _factors(prod):
    """``(A, B)`` with ``prod[n, d] = A[n] . B[d]`` for a dense ``(N, D)`` contraction."""
    node = prod.owner
    if node is None:
        return None
    op = node.op
    is_dot = isinstance(op, Dot) or (isinstance(op, Blockwise) and isinstance(op.core_op, Dot))
    if is_dot and len(node.inputs) == 2 and all(i.ndim == 2 for i in node.inputs):
        a, b = node.inputs
        bt = _untranspose(b)
        return a, (bt if bt is not None else b.T)
    if isinstance(node.op, Sum) and tuple(node.op.axis or ()) in ((2,), (-1,)):
        inner = node.inputs[0]
        if (
            inner.ndim == 3
            and inner.owner is not None
            and isinstance(inner.owner.op, Elemwise)
            and isinstance(inner.owner.op.scalar_op, ps.Mul)
            and len(inner.owner.inputs) == 2
        ):
            out = []
            for x in inner.owner.inputs:
                b = x.type.broadcastable
                if b[:2] == (False, True):
                    out.append((0, _drop_axis(x, 1)))
                elif b[:2] == (True, False):
                    out.append((1, _drop_axis(x, 0)))
                else:
                    return None
            if sorted(k for k, _ in out) != [0, 1]:
                return None
            out.sort(key=lambda p: p[0])
            return out[0][1], out[1][1]
    return None


def _products(logp):
    """Dense ``(N, D)`` contractions of two matrices inside ``logp``."""
    found = []
    for v in ancestors([logp]):
        if v.owner is None or v.ndim != 2 or any(v.type.broadcastable):
            continue
        f = _factors(v)
        if f is not None:
            found.append((v, *f))
    return found


def _masked_reads(logp):
    """The reads ``x[mask]`` of ``(N, D)`` graphs by a constant boolean mask inside
    ``logp`` (PyMC's observed part of a matrix with missing values), as
    ``(read, x, mask)``."""
    found = []
    for v in ancestors([logp]):
        node = v.owner
        if node is None or not isinstance(node.op, AdvancedSubtensor) or len(node.inputs) != 2:
            continue
        x, idx = node.inputs
        if x.ndim == 2 and isinstance(idx, Constant) and idx.dtype == "bool" and idx.ndim == 2:
            found.append((v, x, np.asarray(idx.data)))
    return found


def flatten_dense_product(logp: Variable, shapes: dict) -> Variable | None:
    """``logp`` of an ``(N, D)`` observed matrix whose predictor holds a dense product
    ``A @ B.T`` of two matrices, rewritten with one entry per observation: the
    product becomes ``(A[s] * B[d]).sum(-1)`` with ``s, d`` the row and column of
    each entry, and every element-wise operation between it and ``logp`` reads its
    other inputs at ``(s, d)`` (a gather of the broadcast axis: a column bias
    ``mu`` becomes ``mu[d]``). The flat ``logp`` has the same sum.

    A matrix with missing values, which PyMC observes as ``Y[mask]`` (``logp`` of
    shape ``(n,)`` reading its parameters as ``x[mask]``), is flattened the same
    way at the observed entries only (``s, d = np.nonzero(mask)``, the order of
    ``x[mask]``).

    Parameters
    ----------
    logp : Variable
        The observed variable's element-wise log density, shape ``(N, D)``.
    shapes : dict
        Shapes of the Gaussian globals' value variables; the product's factors
        must both depend on them.

    Returns
    -------
    Variable or None
        The flat ``(N * D,)`` log density, or None when ``logp`` has no such product
        (exactly one, with both factors depending on the globals) or reaches it
        through anything but element-wise operations.

    Examples
    --------
    >>> import numpy as np, pytensor.tensor as pt
    >>> Z, W, mu = pt.matrix("Z", shape=(3, 2)), pt.matrix("W", shape=(4, 2)), pt.vector("mu", shape=(4,))
    >>> logp = -0.5 * (np.ones((3, 4)) - (Z @ W.T + mu)) ** 2
    >>> flat = flatten_dense_product(logp, {Z: (3, 2), W: (4, 2)})
    >>> flat.type.shape
    (12,)
    >>> rng = np.random.default_rng(0)
    >>> vals = {Z: rng.normal(size=(3, 2)), W: rng.normal(size=(4, 2)), mu: rng.normal(size=4)}
    >>> bool(np.allclose(flat.eval(vals), logp.eval(vals).ravel()))
    True
    """
    if logp.ndim not in (1, 2):
        return None
    logp = _inline_einsums(logp)
    reads, mask = [], None
    if logp.ndim == 1:
        reads = _masked_reads(logp)
        if not reads or any(not np.array_equal(r[2], reads[0][2]) for r in reads):
            return None
        mask = reads[0][2]
    products = [
        p for p in _products(logp) if depends_on_any(p[1], shapes) and depends_on_any(p[2], shapes)
    ]
    if len(products) != 1:
        return None
    prod, A, B = products[0]
    shape = _current_shape(prod, shapes)
    full = mask.shape if mask is not None else _current_shape(logp, shapes)
    if shape is None or full != shape:
        return None
    N, D = shape
    rows, cols = np.nonzero(mask) if mask is not None else np.indices(shape).reshape(2, -1)
    s = pt.constant(rows.astype("int64"), name="row_of_entry")
    d = pt.constant(cols.astype("int64"), name="col_of_entry")
    flat_prod = (A[s] * B[d]).sum(-1)
    # the variables computed from the product (the rest is read at (s, d) as it is)
    downstream = {prod}
    for node in io_toposort(list(graph_inputs([logp])), [logp]):
        if any(i in downstream for i in node.inputs):
            downstream.update(node.outputs)
    memo: dict = {}

    def gathered(y):
        """``y``, which broadcasts to ``(N, D)``, read at every ``(s, d)``."""
        if y.ndim != 2:
            return None
        bn, bd = y.type.broadcastable
        if bn and bd:
            return y[0]
        if bn:
            return _drop_axis(y, 0)[d]
        if bd:
            return _drop_axis(y, 1)[s]
        return y.reshape((N * D,)) if mask is None else y[s, d]

    def flat(v):
        if v in memo:
            return memo[v]
        if v is prod:
            out = flat_prod
        elif v not in downstream:
            out = gathered(v)
        else:
            node = v.owner
            if isinstance(node.op, Alloc | SpecifyShape) and node.inputs[0].ndim == 2:
                out = flat(node.inputs[0])  # a broadcast to the observed's shape
            elif not isinstance(node.op, Elemwise) or len(node.outputs) != 1 or v.ndim != 2:
                out = None
            else:
                ins = [flat(i) for i in node.inputs]
                out = None if any(i is None for i in ins) else node.op(*ins)
        memo[v] = out
        return out

    if mask is None:
        return flat(logp)
    flats = {read: flat(x) for read, x, _ in reads}
    if any(f is None for f in flats.values()):
        return None
    out = graph_replace(logp, flats, strict=False)
    return None if prod in ancestors([out]) else out
