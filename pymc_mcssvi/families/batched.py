r"""Cholesky factorization and triangular solves for many small blocks.

Row-block covariances (PMF rows, random-effect groups) need ``R`` factorizations
of ``K x K`` matrices per iteration with ``R`` in the thousands and ``K`` around
2-12. PyTensor's batched linear algebra (``Blockwise``) calls LAPACK once per
block, which is slow when the step is not compiled. Here the algorithms are
unrolled over ``K`` at graph-construction time, so each operation is an
elementwise expression on length-``R`` vectors (``O(K^3)`` of them).

Notes
-----
A block that is not positive definite produces NaN (square root of a negative
number), which the step kernel treats as a rejected step.
"""

from __future__ import annotations

import numpy as np
import pytensor.tensor as pt
from pytensor.compile.mode import optdb
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.graph.rewriting.basic import in2out, node_rewriter

__all__ = [
    "UNROLL_MAX_K",
    "cholesky_unrolled",
    "lower_inverse_unrolled",
    "solve_lower_unrolled",
    "solve_lower_t_unrolled",
    "stacked_linalg_as_blockwise",
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
    Used only in forward computations (no gradient).
    """

    __props__ = ("kind",)

    def __init__(self, kind: str):
        assert kind in ("cholesky", "inverse", "lower_inverse")
        self.kind = kind

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        (x,) = inputs
        if self.kind in ("inverse", "lower_inverse"):
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
stacked_inverse = _StackedLinalg("inverse")
#: ``L^{-1}`` of lower-triangular blocks: NumPy's stacked inverse on the Python VM, one
#: triangular solve in the compiled backends (a general inverse there is an LU
#: factorization and two triangular solves: 13 of a 110 ms JAX step of InstEval's
#: binary factorization, B = 5).
stacked_lower_inverse = _StackedLinalg("lower_inverse")


@node_rewriter([_StackedLinalg])
def stacked_linalg_as_blockwise(fgraph, node):
    """:class:`_StackedLinalg` -> PyTensor's batched ``cholesky`` / ``inv``.

    The stacked op serves the uncompiled step (PyTensor's Python VM). The compiled
    backends implement the batched ops natively; without this rewrite numba ran the
    op's Python ``perform`` in object mode and warned about it, also when a user
    evaluated ``approx.std`` or ``approx.sample_node(...)`` (PyTensor's default mode
    is numba). Registered with PyTensor's ``fast_run`` rewrites, which the
    ``"python"`` backend's modes do not use. A block that is not positive definite
    still gives NaN (``on_error="nan"``).
    """
    if not isinstance(node.op, _StackedLinalg):
        return None
    (x,) = node.inputs
    if node.op.kind == "cholesky":
        return [pt.linalg.cholesky(x, lower=True, check_finite=False, on_error="nan")]
    if node.op.kind == "lower_inverse":
        if None not in x.type.shape:  # a symbolic shape would be inferred by rewriting
            eye = pt.broadcast_to(
                pt.constant(np.eye(x.type.shape[-1], dtype=x.dtype)), x.type.shape
            )
        else:
            eye = pt.broadcast_to(pt.eye(x.shape[-1], dtype=x.dtype), x.shape)
        return [pt.linalg.solve_triangular(x, eye, lower=True, check_finite=False)]
    return [pt.linalg.inv(x)]


optdb.register(
    "stacked_linalg_as_blockwise",
    in2out(stacked_linalg_as_blockwise),
    "fast_run",
    position=0.95,  # before canonicalize, so that the batched ops are rewritten further
)


def register_jax_dispatch() -> None:
    """Teach PyTensor's JAX backend :class:`_StackedLinalg` (idempotent).

    Called before a step is compiled with ``backend="jax"`` (importing the JAX
    dispatch imports JAX, which the other backends do not need). JAX's batched
    Cholesky returns NaN for a block that is not positive definite, as
    :meth:`_StackedLinalg.perform` does.
    """
    from pytensor.link.jax.dispatch import jax_funcify

    if _StackedLinalg in jax_funcify.registry:
        return

    @jax_funcify.register(_StackedLinalg)
    def _jax_stacked_linalg(op, **kwargs):
        import jax.numpy as jnp

        if op.kind == "lower_inverse":
            from jax.scipy.linalg import solve_triangular

            def lower_inverse(x):
                return solve_triangular(
                    x, jnp.broadcast_to(jnp.eye(x.shape[-1], dtype=x.dtype), x.shape), lower=True
                )

            return lower_inverse
        return jnp.linalg.inv if op.kind == "inverse" else jnp.linalg.cholesky
