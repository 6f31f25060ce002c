"""Symbolic analysis of predictors that are affine in the Gaussian globals.

A likelihood term depends on the Gaussian globals ``w`` through a predictor
``eta`` (``X @ w``, ``a[group] * x + b``, ...). When ``eta`` is affine in ``w``,

.. math::

    \\eta_{[i]} = o_{[i]} + \\sum_t \\sum_{j < k_t} v^{(t)}_{[i], j}\\, w^{(t)}[c^{(t)}_{[i], j}]

where each *term* ``t`` reads one Gaussian global ``w^{(t)}`` (flattened) at the
integer columns ``c`` with coefficients ``v``. The arrays ``c`` and ``v`` carry one
trailing *contraction* axis of length ``k_t``; all leading axes broadcast against
the shape of ``eta``. A dense design ``X @ w`` is the term with
``c = arange(D)[None, :]`` (broadcast over rows) and ``v = X``; a gather
``a[group]`` is the term with ``c = group[:, None]`` and ``v = 1``. This one
representation lets the estimators form ``g`` and ``H`` with a BLAS product for
dense terms and with segment sums for gathers, never with an N x D Jacobian.

:func:`linearize` walks a PyTensor graph and returns an :class:`AffineForm`, or
``None`` when the expression is not affine in the given variables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytensor.tensor as pt
from pytensor.compile.builders import OpFromGraph
from pytensor.compile.ops import ViewOp
from pytensor.compile.rewriting import inline_ofg_node
from pytensor.graph.basic import Variable
from pytensor.graph.replace import graph_replace
from pytensor.graph.traversal import ancestors
from pytensor.scalar import basic as ps
from pytensor.sparse import dense_from_sparse
from pytensor.sparse.type import SparseTensorType
from pytensor.tensor.basic import Alloc, Join, MakeVector
from pytensor.tensor.blockwise import Blockwise
from pytensor.tensor.elemwise import DimShuffle, Elemwise
from pytensor.tensor.extra_ops import CumOp
from pytensor.tensor.linalg.solvers.core import SolveBase
from pytensor.tensor.math import Dot, Sum
from pytensor.tensor.shape import Reshape, SpecifyShape
from pytensor.tensor.subtensor import (
    AdvancedIncSubtensor,
    AdvancedSubtensor,
    IncSubtensor,
    Subtensor,
    indices_from_subtensor,
)

from pymc_mcssvi.recognize.graph import shape64

#: Largest sparse data matrix (entries, zeros included) read as a dense one in a
#: predictor (``pytensor.sparse.structured_dot(X, w)``): 160 MB of float64.
SPARSE_AS_DENSE_ENTRIES = 2e7

__all__ = ["AffineForm", "LinearTerm", "linearize", "depends_on"]


@dataclass(frozen=True)
class LinearTerm:
    """One term ``sum_j vals[..., j] * w_source.ravel()[cols[..., j]]``.

    Attributes
    ----------
    source : int
        Index of the Gaussian global this term reads.
    cols : TensorVariable
        Integer array, shape ``expr_shape + (k,)`` up to broadcasting.
    vals : TensorVariable or None
        Coefficients with the same (broadcast) shape; ``None`` means all ones.
    """

    source: int
    cols: Variable
    vals: Variable | None

    @property
    def ndim(self) -> int:
        """Number of leading (non-contraction) axes."""
        return self.cols.ndim - 1

    def map(self, fn) -> LinearTerm:
        """Apply the same leading-axis transformation to ``cols`` and ``vals``."""
        return LinearTerm(self.source, fn(self.cols), None if self.vals is None else fn(self.vals))

    def scaled(self, factor) -> LinearTerm:
        """Multiply the coefficients by ``factor`` (broadcast over leading axes)."""
        factor = pt.shape_padright(pt.as_tensor(factor), 1)
        if factor.ndim < self.cols.ndim:
            factor = pt.shape_padleft(factor, self.cols.ndim - factor.ndim)
        vals = factor if self.vals is None else self.vals * factor
        return LinearTerm(self.source, self.cols, vals)

    @property
    def is_dense(self) -> bool:
        """True when the columns are the same for every leading index (``X @ w``)."""
        return all(self.cols.type.broadcastable[:-1])


@dataclass
class AffineForm:
    """``offset + sum(terms)`` with the shape of the analysed expression."""

    ndim: int
    offset: Variable | None = None
    terms: list[LinearTerm] = field(default_factory=list)

    @property
    def sources(self) -> set[int]:
        return {t.source for t in self.terms}


def depends_on(var: Variable, targets) -> bool:
    """Whether ``var`` has any of ``targets`` among its ancestors."""
    targets = set(targets)
    return any(a in targets for a in ancestors([var]))


def _as_tensor_or_none(x):
    return None if x is None else pt.as_tensor(x)


def _add_offsets(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def _pad_left(term: LinearTerm, ndim: int) -> LinearTerm:
    """Give a term ``ndim`` leading axes by prepending broadcastable ones."""
    missing = ndim - term.ndim
    if missing <= 0:
        return term
    return term.map(lambda x: pt.shape_padleft(x, missing))


def _full_leading(term: LinearTerm, shape) -> LinearTerm:
    """Broadcast ``cols`` and ``vals`` to the full leading ``shape`` (materializing)."""
    k = term.cols.shape[-1]
    target = (*shape, k)
    cols = pt.broadcast_to(term.cols, target)
    vals = None if term.vals is None else pt.broadcast_to(term.vals, target)
    return LinearTerm(term.source, cols, vals)


def _dim(x, i):
    """Length of axis ``i``: a Python 1 when statically known, else symbolic."""
    return 1 if x.type.shape[i] == 1 else x.shape[i]


def _merge_into_contraction(term: LinearTerm, axes: list[int], shape) -> LinearTerm:
    """Move leading ``axes`` into the trailing contraction axis (a sum over them).

    ``shape`` gives the true length of (at least) the summed axes, used to
    broadcast them before they are flattened; it must not depend on ``w``.
    """
    nd = term.ndim
    keep = [a for a in range(nd) if a not in axes]
    order = keep + sorted(axes) + [nd]
    k = term.cols.shape[-1]
    if term.vals is not None and term.vals.type.shape[-1] != 1:
        k = term.vals.shape[-1]

    def move(x):
        # Broadcast the summed axes and the contraction axis to their true length.
        tgt = [_dim(x, i) if i not in axes else shape[i] for i in range(nd)] + [k]
        x = pt.broadcast_to(x, tuple(tgt))
        x = x.transpose(order)
        new_shape = [_dim(x, i) for i in range(len(keep))] + [-1]
        return x.reshape(new_shape, ndim=len(keep) + 1)

    return term.map(move)


def _last_len(cols, vals=None):
    """Length of the contraction axis of ``cols`` broadcast with ``vals``: a Python
    int when the static shapes give it (no shape graph to infer per piece)."""
    k = cols.type.shape[-1]
    kv = 1 if vals is None else vals.type.shape[-1]
    if k is not None and kv is not None:
        return max(int(k), int(kv))
    if vals is None or kv == 1:
        return cols.shape[-1]
    return pt.maximum(cols.shape[-1], vals.shape[-1])


def _unique_positions(indices) -> bool:
    """Whether an index tuple addresses each position at most once: basic indices
    always do; integer arrays only when constant and without repeated positions."""
    arrays = []
    for idx in indices:
        if not isinstance(idx, Variable) or idx.ndim == 0:
            continue
        if not idx.dtype.startswith(("int", "uint")):
            return False  # boolean masks: left to the general path
        data = getattr(idx, "data", None)  # a TensorConstant's value
        if data is None:
            return False
        arrays.append(np.asarray(data))
    if not arrays:
        return True
    rows = np.stack([a.ravel() for a in np.broadcast_arrays(*arrays)], axis=-1)
    return len(np.unique(rows, axis=0)) == len(rows)


def _reads_same_columns(term: LinearTerm, axis: int) -> bool:
    """Whether a term's columns are the same along leading ``axis`` (a dense term's
    rows: its value there is ``vals @ w[cols]`` with one ``cols``)."""
    vals_ok = term.vals is None or term.vals.ndim == term.cols.ndim
    return vals_ok and term.ndim == 2 and term.cols.type.broadcastable[axis]


def _dense_through_dot(term: LinearTerm, other, left: bool) -> LinearTerm:
    """A matrix product with a term whose columns do not change along the contracted
    axis: the coefficients are multiplied, the columns stay (``A @ (B @ w)`` is
    ``(A @ B) @ w``, contraction length unchanged, instead of a contraction over
    both products' axes: a sparse GP's ``K_fu @ solve(K_uu, L @ v)`` would read
    ``v`` through ``M^3`` columns per row).

    ``left``: the product is ``other @ term`` (term leading axes ``(d, m)``,
    ``other`` ``(n, d)``), else ``term @ other`` (term ``(n, d)``, other ``(d, m)``).
    """
    vals = term.vals
    if left:
        cols = term.cols[:1]
        if vals is None or vals.type.broadcastable[0]:
            first = pt.ones((1, 1, 1)) if vals is None else vals[:1]
            return LinearTerm(term.source, cols, other.sum(-1)[:, None, None] * first)
        m, k = _dim(vals, 1), _dim(vals, 2)
        flat = vals.reshape((vals.shape[0], -1), ndim=2)
        new = pt.dot(other, flat).reshape((other.shape[0], m, k), ndim=3)
        return LinearTerm(term.source, cols, new)
    cols = term.cols[:, :1]
    if vals is None or vals.type.broadcastable[1]:
        first = pt.ones((1, 1, 1)) if vals is None else vals[:, :1]
        return LinearTerm(term.source, cols, other.sum(0)[None, :, None] * first)
    n, k = _dim(vals, 0), _dim(vals, 2)
    flat = vals.transpose(0, 2, 1).reshape((-1, vals.shape[1]), ndim=2)
    new = pt.dot(flat, other).reshape((n, k, other.shape[1]), ndim=3).transpose(0, 2, 1)
    return LinearTerm(term.source, cols, new)


class _Linearizer:
    """Memoized walk of a graph that builds :class:`AffineForm` objects."""

    def __init__(self, wrt: dict[Variable, int], shapes: dict[Variable, tuple] | None = None):
        self.wrt = wrt
        self.shapes = shapes or {}
        self.memo: dict[Variable, AffineForm | None] = {}
        #: Integer index arrays applied to expressions of the globals: (sources, index, axis length).
        self.gathers: list[tuple[set, Variable, object]] = []
        self._dep: dict[Variable, bool] = {}

    def shape_of(self, var: Variable) -> tuple:
        """Shape of ``var`` as Python ints or graphs that do not involve ``wrt``."""
        zeros = {v: pt.zeros(self.shapes.get(v, v.type.shape), dtype=v.dtype) for v in self.wrt}
        out = []
        for i, s in enumerate(var.type.shape):
            if s is not None:
                out.append(int(s))
            elif not self.depends(var):
                out.append(var.shape[i])
            else:
                out.append(graph_replace(var.shape[i], zeros, strict=False))
        return tuple(out)

    def depends(self, var: Variable) -> bool:
        if var in self._dep:
            return self._dep[var]
        if var in self.wrt:
            out = True
        elif var.owner is None:
            out = False
        else:
            out = any(self.depends(i) for i in var.owner.inputs)
        self._dep[var] = out
        return out

    def __call__(self, var: Variable) -> AffineForm | None:
        if var in self.memo:
            return self.memo[var]
        out = self._linearize(var)
        self.memo[var] = out
        return out

    # ------------------------------------------------------------------ rules
    def _linearize(self, var: Variable) -> AffineForm | None:
        if var in self.wrt:
            shape = self.shapes.get(var, var.type.shape)
            if None in shape:
                raise ValueError(f"static shape of {var} is unknown; pass it in `shapes`")
            size = int(np.prod(shape, dtype=int))
            cols = pt.constant(np.arange(size, dtype="int64").reshape((*shape, 1)))
            return AffineForm(var.ndim, None, [LinearTerm(self.wrt[var], cols, None)])
        if not self.depends(var):
            return AffineForm(var.ndim, var, [])
        node = var.owner
        op = node.op
        if isinstance(op, Elemwise):
            return self._elemwise(var, node)
        if isinstance(op, DimShuffle):
            return self._dimshuffle(var, node)
        if isinstance(op, Dot) or (isinstance(op, Blockwise) and isinstance(op.core_op, Dot)):
            return self._dot(var, node)
        if isinstance(op, Sum):
            return self._sum(var, node)
        if isinstance(op, Subtensor | AdvancedSubtensor):
            return self._subtensor(var, node)
        if isinstance(op, IncSubtensor | AdvancedIncSubtensor):
            return self._inc_subtensor(var, node)
        if isinstance(op, SpecifyShape | ViewOp):  # ViewOp: a pm.Deterministic in the graph
            inner = self(node.inputs[0])
            return None if inner is None else AffineForm(var.ndim, inner.offset, inner.terms)
        if isinstance(op, Reshape):
            return self._reshape(var, node)
        if isinstance(op, Alloc):
            return self._alloc(var, node)
        if isinstance(op, Join):
            return self._join(var, node)
        if isinstance(op, MakeVector):
            return self._make_vector(var, node)
        if isinstance(op, OpFromGraph):
            return self._inline(var, node)
        if isinstance(op, CumOp) and op.mode == "add" and var.ndim <= 2:
            return self._cumsum(var, node)
        if isinstance(op, Blockwise) and isinstance(op.core_op, SolveBase):
            return self._solve(var, node)
        if type(op).__name__ in ("StructuredDot", "Dot") and type(op).__module__.startswith(
            "pytensor.sparse"
        ):
            return self._sparse_dot(var, node)
        return None

    def _sparse_dot(self, var, node):
        """A product with a sparse data matrix (``pytensor.sparse.structured_dot(X, w)``,
        ``pm.math.dot`` of a sparse ``X``): the same product with ``X`` dense, up to
        :data:`SPARSE_AS_DENSE_ENTRIES` entries."""

        parts = []
        for x in node.inputs:
            if isinstance(x.type, SparseTensorType):
                if self.depends(x):
                    return None
                data = x.data if hasattr(x, "data") else getattr(x, "get_value", lambda: None)()
                if data is None or np.prod(data.shape, dtype=float) > SPARSE_AS_DENSE_ENTRIES:
                    return None
                x = dense_from_sparse(x)
            parts.append(x)
        return self(pt.dot(*parts))

    def _solve(self, var, node):
        """``solve(A, b) = A^{-1} @ b`` with ``A`` free of the globals (``pt.linalg.solve``,
        ``solve_triangular``, ``cho_solve``): a sparse GP's projection
        ``K_fu @ solve(K_uu, u)`` onto its inducing values. The coefficient matrix is
        the same solve with the identity as right-hand side (one per evaluation, as
        the user's graph does one per evaluation)."""
        a, b = node.inputs
        core = node.op.core_op
        if self.depends(a) or a.ndim != 2 or b.ndim != core.b_ndim:
            return None  # batched systems, or A depending on the globals
        props = core._props_dict()
        props.update(b_ndim=2, **{k: False for k in props if k.startswith("overwrite")})
        inverse = Blockwise(type(core)(**props))(a, pt.eye(self.shape_of(a)[-1], dtype=a.dtype))
        return self(pt.dot(inverse, b))

    def _cumsum(self, var, node):
        """``cumsum(x) = T @ x`` with the lower-triangular matrix of ones ``T``; of a
        matrix along its rows ``x @ T.T`` (one random walk per row), along its
        columns ``T @ x``; with ``axis=None`` of ``x`` flattened."""
        (x,) = node.inputs
        axis = node.op.axis
        if axis is None and x.ndim > 1:
            x = x.reshape((-1,))
        if x.ndim == 1:
            axis = 0
        axis = axis % x.ndim
        n = self.shape_of(x)[axis]
        tri = (
            pt.constant(np.tril(np.ones((n, n))))
            if isinstance(n, int | np.integer)
            else pt.tril(pt.ones((n, n)))
        )
        return self(pt.dot(tri, x) if axis == 0 else pt.dot(x, tri.T))

    def _elemwise(self, var, node):
        sop = node.op.scalar_op
        ins = node.inputs
        dep = [self.depends(i) for i in ins]
        if isinstance(sop, ps.Add):
            forms = [self(i) for i in ins]
            if any(f is None for f in forms):
                return None
            offset = None
            terms = []
            for f in forms:
                offset = _add_offsets(offset, f.offset)
                terms.extend(_pad_left(t, var.ndim) for t in f.terms)
            return AffineForm(var.ndim, offset, terms)
        if isinstance(sop, ps.Sub):
            a, b = (self(i) for i in ins)
            if a is None or b is None:
                return None
            offset = a.offset
            if b.offset is not None:
                offset = -b.offset if offset is None else offset - b.offset
            terms = [_pad_left(t, var.ndim) for t in a.terms]
            terms += [_pad_left(t.scaled(-1.0), var.ndim) for t in b.terms]
            return AffineForm(var.ndim, offset, terms)
        if isinstance(sop, ps.Neg):
            a = self(ins[0])
            if a is None:
                return None
            off = None if a.offset is None else -a.offset
            return AffineForm(var.ndim, off, [t.scaled(-1.0) for t in a.terms])
        if isinstance(sop, ps.Mul):
            if sum(dep) != 1:
                return None
            j = dep.index(True)
            a = self(ins[j])
            if a is None:
                return None
            factor = None
            for i, x in enumerate(ins):
                if i != j:
                    factor = x if factor is None else factor * x
            off = None if a.offset is None else a.offset * factor
            return AffineForm(
                var.ndim, off, [_pad_left(t, var.ndim).scaled(factor) for t in a.terms]
            )
        if isinstance(sop, ps.TrueDiv):
            if dep[1] or not dep[0]:
                return None
            a = self(ins[0])
            if a is None:
                return None
            factor = 1.0 / ins[1]
            off = None if a.offset is None else a.offset * factor
            return AffineForm(
                var.ndim, off, [_pad_left(t, var.ndim).scaled(factor) for t in a.terms]
            )
        if isinstance(sop, ps.Second):
            # fill(x, y): y broadcast to the shape of x.
            if self.depends(ins[0]):
                return None
            b = self(ins[1])
            if b is None:
                return None
            off = None if b.offset is None else node.op(ins[0], b.offset)
            return AffineForm(var.ndim, off, [_pad_left(t, var.ndim) for t in b.terms])
        if isinstance(sop, ps.Switch):
            # switch(c, a, b) with c free of the globals: c a + (1 - c) b, row by row
            # (piecewise designs: pm.math.switch(x < k, b_lo * x, b_hi * x))
            if dep[0] or not var.dtype.startswith("float"):
                return None
            fa, fb = self(ins[1]), self(ins[2])
            if fa is None or fb is None:
                return None
            # any nonzero condition picks the first branch (an integer count, a float)
            c = pt.cast(pt.neq(ins[0], 0), var.dtype)
            terms = [_pad_left(t, var.ndim).scaled(c) for t in fa.terms]
            terms += [_pad_left(t, var.ndim).scaled(1.0 - c) for t in fb.terms]
            off = None
            if fa.offset is not None or fb.offset is not None:
                oa = 0.0 if fa.offset is None else fa.offset
                ob = 0.0 if fb.offset is None else fb.offset
                off = pt.switch(ins[0], oa, ob)
            return AffineForm(var.ndim, off, terms)
        if isinstance(sop, ps.Identity | ps.Cast):
            if not var.dtype.startswith("float"):
                return None
            a = self(ins[0])
            if a is None:
                return None
            return AffineForm(var.ndim, a.offset, a.terms)
        return None

    def _dimshuffle(self, var, node):
        a = self(node.inputs[0])
        if a is None:
            return None
        order = list(node.op.new_order)
        nd_in = node.op.input_ndim
        dropped = [i for i in range(nd_in) if i not in order]
        kept = [i for i in range(nd_in) if i not in dropped]
        remap = {old: new for new, old in enumerate(kept)}
        order2 = [remap[o] if o != "x" else "x" for o in order] + [len(kept)]

        def shuffle(x):
            if dropped:
                # Dropped axes have length one; index them away in cols/vals too.
                x = x[tuple(0 if d in dropped else slice(None) for d in range(nd_in))]
            return x.dimshuffle(order2)

        off = None if a.offset is None else node.op(a.offset)
        return AffineForm(var.ndim, off, [_pad_left(t, nd_in).map(shuffle) for t in a.terms])

    def _dot(self, var, node):
        x, y = node.inputs
        dx, dy = self.depends(x), self.depends(y)
        if dx and dy:
            return None
        # ``@`` builds a Blockwise Dot even for two matrices: batched only with batch axes.
        batched = isinstance(node.op, Blockwise) and max(x.ndim, y.ndim) > 2
        if not batched and (x.ndim > 2 or y.ndim > 2):
            return None
        # Work with out2[..., n, m] = sum_j x2[..., n, j] * y2[..., j, m]; squeeze at the end.
        x2 = x if (batched or x.ndim == 2) else x[None, :]
        y2 = y if (batched or y.ndim == 2) else y[:, None]
        nd = max(x2.ndim, y2.ndim)
        x2 = pt.shape_padleft(x2, nd - x2.ndim)
        y2 = pt.shape_padleft(y2, nd - y2.ndim)
        nb = nd - 2
        # Only the contracted length is needed, taken from the operand without w.
        d = self.shape_of(x)[-1]
        shape = (*([1] * nb), 1, d, 1)
        if dy:
            form = self(y)
            if form is None:
                return None
            src = y
        else:
            form = self(x)
            if form is None:
                return None
            src = x
        lift_nd = src.ndim if batched else (2 if src.ndim == 2 else 1)
        terms = []
        for t in form.terms:
            t = _pad_left(t, lift_nd)
            if not batched and src.ndim == 1:
                t = t.map((lambda c: c[:, None, :]) if dy else (lambda c: c[None]))
            if not batched and _reads_same_columns(t, 0 if dy else 1):
                terms.append(_dense_through_dot(t, x2 if dy else y2, dy))
                continue
            t = _pad_left(t, nd)
            if dy:  # (..., d, m, k) -> (..., 1, d, m, k), coefficient x[..., n, d]
                t = t.map(lambda c: pt.expand_dims(c, nb)).scaled(x2[..., None])
            else:  # (..., n, d, k) -> (..., n, d, 1, k), coefficient y[..., d, m]
                t = t.map(lambda c: pt.expand_dims(c, nb + 2)).scaled(pt.expand_dims(y2, nb))
            terms.append(_merge_into_contraction(t, [nb + 1], shape))
        if form.offset is None:
            off = None
        else:
            # at its full shape: a constant added to the coefficients keeps shape (1,)
            # (``X @ (0.5 + 0.3 * z)`` reads it len(z) times)
            full = pt.broadcast_to(form.offset, shape64(self.shape_of(src)))
            off = node.op(x, full) if dy else node.op(full, y)
        if not batched:
            if x.ndim == 1:
                terms = [t.map(lambda c: c[0]) for t in terms]
            if y.ndim == 1:
                terms = [t.map(lambda c: c[..., 0, :]) for t in terms]
        return AffineForm(var.ndim, off, terms)

    def _sum(self, var, node):
        a = self(node.inputs[0])
        if a is None:
            return None
        inp = node.inputs[0]
        axes = node.op.axis
        axes = list(range(inp.ndim)) if axes is None else [ax % inp.ndim for ax in axes]
        shape = self.shape_of(inp)
        terms = [_merge_into_contraction(_pad_left(t, inp.ndim), axes, shape) for t in a.terms]
        off = None
        if a.offset is not None:
            # at its full shape: ``c[:, None] + X * w`` summed over axis 1 adds c D times
            off = pt.sum(pt.broadcast_to(a.offset, shape64(shape)), axis=axes)
        return AffineForm(var.ndim, off, terms)

    def _subtensor(self, var, node):
        x, *idx_in = node.inputs
        if any(self.depends(i) for i in idx_in):
            return None
        a = self(x)
        if a is None:
            return None
        indices = tuple(indices_from_subtensor(idx_in, node.op.idx_list))
        shape = self.shape_of(x)
        for axis, idx in enumerate(indices):
            if (
                isinstance(idx, Variable)
                and idx.ndim >= 1
                and idx.dtype.startswith(("int", "uint"))
            ):
                self.gathers.append((a.sources, idx, shape[axis]))
        terms = []
        for t in a.terms:
            t = _pad_left(t, x.ndim)
            if t.is_dense and (t.vals is not None):
                # Same columns everywhere: index the coefficients only.
                k = t.cols.shape[-1]
                vals = pt.broadcast_to(t.vals, shape64((*shape, pt.maximum(k, t.vals.shape[-1]))))[
                    indices
                ]
                cols = t.cols.reshape((*([1] * var.ndim), k), ndim=var.ndim + 1)
                terms.append(LinearTerm(t.source, cols, vals))
                continue
            t = _full_leading(t, shape)
            terms.append(t.map(lambda c: c[indices]))
        off = None
        if a.offset is not None:
            off = pt.broadcast_to(a.offset, shape64(shape))[indices]
        return AffineForm(var.ndim, off, terms)

    def _inc_subtensor(self, var, node):
        """``x[idx].set(y)`` / ``x[idx].inc(y)``: ``y``'s terms scattered into ``x``'s
        shape (columns and coefficients placed by the same indexing, zero
        coefficients elsewhere), ``x``'s terms kept (with ``set``, zeroed at ``idx``).
        Users build structured vectors and matrices this way (a reference category's
        zero coefficient, loadings filled into a lower triangle). An increment at
        advanced indices is affine only without repeated positions (repeats add up),
        which is checked on constant indices; symbolic ones are left to the general
        path."""
        x, y, *idx_in = node.inputs
        if any(self.depends(i) for i in idx_in):
            return None
        op = node.op
        setting = op.set_instead_of_inc
        indices = tuple(indices_from_subtensor(idx_in, op.idx_list))
        if not setting and not _unique_positions(indices):
            return None
        ax, ay = self(x), self(y)
        if ax is None or ay is None:
            return None
        shape = shape64(self.shape_of(x))
        sub = pt.zeros(shape)[indices]
        sub_shape = tuple(sub.shape[i] if s is None else s for i, s in enumerate(sub.type.shape))
        terms = []
        for t in ax.terms:
            t = _full_leading(_pad_left(t, x.ndim), shape)
            if setting:
                vals = pt.ones(t.cols.shape) if t.vals is None else t.vals
                t = LinearTerm(t.source, t.cols, pt.set_subtensor(vals[indices], 0.0))
            terms.append(t)
        for t in ay.terms:
            t = _full_leading(_pad_left(t, sub.ndim), sub_shape)
            k = t.cols.shape[-1]
            cols = pt.zeros((*shape, k), dtype=t.cols.dtype)[indices].set(t.cols)
            vals = pt.ones(t.cols.shape) if t.vals is None else t.vals
            terms.append(LinearTerm(t.source, cols, pt.zeros((*shape, k))[indices].set(vals)))
        off = None
        if ax.offset is not None or ay.offset is not None:
            base = pt.zeros(shape, dtype=var.dtype)
            if ax.offset is not None:
                base = base + ax.offset
            placed = pt.zeros((), dtype=var.dtype) if ay.offset is None else ay.offset
            off = base[indices].set(placed) if setting else base[indices].inc(placed)
        return AffineForm(var.ndim, off, terms)

    def _reshape(self, var, node):
        x, shp = node.inputs
        a = self(x)
        if a is None:
            return None
        shape = self.shape_of(x)
        new = self.shape_of(var)
        terms = []
        for t in a.terms:
            t = _full_leading(_pad_left(t, x.ndim), shape)
            terms.append(t.map(lambda c: c.reshape((*new, c.shape[-1]), ndim=var.ndim + 1)))
        off = (
            None
            if a.offset is None
            else pt.broadcast_to(a.offset, shape64(shape)).reshape(new, ndim=var.ndim)
        )
        return AffineForm(var.ndim, off, terms)

    def _alloc(self, var, node):
        x, *shape = node.inputs
        a = self(x)
        if a is None:
            return None
        terms = []
        for t in a.terms:
            t = _pad_left(t, var.ndim)
            k = t.cols.shape[-1]
            terms.append(
                LinearTerm(
                    t.source,
                    t.cols,
                    pt.broadcast_to(
                        pt.ones((), dtype=var.dtype) if t.vals is None else t.vals,
                        shape64((*shape, k)),
                    ),
                )
            )
        off = None if a.offset is None else pt.broadcast_to(a.offset, shape64(shape))
        return AffineForm(var.ndim, off, terms)

    def _join(self, var, node):
        if hasattr(node.op, "axis"):
            axis, parts = node.op.axis, node.inputs
        else:  # older PyTensor: the axis is the first input
            axis, *parts = node.inputs
            try:
                axis = int(pt.get_underlying_scalar_constant_value(axis))
            except Exception:
                return None
        axis = axis % var.ndim
        forms = [self(p) for p in parts]
        if any(f is None for f in forms):
            return None
        return self._stack_forms(var, parts, forms, axis, concat=True)

    def _make_vector(self, var, node):
        parts = node.inputs
        forms = [self(p) for p in parts]
        if any(f is None for f in forms):
            return None
        return self._stack_forms(var, parts, forms, 0, concat=False)

    def _stack_forms(self, var, parts, forms, axis, concat):
        """Join of affine pieces: one term per source, each piece's terms of it side by
        side in the contraction axis, zero-padded to a common width and to zero
        columns where a piece does not read the source (a stack of ``N`` per-row
        pieces costs ``O(N)`` graph nodes, not one zero block per pair of pieces)."""
        offsets = []
        pshapes = [self.shape_of(p) for p in parts]
        for pshape, f in zip(pshapes, forms, strict=True):
            offsets.append(
                pt.zeros(pshape, dtype=var.dtype)
                if f.offset is None
                else pt.broadcast_to(f.offset, shape64(pshape)).astype(var.dtype)
            )
        off = pt.join(axis, *offsets) if concat else pt.stack(offsets)
        qshapes = [list(ps) if concat else [1, *ps] for ps in pshapes]
        pieces: dict[int, dict[int, list]] = {}  # source -> part -> [(cols, vals)]
        for i, (p, f) in enumerate(zip(parts, forms, strict=True)):
            for t in f.terms:
                t = _full_leading(_pad_left(t, p.ndim), pshapes[i])
                if not concat:
                    t = t.map(lambda c: c[None])
                vals = pt.ones((), dtype=var.dtype) if t.vals is None else t.vals
                k = _last_len(t.cols, None if t.vals is None else vals)
                full = shape64((*qshapes[i], k))
                pieces.setdefault(t.source, {}).setdefault(i, []).append(
                    (pt.broadcast_to(t.cols, full), pt.broadcast_to(vals, full).astype(var.dtype))
                )
        terms = []
        for source, by_part in pieces.items():
            cols_parts, vals_parts = [], []
            for i in range(len(parts)):
                got = by_part.get(i)
                if got is None:
                    cols_parts.append(pt.zeros((*qshapes[i], 1), dtype="int64"))
                    vals_parts.append(pt.zeros((*qshapes[i], 1), dtype=var.dtype))
                else:
                    cols_parts.append(pt.concatenate([c for c, _ in got], axis=-1))
                    vals_parts.append(pt.concatenate([v for _, v in got], axis=-1))
            lens = [_last_len(c) for c in cols_parts]
            if all(isinstance(n, int) for n in lens):
                width = max(lens)
            else:
                width = pt.max(pt.stack([pt.as_tensor(n, dtype="int64") for n in lens]))
            for i in range(len(parts)):
                pad = (*qshapes[i], width - lens[i])
                cols_parts[i] = pt.concatenate(
                    [cols_parts[i].astype("int64"), pt.zeros(pad, dtype="int64")], axis=-1
                )
                vals_parts[i] = pt.concatenate(
                    [vals_parts[i], pt.zeros(pad, dtype=var.dtype)], axis=-1
                )
            terms.append(LinearTerm(source, pt.join(axis, *cols_parts), pt.join(axis, *vals_parts)))
        return AffineForm(var.ndim, off, terms)

    def _inline(self, var, node):
        expanded = inline_ofg_node(node)[node.outputs.index(var)]
        return self(expanded)


def linearize(
    expr: Variable, wrt: dict[Variable, int], shapes: dict[Variable, tuple] | None = None
) -> AffineForm | None:
    """Express ``expr`` as an affine function of the variables in ``wrt``.

    Parameters
    ----------
    expr : TensorVariable
        The expression to analyse, e.g. a predictor ``X @ w + a[g]``.
    wrt : dict
        Maps each variable the expression may be affine in to an integer id that
        is recorded as :attr:`LinearTerm.source`.
    shapes : dict, optional
        Static shapes of the ``wrt`` variables when their types do not carry them.

    Returns
    -------
    AffineForm or None
        ``None`` when ``expr`` is not affine in ``wrt`` (products of two
        dependent factors, nonlinear functions, unsupported operations).

    Examples
    --------
    >>> import numpy as np, pytensor.tensor as pt
    >>> w = pt.vector("w", shape=(3,))
    >>> X = np.arange(6.0).reshape(2, 3)
    >>> form = linearize(X @ w + 1.0, {w: 0})
    >>> [t.is_dense for t in form.terms]
    [True]
    >>> form.terms[0].vals.eval().tolist()
    [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    """
    return _Linearizer(wrt, shapes)(expr)
