r"""Hyperparameters: point estimates or a Gaussian q in PyMC's unconstrained space.

Free variables that are neither Gaussian globals nor locals (scales, shapes,
cutpoints, LKJ factors ...) are collected in one unconstrained vector ``h``
(ARCHITECTURE.md §5). Two treatments:

``"point"`` (:class:`PointHyperparameters`)
    type-II ML / MAP of the bound: after each q-update a damped Newton step
    ``h <- h + rho |H_h|^{-1} g_h`` with the exact gradient and Hessian of the
    bound in ``h`` (saddle-free: eigenvalues in absolute value), or a
    first-order rule (the paper's Adagrad). The step size ``rho`` and its
    backtracking are shared with q.
``"meanfield"`` (:class:`MeanFieldHyperparameters`)
    ``q(h) = N(mu_h, P_h^{-1})`` independent of q(w). Expectations over q(h)
    use deterministic sigma points ``h_j = mu_h + L_h^{-T} z_j`` (the unscented
    rule up to 8 coordinates, fixed moment-matched draws above; both exact for
    cubics), so the bound stays a deterministic function of the
    variational parameters and backtracking remains valid. q(w)'s natural step
    uses ``g`` and ``H`` averaged over the ``h_j`` (``E_q(h)[Pp]``,
    ``E_q(h)[Pp mu]``); q(h) takes the same natural-gradient step as a Gaussian
    global with ``g_h = E[grad_h B]`` and ``H_h = E[hess_h B]``, the latter from
    gradients only through Stein's lemma.

Both modes are components of the step kernel with the same small interface over
their explicit state (:mod:`~pymc_mcssvi.algorithms.state`): ``evaluate``
(replace the hyperparameter value variables in the bound graphs and return
averaged outputs and the derivatives in ``h``), ``accept`` (the accepted state
after the candidate's verdict), ``step`` (the next candidate) and, on values,
``init_state`` and ``reset``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pytensor.tensor as pt
from pytensor.gradient import pushforward
from pytensor.graph.basic import Constant
from pytensor.graph.replace import graph_replace
from pytensor.graph.rewriting.basic import in2out, node_rewriter
from pytensor.graph.rewriting.utils import rewrite_graph
from pytensor.graph.traversal import ancestors, graph_inputs, io_toposort
from pytensor.tensor.basic import Alloc, Split
from pytensor.tensor.blockwise import Blockwise
from pytensor.tensor.math import Prod
from pytensor.tensor.random.op import RandomVariable
from pytensor.tensor.shape import Reshape

from pymc_mcssvi.algorithms.arrow import arrow_solve
from pymc_mcssvi.algorithms.optimizers import Optimizer
from pymc_mcssvi.algorithms.state import GaussianHyperState, PointHyperState
from pymc_mcssvi.families.gaussian import (
    GaussianBlocks,
    bmm,
    cho_solve_columns,
    covariance,
    natural_step,
)
from pymc_mcssvi.families.gaussian import entropy as gaussian_entropy
from pymc_mcssvi.recognize.graph import depends_on_any
from pymc_mcssvi.recognize.vectorize import jacobian, shapes_at_fixed, vectorize_graph

__all__ = [
    "HyperSpec",
    "JointStep",
    "joint_newton_step",
    "MeanFieldHyperparameters",
    "PointHyperparameters",
    "newton_direction",
    "moment_matched_points",
    "sigma_points",
    "unbatch_constant_split",
]


@dataclass
class HyperSpec:
    """The hyperparameters of a model in PyMC's unconstrained space.

    Attributes
    ----------
    values : list of TensorVariable
        The model's value variables of the hyperparameters.
    shapes : list of tuple
    init : np.ndarray
        Flat initial point.
    optimizer : Optimizer or None
        ``"point"`` mode: first-order rule, or ``None`` for Newton steps.
    max_step : float
        Largest change of any unconstrained coordinate in one step.
    init_sd : float
        ``"meanfield"`` mode: initial standard deviation of q(h).
    fixed_shapes : bool
        ``"meanfield"`` mode: read the shapes of h-dependent tensors at a fixed h
        before batching over the sigma points (:func:`shapes_at_fixed`); needed
        by covariance-matrix hyperparameters, off otherwise (it adds the
        unbatched graphs those shapes are read from).
    """

    values: list
    shapes: list
    init: np.ndarray
    optimizer: Optimizer | None = None
    max_step: float = 1.0
    init_sd: float = 0.1
    fixed_shapes: bool = False

    @property
    def size(self) -> int:
        return int(self.init.size)

    def replacements(self, flat):
        out, off = {}, 0
        for v, shp in zip(self.values, self.shapes, strict=True):
            n = int(np.prod(shp, dtype=int))
            out[v] = flat[off : off + n].reshape(shp).astype(v.dtype)
            off += n
        return out


def _saddle_free(curvature, floor=1e-8):
    """``curvature`` with its eigenvalues in absolute value (floored): positive definite."""
    C = 0.5 * (curvature + curvature.T)
    lam, V = pt.linalg.eigh(C)
    scale = pt.maximum(pt.abs(lam), floor * pt.maximum(pt.max(pt.abs(lam)), 1.0))
    return (V * scale[None, :]) @ V.T


def newton_direction(grad, hess, floor=1e-8):
    """Ascent direction ``|H|^{-1} g`` for maximizing a function of a few variables.

    Notes
    -----
    Eigenvalues of the Hessian are replaced by their absolute values (floored),
    so the direction is Newton's near a maximum and still an ascent direction
    where the bound is not concave in ``h`` (saddle-free Newton).
    """
    H = 0.5 * (hess + hess.T)
    lam, V = pt.linalg.eigh(H)
    scale = pt.maximum(pt.abs(lam), floor * pt.maximum(pt.max(pt.abs(lam)), 1.0))
    return V @ ((V.T @ grad) / scale)


#: Largest number of q(h) coordinates averaged with the unscented rule; above it the
#: points are :func:`moment_matched_points`.
UNSCENTED_MAX_DIM = 8
#: Seed of the fixed draws behind :func:`moment_matched_points` (the bound stays a
#: deterministic function of q, so backtracking remains valid).
POINTS_SEED = 20261126


def sigma_points(dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Points ``z`` (``J x dim``) and weights for expectations under ``N(0, I)``.

    Up to :data:`UNSCENTED_MAX_DIM` coordinates, the unscented transform with
    ``kappa = max(3 - dim, 0)``: with ``dim <= 2`` the rule matches the fourth
    moments along each axis (for ``dim = 1`` it is 3-point Gauss-Hermite). Its
    points lie ``sqrt(dim)`` sds out along each axis, so in more dimensions every
    coordinate is read far in its tails (at 8 sds with 61 coordinates: a per-group
    ``sigma`` of 60 groups came out with posterior sds 0.69-0.85x NUTS's), and
    :func:`moment_matched_points` are used instead.

    Examples
    --------
    >>> z, w = sigma_points(2)
    >>> round(float(w @ z[:, 0] ** 2), 12), round(float(w @ z[:, 0] ** 4), 12)
    (1.0, 3.0)
    """
    if dim > UNSCENTED_MAX_DIM:
        return moment_matched_points(dim)
    kappa = max(3.0 - dim, 0.0)
    r = np.sqrt(dim + kappa)
    pts = [np.zeros(dim)] if kappa > 0 else []
    wts = [kappa / (dim + kappa)] if kappa > 0 else []
    for i in range(dim):
        for sign in (1.0, -1.0):
            e = np.zeros(dim)
            e[i] = sign * r
            pts.append(e)
            wts.append(1.0 / (2.0 * (dim + kappa)))
    return np.array(pts), np.array(wts)


def moment_matched_points(dim: int, extra: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Fixed antithetic Gaussian draws whose first three moments are exact.

    ``m = dim + extra`` standard normal draws are centred and whitened so that
    their covariance is exactly the identity, then mirrored (``z`` and ``-z``):
    ``2 m`` equally weighted points, exact for polynomials up to degree three (as
    the unscented rule, so Stein's lemma on them is exact for a quadratic bound),
    with each coordinate spread like a standard normal rather than along the axes
    at ``sqrt(dim)``.

    Examples
    --------
    >>> z, w = moment_matched_points(20)
    >>> bool(np.allclose(z.T @ np.diag(w) @ z, np.eye(20))), bool(np.allclose(w @ z, 0))
    (True, True)
    >>> z.shape, bool(np.all(w > 0))
    ((56, 20), True)
    """
    m = dim + int(extra)
    Z = np.random.default_rng(POINTS_SEED).standard_normal((m, dim))
    Z -= Z.mean(axis=0)
    Z = Z @ np.linalg.inv(np.linalg.cholesky(Z.T @ Z / m)).T
    return np.concatenate([Z, -Z]), np.full(2 * m, 1.0 / (2 * m))


@node_rewriter([Blockwise])
def unbatch_constant_split(fgraph, node):
    """``Blockwise(Split)`` with constant, unbatched sizes -> ``Split`` on the shifted axis.

    ``vectorize_graph`` over the sigma points turns a ``Split`` (from the gradient
    of a ``Join``) into a ``Blockwise`` whose sizes get a batch axis of length 1;
    JAX then maps over the sizes, cannot use them as static split positions and
    fails to trace the step (random-slope GLMMs). A plain ``Split`` of the batched
    input along the core axis shifted by the batch dimensions is the same.
    """
    core = node.op.core_op
    if not isinstance(core, Split) or core.len_splits < 2 or len(node.inputs) != 2:
        return None
    x, sizes = node.inputs
    data = _constant_value(sizes)
    if data is None:
        return None
    rows = data.reshape(-1, data.shape[-1])
    if not (rows == rows[0]).all():
        return None
    batch = x.ndim - len(node.op.inputs_sig[0])
    outs = pt.split(x, rows[0], n_splits=core.len_splits, axis=core.axis + batch)
    return list(outs)


def _constant_value(var):
    """The value of ``var`` if it is a constant, or an ``Alloc`` of one to a constant
    shape (split sizes of joins of static widths arrive so: rewrites at this stage do
    not fold ``Alloc``); else ``None``."""
    if isinstance(var, Constant):
        return np.asarray(var.data)
    node = var.owner
    if (
        node is not None
        and isinstance(node.op, Alloc)
        and all(isinstance(i, Constant) for i in node.inputs)
    ):
        value, *shape = (np.asarray(i.data) for i in node.inputs)
        return np.broadcast_to(value, tuple(int(s) for s in shape))
    return None


def _sized_by(h, outputs) -> bool:
    """Whether a node in ``outputs`` takes a size or shape from a tensor depending on
    ``h``; then the shapes are read at a fixed ``h`` (:func:`shapes_at_fixed`) before
    ``vectorize_graph`` batches the graph over sigma points of ``h``, which would batch
    that size too.

    A random draw (fresh Monte Carlo draws shaped like the predictor of a non-centered
    effect) cannot take a batch of sizes; with the shapes fixed every sigma point uses
    the same draws. An ``Alloc`` or ``Reshape`` given a batch of target shapes becomes a
    ``Blockwise`` whose core input loses the static length-1 axes it broadcasts
    (``(s * eps) @ L.T`` with a scale ``s``: "Runtime broadcasting not allowed" in the
    step).
    """
    for node in io_toposort(list(graph_inputs(outputs)), outputs):
        if isinstance(node.op, RandomVariable):
            sizes = [node.op.size_param(node)]
        elif isinstance(node.op, Alloc | Reshape):
            sizes = node.inputs[1:]
        else:
            continue
        if any(depends_on_any(x, [h]) for x in sizes):
            return True
    return False


def _finite(*xs):
    return pt.all(pt.stack([pt.all(pt.isfinite(x)) for x in xs]))


def _safe(x):
    return pt.switch(pt.isfinite(x), x, 0.0)


def _expand(w, ndim):
    return w.reshape((-1,) + (1,) * (ndim - 1))


def _capped(delta, cap):
    """``delta`` scaled so that no coordinate moves by more than ``cap``."""
    return delta * pt.minimum(1.0, cap / pt.maximum(pt.max(pt.abs(delta)), 1e-12))


#: Floor of the joint step's curvature in ``h``, relative to q(h)'s precision.
SCHUR_FLOOR = 1e-3


class JointStep(NamedTuple):
    """Result of :func:`joint_newton_step`.

    Attributes
    ----------
    delta_h : TensorVariable
        Step of q(h)'s mean; NaN when a factorization failed.
    shifts : list
        Change of each segment's mean (``None`` where ``B`` is ``None``).
    precision_shifts : list
        Change of each segment's precision (``None`` where ``D`` is ``None``).
    curvature : TensorVariable
        The curvature ``S`` in ``h`` with q(w) eliminated, eigenvalues floored
        (positive definite): the precision of the linear-response q(h).
    responses : list
        ``P_w^{-1} B`` per segment, ``(R, K, n_h)`` (``None`` where ``B`` is
        ``None``): how q(w)'s mean follows ``h``.
    """

    delta_h: object
    shifts: list
    precision_shifts: list
    curvature: object
    responses: list


def joint_newton_step(
    g_h,
    P_h,
    rho,
    factors,
    grads,
    crosses,
    hessian_crosses=None,
    old_factors=None,
    arrow=None,
    max_step=1.0,
):
    r"""One damped Newton step of q(h)'s mean with q(w) following it.

    The separate steps ``dw = rho P_w^{-1} g_w`` (with q(w)'s natural precision
    step) and ``dh = rho P_h^{-1} g_h`` ignore how q(w)'s optimum moves with
    ``h`` and converge like block coordinate ascent, or EM: slowly when the
    data say little about a scale (a non-centered random effect ``sigma * z``:
    hundreds of iterations on grouseticks). Here ``h`` takes a Newton step on
    the bound with q(w) eliminated (a Schur complement), and q(w) moves with it:

    * mean coupling ``B = E[d g_w / d h]`` (``(R, K, n_h)`` per segment):
      curvature ``- B^T P_w^{-1} B``, gradient ``+ B^T P_w^{-1} g_w``, and
      q(w)'s mean shifts by ``P_w^{-1} B dh``;
    * covariance coupling ``D = E[d H_w / d h]`` (``(R, K, K, n_h)``; q(w)'s
      natural precision target ``-H_w`` moves by ``-D dh``): the entropy's
      curvature in the covariance ``C`` gives the curvature
      ``- 1/2 tr(C D_i C D_j)``, the covariance step ``dC`` of this iteration
      moves the gradient by ``1/2 tr(D_i dC)``, and q(w)'s precision shifts by
      ``-D dh``.

    so ``dh = S^{-1} (rho (g_h + B^T P_w^{-1} g_w) + 1/2 tr(D dC))`` with ``S``
    the curvature above (``n_h x n_h``). ``P_w`` is block diagonal over q(w)'s
    blocks, so the cost is ``n_h`` blockwise solves and products. The fixed
    points are those of the separate steps (``g_w = 0``, ``g_h = 0``, ``dC = 0``).

    Parameters
    ----------
    g_h : TensorVariable
        Gradient of the bound in q(h)'s mean, ``(n_h,)``.
    P_h : TensorVariable
        New precision of q(h), ``(n_h, n_h)``.
    rho : scalar
    factors, grads, crosses : lists over q(w)'s segments
        Lower Cholesky factors ``(R, K, K)`` of the new precisions (after this
        iteration's natural step), gradients ``(R, K)``, cross derivatives
        ``B`` or ``None``.
    hessian_crosses, old_factors : lists over q(w)'s segments, optional
        Cross derivatives ``D`` (or ``None``) and the factors before the step.
    arrow : Arrow, optional
        q(w)'s curvature with its head-body cross blocks
        (:mod:`~pymc_mcssvi.algorithms.arrow`): ``P_w^{-1} B`` is then the
        arrow solve and every segment's mean follows ``h``.
    max_step : float
        Largest change of any coordinate of ``h``.

    Returns
    -------
    JointStep
        ``delta_h`` is NaN when a factorization failed (the caller keeps the
        separate steps).

    Notes
    -----
    Eigenvalues of ``S`` are taken in absolute value and floored at
    :data:`SCHUR_FLOOR` times the largest diagonal entry of ``P_h``; the step is
    capped at ``max_step`` and, like every candidate, judged by the bound.
    """
    nseg = len(factors)
    hessian_crosses = hessian_crosses or [None] * nseg
    S, rhs, move = P_h, g_h, 0.0
    if arrow is not None and any(B is not None for B in crosses):
        # q(w)'s curvature is the arrow: every segment responds (the head follows the body).
        n_h = next(B for B in crosses if B is not None).type.shape[-1]
        Bs = [
            pt.zeros((g.shape[0], g.shape[1], n_h)) if B is None else B
            for g, B in zip(grads, crosses, strict=True)
        ]
        U_arrow = arrow_solve(arrow, Bs)
        U_block = [cho_solve_columns(L, B) for L, B in zip(factors, Bs, strict=True)]
        # A curvature that is not positive definite (NaN) leaves q's own blocks.
        ok = pt.all([pt.all(pt.isfinite(u)) for u in U_arrow])
        U = [pt.switch(ok, a, b) for a, b in zip(U_arrow, U_block, strict=True)]
    else:
        U = [
            None if B is None else cho_solve_columns(L, B)
            for L, B in zip(factors, crosses, strict=True)
        ]
    for g, B, U_s in zip(grads, crosses, U, strict=True):
        if U_s is None:
            continue
        axes = list(range(U_s.ndim - 1))
        if B is not None:
            S = S - pt.tensordot(B, U_s, [axes, axes])
        rhs = rhs + pt.tensordot(U_s, g, [axes, list(range(g.ndim))])
    for L, L_old, D in zip(factors, old_factors or [None] * nseg, hessian_crosses, strict=True):
        if D is None:
            continue
        C = covariance(GaussianBlocks(None, L), "precision")
        dC = C - covariance(GaussianBlocks(None, L_old), "precision")
        n = D.type.shape[-1]
        M = [bmm(C, D[..., i]) for i in range(n)]  # C D_i, (R, K, K) each
        X = pt.stack([m.ravel() for m in M])
        Y = pt.stack([pt.matrix_transpose(m).ravel() for m in M])
        S = S - 0.5 * (X @ Y.T)
        move = move + 0.5 * pt.stack([pt.sum(D[..., i] * dC) for i in range(n)])
    rhs = rho * rhs + move
    S = 0.5 * (S + S.T)
    # A failed factorization of q(w) or q(h) (NaN) must not reach LAPACK's eigh, which
    # raises; the step is then NaN and the caller falls back to the separate steps.
    finite = pt.all(pt.isfinite(S)) & pt.all(pt.isfinite(rhs))
    # a static size: pt.eye of a symbolic one constant-folds S's whole shape graph
    n_h = g_h.type.shape[-1] if g_h.type.shape[-1] is not None else S.shape[0]
    lam, V = pt.linalg.eigh(pt.switch(finite, S, pt.eye(n_h)))
    scale = pt.maximum(pt.abs(lam), SCHUR_FLOOR * pt.max(pt.diagonal(P_h)))
    dh = _capped(V @ ((V.T @ rhs) / scale), max_step)
    dh = pt.switch(finite, dh, np.nan)
    shifts = [None if U_s is None else pt.tensordot(U_s, dh, [[-1], [0]]) for U_s in U]
    pshifts = [None if D is None else -pt.tensordot(D, dh, [[-1], [0]]) for D in hessian_crosses]
    curvature = (V * scale[None, :]) @ V.T
    return JointStep(dh, shifts, pshifts, curvature, U)


@node_rewriter([Prod])
def _prod_without_zeros(fgraph, node):
    if node.op.no_zeros_in_input:
        return None
    op = node.op
    new = Prod(axis=op.axis, dtype=op.dtype, acc_dtype=op.acc_dtype, no_zeros_in_input=True)
    return [new(*node.inputs)]


def twice_differentiable_products(outputs):
    """``outputs`` with every ``prod`` marked as free of zeros, so that it has a second
    derivative (PyTensor's has none otherwise: ``NullTypeGradError``).

    A multi-dimensional HSGP's spectral density multiplies its length scales
    (``pt.prod``); the point hyperparameters' Newton step differentiates it twice.
    The first derivative, ``prod(x) / x``, is the same away from zeros.

    Examples
    --------
    >>> import pytensor, pytensor.tensor as pt
    >>> x = pt.vector("x")
    >>> (y,) = twice_differentiable_products([pt.prod(x) ** 2])
    >>> h = pytensor.gradient.hessian(y, x)
    >>> h.eval({x: [1.0, 2.0]}).tolist()
    [[8.0, 8.0], [8.0, 2.0]]
    """
    if not any(
        n.owner is not None and isinstance(n.owner.op, Prod) for n in ancestors(list(outputs))
    ):
        return list(outputs)
    return rewrite_graph(list(outputs), include=(), custom_rewrite=in2out(_prod_without_zeros))


class PointHyperparameters:
    """Type-II ML / MAP estimates of the hyperparameters (see the module docstring).

    A component of the step (:class:`~pymc_mcssvi.algorithms.kernel.StepKernel`):
    its state is a :class:`~pymc_mcssvi.algorithms.state.PointHyperState`, and
    :meth:`evaluate`, :meth:`accept` and :meth:`step` are pure functions of it.
    """

    mode = "point"

    def __init__(self, spec: HyperSpec):
        self.spec = spec

    def init_state(self) -> PointHyperState:
        spec, n = self.spec, self.spec.size
        init = np.asarray(spec.init, dtype="float64")
        opt0 = tuple(spec.optimizer.init(init)) if spec.optimizer else ()
        # Newton steps keep the accepted Hessian; first-order steps need none (an
        # n x n array for thousands of coordinates, a topic model's topics, is not kept)
        hess = -np.eye(n) if spec.optimizer is None else np.zeros((0, 0))
        return PointHyperState(init, init, np.zeros(n), hess, opt0, opt0)

    def reset(self, state: PointHyperState) -> PointHyperState:
        """The candidate back at the accepted estimate (values)."""
        return state._replace(cand=np.copy(state.base), cand_opt=tuple(state.base_opt))

    def with_linear_response(self, state: PointHyperState, response_shapes):
        """``state`` unchanged: a point has no q(h) to view (the interface's sake)."""
        return state

    def evaluate(self, state: PointHyperState, outputs, n_values=1, entropy=True, cross=()):
        """Outputs at the candidate ``h``, plus finiteness and the derivatives in ``h``
        (a point has no entropy: ``entropy`` is for the interface's sake).

        For the outputs at the positions ``cross`` (q(w)'s gradients ``g_s`` and
        Hessians ``H_s``), the auxiliary result also holds their derivatives in ``h``,
        of shape ``x.shape + (n_h,)`` (``None`` where ``x`` does not depend on ``h``),
        by forward-mode products (one per coordinate of ``h``).
        """
        outs = graph_replace(outputs, self.spec.replacements(state.cand), strict=False)
        if self.spec.optimizer is None:  # the Newton step differentiates twice
            outs = twice_differentiable_products(outs)
        value = outs[0]
        ok = pt.isfinite(value)
        grad = pt.grad(pt.switch(ok, value, 0.0), state.cand, disconnected_inputs="ignore")
        hess = jacobian(grad, state.cand) if self.spec.optimizer is None else None
        finite = _finite(grad) if hess is None else _finite(grad, hess)
        if not cross:
            return outs, finite, (grad, hess)
        crosses = [self._cross(outs[i], state.cand) for i in cross]
        present = [c for c in crosses if c is not None]
        if present:
            finite = finite & _finite(*present)
        return outs, finite, (grad, hess, crosses)

    def _cross(self, x, h):
        """``d x / d h`` as ``x.shape + (n_h,)``, or ``None`` (``x`` free of ``h``)."""
        if not depends_on_any(x, [h]):
            return None
        eye = np.eye(self.spec.size)
        cols = [pushforward(x, h, pt.constant(eye[j])) for j in range(self.spec.size)]
        return pt.stack(cols, axis=-1)

    def accept(self, state: PointHyperState, accept, aux) -> PointHyperState:
        """The accepted estimate, gradient and Hessian after the candidate's verdict."""
        grad, hess = aux[:2]
        sel = lambda a, b: pt.switch(accept, a, b)  # noqa: E731
        base_opt = state.base_opt
        if self.spec.optimizer is not None:
            restarted = self.spec.optimizer.restart(state.base_opt)
            base_opt = tuple(
                pt.switch(accept, c, b) for c, b in zip(state.cand_opt, restarted, strict=True)
            )
        return state._replace(
            base=sel(state.cand, state.base),
            grad=sel(grad, state.grad),
            hess=sel(hess, state.hess) if self.spec.optimizer is None else state.hess,
            base_opt=base_opt,
        )

    def step(self, state: PointHyperState, rho, scale, t, coupling=None):
        """The next candidate from the accepted state; returns ``(state, joint)``.

        With ``coupling`` (see :meth:`MeanFieldHyperparameters.step`), ``h`` takes the
        Newton step on the bound with q(w) eliminated and q(w) follows it
        (:func:`joint_newton_step`; ``joint`` holds q(w)'s shifts): the separate steps
        converge like EM, a sparse GP's kernel in 2,800 iterations (60 s).
        """
        if self.spec.optimizer is None and coupling is not None:
            grad = _safe(state.grad)
            separate = _capped(rho * newton_direction(grad, _safe(state.hess)), self.spec.max_step)
            joint = joint_newton_step(
                grad, _saddle_free(-_safe(state.hess)), rho, *coupling, max_step=self.spec.max_step
            )
            ok = pt.all(pt.isfinite(joint.delta_h))
            joint = joint._replace(
                shifts=[None if x is None else pt.switch(ok, x, 0.0) for x in joint.shifts],
                precision_shifts=[
                    None if x is None else pt.switch(ok, x, 0.0) for x in joint.precision_shifts
                ],
            )
            cand = state.base + pt.switch(ok, joint.delta_h, separate)
            return state._replace(cand=cand), joint
        if self.spec.optimizer is None:
            delta = rho * newton_direction(_safe(state.grad), _safe(state.hess))
            cand_opt = state.cand_opt
        else:
            delta, cand_opt = self.spec.optimizer.update(
                _safe(state.grad), state.base_opt, scale, t
            )
            cand_opt = tuple(cand_opt)
        cand = state.base + _capped(delta, self.spec.max_step)
        return state._replace(cand=cand, cand_opt=cand_opt), None


class MeanFieldHyperparameters:
    """Gaussian q(h), independent of q(w), fitted with natural-gradient steps.

    A component of the step with a :class:`~pymc_mcssvi.algorithms.state.GaussianHyperState`
    (see :class:`PointHyperparameters`).
    """

    mode = "meanfield"

    def __init__(self, spec: HyperSpec):
        self.spec = spec
        self.z, self.w = sigma_points(spec.size)

    def init_state(self) -> GaussianHyperState:
        spec, n = self.spec, self.spec.size
        L0 = np.eye(n)[None] / spec.init_sd
        init = np.asarray(spec.init, dtype="float64")[None]
        return GaussianHyperState(
            base_mean=init,
            base_factor=L0,
            cand_mean=init,
            cand_factor=L0,
            grad=np.zeros((1, n)),
            hess=-np.eye(n)[None] / spec.init_sd**2,
            lr_factor=None,
            lr_responses=(),
        )

    def with_linear_response(self, state: GaussianHyperState, response_shapes):
        """``state`` with the linear-response view (the coupled step keeps it):
        ``lr_factor`` the lower Cholesky factor of the curvature in ``h`` with q(w)
        eliminated (the precision of the linear-response q(h)), ``lr_responses``
        ``P_w^{-1} B`` per segment (zero for segments that do not depend on ``h``)."""
        n = self.spec.size
        return state._replace(
            lr_factor=np.eye(n)[None] / self.spec.init_sd,
            lr_responses=tuple(np.zeros(shp) for shp in response_shapes),
        )

    def reset(self, state: GaussianHyperState) -> GaussianHyperState:
        """The candidate back at the accepted q(h) (values)."""
        return state._replace(
            cand_mean=np.copy(state.base_mean), cand_factor=np.copy(state.base_factor)
        )

    def _draws(self, state: GaussianBlocks):
        # h_j = mu + L^{-T} z_j
        A = pt.linalg.solve_triangular(state.factor[0], pt.eye(self.spec.size), lower=True).T
        return state.mean + pt.constant(self.z) @ A.T

    def evaluate(self, state: GaussianHyperState, outputs, n_values=1, cross=(), entropy=True):
        """Sigma-point averages of the outputs and of the derivatives in ``h``.

        The entropy of q(h) is added to the first ``n_values`` outputs (bound values),
        with ``entropy`` (a part of a bound split into parts takes it once).
        For the outputs at the positions ``cross`` (q(w)'s gradients ``g_s`` and
        Hessians ``H_s``), the auxiliary result also holds the cross derivatives
        ``E[d x / d h]``, of shape ``x.shape + (n_h,)`` (``None`` where ``x``
        does not depend on ``h``), by Stein's lemma on the same points.
        """
        h = pt.vector("h_draw", shape=(self.spec.size,))
        outs = graph_replace(outputs, self.spec.replacements(h), strict=False)
        value = outs[0]
        grad = pt.grad(pt.switch(pt.isfinite(value), value, 0.0), h, disconnected_inputs="ignore")
        st = GaussianBlocks(state.cand_mean, state.cand_factor)
        draws = self._draws(st)
        singles = [*outs, grad]
        if self.spec.fixed_shapes or _sized_by(h, singles):
            singles = shapes_at_fixed(h, singles)
        batched = vectorize_graph(singles, {h: draws})
        w = pt.constant(self.w)
        # Outputs that do not involve h are left unbatched by vectorize_graph.
        avgs = [
            pt.tensordot(w, b, axes=[[0], [0]]) if depends_on_any(x, [h]) else b
            for x, b in zip(singles, batched, strict=True)
        ]
        outs_avg, g_h = avgs[: len(outs)], avgs[-1]
        # Stein's lemma, E[grad B (h - mu)^T] = E[hess B] S, on the sigma points: a
        # central difference of gradients, exact for quadratic B, no second derivatives.
        grads = batched[-1]
        L = st.factor[0]
        C = (grads * w[:, None]).T @ (draws - st.mean)
        P_h = L @ L.T
        H_h = C @ P_h
        H_h = 0.5 * (H_h + H_h.T)
        crosses = []
        for i in cross:
            if not depends_on_any(outs[i], [h]):
                crosses.append(None)
                continue
            C_s = pt.tensordot(
                batched[i] * _expand(w, batched[i].ndim), draws - st.mean, [[0], [0]]
            )
            crosses.append(C_s @ P_h)
        if entropy:
            ent = gaussian_entropy(st, "precision")
            outs_avg = [o + ent if i < n_values else o for i, o in enumerate(outs_avg)]
        finite = _finite(g_h, H_h, *[c for c in crosses if c is not None])
        return outs_avg, finite, (g_h, H_h, crosses)

    def accept(self, state: GaussianHyperState, accept, aux) -> GaussianHyperState:
        """The accepted q(h), gradient and Hessian after the candidate's verdict."""
        g_h, H_h = aux[:2]
        sel = lambda a, b: pt.switch(accept, a, b)  # noqa: E731
        return state._replace(
            base_mean=sel(state.cand_mean, state.base_mean),
            base_factor=sel(state.cand_factor, state.base_factor),
            grad=sel(g_h[None], state.grad),
            hess=sel(H_h[None], state.hess),
        )

    def step(self, state: GaussianHyperState, rho, scale, t, coupling=None):
        """The next candidate of q(h) from the accepted state.

        Parameters
        ----------
        coupling : tuple, optional
            ``(factors, grads, crosses, hessian_crosses, old_factors, arrow)`` of q(w)'s
            segments, the arguments of :func:`joint_newton_step`: the lower
            Cholesky factors of their new precisions, their (finite) gradients,
            the cross derivatives ``E[d g_s / d h]`` and ``E[d H_s / d h]`` of
            the new base (``None`` for segments that do not depend on ``h``),
            the factors before the step and the arrow of q(w)'s curvature (or
            ``None``). With it, q(h)'s mean takes the joint
            Newton step and q(w) follows it; the precision of q(h) keeps its
            mean-field natural step.

        Returns
        -------
        state : GaussianHyperState
        joint : JointStep or None
            With ``coupling``: the changes to add to each segment's mean and
            precision step.
        """
        mean, factor = state.base_mean, state.base_factor
        nxt = natural_step(GaussianBlocks(mean, factor), _safe(state.grad), _safe(state.hess), rho)
        next_mean, joint = nxt.mean, None
        lr_factor, lr_responses = state.lr_factor, state.lr_responses
        if coupling is not None:
            L_h = nxt.factor[0]
            joint = joint_newton_step(
                _safe(state.grad[0]), L_h @ L_h.T, rho, *coupling, max_step=self.spec.max_step
            )
            # A failed factorization (NaN) leaves the separate steps.
            ok = pt.all(pt.isfinite(joint.delta_h))
            next_mean = pt.switch(ok, mean + joint.delta_h[None], nxt.mean)

            def zero_if_failed(xs):
                return [None if x is None else pt.switch(ok, x, 0.0) for x in xs]

            joint = joint._replace(
                shifts=zero_if_failed(joint.shifts),
                precision_shifts=zero_if_failed(joint.precision_shifts),
            )
            if state.lr_factor is not None:
                L = pt.linalg.cholesky(joint.curvature, lower=True, on_error="nan")
                good = ok & pt.all(pt.isfinite(L))
                lr_factor = pt.switch(good, L[None], state.lr_factor)
                lr_responses = tuple(
                    sh if U is None else pt.switch(good, U, sh)
                    for sh, U in zip(state.lr_responses, joint.responses, strict=True)
                )
        new = state._replace(
            cand_mean=next_mean,
            cand_factor=nxt.factor,
            lr_factor=lr_factor,
            lr_responses=lr_responses,
        )
        return new, joint
