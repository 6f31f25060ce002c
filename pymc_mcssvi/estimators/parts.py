r"""A general term's sum over observations, evaluated part by part.

A ``pm.Potential`` such as a topic model's

.. code-block:: python

    d, v = np.nonzero(C)
    p = (theta[d] * beta[:, v].T).sum(-1)
    pm.Potential("w", (C[d, v] * pt.log(p)).sum())

is one scalar, but it is a sum over the rows of its constant leaves (``d``, ``v``):
each intermediate between those leaves and the final ``Sum`` has the observations
along one axis. The Monte Carlo estimator's memory then grows as draws x observations
x K (a ``(P, K)`` array per node and draw: 2.6 GB a draw at 518,836 pairs and
K = 50). :class:`ObservationParts` recognizes that form and evaluates the term on
``n_parts`` slices of its observations in turn (a scan), adding up the value and the
per-draw gradients; the gradient of a sum is the sum of the parts' gradients, so the
numbers are those of the whole term. The globals-only part of the graph (a softmax
over the topics) is recomputed per part: parts are made large enough that this
stays small (:data:`PART_BYTES`).

The check is structural (:func:`observation_axes`): from the observation leaves to the
total, every operation must keep the observations on one axis (elementwise operations
with globals broadcast along it, transposes, reductions over other axes, gathers from
globals by an observation index) until a ``Sum`` over that axis, after which only
linear operations may follow. The last part is padded by repeating the first
observations, masked out before the sum.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.graph.basic import Constant, Variable
from pytensor.graph.replace import clone_replace, graph_replace
from pytensor.graph.traversal import graph_inputs, io_toposort
from pytensor.scalar import basic as ps
from pytensor.tensor.basic import Join, MakeVector
from pytensor.tensor.elemwise import CAReduce, DimShuffle, Elemwise
from pytensor.tensor.math import Sum
from pytensor.tensor.subtensor import AdvancedSubtensor

from pymc_mcssvi.recognize.graph import gather_index
from pymc_mcssvi.recognize.vectorize import shapes_at_fixed

__all__ = ["PART_BYTES", "ObservationParts", "RowWindows", "observation_axes"]

#: Bytes of one draw's observation-indexed intermediates per part. Large enough that
#: the globals-only nodes each part recomputes (a ``K x V`` softmax) stay a small
#: share of its work, small enough that a part's arrays are a fraction of a gigabyte.
PART_BYTES = 2**27
#: Fewest observations a term needs before it is split.
MIN_ROWS = 1024


def _full_slice(entry) -> bool:
    """Whether an entry of an ``AdvancedSubtensor``'s index list is ``:``."""
    return isinstance(entry, slice) and entry == slice(None, None, None)


def observation_axes(total: Variable, leaves: list[Variable]):
    """The observation axis of each intermediate between ``leaves`` and ``total``.

    Returns ``(axes, reducers)``: ``axes`` maps each variable that holds observations
    to the axis they lie along, ``reducers`` lists the ``Sum`` nodes over that axis.
    ``None`` when ``total`` is not a sum over the leaves' rows (see the module
    docstring), e.g. when an operation mixes observations or reads their number.

    Examples
    --------
    >>> import numpy as np
    >>> import pytensor.tensor as pt
    >>> x = pt.vector("x", shape=(3,))
    >>> d = pt.constant(np.arange(2000) % 3)
    >>> axes, sums = observation_axes(pt.log(pt.exp(x)[d]).sum(), [d])
    >>> len(sums)
    1
    >>> observation_axes(pt.log(pt.exp(x)[d].sum()), [d]) is None  # the log of the sum
    True
    """
    axes = {leaf: 0 for leaf in leaves}
    reduced: set[Variable] = set()
    reducers = []
    for node in io_toposort(list(graph_inputs([total])), [total]):
        rowed = [(i, axes[i]) for i in node.inputs if i in axes]
        after = [i for i in node.inputs if i in reduced]
        if not rowed and not after:
            continue
        op = node.op
        out = node.outputs[0]
        if after:  # past the sum over the observations: linear operations only
            if rowed:
                return None
            # a global (or constant) added to the sum would be added once per part; a
            # global factor scales every part alike
            every = all(i in reduced for i in node.inputs)
            linear = isinstance(op, DimShuffle | Sum) or (
                isinstance(op, MakeVector | Join)
                and all(i in reduced for i in node.inputs[isinstance(op, Join) :])
            )
            if isinstance(op, Elemwise):
                sop = op.scalar_op
                linear = (isinstance(sop, ps.Add | ps.Sub | ps.Neg | ps.Identity) and every) or (
                    isinstance(sop, ps.Mul) and len(after) == 1
                )
            if not linear or len(node.outputs) != 1:
                return None
            reduced.add(out)
            continue
        if len(node.outputs) != 1:
            return None
        if isinstance(op, Elemwise):
            found = {a for _, a in rowed}
            if len(found) != 1:
                return None
            (a,) = found
            for i in node.inputs:
                if i not in axes and not (i.type.ndim == out.type.ndim and i.type.broadcastable[a]):
                    return None
            axes[out] = a
        elif isinstance(op, DimShuffle):
            (_, a), order = rowed[0], list(op.new_order)
            if a not in order:
                return None
            axes[out] = order.index(a)
        elif isinstance(op, CAReduce):
            (_, a) = rowed[0]
            red = tuple(range(node.inputs[0].type.ndim)) if op.axis is None else tuple(op.axis)
            if a in red:
                if not isinstance(op, Sum):
                    return None
                reducers.append(node)
                reduced.add(out)
            else:
                axes[out] = a - sum(r < a for r in red)
        elif isinstance(op, AdvancedSubtensor):
            x, *index = node.inputs
            entries = list(getattr(op, "idx_list", ()))
            if x in axes or len(entries) != len(index) + sum(map(_full_slice, entries)):
                return None
            if any(isinstance(e, slice) and not _full_slice(e) for e in entries):
                return None
            positions = [k for k, e in enumerate(entries) if not isinstance(e, slice)]
            if not positions or any(i not in axes for i in index):
                return None
            if any(i.type.ndim != 1 or axes[i] != 0 for i in index):
                return None
            if positions != list(range(positions[0], positions[0] + len(positions))):
                return None  # separated advanced indices move their axis to the front
            axes[out] = positions[0]
        else:
            return None
    if total in axes or total not in reduced:
        return None
    return axes, reducers


def _candidate_leaves(total: Variable, min_rows: int = MIN_ROWS) -> dict[int, list[Variable]]:
    """Constant leaves of ``total`` with at least ``min_rows`` rows, by row count."""
    out: dict[int, list[Variable]] = {}
    for v in graph_inputs([total]):
        if isinstance(v, Constant) and getattr(v.type, "ndim", 0) >= 1:
            n = int(np.shape(v.data)[0])
            if n >= min_rows:
                out.setdefault(n, []).append(v)
    return out


def _sum_over_rows(total: Variable, min_rows: int = MIN_ROWS):
    """``(leaves, axes, reducers)`` for the constant leaves (at least ``min_rows`` rows,
    the longest first) over whose rows ``total`` is a sum (:func:`observation_axes`),
    or ``None``."""
    for _, leaves in sorted(_candidate_leaves(total, min_rows).items(), reverse=True):
        found = observation_axes(total, leaves)
        if found is not None:
            return (leaves, *found)
    return None


class ObservationParts:
    """``total`` (a function of ``w``) evaluated on ``n_parts`` slices of its observations.

    Use :meth:`build`, which returns ``None`` when ``total`` is not a sum over the rows
    of its constant leaves, or when one part would hold every observation.

    Attributes
    ----------
    n_rows, n_parts, part_rows : int
        Observations, parts, observations per part (the last part padded).
    """

    def __init__(self, total, w, leaves, reducers, axes, n_parts=None, order=None):
        self.w = w
        self.n_rows = int(np.shape(leaves[0].data)[0])
        if order is None:  # n_parts slices of the rows, the last padded
            self.n_parts = int(n_parts)
            self.part_rows = -(-self.n_rows // self.n_parts)
            order = np.arange(self.part_rows * self.n_parts)
            order[order >= self.n_rows] = -1  # padding (-1): masked out
            order = order.reshape((self.n_parts, self.part_rows))
        order = np.asarray(order)
        self.n_parts, L = order.shape[-2], order.shape[-1]
        self.part_rows = L
        self.mask = pt.vector("part_mask", shape=(L,))
        # the sums' inputs masked (by a mask of any length: the static length of the
        # inputs is the whole term's until the leaves are replaced by one part's rows)
        any_mask = pt.vector("part_mask_any", shape=(None,))
        masked = {}
        for node in reducers:
            x = node.inputs[0]
            pattern = ["x"] * x.type.ndim
            pattern[axes[x]] = 0
            keep = any_mask.dimshuffle(pattern) > 0
            masked[node.outputs[0]] = node.op(pt.switch(keep, x, pt.zeros_like(x)))
        total = graph_replace(total, masked, strict=False)
        holders, values = {}, []
        rows = np.where(order >= 0, order, 0)  # padding: the first row, masked out
        for leaf in leaves:
            data = np.asarray(leaf.data)
            holders[leaf] = pt.tensor(
                f"{leaf.name or 'rows'}_part", dtype=leaf.dtype, shape=(L, *data.shape[1:])
            )
            values.append(pt.constant(data[rows]))
        self.total = clone_replace(total, {**holders, any_mask: self.mask}, rebuild_strict=False)
        self.holders = list(holders.values())
        # shapes read at fixed inputs: batched over draws, they would become Blockwise
        # reshapes and splits (see shapes_at_fixed)
        self.total, self.grad = shapes_at_fixed(
            [w, self.mask, *self.holders], [self.total, pt.grad(self.total, w)]
        )
        #: per part (per window and part, with :meth:`windows`), the leaves' rows and
        #: the mask: the sequences of the scan
        self.sequences = [*values, pt.constant((order >= 0).astype("float64"))]

    @classmethod
    def build(cls, total: Variable, w: Variable, bytes_per_draw: float):
        """The parts of ``total`` so that one draw's observation-indexed
        intermediates (``bytes_per_draw`` in all) take at most about
        :data:`PART_BYTES` a part, or ``None``."""
        n_parts = int(np.ceil(bytes_per_draw / PART_BYTES))
        if n_parts < 2:
            return None
        found = _sum_over_rows(total)
        if found is None:
            return None
        leaves, axes, reducers = found
        n = int(np.shape(leaves[0].data)[0])
        return cls(total, w, leaves, reducers, axes, min(n_parts, n // 2))

    def values(self, vectorize, W, mode=None, window=None):
        """Per draw the value and the gradient with respect to ``w``, summed over the
        parts: ``(n,)`` and ``(n, dim)`` for the draws ``W`` (``(n, dim)``).
        ``vectorize(graphs, replace)`` batches a graph over the draws; ``mode`` is the
        scan's compile mode (the step's, as for the kernel's chunk scans). ``window``
        (a symbolic integer, parts laid out by :class:`RowWindows`) sums that window's
        parts only."""
        sequences = self.sequences if window is None else [s[window] for s in self.sequences]

        def step(*args):
            *rows, mask, value, grad = args
            repl = {self.w: W, self.mask: mask, **dict(zip(self.holders, rows, strict=True))}
            v, g = vectorize([self.total, self.grad], repl)
            return value + v, grad + g

        n = W.shape[0]
        init = [pt.zeros((n,)), pt.zeros((n, self.w.type.shape[0]))]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The `mode` argument of `scan`", FutureWarning)
            value, grad = pytensor.scan(
                step, sequences=sequences, outputs_info=init, return_updates=False, mode=mode
            )
        return value[-1], grad[-1]


class RowWindows:
    """A general term's sum over observations restricted to a window of the rows of a
    per-row global (a topic model's documents), for fits that move ``batch`` rows a
    step (``row_batch``).

    The observations (the rows of the term's constant leaves, e.g. a document's
    nonzero counts) are grouped by the row of the global they read, ``index``
    (``d`` in ``theta[d]``); window ``j`` holds the observations of rows
    ``lo[j] <= r < hi[j]`` (consecutive rows, ``batch`` of them, the last window
    shorter), laid out as parts (:class:`ObservationParts`) padded to the longest
    window. Use :meth:`build`, which checks that an observation reads the global's
    rows only through its own index.

    Attributes
    ----------
    parts : ObservationParts
        The windows' parts: ``parts.values(..., window=j)`` sums window ``j``.
    lo, hi : numpy.ndarray
        Each window's first and one-past-last row.
    n_windows, n_rows : int
        Windows, rows of the global.
    scale : float
        The weight of a window's term in the estimate of the whole term: the number
        of windows. The steps visit the windows in turn, each as often, so the
        average of the scaled windows is the whole term (rows / window rows would
        over-weight a shorter last window).
    """

    def __init__(self, parts, lo, hi, n_rows):
        self.parts = parts
        self.lo, self.hi = np.asarray(lo), np.asarray(hi)
        self.n_windows = len(self.lo)
        self.n_rows = int(n_rows)
        self.scale = float(self.n_windows)

    @classmethod
    def build(cls, total, w, bytes_per_draw, positions, batch, check=None):
        """The windows of ``total``'s observations by the rows of the global whose
        ``(R, K)`` flat positions in ``w`` are ``positions``, ``batch`` rows each.

        Returns ``(windows, None)``, or ``(None, reason)`` when ``total`` is not a sum
        over observations each reading one row of that global through a constant
        index. ``check(parts, window)`` returns the gradient of a window's total
        with respect to ``w`` (at some point): rows outside the window must get
        none, which :meth:`build` verifies on the first windows.
        """
        R = positions.shape[0]
        found = _sum_over_rows(total, min_rows=2)
        if found is None:
            return None, (
                "its log density is not a sum over observations (the rows of its constant "
                "arrays) that keeps each observation on its own row"
            )
        leaves, axes, reducers = found
        index = _row_index(total, leaves, R)
        if index is None:
            return None, (
                f"no observation index gathers the {R} rows (theta[d] with a constant "
                "integer d, one entry per observation)"
            )
        d = np.asarray(index.data).astype("int64") % R
        batch = int(min(max(int(batch), 1), R))
        lo = np.arange(0, R, batch)
        hi = np.minimum(lo + batch, R)
        window_of = d // batch
        counts = np.bincount(window_of, minlength=len(lo))
        longest = max(int(counts.max()), 1)
        n_rows_all = len(d)
        per_window = bytes_per_draw * longest / max(n_rows_all, 1)
        n_sub = int(min(max(np.ceil(per_window / PART_BYTES), 1), longest))
        L = -(-longest // n_sub)
        order = np.full((len(lo), n_sub * L), -1, dtype="int64")
        sort = np.argsort(window_of, kind="stable")
        starts = np.concatenate([[0], np.cumsum(counts)])
        for j in range(len(lo)):
            order[j, : counts[j]] = sort[starts[j] : starts[j + 1]]
        parts = ObservationParts(
            total, w, leaves, reducers, axes, order=order.reshape((len(lo), n_sub, L))
        )
        windows = cls(parts, lo, hi, R)
        if check is not None:
            for j in range(min(len(lo), 3)):
                g = np.asarray(check(parts, j))[positions]  # (R, K)
                outside = np.ones(R, dtype=bool)
                outside[lo[j] : hi[j]] = False
                if np.any(g[outside] != 0.0):
                    return None, (
                        "an observation reads rows of it other than its own (row "
                        f"{int(np.flatnonzero(np.any(g != 0.0, axis=1) & outside)[0])} from "
                        f"the observations of rows {lo[j]}-{hi[j] - 1})"
                    )
        return windows, None


def _row_index(total, leaves, R):
    """The leaf among ``leaves`` that gathers ``R`` rows (``x[d]``, ``x`` with ``R``
    rows and not itself observation-indexed), if exactly one does."""
    found = set()
    for node in io_toposort(list(graph_inputs([total])), [total]):
        idx = gather_index(node)
        if idx is None or idx not in leaves:
            continue
        x = node.inputs[0]
        if x in leaves or x.type.shape[0] != R:
            continue
        found.add(idx)
    return found.pop() if len(found) == 1 else None
