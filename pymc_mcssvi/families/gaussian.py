r"""Gaussian variational family over one segment: ``R`` independent blocks of size ``K``.

Coordinates (for one block; all functions are batched over the leading ``R`` axis):

=============  ===========================================  ==============================
coordinates    parameters                                   role
=============  ===========================================  ==============================
moment         mean :math:`m`, covariance :math:`S`         views, sampling, bound
natural        :math:`(P m,\ -\tfrac12 P)`, :math:`P=S^{-1}`  MC-SSVI / H-MC-SSVI steps
expectation    :math:`(m,\ S + m m^T)`                      gradients g, H (Bonnet/Price)
=============  ===========================================  ==============================

The state stores the mean and a triangular *factor*: with ``"precision"``
parameterization the lower Cholesky factor ``L`` of the precision
(:math:`P = L L^T`, what the natural-gradient algorithms update); with
``"covariance"`` the upper factor ``C`` of the covariance (:math:`S = C^T C`, the
paper's S-DSVI parameterization). No explicit matrix inverse is formed: every
covariance view goes through triangular solves with the factor.

The natural-gradient step (paper eq. generalSVIupdate, Gaussian case)::

    P     <- (1 - rho) P     + rho (-H)
    P m   <- (1 - rho) P m   + rho (g - H m)

where ``g`` and ``H`` are the expected gradient and Hessian of the log joint
(likelihood plus Gaussian prior). :func:`natural_step` applies it and returns
the new factor; a Cholesky failure (indefinite precision) shows up as NaN, which
the caller treats as a rejected step.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np
import pytensor.tensor as pt
from pytensor.conditional.op import ifelse
from pytensor.graph.rewriting.basic import node_rewriter
from pytensor.scalar import Mul
from pytensor.tensor.elemwise import DimShuffle, Elemwise
from pytensor.tensor.math import Sum

from pymc_mcssvi.families.batched import (
    UNROLL_MAX_K,
    cholesky_unrolled,
    lower_inverse_unrolled,
    solve_lower_t_unrolled,
    solve_lower_unrolled,
)

__all__ = [
    "GaussianBlocks",
    "bmm",
    "bmv",
    "broadcast_products_as_matmul",
    "cho_solve_blocks",
    "cho_solve_columns",
    "cholesky",
    "covariance",
    "entropy",
    "kl_to_gaussian",
    "natural_step",
    "natural_step_gain",
    "precision",
    "projected_hessian",
    "psd_projection",
    "sample",
]

Parameterization = Literal["precision", "covariance"]


class GaussianBlocks(NamedTuple):
    """Variational parameters of one segment.

    Attributes
    ----------
    mean : TensorVariable
        Shape ``(R, K)``.
    factor : TensorVariable
        Shape ``(R, K, K)``: lower Cholesky factor of the precision, or upper
        factor ``C`` of the covariance (``S = C^T C``).
    """

    mean: pt.TensorVariable
    factor: pt.TensorVariable


def cholesky(P):
    """Lower Cholesky factor of a batch of SPD matrices ``(R, K, K)``.

    Notes
    -----
    Returns NaN (instead of raising) when a block is not positive definite, so
    that the step function can reject the step and back off its step size.
    ``K = 1`` avoids the batched LAPACK call; up to
    :data:`~pymc_mcssvi.families.batched.UNROLL_MAX_K` the factorization is unrolled
    into elementwise operations. Larger blocks use PyTensor's batched Cholesky, which
    the Python backend's modes run as one stacked LAPACK call
    (:func:`~pymc_mcssvi.families.batched.blockwise_linalg_as_stacked`).
    """
    if P.type.shape[-1] == 1:
        return pt.sqrt(P)
    if _unroll(P):
        return cholesky_unrolled(P)
    return pt.linalg.cholesky(P, lower=True)


def _unroll(x) -> bool:
    """Many tiny blocks: unrolled elementwise algorithms beat per-block LAPACK calls."""
    R, K = x.type.shape[0], x.type.shape[-1]
    return x.ndim == 3 and K is not None and K <= UNROLL_MAX_K and (R is None or R > 1)


def bmm(A, B):
    """``A @ B`` for stacks of small matrices, as an elementwise product and a sum.

    A batched ``@`` is a loop of BLAS calls (a Python loop when the step is not
    compiled); for ``K`` up to :data:`BROADCAST_MAX_K` the broadcast form is
    faster, for larger blocks (a 185-dimensional joint block: 6.3 million
    temporaries per product) the BLAS call is. A JAX step's mode turns the
    broadcast form back into a batched ``@``
    (:func:`broadcast_products_as_matmul`), which XLA runs as one batched dot.
    """
    if (A.ndim <= 2 and B.ndim <= 2) or not _broadcast_small(A.type.shape[-1], B.type.shape[-1]):
        return A @ B
    return pt.sum(A[..., :, :, None] * B[..., None, :, :], axis=-2)


def _dimshuffle_adds(var, position):
    """The input of ``var`` if ``var`` is a ``DimShuffle`` that only inserts one broadcast
    axis at ``position`` (counted from the end of the output), else ``None``."""
    node = var.owner
    if node is None or not isinstance(node.op, DimShuffle):
        return None
    order = list(node.op.new_order)
    at = len(order) + position
    if order.count("x") != 1 or order.index("x") != at:
        return None
    if [o for o in order if o != "x"] != list(range(node.inputs[0].type.ndim)):
        return None
    return node.inputs[0]


@node_rewriter([Sum])
def broadcast_products_as_matmul(fgraph, node):
    """``sum(A[..., :, :, None] * B[..., None, :, :], axis=-2)`` (:func:`bmm`'s broadcast
    form) -> ``A @ B``.

    For a JAX step: XLA turns the broadcast form into a reduction over ``K^3``
    temporaries and the batched ``@`` into one batched dot (for ``(14860, 10, 10)``
    blocks 1.2 ms against 8.5 ms, JAX on CPU). Registered in the JAX step's mode
    only (:func:`~pymc_mcssvi.backend.modes.jax_step_mode`).

    Examples
    --------
    >>> import pytensor, pytensor.tensor as pt
    >>> from pytensor.compile.mode import Mode
    >>> from pytensor.graph.rewriting.basic import in2out
    >>> A = pt.tensor3("A", shape=(None, 3, 3))
    >>> mode = Mode(linker="py", optimizer=None).register((in2out(broadcast_products_as_matmul), 0))
    >>> fn = pytensor.function([A], bmm(A, A), mode=mode)
    >>> [type(n.op).__name__ for n in fn.maker.fgraph.apply_nodes]
    ['Blockwise']
    """
    axis = node.op.axis
    (prod,) = node.inputs
    nd = prod.type.ndim
    if axis is None or len(axis) != 1 or axis[0] != nd - 2 or nd < 3:
        return None
    mul = prod.owner
    if mul is None or not isinstance(mul.op, Elemwise) or not isinstance(mul.op.scalar_op, Mul):
        return None
    if len(mul.inputs) != 2:
        return None
    A = _dimshuffle_adds(mul.inputs[0], -1)
    B = _dimshuffle_adds(mul.inputs[1], -3)
    if A is None or B is None or A.type.ndim < 2 or B.type.ndim < 2:
        return None
    out = A @ B
    return [out.astype(node.outputs[0].dtype) if out.dtype != node.outputs[0].dtype else out]


#: Largest block size for which stacked products use the broadcast form (K^3 temporaries).
BROADCAST_MAX_K = 16


def _broadcast_small(*dims) -> bool:
    return all(d is not None and d <= BROADCAST_MAX_K for d in dims)


def bmv(A, x):
    """``A @ x`` for stacks of small matrices and vectors."""
    if not _broadcast_small(A.type.shape[-1]):
        return (A @ x[..., :, None])[..., 0]
    return pt.sum(A * x[..., None, :], axis=-1)


def _eye_like(factor):
    """Identity blocks shaped like ``factor``.

    Static shapes are used when known: a symbolic ``factor.shape`` makes
    ``eye``/``broadcast_to`` infer static shapes by cloning and rewriting the
    whole graph behind ``factor`` (0.7 s of a GLMM step's construction).
    """
    shape = factor.type.shape
    if None not in shape:
        # one K x K constant broadcast at run time: an (R, K, K) constant per call
        # (26 MB for 1,350 blocks of 49) is copied into the compiled program each time
        eye = pt.constant(np.eye(shape[-1], dtype=factor.dtype))
        return pt.broadcast_to(eye, tuple(int(d) for d in shape))
    k = factor.shape[-1]
    return pt.broadcast_to(pt.eye(k, dtype=factor.dtype), factor.shape)


def _lower_inverse(L):
    """``L^{-1}`` for lower-triangular blocks (a triangular solve against identity
    blocks, not an inverse; one stacked call on the Python backend, see
    :func:`~pymc_mcssvi.families.batched.blockwise_linalg_as_stacked`)."""
    if L.type.shape[-1] == 1:
        return 1.0 / L
    if _unroll(L):
        return lower_inverse_unrolled(L)
    return pt.linalg.solve_triangular(L, _eye_like(L), lower=True)


def covariance(state: GaussianBlocks, parameterization: Parameterization):
    """Covariance blocks ``S`` of shape ``(R, K, K)``.

    Notes
    -----
    Precision parameterization: ``S = L^{-T} L^{-1}`` with ``L^{-1}`` from a
    triangular solve; the result is exactly symmetric by construction.
    """
    f = state.factor
    if parameterization == "covariance":
        return bmm(pt.matrix_transpose(f), f)
    Li = _lower_inverse(f)
    return bmm(pt.matrix_transpose(Li), Li)


def precision(state: GaussianBlocks, parameterization: Parameterization):
    """Precision blocks ``P`` of shape ``(R, K, K)``."""
    f = state.factor
    if parameterization == "precision":
        return bmm(f, pt.matrix_transpose(f))
    # P = C^{-1} C^{-T} with C upper triangular.
    Ci = pt.matrix_transpose(_lower_inverse(pt.matrix_transpose(f)))
    return bmm(Ci, pt.matrix_transpose(Ci))


def sample(state: GaussianBlocks, parameterization: Parameterization, eps):
    """Reparameterized draws ``m + A eps`` with ``A A^T = S``.

    Parameters
    ----------
    eps : TensorVariable
        Standard normal draws of shape ``(..., R, K)``.
    """
    f = state.factor
    if parameterization == "precision":
        A = pt.matrix_transpose(_lower_inverse(f))  # L^{-T}
    else:
        A = pt.matrix_transpose(f)  # C^T
    return state.mean + bmv(A, eps)


def log_det_covariance(state: GaussianBlocks, parameterization: Parameterization):
    """``log det S`` summed over blocks."""
    d = pt.diagonal(state.factor, axis1=-2, axis2=-1)
    ld = 2.0 * pt.sum(pt.log(pt.abs(d)))
    return -ld if parameterization == "precision" else ld


def entropy(state: GaussianBlocks, parameterization: Parameterization):
    """Differential entropy of the segment, ``0.5 log det(2 pi e S)``."""
    dim = state.mean.shape[0] * state.mean.shape[1]
    return 0.5 * dim * (1.0 + np.log(2 * np.pi)) + 0.5 * log_det_covariance(state, parameterization)


def kl_to_gaussian(
    state: GaussianBlocks, parameterization: Parameterization, prior_mean, prior_precision
):
    """``KL(q || N(prior_mean, prior_precision^{-1}))`` for block-diagonal priors.

    Parameters
    ----------
    prior_mean : TensorVariable
        Shape ``(R, K)``.
    prior_precision : TensorVariable
        Shape ``(R, K, K)``.

    Notes
    -----
    ``tr(Pp S)`` uses the covariance view (triangular solves); the prior's log
    determinant uses its Cholesky factor.
    """
    S = covariance(state, parameterization)
    d = state.mean - prior_mean
    trace = pt.sum(prior_precision * S)
    quad = pt.sum(d[..., None, :] @ prior_precision @ d[..., :, None])
    Lp = cholesky(prior_precision)
    logdet_prior_prec = 2.0 * pt.sum(pt.log(pt.diagonal(Lp, axis1=-2, axis2=-1)))
    dim = state.mean.shape[0] * state.mean.shape[1]
    return 0.5 * (
        trace + quad - dim - logdet_prior_prec - log_det_covariance(state, parameterization)
    )


def psd_projection(A):
    """Nearest positive semi-definite matrices (Frobenius) of symmetric blocks ``A``.

    Notes
    -----
    Eigenvalues below zero are clipped (paper, CTM section). Used only when the
    natural step with the exact Hessian would leave the precision indefinite.
    """
    if A.type.shape[-1] == 1:
        return pt.maximum(A, 0.0)
    A = 0.5 * (A + pt.matrix_transpose(A))
    lam, V = pt.linalg.eigh(A)
    return (V * pt.maximum(lam, 0.0)[..., None, :]) @ pt.matrix_transpose(V)


def projected_hessian(H, part):
    """``H`` with its indefinite ``part`` replaced by the part's projection.

    ``H`` is the expected Hessian of the log joint and ``part`` the share of it from
    terms that need not be log-concave (:attr:`~pymc_mcssvi.terms.base.Term.indefinite`).
    As in the paper's CTM update, ``P <- (1 - rho) P + rho (Sigma^-1 + Pi(-H_lik))``,
    the projection ``Pi`` (:func:`psd_projection`) acts on the likelihood's part alone,
    so the target precision is never below the concave part's (the prior's): a
    direction in which the likelihood is locally convex neither lowers q's precision
    nor makes it singular at ``rho = 1``. A negative semi-definite ``part`` is
    unchanged (up to rounding).
    """
    return H - part - psd_projection(-part)


def natural_step(
    state: GaussianBlocks, g, H, rho, mean_update: bool = True, project: bool = True
) -> GaussianBlocks:
    """MC-SSVI step on the natural parameters (precision parameterization).

    Parameters
    ----------
    state : GaussianBlocks
        Current mean and lower Cholesky factor of the precision.
    g, H : TensorVariable
        Expected gradient ``(R, K)`` and Hessian ``(R, K, K)`` of the log joint.
    rho : scalar
        Step size; ``rho = 1`` is the fixed-point update ``theta <- theta_p + G``.
    mean_update : bool
        Also update ``P m`` (MC-SSVI); with ``False`` the mean is kept
        (H-MC-SSVI updates it by a separate gradient step).
    project : bool
        Replace an indefinite block's ``-H`` by its PSD projection (behind a
        lazy ``ifelse``). With ``False`` such a block's factor is NaN, and the
        graph has no ``ifelse``, so it can be vectorized over draws.

    Returns
    -------
    GaussianBlocks
        New mean and factor.

    Notes
    -----
    For a log-concave model ``-H`` is positive semi-definite and so is the new
    precision. Otherwise a block whose new precision is indefinite (its Cholesky
    factorization fails) uses the projection of ``-H`` onto the positive
    semi-definite cone instead, which keeps ``P`` positive definite for any
    ``rho`` in (0, 1]. The new mean solves ``P_new m = b`` with two triangular
    solves. For a conjugate model (Gaussian likelihood, affine predictor)
    ``rho = 1`` lands exactly on the posterior.
    """
    L = state.factor
    m = state.mean
    P = bmm(L, pt.matrix_transpose(L))
    H = 0.5 * (H + pt.matrix_transpose(H))
    trial = cholesky((1.0 - rho) * P - rho * H)
    L_new = trial
    if project:
        bad = pt.any(pt.isnan(trial), axis=(-2, -1))
        # The projection needs an eigendecomposition: only computed (lazily) when a block failed.
        projected = pt.switch(bad[..., None, None], -psd_projection(-H), H)
        H = ifelse(pt.any(bad), projected, H)
        P_new = (1.0 - rho) * P - rho * H
        L_new = ifelse(pt.any(bad), pt.switch(bad[..., None, None], cholesky(P_new), trial), trial)
    if not mean_update:
        return GaussianBlocks(m, L_new)
    Hm = bmv(H, m)
    Pm = bmv(P, m)
    b = (1.0 - rho) * Pm + rho * (g - Hm)
    m_new = cho_solve_blocks(L_new, b)
    return GaussianBlocks(m_new, L_new)


def natural_step_gain(old: GaussianBlocks, new: GaussianBlocks, g):
    r"""Gain of the bound predicted for a full (``rho = 1``) natural step ``old -> new``.

    The second-order model of the bound that the step maximizes: for the mean
    the Newton decrement ``g^T (m_new - m) / 2`` (``m_new - m = P_new^{-1} g``);
    for the precision, from ``P`` to ``P_new``,
    ``(tr(A) - log det A - K) / 2`` with ``A = P_new P^{-1}`` (the gain of the
    entropy plus ``-tr(P_new S) / 2`` when ``S`` moves from ``P^{-1}`` to
    ``P_new^{-1}``). Both are exact for a Gaussian likelihood and non-negative;
    summed over the blocks. Precision parameterization only.

    Examples
    --------
    A step from ``N(0, 1)`` to ``N(1, 1/4)`` under ``g = 4`` (so ``P_new = 4``):
    ``4 * 1 / 2 + (4 - log 4 - 1) / 2``.

    >>> import numpy as np, pytensor.tensor as pt
    >>> old = GaussianBlocks(pt.as_tensor(np.zeros((1, 1))), pt.as_tensor(np.ones((1, 1, 1))))
    >>> new = GaussianBlocks(pt.as_tensor(np.ones((1, 1))), pt.as_tensor(np.full((1, 1, 1), 2.0)))
    >>> gain = natural_step_gain(old, new, pt.as_tensor(np.full((1, 1), 4.0)))
    >>> bool(np.isclose(gain.eval(), 2.0 + 0.5 * (4.0 - np.log(4.0) - 1.0)))
    True
    """
    mean_part = 0.5 * pt.sum(g * (new.mean - old.mean))
    M = bmm(_lower_inverse(old.factor), new.factor)  # L^{-1} L_new: tr(A) = |M|_F^2
    # log det A = log det P_new - log det P = log det S - log det S_new
    log_det = log_det_covariance(old, "precision") - log_det_covariance(new, "precision")
    dim = old.mean.shape[0] * old.mean.shape[1]
    return mean_part + 0.5 * (pt.sum(M**2) - log_det - dim)


def cho_solve_blocks(L, b):
    """Solve ``(L L^T) x = b`` blockwise for ``b`` of shape ``(R, K)``."""
    if L.type.shape[-1] == 1:
        return b / (L[..., 0] ** 2)
    if _unroll(L):
        return solve_lower_t_unrolled(L, solve_lower_unrolled(L, b))
    if L.type.ndim == 3 and (L.type.shape[0] is None or L.type.shape[0] > 1):
        Li = _lower_inverse(L)
        return pt.sum(
            pt.matrix_transpose(Li) * pt.sum(Li * b[..., None, :], axis=-1)[..., None, :], axis=-1
        )
    y = pt.linalg.solve_triangular(L, b[..., None], lower=True)
    return pt.linalg.solve_triangular(L, y, lower=True, trans=1)[..., 0]


def cho_solve_columns(L, B):
    """Solve ``(L L^T) X = B`` blockwise for ``B`` of shape ``(R, K, n)`` with a static ``n``.

    Examples
    --------
    >>> import numpy as np
    >>> L = np.array([[[2.0, 0.0], [1.0, 1.0]]])
    >>> B = np.arange(4.0).reshape(1, 2, 2)
    >>> X = cho_solve_columns(pt.as_tensor(L), pt.as_tensor(B)).eval()
    >>> np.allclose(L[0] @ L[0].T @ X[0], B[0])
    True
    """
    n = B.type.shape[-1]
    if n is None:
        raise ValueError("cho_solve_columns needs a static number of columns")
    return pt.stack([cho_solve_blocks(L, B[..., j]) for j in range(n)], axis=-1)
