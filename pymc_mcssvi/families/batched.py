r"""Cholesky factorization and triangular solves for many small blocks.

Row-block covariances (PMF rows, random-effect groups) need ``R`` factorizations
of ``K x K`` matrices per iteration with ``R`` in the thousands and ``K`` around
2-12. PyTensor's batched linear algebra (``Blockwise``) calls LAPACK once per
block, which is slow when the step is not compiled. Two remedies:

* for ``K <= UNROLL_MAX_K`` the algorithms are unrolled over ``K`` at
  graph-construction time, so each operation is an elementwise expression on
  length-``R`` vectors (``O(K^3)`` of them), in every backend;
* for larger blocks the graphs hold PyTensor's own batched ops (``Blockwise``
  ``Cholesky`` and ``SolveTriangular``), which every backend compiles natively,
  and the Python backend's modes rewrite them into one call of NumPy's stacked
  LAPACK routines (:func:`blockwise_linalg_as_stacked`, registered in the
  plugin's own modes only: nothing is added to PyTensor's global rewrite
  database).

Notes
-----
A block that is not positive definite produces NaN (square root of a negative
number), which the step kernel treats as a rejected step.
"""

from __future__ import annotations

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Apply, Constant
from pytensor.graph.op import Op
from pytensor.graph.rewriting.basic import node_rewriter
from pytensor.tensor.basic import Alloc, Eye
from pytensor.tensor.blockwise import Blockwise
from pytensor.tensor.linalg.decomposition.cholesky import Cholesky
from pytensor.tensor.linalg.solvers.triangular import SolveTriangular

__all__ = [
    "UNROLL_MAX_K",
    "cholesky_unrolled",
    "lower_inverse_unrolled",
    "solve_lower_unrolled",
    "solve_lower_t_unrolled",
    "blockwise_linalg_as_stacked",
    "stacked_cholesky",
    "stacked_lower_inverse",
]

#: Largest block size handled by unrolled loops (larger blocks use NumPy's stacked LAPACK).
UNROLL_MAX_K = 3


def _stack_lower(entries, K):
    """``(R, K, K)`` lower-triangular tensor from a dict ``(i, j) -> (R,)``."""
    zero = pt.zeros_like(entries[(0, 0)])
    rows = [pt.stack([entries.get((i, j), zero) for j in range(K)], axis=-1) for i in range(K)]
    return pt.stack(rows, axis=-2)


def cholesky_unrolled(P):
    """Lower Cholesky factors of ``(R, K, K)`` symmetric positive definite blocks."""
    K = P.type.shape[-1]
    L = {}
    for j in range(K):
        s = P[:, j, j]
        for k in range(j):
            s = s - pt.square(L[(j, k)])
        L[(j, j)] = pt.sqrt(s)
        for i in range(j + 1, K):
            s = P[:, i, j]
            for k in range(j):
                s = s - L[(i, k)] * L[(j, k)]
            L[(i, j)] = s / L[(j, j)]
    return _stack_lower(L, K)


def lower_inverse_unrolled(L):
    """``L^{-1}`` of ``(R, K, K)`` lower-triangular blocks (forward substitution)."""
    K = L.type.shape[-1]
    X = {}
    for j in range(K):
        X[(j, j)] = 1.0 / L[:, j, j]
        for i in range(j + 1, K):
            s = 0.0
            for k in range(j, i):
                s = s + L[:, i, k] * X[(k, j)]
            X[(i, j)] = -s / L[:, i, i]
    return _stack_lower(X, K)


def solve_lower_unrolled(L, b):
    """Solve ``L x = b`` for ``b`` of shape ``(R, K)``."""
    K = L.type.shape[-1]
    x = []
    for i in range(K):
        s = b[:, i]
        for k in range(i):
            s = s - L[:, i, k] * x[k]
        x.append(s / L[:, i, i])
    return pt.stack(x, axis=-1)


def solve_lower_t_unrolled(L, b):
    """Solve ``L^T x = b`` for ``b`` of shape ``(R, K)``."""
    K = L.type.shape[-1]
    x = [None] * K
    for i in reversed(range(K)):
        s = b[:, i]
        for k in range(i + 1, K):
            s = s - L[:, k, i] * x[k]
        x[i] = s / L[:, i, i]
    return pt.stack(x, axis=-1)


class _StackedLinalg(Op):
    """Batched LAPACK on a ``(R, K, K)`` stack through NumPy's stacked routines.

    PyTensor's ``Blockwise`` linear algebra calls SciPy once per block from
    Python when the step is not compiled (``np.vectorize``), which dominates
    the iteration for thousands of small blocks; ``np.linalg`` loops in C.
    Used only in forward computations (no gradient), and only in graphs compiled
    for the Python VM (:func:`blockwise_linalg_as_stacked`).
    """

    __props__ = ("kind",)

    def __init__(self, kind: str):
        assert kind in ("cholesky", "lower_inverse")
        self.kind = kind

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        (x,) = inputs
        if self.kind == "lower_inverse":
            # NumPy's stacked inverse of the triangular blocks: one C loop, 5-30x faster
            # than SciPy's batched triangular solve on (3000, 10, 10) to (20000, 4, 4)
            # stacks, equal to it within 1e-14
            with np.errstate(all="ignore"):
                try:
                    out = np.linalg.inv(x)
                except np.linalg.LinAlgError:
                    out = np.full_like(x, np.nan)
            outputs[0][0] = out
            return
        try:
            out = np.linalg.cholesky(x)
        except np.linalg.LinAlgError:
            out = np.empty_like(x)
            for r in range(x.shape[0]):
                try:
                    out[r] = np.linalg.cholesky(x[r])
                except np.linalg.LinAlgError:
                    out[r] = np.nan
        outputs[0][0] = out

    def infer_shape(self, *args):
        # ``(node, shapes)`` in current PyTensor, ``(fgraph, node, shapes)`` before (that
        # signature is deprecated and warns at import)
        return args[-1]


stacked_cholesky = _StackedLinalg("cholesky")
#: ``L^{-1}`` of lower-triangular blocks on the Python VM.
stacked_lower_inverse = _StackedLinalg("lower_inverse")


def _is_identity_blocks(x) -> bool:
    """Whether ``x`` is identity matrices: a constant, or ``eye`` broadcast (``Alloc``)."""
    if isinstance(x, Constant):
        data = np.asarray(x.data)
        return (
            data.ndim >= 2
            and data.shape[-1] == data.shape[-2]
            and np.array_equal(
                data, np.broadcast_to(np.eye(data.shape[-1], dtype=data.dtype), data.shape)
            )
        )
    node = x.owner
    if node is not None and isinstance(node.op, Alloc):
        return _is_identity_blocks(node.inputs[0])
    if node is not None and isinstance(node.op, Eye):
        n, m, k = node.inputs
        square = n is m or (
            isinstance(n, Constant) and isinstance(m, Constant) and int(n.data) == int(m.data)
        )
        return square and isinstance(k, Constant) and int(k.data) == 0
    return False


@node_rewriter([Blockwise])
def blockwise_linalg_as_stacked(fgraph, node):
    """PyTensor's batched ``cholesky`` / lower-triangular inverse -> :class:`_StackedLinalg`.

    For the Python VM only (registered in
    :func:`~pymc_mcssvi.backend.modes.python_step_mode` and its siblings). A
    ``(R, K, K)`` ``Blockwise`` Cholesky with ``on_error="nan"`` becomes one call of
    NumPy's stacked Cholesky; a ``Blockwise`` lower-triangular solve against identity
    blocks (``L^{-1}``, how the Gaussian family forms covariances) one stacked
    inverse. A block that is not positive definite still gives NaN.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> from pytensor.compile.mode import Mode
    >>> from pytensor.graph.rewriting.basic import in2out
    >>> P = pt.tensor3("P", shape=(None, 4, 4))
    >>> L = pt.linalg.cholesky(P, lower=True, on_error="nan")
    >>> mode = Mode(linker="py", optimizer=None).register((in2out(blockwise_linalg_as_stacked), 0))
    >>> fn = pytensor.function([P], L, mode=mode)
    >>> [type(n.op).__name__ for n in fn.maker.fgraph.apply_nodes]
    ['_StackedLinalg']
    >>> A = np.eye(4) * 4.0 + 1.0
    >>> bool(np.allclose(fn(np.stack([A, -A]))[0], np.linalg.cholesky(A)))
    True
    """
    core = node.op.core_op
    x = node.inputs[0]
    if x.type.ndim != 3:
        return None
    if isinstance(core, Cholesky) and core.lower:  # NaN where a block is not definite
        return [stacked_cholesky(x)]
    if (
        isinstance(core, SolveTriangular)
        and core.lower
        and core.b_ndim == 2
        and not core.unit_diagonal
        and _is_identity_blocks(node.inputs[1])
        and node.outputs[0].type.ndim == 3
    ):
        return [stacked_lower_inverse(x)]
    return None
