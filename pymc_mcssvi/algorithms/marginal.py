r"""A skewed marginal for the hyperparameters: profile slices along q(h)'s axes.

The fit's q(h) is Gaussian in PyMC's unconstrained space with the curvature of
the bound with q(w) eliminated to first order (the linear response). Its
group-level scales are usually skewed in log space (long tail towards 0): on
the radon data the Gaussian puts the posterior mean of ``sigma_county`` 26-32%
above the exact value. As INLA does, the correction evaluates the profile
``L(h) = max_{q(w)} bound(q(w), h)`` (:class:`ConditionalProfile`: q(w | h)
re-fitted by natural steps with ``rho = 1`` until the bound settles): first
its curvature at the centre of q(h) by finite differences, which replaces the
linear response's (a Schur complement that loses its accuracy where ``h`` and
q(w) are strongly coupled), then its values along each principal axis of that
Gaussian at ``z = -4, ..., 4`` standard deviations, whose interpolated 1-D
densities become independent marginals of the axis coordinates.

The correction is applied only when the profile along the axes agrees with
the curvature at the centre (second difference at ``z = +-1`` within
:data:`CURVATURE_RANGE` of 1 on every axis) and all values are finite;
otherwise the Gaussian is kept. Draws are ``h = mu + V diag(s) T(e)`` with
``e ~ N(0, I)`` and ``T`` the monotone map from standard normal to each axis
marginal (its quantile function at ``Phi(e)``), tabulated on a grid of ``e``.
The walk along an axis is re-scaled when the profile's second difference at
``+-1`` sd disagrees with the curvature (:meth:`ConditionalProfile.along_axes`).
The re-fitted q(w | h) at the profile points also shape the Gaussian
globals' draws, both in the coordinates the data see (each coordinate scaled
by its column of the predictor's Jacobian, :func:`sensitivity_log_scales`):
their averaged conditional covariance (:func:`averaged_view_factors`) and
their conditional means along the axes (:func:`conditional_mean_table`,
moments by :func:`draw_moments`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytensor.tensor as pt
from scipy.interpolate import PchipInterpolator
from scipy.special import ndtr

from pymc_mcssvi.families.gaussian import GaussianBlocks, natural_step, natural_step_gain

__all__ = [
    "AXIS_POINTS",
    "CURVATURE_RANGE",
    "EPS_GRID",
    "AxisMarginal",
    "NODES",
    "averaged_view_factors",
    "refit_log_scales",
    "sensitivity_log_scales",
    "axis_marginal",
    "ConditionalProfile",
    "Refit",
    "conditional_mean_table",
    "DrawMoments",
    "MAX_MOMENT_GRID",
    "MAX_MEAN_LOG_SCALE",
    "MAX_MOMENT_RANK",
    "draw_moments",
    "node_interpolation",
    "refit_graph",
    "table_transform",
]

#: Points along each axis, in standard deviations of the linear-response q(h).
AXIS_POINTS = np.array([-4.0, -3.0, -2.0, -1.0, 1.0, 2.0, 3.0, 4.0])
#: The same points with the centre, in order (unit spacing).
NODES = np.arange(-4.0, 5.0)
#: Accepted range of the profile's second difference at +-1 sd (1 for a Gaussian).
CURVATURE_RANGE = (0.4, 1.6)
#: Grid of the standard-normal argument of the tabulated axis transforms.
EPS_GRID = np.linspace(-8.0, 8.0, 801)
#: Largest number of hyperparameter coordinates that get the correction.
MAX_CORRECTED_HYPERS = 4


class AxisMarginal(NamedTuple):
    """Skewed marginal of ``h``: ``h = mean0 + V diag(scales) T(e)``.

    Attributes
    ----------
    directions : np.ndarray
        ``(n, n)``, columns are q(h)'s principal axes.
    scales : np.ndarray
        ``(n,)``, q(h)'s standard deviations along them.
    table : np.ndarray
        ``(n, len(EPS_GRID))``: ``T_j`` at the grid points.
    mean_shift : np.ndarray
        ``E[h] - mean0``.
    cov : np.ndarray
        Covariance of ``h``.
    log_density : np.ndarray
        ``(n, len(AXIS_POINTS))`` profile values relative to the centre (report).
    weights : np.ndarray
        ``(n, 1 + len(AXIS_POINTS))``: quadrature weights of the axis marginal at
        the centre (column 0) and at ``AXIS_POINTS`` (unit spacing, so
        proportional to the interpolated density there; each row sums to 1).
    """

    directions: np.ndarray
    scales: np.ndarray
    table: np.ndarray
    mean_shift: np.ndarray
    cov: np.ndarray
    log_density: np.ndarray
    weights: np.ndarray


#: Relative change of the profile value below which q(w | h)'s natural steps stop.
REFIT_TOL = 1e-5
#: Most evaluations (natural steps) of one re-fit of q(w | h).
MAX_REFIT_STEPS = 12
#: Consecutive halvings of the step size after a step that lowered the bound.
MAX_REFIT_HALVINGS = 3
#: Finite-difference step of the profile's Hessian, in sds of the linear-response q(h).
HESSIAN_STEP = 0.25
#: Times an axis's scale is re-set from the profile's second difference at +-1 sd.
MAX_AXIS_RESCALES = 3


def refit_graph(kernel, project: bool = True, gain: bool = False, sensitivity: bool = False):
    """One natural step of q(w) at a point ``h``: the profile's building block.

    Returns ``(inputs, outputs)``. ``inputs`` are the model's value variables of
    the hyperparameters (no graph replacement: cloning the bound's graph costs
    more than building it), the step size ``rho``, then q(w)'s means and
    precision Cholesky factors, one per segment. ``outputs`` are the bound at that q(w) and ``h`` (no q(h)
    entropy: ``h`` is a point), then the means and factors after the step,
    and with ``gain=True`` the gain of a full step predicted by the bound's
    second-order model (:func:`~pymc_mcssvi.families.gaussian.natural_step_gain`),
    and with ``sensitivity=True`` the squared column norms of the likelihoods'
    predictor Jacobian per segment, ``(R, K)``
    (:meth:`~pymc_mcssvi.bounds.structured.StructuredBound.sensitivities`:
    :func:`averaged_view_factors` reads from them how each coordinate's effect
    on the data scales with ``h``).
    :class:`ConditionalProfile` iterates it to the optimum of q(w | h).
    """
    hyp = kernel.hypers
    rho = pt.scalar("refit_rho", dtype="float64")
    means = [m.type(f"refit_mean_{s}") for s, m in enumerate(kernel.base_mean)]
    factors = [f.type(f"refit_factor_{s}") for s, f in enumerate(kernel.base_factor)]
    states = [GaussianBlocks(m, f) for m, f in zip(means, factors, strict=True)]
    ev = kernel.bound.evaluate(states)
    # as in the fit's step: non-finite derivatives (far out along q(h)'s axes) must not
    # reach the projection's eigendecomposition, which raises; the step's bound is then
    # not finite and the re-fit backs off
    grads = [pt.switch(pt.isfinite(g), g, 0.0) for g in ev.grads]
    hessians = [pt.switch(pt.isfinite(H), H, 0.0) for H in ev.hessians]
    new = [
        natural_step(st, g, H, rho, project=project)
        for st, g, H in zip(states, grads, hessians, strict=True)
    ]
    inputs = [*hyp.spec.values, rho, *means, *factors]
    outputs = [ev.value, *[st.mean for st in new], *[st.factor for st in new]]
    if gain:
        outputs.append(
            sum(natural_step_gain(st, nw, g) for st, nw, g in zip(states, new, grads, strict=True))
        )
    if sensitivity:
        outputs.extend(kernel.bound.sensitivities(len(states)))
    return inputs, outputs


class Refit(NamedTuple):
    """q(w | h) re-fitted at a point ``h``: the profile ``value`` there, the
    segments' ``means`` and precision Cholesky ``factors``, the natural
    ``steps`` taken and, when the step returns them, the squared column norms
    of the likelihoods' predictor Jacobian per segment (``sensitivity``,
    ``(R, K)`` each, see :func:`refit_graph`)."""

    value: float
    means: list
    factors: list
    steps: int
    sensitivity: list | None = None


class ConditionalProfile:
    """The profile ``L(h) = max_{q(w)} bound(q(w), h)``, q(w | h) re-fitted by natural steps.

    The fit's q(h) comes from the curvature of the bound with q(w) eliminated
    to first order (a Schur complement of sigma-point derivatives, see
    :func:`~pymc_mcssvi.algorithms.hyperparameters.joint_newton_step`). Where
    ``h`` and q(w) are strongly coupled (a non-centered effect ``sigma * z``
    under a Poisson likelihood) that complement is a small difference of large
    terms: on the grouseticks GLMM it put the precision of ``log sigma_brood``
    at 24 where the profile's is 64. Here the profile is evaluated directly:
    at each point q(w | h) starts from the linear response (or from a
    neighbouring point's re-fit) and takes natural steps with ``rho = 1``
    until the bound stops changing (:data:`REFIT_TOL`; 1.8-3.7 evaluations of
    the bound on average on the benchmark GLMMs, see :meth:`refit`); a single
    step, enough for a Gaussian likelihood, left the grouseticks profile 6-40%
    low at 1-2 sds and 10-100x low at 3-4 sds.

    Parameters
    ----------
    step : callable
        ``(h, rho, means, factors) -> (value, means, factors[, gain])``: the
        compiled :func:`refit_graph` with ``h`` flat (``gain``: the predicted
        gain of a full step, see :meth:`refit`).
    mean : np.ndarray
        Centre of q(h), ``(n_h,)``: the point of the fitted q(w).
    means, factors : list of np.ndarray
        The fitted q(w)'s segments.
    responses : list of np.ndarray
        ``dm_w / dh`` per segment, ``(R, K, n_h)`` (linear response).
    """

    def __init__(self, step, mean, means, factors, responses):
        self.step = step
        self.mean = np.asarray(mean, dtype="float64")
        self.fitted = Refit(np.nan, list(means), list(factors), 0)
        self.responses = list(responses)

    def start(self, h, origin: Refit, at):
        """``origin``'s q(w) (re-fitted at ``at``) moved to ``h`` by the linear response."""
        dh = np.asarray(h) - np.asarray(at)
        means = [
            m + np.tensordot(U, dh, [[-1], [0]])
            for m, U in zip(origin.means, self.responses, strict=True)
        ]
        return means, origin.factors

    def refit(self, h, means, factors) -> Refit:
        """Natural steps of q(w | h) from ``(means, factors)`` until the bound settles.

        Steps start with ``rho = 1`` (the fixed point: exact in one step for a
        Gaussian likelihood); a step that lowers the bound or makes it
        non-finite is retried from the previous state with half the step size
        (kept for the later steps), at most :data:`MAX_REFIT_HALVINGS` times
        in a row. At most :data:`MAX_REFIT_STEPS` evaluations. The re-fit stops
        when the last step gained at most :data:`REFIT_TOL` (relative), or
        when ``step`` returns a fourth value, the gain a full next step is
        predicted to make, and that is below it: the step is then taken and
        its bound is the predicted one (one evaluation fewer per re-fit).

        Examples
        --------
        A one-coordinate "q(w)" whose full step ``-2.5 x`` overshoots the optimum
        at 0 (the bound ``-cosh(x)`` falls); half steps converge:

        >>> import numpy as np
        >>> step = lambda h, rho, m, f: (-np.cosh(m[0]), [m[0] - rho * 2.5 * m[0]], f)
        >>> prof = ConditionalProfile(step, np.zeros(1), [], [], [])
        >>> r = prof.refit(np.zeros(1), [np.array(1.0)], [])
        >>> bool(abs(r.means[0]) < 0.01), r.steps > 1
        (True, True)
        """
        best, rho, halvings, retry = None, 1.0, 0, False
        for _ in range(MAX_REFIT_STEPS):
            out = self.step(h, rho, means, factors)
            value, new_means, new_factors = out[:3]
            value = float(value)
            predicted = float(out[3]) if len(out) > 3 else np.inf
            sensitivity = out[4] if len(out) > 4 else None
            if retry:  # ``best`` again: take its shorter step
                means, factors, retry = new_means, new_factors, False
                continue
            if not np.isfinite(value) or (best is not None and value < best.value):
                if best is None or halvings == MAX_REFIT_HALVINGS:
                    break
                rho, halvings, retry = 0.5 * rho, halvings + 1, True
                means, factors = best.means, best.factors
                continue
            gain = np.inf if best is None else value - best.value
            steps = 0 if best is None else best.steps + 1
            best = Refit(value, means, factors, steps, sensitivity)
            tol = REFIT_TOL * (abs(value) + 10.0)
            if gain <= tol:
                break
            if rho == 1.0 and 0.0 <= predicted <= tol:
                # the next full step would gain little: take it without evaluating the
                # stepped state, whose bound the second-order prediction gives (its
                # error is a small fraction of an already small gain; stopping one
                # step short instead would leave the whole gain as error, enough to
                # bias the profile's finite-difference curvature)
                best = Refit(value + predicted, new_means, new_factors, steps + 1, sensitivity)
                break
            means, factors, halvings = new_means, new_factors, 0
        if best is None:
            raise FloatingPointError(f"the bound is not finite at h = {np.round(h, 4).tolist()}")
        return best

    def hessian(self, centre: Refit, steps) -> np.ndarray:
        """Central second differences of the profile at the centre.

        ``steps`` are the coordinates' finite-difference steps; ``n (n + 1)``
        re-fits from the linear response of ``centre``.

        Examples
        --------
        A quadratic "bound" (no q(w) to re-fit) gives its Hessian back:

        >>> import numpy as np
        >>> A = np.array([[2.0, 0.5], [0.5, 1.0]])
        >>> step = lambda h, rho, m, f: (-0.5 * h @ A @ h, m, f)
        >>> prof = ConditionalProfile(step, np.zeros(2), [], [], [])
        >>> centre = prof.refit(np.zeros(2), [], [])
        >>> np.allclose(prof.hessian(centre, np.array([0.1, 0.2])), -A)
        True
        """
        n, f0 = len(self.mean), centre.value
        eye = np.diag(np.asarray(steps, dtype="float64"))

        def at(d):
            h = self.mean + d
            return self.refit(h, *self.start(h, centre, self.mean)).value

        fp = [at(eye[i]) for i in range(n)]
        fm = [at(-eye[i]) for i in range(n)]
        H = np.diag([(fp[i] + fm[i] - 2.0 * f0) / eye[i, i] ** 2 for i in range(n)])
        for i in range(n):
            for j in range(i + 1, n):
                both = at(eye[i] + eye[j]) + at(-eye[i] - eye[j])
                H[i, j] = H[j, i] = (both - fp[i] - fm[i] - fp[j] - fm[j] + 2.0 * f0) / (
                    2.0 * eye[i, i] * eye[j, j]
                )
        return H

    def along_axes(self, centre: Refit, directions, scales) -> tuple[list[Refit], np.ndarray]:
        """Re-fits at :data:`AXIS_POINTS` along each axis (the order of :func:`axis_marginal`),
        and the axes' scales they were taken at.

        Each side of an axis is walked outwards from the centre, every point
        starting from its inner neighbour's re-fit (continuation). The points at
        ``+-1`` sd come first: where the profile's second difference there is
        outside :data:`CURVATURE_RANGE`, the curvature at the centre
        mis-states the axis's width (confounded effects: a profile that fell 4
        nats at 1 sd and 21 at 2 sd of the curvature's Gaussian), and the axis's
        scale is set to the one that difference gives and the ``+-1`` points
        taken again (at most :data:`MAX_AXIS_RESCALES` times).

        Examples
        --------
        A Gaussian profile of sd 0.5 along an axis whose assumed scale is 1:

        >>> import numpy as np
        >>> step = lambda h, rho, m, f: (-2.0 * float(h @ h), m, f)
        >>> prof = ConditionalProfile(step, np.zeros(1), [], [], [])
        >>> centre = prof.refit(np.zeros(1), [], [])
        >>> refits, scales = prof.along_axes(centre, np.eye(1), np.ones(1))
        >>> float(scales[0]), [round(r.value, 6) for r in refits][:4]
        (0.5, [-8.0, -4.5, -2.0, -0.5])
        """
        scales = np.array(scales, dtype="float64")
        out = []
        for j in range(len(scales)):
            for _ in range(MAX_AXIS_RESCALES + 1):
                axis = np.asarray(directions)[:, j] * scales[j]
                ones = {
                    z: self.refit(
                        self.mean + z * axis, *self.start(self.mean + z * axis, centre, self.mean)
                    )
                    for z in (-1.0, 1.0)
                }
                curvature = 2.0 * centre.value - ones[-1.0].value - ones[1.0].value
                lo, hi = CURVATURE_RANGE
                if not (np.isfinite(curvature) and curvature > 0) or lo <= curvature <= hi:
                    break
                scales[j] /= np.sqrt(curvature)
            side = dict(ones)
            for sign in (-1.0, 1.0):
                prev, prev_z = ones[sign], sign
                for z in sorted(AXIS_POINTS[np.sign(AXIS_POINTS) == sign], key=abs)[1:]:
                    h = self.mean + z * axis
                    prev = self.refit(h, *self.start(h, prev, self.mean + prev_z * axis))
                    side[z], prev_z = prev, z
            out.extend(side[z] for z in AXIS_POINTS)
        return out, scales


def axis_marginal(values, directions, scales) -> AxisMarginal | None:
    """The skewed marginal from profile values, or ``None`` if they are not trusted.

    Parameters
    ----------
    values : np.ndarray
        Profile at the centre, then at ``AXIS_POINTS`` along each axis in turn
        (``1 + n len(AXIS_POINTS)`` values).
    directions, scales : np.ndarray
        Principal axes (columns) and standard deviations of the Gaussian q(h).

    Examples
    --------
    A Gaussian profile gives back the Gaussian:

    >>> import numpy as np
    >>> vals = np.r_[0.0, -0.5 * AXIS_POINTS**2]
    >>> am = axis_marginal(vals, np.eye(1), np.ones(1))
    >>> bool(abs(am.cov[0, 0] - 1) < 0.02 and abs(am.mean_shift[0]) < 1e-6)
    True
    """
    values = np.asarray(values, dtype="float64")
    n = len(scales)
    if not np.all(np.isfinite(values)):
        return None
    d = (values[1:] - values[0]).reshape(n, len(AXIS_POINTS))
    i_m1, i_p1 = np.flatnonzero(AXIS_POINTS == -1.0)[0], np.flatnonzero(AXIS_POINTS == 1.0)[0]
    curvature = -(d[:, i_m1] + d[:, i_p1])
    lo, hi = CURVATURE_RANGE
    if np.any(curvature < lo) or np.any(curvature > hi):
        return None
    z_nodes = np.r_[AXIS_POINTS[AXIS_POINTS < 0], 0.0, AXIS_POINTS[AXIS_POINTS > 0]]
    fine = np.linspace(EPS_GRID[0], EPS_GRID[-1], 4001)
    table = np.empty((n, EPS_GRID.size))
    shift, var = np.empty(n), np.empty(n)
    weights = np.empty((n, 1 + len(AXIS_POINTS)))
    centre = int(np.flatnonzero(z_nodes == 0.0)[0])
    for j in range(n):
        lg = np.r_[d[j, AXIS_POINTS < 0], 0.0, d[j, AXIS_POINTS > 0]]
        lg = _unimodal(lg, centre)
        node_density = np.exp(_axis_log_density(z_nodes, lg, z_nodes))
        node_density = np.r_[node_density[centre], np.delete(node_density, centre)]
        weights[j] = node_density / node_density.sum()
        logp = _axis_log_density(z_nodes, lg, fine)
        p = np.exp(logp - logp.max())
        cdf = np.cumsum(p)
        cdf /= cdf[-1]
        table[j] = np.interp(ndtr(EPS_GRID), cdf, fine)
        w = p / p.sum()
        shift[j] = w @ fine
        var[j] = w @ (fine - shift[j]) ** 2
    V, s = np.asarray(directions), np.asarray(scales)
    return AxisMarginal(
        V,
        s,
        table,
        V @ (s * shift),
        (V * (s**2 * var)) @ V.T,
        d,
        weights,
    )


def _unimodal(lg, centre):
    """Log densities made non-increasing away from the centre (a slice of a unimodal density)."""
    out = lg.copy()
    out[centre + 1 :] = np.minimum.accumulate(out[centre + 1 :])
    out[:centre] = np.minimum.accumulate(out[:centre][::-1])[::-1]
    return np.minimum(out, 0.0)


def _axis_log_density(z, lg, fine):
    """Shape-preserving interpolation inside the nodes; beyond them the last slope plus a
    unit-Gaussian decay."""
    inside = PchipInterpolator(z, lg)(np.clip(fine, z[0], z[-1]))
    lo_slope = min(0.0, -(lg[1] - lg[0]) / (z[1] - z[0]))  # slope going outward (left)
    hi_slope = min(0.0, (lg[-1] - lg[-2]) / (z[-1] - z[-2]))
    left, right = np.maximum(z[0] - fine, 0.0), np.maximum(fine - z[-1], 0.0)
    return inside + lo_slope * left + hi_slope * right - 0.5 * (left**2 + right**2)


#: Largest ``sum(R K^3)`` over the segments of q(w) for which the conditional
#: covariances are averaged (an 88-dimensional full block: 7e5).
MAX_VIEW_WORK = 3e7


def averaged_view_factors(weights, factors, log_scales=None):
    """The conditional covariance of q(w | h) averaged over the axis marginal, per segment.

    q(w)'s own covariance comes from the prior precision averaged over q(h)
    (``E[1/sigma^2]`` for a centered group effect), which is the conditional
    covariance at a *small* scale: with few groups, whose scale is uncertain,
    it under-states the spread of the effects and of the intercept they share
    (Jensen: ``1 / E[1/sigma^2] < E[sigma^2]``). The covariance of the
    re-fitted ``q(w | h)`` at the profile points, averaged with the axis
    marginal's weights, is the conditional part of the law of total variance;
    the linear response adds the part from the mean's dependence on ``h``.
    How each coordinate's conditional sd moves with ``h`` is returned too
    (draws scale their noise by it: a non-centered effect ``z`` is wide where
    its scale is small, and ``sigma z`` must not pair a large ``sigma`` with
    that width).

    The covariances are averaged in the coordinates the data see: each
    coordinate scaled by how strongly it moves the likelihoods' predictors at
    that point relative to the centre (the column norms of the predictor's
    Jacobian: ``sigma / sigma_centre`` for a non-centered ``z`` in ``sigma z``,
    1 for a centered effect, whose prior is what changes). For non-centered effects of
    two crossed factors the data fix ``sigma_1 z_1 + sigma_2 z_2`` on rows that
    share both: in ``z`` that tight direction turns with the scales, and an
    average of the ``z`` covariances is wide along every turned copy of it
    (held-out predictor sds up to 2.8x NUTS's on grouseticks); in the data's
    coordinates it stays put.

    Parameters
    ----------
    weights : np.ndarray
        ``AxisMarginal.weights``, ``(n, 1 + len(AXIS_POINTS))``.
    factors : list of list of np.ndarray
        Per profile point (the centre, then ``AXIS_POINTS`` along each axis in
        turn), per segment, the ``(R, K, K)`` lower precision Cholesky factors.
    log_scales : list of list of np.ndarray, optional
        At the same points, per segment, the ``(R, K)`` log column norms of the
        predictor's Jacobian relative to the centre's (:func:`refit_log_scales`);
        ``None`` averages the covariances as they are.

    Returns
    -------
    (list of np.ndarray, list of np.ndarray, list of np.ndarray) or None
        Per segment: the lower Cholesky factor of the inverse averaged
        covariance (the draws' noise, before scaling); the log ratios of
        ``sd(w | h)`` at :data:`NODES` along each axis, ``(n, len(NODES), R,
        K)``, whose sum over the axes at a draw's coordinates scales its noise
        (``log(sd(w | h) / sd_avg)``: relative to the centre on each axis, axis
        0 carrying ``log(sd_centre / sd_avg)``); and the lower Cholesky factor
        of the inverse of the scaled noise's covariance averaged over the axis
        marginal (``E[exp(T_i + T_l)] S_il``, independent axes: the
        covariance ``std`` and ``cov`` report). ``None`` when a result is not
        positive definite or not finite. Axes combine additively around the
        centre: ``S_c + sum_j (E_j[S] - S_c)``.

    Examples
    --------
    Conditional variances 1 at the centre and 4 at every other point of one
    axis, half of the weight at the centre: the average is 2.5.

    >>> import numpy as np
    >>> w = np.r_[0.5, np.full(8, 0.5 / 8)][None]
    >>> f = [[np.ones((1, 1, 1))]] + [[np.full((1, 1, 1), 0.5)]] * 8
    >>> L, log_ratio, L_mom = averaged_view_factors(w, f)
    >>> var = lambda L: round(float(1 / L[0][0, 0, 0] ** 2), 12)
    >>> var(L), round(float(np.exp(2 * log_ratio[0][0, 4, 0, 0])), 12), var(L_mom)
    (2.5, 0.4, 2.5)

    A non-centered ``z`` whose scale is twice the centre's at every other point:
    its squared column norm is 4x and its conditional variance 1/4 there. The
    data see one variance throughout, so the average is the centre's, and the
    variances along the axis are the re-fits' own (their average, 0.625, is
    what ``std`` reports).

    >>> f = [[np.ones((1, 1, 1))]] + [[np.full((1, 1, 1), 2.0)]] * 8
    >>> ls = [[np.zeros((1, 1))]] + [[np.full((1, 1), np.log(2.0))]] * 8
    >>> L, log_ratio, L_mom = averaged_view_factors(w, f, ls)
    >>> var(L), round(float(np.exp(2 * log_ratio[0][0, 5, 0, 0])), 12), var(L_mom)
    (1.0, 0.25, 0.625)
    """
    n, per_axis = weights.shape[0], weights.shape[1] - 1
    if len(factors) != 1 + n * per_axis:
        raise ValueError(f"expected {1 + n * per_axis} profile points, got {len(factors)}")
    centre_at = int(np.flatnonzero(NODES == 0.0)[0])
    # NODES positions of the weights' points (the centre, then AXIS_POINTS)
    at_weights = [centre_at, *(int(np.flatnonzero(NODES == z)[0]) for z in AXIS_POINTS)]
    out, ratios, moments = [], [], []
    for s in range(len(factors[0])):
        covs = [_block_covariance(f[s]) for f in factors]
        seg_scales = (
            [np.zeros(np.shape(c)[:-1]) for c in covs]
            if log_scales is None
            else [np.asarray(ls[s]) for ls in log_scales]
        )
        # in the data's coordinates (unscaled at the centre)
        covs = [
            c * np.exp(ls[..., :, None] + ls[..., None, :])
            for c, ls in zip(covs, seg_scales, strict=True)
        ]
        centre = covs[0]
        avg = centre.copy()
        for j in range(n):
            pts = covs[1 + j * per_axis : 1 + (j + 1) * per_axis]
            axis_mean = weights[j, 0] * centre + sum(
                w * c for w, c in zip(weights[j, 1:], pts, strict=True)
            )
            avg += axis_mean - centre
        avg = 0.5 * (avg + np.swapaxes(avg, -1, -2))
        try:
            prec = np.linalg.inv(avg)
            L = np.linalg.cholesky(0.5 * (prec + np.swapaxes(prec, -1, -2)))
        except np.linalg.LinAlgError:
            return None
        var_avg = np.diagonal(avg, axis1=-2, axis2=-1)
        # sd(w | h) relative to the centre's, back in w's coordinates
        log_sds = [
            0.5 * np.log(np.diagonal(c, axis1=-2, axis2=-1)) - ls
            for c, ls in zip(covs, seg_scales, strict=True)
        ]
        ratio = np.empty((n, len(NODES), *var_avg.shape))
        for j in range(n):
            along = log_sds[1 + j * per_axis : 1 + (j + 1) * per_axis]
            along.insert(centre_at, log_sds[0])
            ratio[j] = np.stack(along) - log_sds[0]
        # the axes multiply the centre's sd; the average over them is the averaged sd
        ratio[0] += log_sds[0] - 0.5 * np.log(var_avg)
        scaled = avg.copy()
        for j in range(n):
            e = np.exp(ratio[j][at_weights])
            scaled *= np.einsum("k,k...i,k...l->...il", weights[j], e, e)
        try:
            prec = np.linalg.inv(scaled)
            L_mom = np.linalg.cholesky(0.5 * (prec + np.swapaxes(prec, -1, -2)))
        except np.linalg.LinAlgError:
            return None
        if not (
            np.all(np.isfinite(L)) and np.all(np.isfinite(ratio)) and np.all(np.isfinite(L_mom))
        ):
            return None
        out.append(L)
        ratios.append(ratio)
        moments.append(L_mom)
    return out, ratios, moments


#: Largest change of a coordinate's log scale over the profile points (a factor 20) for
#: which its draws' mean follows it without checking the re-fitted means: non-centered
#: GLMM effects change by at most 1.6 (grouseticks), a Hilbert-space GP's
#: high-frequency coefficients by up to 40.
MAX_MEAN_LOG_SCALE = 3.0


def refit_log_scales(refits, means: bool = False):
    """Per re-fit, per segment, the log scales of the data's coordinates relative to the centre.

    :func:`sensitivity_log_scales` of the re-fits' ``sensitivity`` (the first
    re-fit is the centre); ``None`` if a re-fit lacks it. With ``means=True``
    (the scales the draws' means follow) a coordinate whose log scale changes
    by more than :data:`MAX_MEAN_LOG_SCALE` keeps them only if its re-fitted
    means fit ``m_k = m_0 exp(-ls_k)`` (data-held: a non-centered ``z`` moves
    like ``1 / sigma``) at least as well as ``m_k = m_0`` (in the local sds,
    summed over the profile points); otherwise its scales are 0. A
    high-frequency basis coefficient of a Hilbert-space GP, whose column
    scales with its spectral density over orders of magnitude while the prior
    holds it, is such a coordinate: with its scales its draws' means came out
    0.8 NUTS sd off. Smaller changes are kept without the check: the direction
    two crossed effects share is data-held even where each coordinate alone
    would fit ``m_0`` better (and keeping it brought grouseticks' predictor
    sds from 1.33x to 1.16x NUTS's). Covariances are averaged with all scales.

    Examples
    --------
    A coordinate whose mean follows ``1 / sigma`` and one whose mean follows
    ``sigma^2``, both with columns ``sigma`` (at ``sigma`` 1, 30 and 60, log
    scales past :data:`MAX_MEAN_LOG_SCALE`):

    >>> import numpy as np
    >>> f = [np.eye(2)[None]]
    >>> sens = lambda s: [np.array([[s * s, s * s]])]
    >>> refits = [Refit(0.0, [np.array([[1.0, 1.0]])], f, 0, sens(1.0)),
    ...           Refit(0.0, [np.array([[1 / 30, 900.0]])], f, 0, sens(30.0)),
    ...           Refit(0.0, [np.array([[1 / 60, 3600.0]])], f, 0, sens(60.0))]
    >>> [np.round(x[0], 3).tolist() for x in refit_log_scales(refits, means=True)]
    [[[0.0, 0.0]], [[3.401, 0.0]], [[4.094, 0.0]]]
    """
    if any(r.sensitivity is None for r in refits):
        return None
    nseg = len(refits[0].sensitivity)
    out = [[None] * nseg for _ in refits]
    grid = np.array([0.0, 1.0])[:, None, None, None]
    for s in range(nseg):
        ls = np.stack(sensitivity_log_scales([r.sensitivity[s] for r in refits]))
        if means:
            sd = np.stack(
                [
                    np.sqrt(np.diagonal(_block_covariance(r.factors[s]), axis1=-2, axis2=-1))
                    for r in refits
                ]
            )
            m = np.stack([np.asarray(r.means[s]) for r in refits])
            with np.errstate(invalid="ignore", over="ignore"):
                misfit = np.sum(((m - m[0] * np.exp(-grid * ls)) / sd) ** 2, axis=1)
            misfit = np.where(np.isfinite(misfit), misfit, np.inf)
            moderate = np.max(np.abs(ls), axis=0) <= MAX_MEAN_LOG_SCALE
            ls = np.where(moderate | (misfit[1] <= misfit[0]), ls, 0.0)
        for i in range(len(refits)):
            out[i][s] = ls[i]
    return out


def sensitivity_log_scales(sensitivities, floor=1e-12):
    """``log`` of how strongly each coordinate moves the predictors, relative to the centre.

    ``0.5 log(c_k / c_0)`` for the squared column norms ``c_k`` of the
    predictor's Jacobian at each point (``c_0`` at the centre): a coordinate
    that enters the predictor as ``sigma z`` has ``c_k / c_0 = (sigma_k /
    sigma_0)^2``. Zero where a norm is not positive or the centre's is below
    ``floor`` times the segment's largest (no data move the coordinate).

    Examples
    --------
    >>> import numpy as np
    >>> c = [np.array([[4.0, 1.0, 0.0]]), np.array([[16.0, 1.0, 5.0]])]
    >>> [np.round(x, 4).tolist() for x in sensitivity_log_scales(c)]
    [[[0.0, 0.0, 0.0]], [[0.6931, 0.0, 0.0]]]
    """
    c0 = np.asarray(sensitivities[0], dtype="float64")
    top = np.max(c0) if c0.size else 0.0
    held = c0 > floor * top
    out = []
    for c in sensitivities:
        c = np.asarray(c, dtype="float64")
        ok = held & (c > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            out.append(np.where(ok, 0.5 * np.log(np.where(ok, c / c0, 1.0)), 0.0))
    return out


def conditional_mean_table(
    refits, fitted_means, directions, scales, flat_maps, size, log_scales=None
):
    """q(w | h)'s re-fitted means at :data:`NODES` along each axis, in the data's coordinates.

    A non-centered effect ``z`` with ``a = sigma z`` fixed by the data moves like
    ``1 / sigma``, far from linearly in ``log sigma``: a linear response spreads
    ``a`` over the draws of ``sigma`` (on the grouseticks GLMM the
    well-determined brood effects' sds were up to 1.3x NUTS's and their means
    0.35 sd off). With two crossed or nested factors the data fix ``sb zb + sl
    zl``, and each ``z`` follows a product of both scales, which no sum of
    per-axis corrections in ``z`` reproduces (held-out predictors up to 1.4x
    NUTS's sds). In the data's coordinates ``u = s(h) w`` (``s`` the column
    norms of the predictor's Jacobian relative to the centre, see
    :func:`sensitivity_log_scales`) the mean barely moves and its moves add up
    across axes. The draws' mean is then ``exp(-sum_j LS_j(t_j)) (m + sum_j
    M_j(t_j))`` with both tables interpolated along the axes
    (:func:`node_interpolation`; ``m`` the fitted mean).

    Parameters
    ----------
    refits : list of Refit
        The centre, then :data:`AXIS_POINTS` along each axis in turn.
    fitted_means : list of np.ndarray
        q(w)'s fitted means ``(R, K)`` per segment.
    directions, scales : np.ndarray
        q(h)'s axes (columns) and sds; node ``z`` of axis ``j`` is
        ``mu + z scales[j] directions[:, j]``.
    flat_maps : list of np.ndarray
        Per segment, the ``(R, K)`` positions in the flat vector of q(w).
    size : int
        Length of that flat vector.
    log_scales : list of list of np.ndarray, optional
        Per refit, per segment, ``log s`` relative to the centre's, ``(R, K)``
        (:func:`refit_log_scales`); ``None``: ``s = 1``.

    Returns
    -------
    (np.ndarray, np.ndarray)
        ``M`` and ``LS``, each ``(n_h, len(NODES), size)``: at each node the
        mean in the data's coordinates minus the centre's (axis 0 also carries
        the centre's offset from the fitted mean: the fitted q(w) optimizes the
        bound averaged over q(h), the centre's re-fit the bound at its mean),
        and ``log s`` (0 at the centre).

    Examples
    --------
    One coordinate ``z`` whose re-fitted mean is ``exp(-h)`` (``1 / sigma``) and
    whose column norm is ``exp(h)``: in the data's coordinates it does not move.

    >>> import numpy as np
    >>> nodes = np.r_[0.0, AXIS_POINTS]
    >>> refits = [Refit(0.0, [np.exp(-np.array([[z]]))], [None], 0) for z in nodes]
    >>> ls = [[np.array([[z]])] for z in nodes]
    >>> M, LS = conditional_mean_table(
    ...     refits, [np.ones((1, 1))], np.eye(1), np.ones(1),
    ...     [np.zeros((1, 1), dtype=int)], 1, ls)
    >>> bool(np.allclose(M, 0.0)), bool(np.allclose(LS[0, :, 0], NODES))
    (True, True)
    """

    def flat(blocks):
        out = np.zeros(size)
        for m, idx in zip(blocks, flat_maps, strict=True):
            out[np.asarray(idx).reshape(-1)] = np.asarray(m).reshape(-1)
        return out

    n = len(scales)
    centre = flat(refits[0].means)
    table = np.zeros((n, len(NODES), size))
    log_table = np.zeros((n, len(NODES), size))
    per_axis = len(AXIS_POINTS)
    for j in range(n):
        for k, z in enumerate(AXIS_POINTS):
            node = int(np.flatnonzero(NODES == z)[0])
            i = 1 + j * per_axis + k
            ls = np.zeros(size) if log_scales is None else flat(log_scales[i])
            table[j, node] = np.exp(ls) * flat(refits[i].means) - centre
            log_table[j, node] = ls
    table[0] += centre - flat(fitted_means)
    return table, log_table


class DrawMoments(NamedTuple):
    """The moments of the Gaussian globals' draws' mean part under the axis marginal.

    With ``t_j`` the draws' coordinates along q(h)'s axes (``h - mu = sum_j
    scales_j t_j directions_j``), the draws are ``m + noise + g(t)``, ``g(t) =
    exp(-sum_j LS_j(t_j)) (m + sum_j M_j(t_j)) - m``
    (:func:`conditional_mean_table`), the noise independent of ``t``. On the
    grid of the axis marginal's nodes (independent axes):

    * ``shift = E[g]``: the draws' mean is ``m + shift``;
    * ``R R^T = Cov(g)``: added to the noise's covariance;
    * ``cross = Cov(g, h)``: the cross-covariance with ``h``.
    """

    shift: np.ndarray
    R: np.ndarray
    cross: np.ndarray


#: Largest number of grid points times coordinates of :func:`draw_moments`'s exact grid
#: (above it, points are drawn from the grid's weights).
MAX_MOMENT_GRID = 2e7
#: Largest rank of ``R`` in :class:`DrawMoments`.
MAX_MOMENT_RANK = 729


def draw_moments(mean_table, log_scale_table, marginal: AxisMarginal, fitted) -> DrawMoments:
    """The :class:`DrawMoments` of the tables of :func:`conditional_mean_table`.

    Examples
    --------
    A table that is 1 at the centre and 0 elsewhere, half of the weight at the
    centre: the mean moves by 1/2 and the variance grows by 1/4.

    >>> import numpy as np
    >>> table = np.zeros((1, len(NODES), 1))
    >>> table[0, 4, 0] = 1.0
    >>> am = AxisMarginal(np.eye(1), np.ones(1), None, np.zeros(1), None, None,
    ...                   np.r_[0.5, np.full(8, 0.5 / 8)][None])
    >>> mom = draw_moments(table, np.zeros_like(table), am, np.zeros(1))
    >>> float(mom.shift[0]), round(float((mom.R @ mom.R.T)[0, 0]), 12)
    (0.5, 0.25)

    A coordinate ``z = 1 / sigma`` (``log sigma = t``, the data's coordinate
    fixed at 1) gets the moments of ``exp(-t)`` on the nodes:

    >>> w = np.r_[0.5, np.full(8, 0.5 / 8)]
    >>> am = am._replace(weights=w[None])
    >>> ls = NODES.reshape(1, -1, 1).astype(float)
    >>> mom = draw_moments(np.zeros((1, len(NODES), 1)), ls, am, np.ones(1))
    >>> e = np.exp(-np.r_[0.0, AXIS_POINTS])
    >>> bool(np.isclose(1.0 + mom.shift[0], w @ e))
    True
    """
    fitted = np.asarray(fitted, dtype="float64")
    n, size = mean_table.shape[0], mean_table.shape[-1]
    z = np.r_[0.0, AXIS_POINTS]
    order = [int(np.flatnonzero(NODES == zk)[0]) for zk in z]
    weights = np.asarray(marginal.weights)
    n_grid = len(z) ** n
    if n_grid * size <= MAX_MOMENT_GRID:
        points = np.indices((len(z),) * n).reshape(n, -1).T  # (G, n) node indices
        p = np.prod(weights[np.arange(n), points], axis=1)
    else:
        # points drawn axis by axis from the node weights, equally weighted
        rng = np.random.default_rng(0)
        m = int(MAX_MOMENT_GRID // size)
        points = np.column_stack([rng.choice(len(z), size=m, p=weights[j]) for j in range(n)])
        p = np.full(m, 1.0 / m)
    M = sum(mean_table[j, np.asarray(order)[points[:, j]]] for j in range(n))
    LS = sum(log_scale_table[j, np.asarray(order)[points[:, j]]] for j in range(n))
    g = np.exp(-LS) * (fitted + M) - fitted  # (G, size)
    shift = p @ g
    gc = np.sqrt(p)[:, None] * (g - shift)
    t = z[points]  # (G, n)
    tc = t - p @ t
    cross_t = gc.T @ (np.sqrt(p)[:, None] * tc)  # Cov(g, t), (size, n)
    cross = cross_t @ (np.asarray(marginal.directions) * marginal.scales).T
    if gc.shape[0] <= MAX_MOMENT_RANK:
        R = gc.T
    else:
        _, sv, Vt = np.linalg.svd(gc, full_matrices=False)
        keep = min(MAX_MOMENT_RANK, int(np.sum(sv > 1e-12 * max(sv[0], 1e-300))) or 1)
        R = (Vt[:keep].T * sv[:keep]).copy()
    return DrawMoments(shift, R, cross)


def node_interpolation(t, table):
    """``table`` at the axis coordinates ``t`` (linear between :data:`NODES`, constant
    beyond), summed over the axes.

    Parameters
    ----------
    t : TensorVariable
        ``(draws, n)`` coordinates along q(h)'s axes, in its standard deviations.
    table : TensorVariable
        ``(n, len(NODES), d)``.

    Returns
    -------
    TensorVariable
        ``(draws, d)``.
    """
    pos = pt.clip(t, NODES[0], NODES[-1]) - NODES[0]
    i = pt.clip(pt.floor(pos), 0, len(NODES) - 2).astype("int64")
    frac = (pos - i)[..., None]
    axes = pt.arange(table.shape[0])[None, :]
    per_axis = table[axes, i] * (1.0 - frac) + table[axes, i + 1] * frac
    return pt.sum(per_axis, axis=1)


def _block_covariance(L):
    """``(L L^T)^{-1}`` for a stack of lower Cholesky factors of precisions."""
    eye = np.broadcast_to(np.eye(L.shape[-1]), L.shape)
    Li = np.linalg.solve(L, eye)  # L^{-1}
    return np.swapaxes(Li, -1, -2) @ Li


def table_transform(eps, table):
    """``T_j(e_j)`` for draws ``eps`` of shape ``(draws, n)`` (linear interpolation, symbolic)."""
    lo, step = EPS_GRID[0], EPS_GRID[1] - EPS_GRID[0]
    pos = (pt.clip(eps, EPS_GRID[0], EPS_GRID[-1]) - lo) / step
    i = pt.clip(pt.floor(pos), 0, EPS_GRID.size - 2).astype("int64")
    frac = pos - i
    cols = pt.arange(table.shape[0])[None, :]
    return table[cols, i] * (1.0 - frac) + table[cols, i + 1] * frac
