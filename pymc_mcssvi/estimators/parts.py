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

from pymc_mcssvi.recognize.vectorize import shapes_at_fixed

__all__ = ["PART_BYTES", "ObservationParts", "observation_axes"]

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


def _candidate_leaves(total: Variable) -> dict[int, list[Variable]]:
    """Constant leaves of ``total`` with at least :data:`MIN_ROWS` rows, by row count."""
    out: dict[int, list[Variable]] = {}
    for v in graph_inputs([total]):
        if isinstance(v, Constant) and getattr(v.type, "ndim", 0) >= 1:
            n = int(np.shape(v.data)[0])
            if n >= MIN_ROWS:
                out.setdefault(n, []).append(v)
    return out


class ObservationParts:
    """``total`` (a function of ``w``) evaluated on ``n_parts`` slices of its observations.

    Use :meth:`build`, which returns ``None`` when ``total`` is not a sum over the rows
    of its constant leaves, or when one part would hold every observation.

    Attributes
    ----------
    n_rows, n_parts, part_rows : int
        Observations, parts, observations per part (the last part padded).
    """

    def __init__(self, total, w, leaves, reducers, axes, n_parts):
        self.w = w
        self.n_rows = int(np.shape(leaves[0].data)[0])
        self.n_parts = int(n_parts)
        self.part_rows = -(-self.n_rows // self.n_parts)
        L, padded = self.part_rows, self.part_rows * self.n_parts
        order = np.arange(padded) % self.n_rows  # padding repeats the first rows
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
        for leaf in leaves:
            data = np.asarray(leaf.data)
            holders[leaf] = pt.tensor(
                f"{leaf.name or 'rows'}_part", dtype=leaf.dtype, shape=(L, *data.shape[1:])
            )
            values.append(pt.constant(data[order].reshape((self.n_parts, L, *data.shape[1:]))))
        self.total = clone_replace(total, {**holders, any_mask: self.mask}, rebuild_strict=False)
        self.holders = list(holders.values())
        # shapes read at fixed inputs: batched over draws, they would become Blockwise
        # reshapes and splits (see shapes_at_fixed)
        self.total, self.grad = shapes_at_fixed(
            [w, self.mask, *self.holders], [self.total, pt.grad(self.total, w)]
        )
        masks = (np.arange(padded) < self.n_rows).astype("float64").reshape((self.n_parts, L))
        #: per part, the leaves' rows and the mask: the sequences of the scan
        self.sequences = [*values, pt.constant(masks)]

    @classmethod
    def build(cls, total: Variable, w: Variable, bytes_per_draw: float):
        """The parts of ``total`` so that one draw's observation-indexed
        intermediates (``bytes_per_draw`` in all) take at most about
        :data:`PART_BYTES` a part, or ``None``."""
        n_parts = int(np.ceil(bytes_per_draw / PART_BYTES))
        if n_parts < 2:
            return None
        for n, leaves in sorted(_candidate_leaves(total).items(), reverse=True):
            found = observation_axes(total, leaves)
            if found is None:
                continue
            axes, reducers = found
            return cls(total, w, leaves, reducers, axes, min(n_parts, n // 2))
        return None

    def values(self, vectorize, W, mode=None):
        """Per draw the value and the gradient with respect to ``w``, summed over the
        parts: ``(n,)`` and ``(n, dim)`` for the draws ``W`` (``(n, dim)``).
        ``vectorize(graphs, replace)`` batches a graph over the draws; ``mode`` is the
        scan's compile mode (the step's, as for the kernel's chunk scans)."""

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
                step, sequences=self.sequences, outputs_info=init, return_updates=False, mode=mode
            )
        return value[-1], grad[-1]
