r"""A skewed marginal for the hyperparameters: profile slices along q(h)'s axes.

The fit's q(h) is Gaussian in PyMC's unconstrained space with the curvature of
the bound with q(w) eliminated to first order (the linear response). Its
group-level scales are usually skewed in log space (a long tail towards 0),
which the Gaussian misses. As INLA does, the correction evaluates the profile
``L(h) = max_{q(w)} bound(q(w), h)`` (:class:`ConditionalProfile`: q(w | h)
re-fitted by natural steps with ``rho = 1`` until the bound settles): first
its curvature at the centre of q(h) by finite differences, which replaces the
linear response's (a Schur complement that loses its accuracy where ``h`` and
q(w) are strongly coupled), then its values along each principal axis of that
Gaussian at ``z = -4, ..., 4`` standard deviations, whose interpolated 1-D
densities become independent marginals of the axis coordinates.

The correction is applied only when the profile along the axes agrees with
the curvature at the centre (second difference at ``z = +-1`` within
``SETTINGS.curvature_range`` on every axis) and all values are finite;
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

With one or two coordinates the draws of ``h`` and its moments come from the
profile on a grid instead (:mod:`pymc_mcssvi.posterior.profile_grid`), which
follows tails and ridges the axes' slices leave out; the axis marginal's
directions still key the view's tables, and the moments of the Gaussian
globals' draws come from q(w | h) re-fitted at the grid's nodes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytensor.tensor as pt
from scipy.interpolate import PchipInterpolator
from scipy.linalg import solve_triangular
from scipy.special import ndtr

from pymc_mcssvi.algorithms.state import QState
from pymc_mcssvi.families.gaussian import GaussianBlocks, natural_step, natural_step_gain
from pymc_mcssvi.posterior.settings import SETTINGS

__all__ = [
    "AXIS_POINTS",
    "profile_scales",
    "volume_corrections",
    "corrected_axis_values",
    "EPS_GRID",
    "AxisMarginal",
    "axis_skew",
    "NODES",
    "averaged_view_factors",
    "DataCoordinates",
    "data_coordinates",
    "sensitivity_log_scales",
    "axis_marginal",
    "ConditionalProfile",
    "Refit",
    "conditional_mean_table",
    "DrawMoments",
    "draw_moments",
    "node_interpolation",
    "axis_node_table",
    "off_axis_nodes",
    "within_axis_range",
    "grid_nodes",
    "node_table_points",
    "grid_interpolation",
    "refit_graph",
    "table_transform",
]

#: Points along each axis, in standard deviations of the linear-response q(h).
AXIS_POINTS = np.array([-4.0, -3.0, -2.0, -1.0, 1.0, 2.0, 3.0, 4.0])
#: The same points with the centre, in order (unit spacing).
NODES = np.arange(-4.0, 5.0)
#: Index of the centre (0) in :data:`NODES`.
CENTRE_AT = int(np.flatnonzero(NODES == 0.0)[0])
#: Grid of the standard-normal argument of the tabulated axis transforms.
EPS_GRID = np.linspace(-8.0, 8.0, 801)
#: Most hyperparameter coordinates that get the correction: its profile costs
#: ``n (n + 1) + 8 n`` re-fits. Read by :mod:`pymc_mcssvi.pymc.inference` at import (a
#: constant until that module reads :data:`~pymc_mcssvi.posterior.settings.SETTINGS`).
MAX_CORRECTED_HYPERS = 8


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


def refit_graph(
    bound, spec, like: QState, project: bool = True, gain: bool = False, sensitivity: bool = False
):
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

    ``bound`` is the fit's :class:`~pymc_mcssvi.bounds.structured.StructuredBound`,
    ``spec`` its hyperparameters' :class:`~pymc_mcssvi.algorithms.hyperparameters.HyperSpec`
    and ``like`` a q(w) state whose variables give the means' and factors' types.
    """
    rho = pt.scalar("refit_rho", dtype="float64")
    means = [m.type(f"refit_mean_{s}") for s, m in enumerate(like.means)]
    factors = [f.type(f"refit_factor_{s}") for s, f in enumerate(like.factors)]
    states = [GaussianBlocks(m, f) for m, f in zip(means, factors, strict=True)]
    ev = bound.evaluate(states)
    # as in the fit's step: non-finite derivatives (far out along q(h)'s axes) must not
    # reach the projection's eigendecomposition, which raises; the step's bound is then
    # not finite and the re-fit backs off
    grads = [pt.switch(pt.isfinite(g), g, 0.0) for g in ev.grads]
    hessians = [pt.switch(pt.isfinite(H), H, 0.0) for H in ev.hessians]
    new = [
        natural_step(st, g, H, rho, project=project)
        for st, g, H in zip(states, grads, hessians, strict=True)
    ]
    inputs = [*spec.values, rho, *means, *factors]
    outputs = [ev.value, *[st.mean for st in new], *[st.factor for st in new]]
    if gain:
        outputs.append(
            sum(natural_step_gain(st, nw, g) for st, nw, g in zip(states, new, grads, strict=True))
        )
    if sensitivity:
        outputs.extend(bound.sensitivities(len(states)))
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
    terms, and it understates the precision. Here the profile is evaluated
    directly: at each point q(w | h) starts from the linear response (or from a
    neighbouring point's re-fit) and takes natural steps with ``rho = 1``
    until the bound stops changing (``SETTINGS.refit_tol``, see :meth:`refit`);
    a single step is exact for a Gaussian likelihood only, and leaves the
    profile low elsewhere, most so in the tails.

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
        (kept for the later steps), at most ``SETTINGS.max_refit_halvings`` times
        in a row. At most ``SETTINGS.max_refit_steps`` evaluations. The re-fit stops
        when the last step gained at most ``SETTINGS.refit_tol`` (relative), or
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
        for _ in range(SETTINGS.max_refit_steps):
            out = self.step(h, rho, means, factors)
            value, new_means, new_factors = out[:3]
            value = float(value)
            predicted = float(out[3]) if len(out) > 3 else np.inf
            sensitivity = out[4] if len(out) > 4 else None
            if retry:  # ``best`` again: take its shorter step
                means, factors, retry = new_means, new_factors, False
                continue
            if not np.isfinite(value) or (best is not None and value < best.value):
                if best is None or halvings == SETTINGS.max_refit_halvings:
                    break
                rho, halvings, retry = 0.5 * rho, halvings + 1, True
                means, factors = best.means, best.factors
                continue
            gain = np.inf if best is None else value - best.value
            steps = 0 if best is None else best.steps + 1
            best = Refit(value, means, factors, steps, sensitivity)
            tol = SETTINGS.refit_tol * (abs(value) + 10.0)
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
        outside ``SETTINGS.curvature_range``, the curvature at the centre
        mis-states the axis's width (as for confounded effects), and the axis's
        scale is set to the one that difference gives and the ``+-1`` points
        taken again (at most ``SETTINGS.max_axis_rescales`` times).

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
            for attempt in range(SETTINGS.max_axis_rescales + 1):
                axis = np.asarray(directions)[:, j] * scales[j]
                ones = {
                    z: self.refit(
                        self.mean + z * axis, *self.start(self.mean + z * axis, centre, self.mean)
                    )
                    for z in (-1.0, 1.0)
                }
                curvature = 2.0 * centre.value - ones[-1.0].value - ones[1.0].value
                lo, hi = SETTINGS.curvature_range
                if not (np.isfinite(curvature) and curvature > 0) or lo <= curvature <= hi:
                    break
                if attempt == SETTINGS.max_axis_rescales:
                    break  # the scale the points were taken at (it was changed once more)
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


def axis_skew(marginal: AxisMarginal) -> float:
    """Largest departure of an axis marginal from q(h)'s Gaussian: the larger of
    ``|mean|`` and ``|sd - 1|`` over the axes, in the axes' standard deviations (from
    the quadrature weights at the centre and :data:`AXIS_POINTS`).

    Examples
    --------
    >>> import numpy as np
    >>> z = np.r_[0.0, AXIS_POINTS]
    >>> w = np.exp(-0.5 * np.vstack([z, z - 0.3]) ** 2)  # the second axis moved by 0.3
    >>> am = AxisMarginal(None, None, None, None, None, None, w / w.sum(1, keepdims=True))
    >>> round(axis_skew(am), 2)
    0.3
    """
    z = np.r_[0.0, AXIS_POINTS]
    w = np.asarray(marginal.weights)
    mean = w @ z
    sd = np.sqrt(np.maximum(w @ z**2 - mean**2, 0.0))
    return float(max(np.max(np.abs(mean)), np.max(np.abs(sd - 1.0))))


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
    lo, hi = SETTINGS.curvature_range
    # A flat top (a small group scale's log: the likelihood bounds it on one side, its
    # shrinkage on the other) that has fallen by SETTINGS.flat_top_fall at the outermost
    # points on both sides, so the nodes hold its bulk: it has lighter tails than the
    # Gaussian of the centre's curvature, which would run far out.
    flat_top = (curvature >= 0.0) & (np.maximum(d[:, 0], d[:, -1]) <= -SETTINGS.flat_top_fall)
    if np.any(((curvature < lo) & ~flat_top) | (curvature > hi)):
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


def profile_scales(values, scales) -> np.ndarray:
    """Scales of the Gaussian that best fits the profile along each axis.

    The Gaussian q(h) kept when :func:`axis_marginal` refuses the axes' profile
    (its second difference at +-1 sd outside ``SETTINGS.curvature_range``) has the
    curvature of the profile at the centre, which can be far from its fall a
    few sds out (a flat top gives a Gaussian far too wide). Along each axis
    ``j`` the profile ``d(z)`` at :data:`AXIS_POINTS` (finite values within
    ``SETTINGS.profile_fit_fall`` nats of the centre) is fitted by ``-c_j z^2 / 2`` in
    least squares, and the axis's scale becomes ``scales_j / sqrt(c_j)``; an
    axis with no such value, or a fit that does not fall, keeps its scale.

    Parameters
    ----------
    values : array_like
        Profile at the centre, then at ``AXIS_POINTS`` along each axis in turn
        (the order of :func:`axis_marginal`).
    scales : array_like
        ``(n,)`` the scales the axes' points were taken at.

    Examples
    --------
    A profile that falls as a Gaussian of half the assumed sd on the first axis;
    the second axis has no finite value:

    >>> import numpy as np
    >>> vals = np.r_[0.0, -2.0 * AXIS_POINTS**2, np.full(len(AXIS_POINTS), -np.inf)]
    >>> profile_scales(vals, np.ones(2)).round(6).tolist()
    [0.5, 1.0]
    """
    values = np.asarray(values, dtype="float64")
    scales = np.asarray(scales, dtype="float64")
    d = (values[1:] - values[0]).reshape(len(scales), len(AXIS_POINTS))
    z2 = AXIS_POINTS**2
    out = scales.copy()
    for j in range(len(scales)):
        use = np.isfinite(d[j]) & (d[j] >= -SETTINGS.profile_fit_fall)
        c = -2.0 * (d[j, use] @ z2[use]) / (z2[use] @ z2[use]) if use.any() else 0.0
        if np.isfinite(values[0]) and c > 0:
            out[j] = scales[j] / np.sqrt(c)
    return out


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
    that width), unless scaling each coordinate fits the re-fitted covariances
    worse than the plain average (:func:`_scaling_misfits`; the ratios are then 0).

    The covariances are averaged in the coordinates the data see: each
    coordinate scaled by how strongly it moves the likelihoods' predictors at
    that point relative to the centre (the column norms of the predictor's
    Jacobian: ``sigma / sigma_centre`` for a non-centered ``z`` in ``sigma z``,
    1 for a centered effect, whose prior is what changes). For non-centered effects of
    two crossed factors the data fix ``sigma_1 z_1 + sigma_2 z_2`` on rows that
    share both: in ``z`` that tight direction turns with the scales, and an
    average of the ``z`` covariances is wide along every turned copy of it; in the
    data's coordinates it stays put.

    Parameters
    ----------
    weights : np.ndarray
        ``AxisMarginal.weights``, ``(n, 1 + len(AXIS_POINTS))``.
    factors : list of list of np.ndarray
        Per profile point (the centre, then ``AXIS_POINTS`` along each axis in
        turn), per segment, the ``(R, K, K)`` lower precision Cholesky factors.
    log_scales : list of list of np.ndarray, optional
        At the same points, per segment, the ``(R, K)`` log column norms of the
        predictor's Jacobian relative to the centre's (:func:`data_coordinates`);
        ``None`` averages the covariances as they are.

    Returns
    -------
    (list of np.ndarray, list of np.ndarray) or None
        Per segment: the lower Cholesky factor of the inverse averaged
        covariance (in the data's coordinates: the draws' noise before
        scaling), and the log ratios of the data coordinates' conditional sds
        at :data:`NODES` along each axis, ``(n, len(NODES), R, K)``, relative to
        the centre (axis 0 also carrying ``log(sd_centre / sd_avg)``): a draw's
        noise is that factor's, scaled by ``exp(sum_j T_j(t_j) - LS(h))`` with
        ``LS(h)`` the log scales of the data's coordinates at the draw
        (:func:`noise_moment_factors` gives the covariance of the result).
        ``None`` when a result is not positive definite or not finite. Axes
        combine additively around the centre: ``S_c + sum_j (E_j[S] - S_c)``.

    Examples
    --------
    Conditional variances 1 at the centre and 4 at every other point of one
    axis, half of the weight at the centre: the average is 2.5.

    >>> import numpy as np
    >>> w = np.r_[0.5, np.full(8, 0.5 / 8)][None]
    >>> f = [[np.ones((1, 1, 1))]] + [[np.full((1, 1, 1), 0.5)]] * 8
    >>> L, log_ratio = averaged_view_factors(w, f)
    >>> var = lambda L: round(float(1 / L[0][0, 0, 0] ** 2), 12)
    >>> var(L), round(float(np.exp(2 * log_ratio[0][0, 4, 0, 0])), 12)
    (2.5, 0.4)

    A non-centered ``z`` whose scale is twice the centre's at every other point:
    its squared column norm is 4x and its conditional variance 1/4 there. The
    data see one variance throughout, so the average is the centre's, and so
    are the data coordinate's sds along the axis.

    >>> f = [[np.ones((1, 1, 1))]] + [[np.full((1, 1, 1), 2.0)]] * 8
    >>> ls = [[np.zeros((1, 1))]] + [[np.full((1, 1), np.log(2.0))]] * 8
    >>> L, log_ratio = averaged_view_factors(w, f, ls)
    >>> var(L), round(float(np.exp(2 * log_ratio[0][0, 5, 0, 0])), 12)
    (1.0, 1.0)
    """
    n, per_axis = weights.shape[0], weights.shape[1] - 1
    if len(factors) != 1 + n * per_axis:
        raise ValueError(f"expected {1 + n * per_axis} profile points, got {len(factors)}")
    out, ratios = [], []
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
            L = _precision_factor(avg)
        except np.linalg.LinAlgError:
            return None
        var_avg = np.diagonal(avg, axis1=-2, axis2=-1)
        log_sds = [0.5 * np.log(np.diagonal(c, axis1=-2, axis2=-1)) for c in covs]
        ratio = np.empty((n, len(NODES), *var_avg.shape))
        for j in range(n):
            along = log_sds[1 + j * per_axis : 1 + (j + 1) * per_axis]
            along.insert(CENTRE_AT, log_sds[0])
            ratio[j] = np.stack(along) - log_sds[0]
        # the axes multiply the centre's sd; the average over them is the averaged sd
        ratio[0] += log_sds[0] - 0.5 * np.log(var_avg)
        if not (np.all(np.isfinite(L)) and np.all(np.isfinite(ratio))):
            return None
        # The per-coordinate scaling is dropped only where no data coordinate's scale
        # moves with h (centered effects; with non-centered ones it carries ``z``'s width
        # where its scale is small, which the misfits misjudge), where it is clearly
        # wrong on average and no scaling fits the re-fits better both at each point and
        # on average.
        if not any(np.any(np.abs(ls) > 1e-8) for ls in seg_scales):
            with np.errstate(all="ignore"):
                # log det of each point's covariance, from its factor
                logdets = [
                    -2.0 * np.sum(np.log(np.abs(np.diagonal(f[s], axis1=-2, axis2=-1))), -1)
                    for f in factors
                ]
                prec = L @ np.swapaxes(L, -1, -2)  # avg^{-1}, from its factor
                fit = (weights, covs, logdets, avg, prec)
                scaled = _scaling_misfits(*fit, ratio)
                plain = _scaling_misfits(*fit, np.zeros_like(ratio))
            if (
                all(np.isfinite(plain))
                and scaled[1] > SETTINGS.max_scaling_misfit
                and plain[0] < scaled[0]
                and plain[1] < scaled[1]
            ):
                ratio = np.zeros_like(ratio)
        out.append(L)
        ratios.append(ratio)
    return out, ratios


def _point_log_scales(weights, ratio):
    """Per profile point (the centre, then ``AXIS_POINTS`` along each axis in turn): its
    axis (``None`` at the centre), its weight in the axis marginal and the log sd ratios
    ``log D`` that the draws' noise gets there from ``ratio``."""
    n, per_axis = weights.shape[0], weights.shape[1] - 1
    at_centre = ratio[:, CENTRE_AT].sum(axis=0)
    yield None, weights[:, 0], at_centre
    for j in range(n):
        for i in range(per_axis):
            node = i if i < CENTRE_AT else i + 1  # AXIS_POINTS skip the centre
            yield j, weights[j, 1 + i], at_centre - ratio[j, CENTRE_AT] + ratio[j, node]


def _kl(C, S):
    """``KL(N(0, C) || N(0, S))`` summed over a stack of blocks; NaN unless both are
    positive definite."""
    try:
        L_C, L_S = np.linalg.cholesky(C), np.linalg.cholesky(S)
    except np.linalg.LinAlgError:
        return np.nan
    k = C.shape[-1]
    # tr(S^{-1} C) = ||L_S^{-1} L_C||_F^2 (a triangular solve); log dets from the factors
    trace = np.sum(_lower_solve(L_S, L_C) ** 2, axis=(-2, -1))
    logdet_S, logdet_C = (
        2.0 * np.sum(np.log(np.diagonal(f, axis1=-2, axis2=-1)), axis=-1) for f in (L_S, L_C)
    )
    return 0.5 * float(np.sum(trace - k + logdet_S - logdet_C))


def _scaling_misfits(weights, covs, logdets, avg, prec, ratio):
    """How far the draws' noise ``D avg D`` (``D`` the sd ratios ``ratio`` put together
    along the axes) is from the re-fitted conditional covariances ``C_p`` of the profile
    points: ``(pointwise, averaged)``.

    *pointwise*: ``KL(N(0, C_p) || N(0, D avg D))``, summed over the blocks and averaged
    with the axis marginal's weights (the shape of q(w | h) at each ``h``); from
    ``prec = avg^{-1}`` and the points' log determinants ``logdets``, without a
    factorization per point.
    *averaged*: ``KL(N(0, E[C_p]) || N(0, E[D avg D]))``, averaged over the axes as
    :func:`averaged_view_factors` averages: the conditional part of the draws'
    covariance, which the draws' marginals show.

    Used where the data's coordinates do not move with ``h``, so that these
    covariances are also q(w)'s own.
    """
    n, k = weights.shape[0], avg.shape[-1]
    logdet_avg = np.linalg.slogdet(avg)[1]
    pointwise = 0.0
    target = [np.zeros_like(avg) for _ in range(n + 1)]
    model = [np.zeros_like(avg) for _ in range(n + 1)]
    for p, (axis, w, log_d) in enumerate(_point_log_scales(weights, ratio)):
        inv_d = np.exp(-log_d)
        trace = np.einsum(
            "...ab,...ab->...", prec * inv_d[..., :, None] * inv_d[..., None, :], covs[p]
        )
        kl = 0.5 * float(np.sum(trace - k + logdet_avg + 2.0 * log_d.sum(-1) - logdets[p]))
        noise = avg * np.exp(log_d[..., :, None] + log_d[..., None, :])
        if axis is None:  # the centre: its own term, and its share of each axis's average
            pointwise += float(np.sum(w)) * kl
            target[n], model[n] = covs[p], noise
            for j in range(n):
                target[j] += w[j] * target[n]
                model[j] += w[j] * model[n]
        else:
            pointwise += w * kl
            target[axis] += w * covs[p]
            model[axis] += w * noise
    # additive over the axes around the centre, as the averaged covariance itself
    T = target[n] + sum(target[j] - target[n] for j in range(n))
    M = model[n] + sum(model[j] - model[n] for j in range(n))
    return pointwise / n, _kl(
        0.5 * (T + np.swapaxes(T, -1, -2)), 0.5 * (M + np.swapaxes(M, -1, -2))
    )


class MomentGrid(NamedTuple):
    """Points of the axis marginal where the draws' moments are computed.

    Attributes
    ----------
    nodes : np.ndarray
        ``(G, n)`` positions in :data:`NODES` of each point's axis coordinates.
    t : np.ndarray
        ``(G, n)`` the coordinates (in sds along q(h)'s axes).
    h : np.ndarray
        ``(G, n_h)`` the hyperparameters there (``centre + V diag(s) t``).
    p : np.ndarray
        ``(G,)`` weights (products of the axes' node weights, summing to 1).
    """

    nodes: np.ndarray
    t: np.ndarray
    h: np.ndarray
    p: np.ndarray


def moment_grid(marginal: AxisMarginal, centre_h, size: int) -> MomentGrid:
    """The tensor grid of the axis marginal's nodes (independent axes), or equally
    weighted draws from it (at most ``SETTINGS.max_moment_draws``) when ``9^n`` points
    times ``size`` coordinates exceed ``SETTINGS.max_moment_grid``.

    Examples
    --------
    >>> import numpy as np
    >>> am = AxisMarginal(np.eye(2), np.ones(2), None, np.zeros(2), None, None,
    ...                   np.tile(np.r_[0.5, np.full(8, 0.5 / 8)], (2, 1)))
    >>> grid = moment_grid(am, np.zeros(2), 3)
    >>> grid.p.shape, round(float(grid.p.sum()), 12), float(grid.p.max())
    ((81,), 1.0, 0.25)
    """
    z = np.r_[0.0, AXIS_POINTS]
    order = np.array([int(np.flatnonzero(NODES == zk)[0]) for zk in z])
    weights = np.asarray(marginal.weights)
    n = weights.shape[0]
    if len(z) ** n * size <= SETTINGS.max_moment_grid:
        points = np.indices((len(z),) * n).reshape(n, -1).T
        p = np.prod(weights[np.arange(n), points], axis=1)
    else:
        rng = np.random.default_rng(0)
        m = int(max(min(SETTINGS.max_moment_grid // max(size, 1), SETTINGS.max_moment_draws), 1))
        points = np.column_stack([rng.choice(len(z), size=m, p=weights[j]) for j in range(n)])
        p = np.full(m, 1.0 / m)
    t = z[points]
    h = np.asarray(centre_h) + (t * marginal.scales) @ np.asarray(marginal.directions).T
    return MomentGrid(order[points], t, h, p)


def grid_nodes(n: int) -> np.ndarray:
    """``(len(NODES)^n, n)`` node indices of every point of the tensor grid of
    :data:`NODES` along ``n`` axes, in row-major order (the rows of the tables
    :func:`grid_interpolation` reads)."""
    return np.indices((len(NODES),) * n).reshape(n, -1).T


def node_table_points(marginal: AxisMarginal, centre_h, nodes=None) -> np.ndarray:
    """The hyperparameters at points of the tensor grid of :data:`NODES` along q(h)'s
    axes: at ``nodes`` (``(m, n)`` node indices per axis), by default at every point,
    ``(len(NODES)^n, n_h)`` in row-major order (the rows of the tables
    :func:`grid_interpolation` reads)."""
    n = len(marginal.scales)
    if nodes is None:
        nodes = grid_nodes(n)
    t = NODES[np.asarray(nodes)]
    return np.asarray(centre_h) + (t * marginal.scales) @ np.asarray(marginal.directions).T


def axis_node_table(axis_values) -> np.ndarray:
    """``(n, len(NODES), size)``: a function that is 0 at the centre and adds up across
    q(h)'s axes, at :data:`NODES` along each axis, from its values at the profile
    points (``axis_values``: the centre, then :data:`AXIS_POINTS` along each axis in
    turn, each ``(size,)``). :func:`node_interpolation` sums it over the axes; it
    holds ``9 n`` rows where the tensor grid holds ``9^n``.

    Examples
    --------
    >>> import numpy as np
    >>> vals = [np.zeros(1)] + [np.array([z]) for z in AXIS_POINTS] + [
    ...     np.array([10 * z]) for z in AXIS_POINTS]
    >>> table = axis_node_table(vals)
    >>> nodes = np.array([[0, 8], [4, 6]])  # t = (-4, 4) and (0, 2)
    >>> table[np.arange(2), nodes].sum(axis=1)[:, 0].tolist()
    [36.0, 20.0]
    """
    size = np.shape(axis_values[0])[-1]
    per_axis = len(AXIS_POINTS)
    n = (len(axis_values) - 1) // per_axis
    table = np.zeros((n, len(NODES), size))
    for j in range(n):
        along = list(axis_values[1 + j * per_axis : 1 + (j + 1) * per_axis])
        along.insert(CENTRE_AT, np.zeros(size))
        table[j] = np.stack(along)
    return table


def off_axis_nodes(n: int) -> np.ndarray:
    """``(m, n)`` node indices of the points at ``+-2`` sds on every pair of axes: where a
    function that adds up across the axes is checked."""
    out = []
    for j in range(n):
        for k in range(j + 1, n):
            for a in (-2, 2):
                for b in (-2, 2):
                    idx = [CENTRE_AT] * n
                    idx[j], idx[k] = CENTRE_AT + a, CENTRE_AT + b
                    out.append(idx)
    return np.asarray(out, dtype="int64").reshape(-1, n)


def volume_corrections(axis_values, corner_values) -> np.ndarray:
    """Log volume of the other axes along each axis, at ``-2`` and ``+2`` sds: ``(n, 2)``.

    The axis marginals of :func:`axis_marginal` are slices of the profile
    ``L(t)`` through the centre; the marginal of ``t_j`` integrates ``exp(L)``
    over the other axes, whose spread can change along ``t_j``. Laplace's
    approximation in each other axis ``k`` (its curvature ``c_k`` from the second
    difference at ``t_k = +-2``) gives the slice's correction ``-1/2 sum_k
    log(c_k(t_j) / c_k(0))``, computed at ``t_j = +-2`` from the profile at the
    corners ``(t_j, t_k) = (+-2, +-2)`` (:func:`off_axis_nodes`). It is 0 where the
    profile adds up across the axes (independent group scales), and it moves what
    slices miss: the sds of an LKJ covariance, whose correlations are freer at
    larger sds, which the slices put low. A pair
    whose curvature is not positive at a corner adds nothing; each correction
    is capped at ``SETTINGS.volume_cap`` nats.

    Parameters
    ----------
    axis_values : np.ndarray
        ``(n, len(AXIS_POINTS))`` the profile along the axes, relative to the centre.
    corner_values : np.ndarray
        The profile relative to the centre at the :func:`off_axis_nodes` points.

    Examples
    --------
    ``L = -t_1^2 / 2 - exp(b t_1) t_2^2 / 2``: the marginal of ``t_1`` is its slice
    times ``exp(-b t_1 / 2)``:

    >>> import numpy as np
    >>> b = 0.3
    >>> L = lambda t1, t2: -0.5 * t1**2 - 0.5 * np.exp(b * t1) * t2**2
    >>> d = np.array([L(AXIS_POINTS, 0.0), L(0.0, AXIS_POINTS)])
    >>> corners = np.array([L(*NODES[i]) for i in off_axis_nodes(2)])
    >>> volume_corrections(d, corners)[0].round(6).tolist()
    [0.3, -0.3]
    """
    d = np.asarray(axis_values, dtype="float64")
    n = d.shape[0]
    at = {z: i for i, z in enumerate(AXIS_POINTS)}
    value = {}  # (j, k, t_j, t_k) for j < k
    for idx, v in zip(off_axis_nodes(n), np.asarray(corner_values, dtype="float64"), strict=True):
        t = NODES[idx]
        j, k = np.flatnonzero(t)
        value[j, k, t[j], t[k]] = v
    out = np.zeros((n, 2))
    for j in range(n):
        for side, a in enumerate((-2.0, 2.0)):
            total = 0.0
            for k in range(n):
                if k == j:
                    continue
                pair = [value[j, k, a, b] if j < k else value[k, j, b, a] for b in (-2.0, 2.0)]
                c_at = -(pair[0] + pair[1] - 2.0 * d[j, at[a]]) / 4.0
                c_0 = -(d[k, at[-2.0]] + d[k, at[2.0]]) / 4.0
                if np.isfinite(c_at) and np.isfinite(c_0) and c_at > 0 and c_0 > 0:
                    total -= 0.5 * np.log(c_at / c_0)
            out[j, side] = np.clip(total, -SETTINGS.volume_cap, SETTINGS.volume_cap)
    return out


def corrected_axis_values(values, corrections) -> np.ndarray:
    """Profile values (the order of :func:`axis_marginal`) plus the other axes' log
    volume (:func:`volume_corrections`): linear in ``t`` out to ``+-2`` sds on each
    side of the centre (exact where the other axes' log curvatures are), and held
    at its value there beyond, where the corners say nothing (extrapolated
    linearly, it over-widens heavy-tailed scales).

    Examples
    --------
    >>> import numpy as np
    >>> v = corrected_axis_values(np.zeros(1 + len(AXIS_POINTS)), np.array([[0.3, -0.3]]))
    >>> v[1:].round(2).tolist()  # at AXIS_POINTS -4 .. 4
    [0.3, 0.3, 0.3, 0.15, -0.15, -0.3, -0.3, -0.3]
    """
    values = np.asarray(values, dtype="float64")
    c = np.asarray(corrections, dtype="float64")
    z = AXIS_POINTS
    w = np.minimum(np.abs(z), 2.0) / 2.0
    delta = np.where(z < 0, c[:, :1] * w, c[:, 1:] * w)
    return np.r_[values[0], values[1:] + delta.ravel()]


def within_axis_range(table, n: int) -> np.ndarray:
    """``table`` (rows: the tensor grid of :data:`NODES` along ``n`` axes, as
    :func:`grid_interpolation` reads it) with each column clipped to its range on
    the axes (the rows with at most one coordinate off the centre).

    The conditional view's draws follow the log scales of the data's coordinates
    where those do not add up across q(h)'s axes (an HSGP's spectral density);
    the rule is exact while the data determine a coordinate, and the conditional
    means it is paired with come from re-fits along the axes only. Off the axes
    the log scales can run far beyond them (an HSGP's high frequencies at a long
    lengthscale and a small amplitude), where the prior, not the data, holds the
    coefficient: unclipped, a few draws would run orders of magnitude past the
    prior.

    Examples
    --------
    >>> import numpy as np
    >>> k = len(NODES)
    >>> t = NODES[np.indices((k, k)).reshape(2, -1).T]
    >>> table = (t[:, 0] * t[:, 1] + t[:, 0])[:, None]  # the product: off the axes only
    >>> out = within_axis_range(table, 2)
    >>> float(table.max()), float(out.max()), float(out.min())
    (20.0, 4.0, -4.0)
    """
    table = np.asarray(table)
    on_axes = (grid_nodes(n) != CENTRE_AT).sum(axis=1) <= 1
    return np.clip(table, table[on_axes].min(axis=0), table[on_axes].max(axis=0))


def grid_interpolation(t, table, n: int):
    """Multilinear interpolation of ``table`` (rows: the tensor grid of :data:`NODES`
    along the ``n`` axes, row-major, see :func:`node_table_points`) at the axis
    coordinates ``t`` (``(draws, n)``, constant beyond the grid), symbolic.

    Examples
    --------
    >>> import numpy as np, pytensor.tensor as pt
    >>> pts = NODES[np.indices((9, 9)).reshape(2, -1).T]
    >>> table = (pts[:, 0] * pts[:, 1] + pts[:, 0])[:, None]  # bilinear: exact
    >>> t = np.array([[0.3, -1.7], [2.5, 3.25]])
    >>> out = grid_interpolation(pt.as_tensor(t), pt.as_tensor(table), 2).eval()
    >>> bool(np.allclose(out[:, 0], t[:, 0] * t[:, 1] + t[:, 0]))
    True
    """
    k = len(NODES)
    pos = pt.clip(t, NODES[0], NODES[-1]) - NODES[0]
    i = pt.clip(pt.floor(pos), 0, k - 2).astype("int64")
    frac = pos - i
    strides = k ** np.arange(n - 1, -1, -1)
    base = pt.sum(i * strides[None, :], axis=1)[:, None]  # the cell's lowest corner
    corners = np.indices((2,) * n).reshape(n, -1).T
    parts = []
    # the 2^n corners in blocks (one gather of (draws, block, d) each): a sum of one
    # term per corner became one Add node of 2^n operands, which PyTensor's Python
    # VM refuses above 32 (5 axes)
    for start in range(0, len(corners), SETTINGS.corner_block):
        c = corners[start : start + SETTINGS.corner_block]
        weight = pt.prod(pt.where(c[None], frac[:, None, :], 1.0 - frac[:, None, :]), axis=2)
        # clipped: a placeholder table (view not computed, its branch unused) has one row
        idx = pt.minimum(base + (c @ strides)[None, :], table.shape[0] - 1)
        parts.append(pt.sum(weight[:, :, None] * table[idx], axis=1))
    return parts[0] if len(parts) == 1 else pt.sum(pt.stack(parts), axis=0)


def noise_moment_factors(factors, sd_tables, grid: MomentGrid, log_scales, flat_maps):
    """Per segment, the lower Cholesky factor of the inverse covariance of the draws'
    noise averaged over the grid: ``E[exp(T_i + T_l - LS_i - LS_l)] S_il`` with ``S``
    the averaged covariance (``factors``), ``T`` the ``sd_tables``
    (:func:`averaged_view_factors`) at the grid's nodes and ``LS`` the data
    coordinates' log scales at its points (``(G, size)`` flat, ``log_scales``).
    The covariance ``std`` and ``cov`` report; ``None`` if not positive definite.

    Examples
    --------
    One coordinate whose sd follows ``1 / sigma`` (``log sigma = t``) around a
    data coordinate of variance 1: the moment is ``E[exp(-2 t)]`` on the grid.

    >>> import numpy as np
    >>> w = np.r_[0.5, np.full(8, 0.5 / 8)]
    >>> am = AxisMarginal(np.eye(1), np.ones(1), None, np.zeros(1), None, None, w[None])
    >>> grid = moment_grid(am, np.zeros(1), 1)
    >>> (L,) = noise_moment_factors([np.ones((1, 1, 1))], [np.zeros((1, len(NODES), 1, 1))],
    ...                             grid, grid.t, [np.zeros((1, 1), int)])
    >>> bool(np.isclose(1 / L[0, 0, 0] ** 2, w @ np.exp(-2 * np.r_[0.0, AXIS_POINTS])))
    True
    """
    n = grid.nodes.shape[1]
    out = []
    for L, table, idx in zip(factors, sd_tables, flat_maps, strict=True):
        idx = np.asarray(idx)
        T = sum(table[j, grid.nodes[:, j]] for j in range(n))  # (G, R, K)
        e = np.exp(T - np.asarray(log_scales)[:, idx])
        second = np.einsum("g,grk,grl->rkl", grid.p, e, e)
        S = _block_covariance(L) * second
        try:
            L_mom = _precision_factor(S)
        except np.linalg.LinAlgError:
            return None
        if not np.all(np.isfinite(L_mom)):
            return None
        out.append(L_mom)
    return out


class DataCoordinates(NamedTuple):
    """How the data's coordinates ``u = s(h) w`` of q(w) move along q(h)'s profile.

    Attributes
    ----------
    log_scales : list of list of np.ndarray
        Per re-fit (the centre first), per segment, ``log s`` relative to the
        centre, ``(R, K)`` (:func:`sensitivity_log_scales`).
    held : list of np.ndarray
        Per segment, the coordinates the data move at all (the others have
        ``s = 1``).
    follows : list of np.ndarray
        Per segment, the coordinates whose conditional means follow ``s``
        (see :func:`data_coordinates`).
    """

    log_scales: list
    held: list
    follows: list

    def mean_log_scales(self):
        """``log_scales`` where the means follow them, 0 elsewhere."""
        return [
            [ls * f for ls, f in zip(point, self.follows, strict=True)] for point in self.log_scales
        ]


def data_coordinates(refits) -> DataCoordinates | None:
    """Per re-fit, per segment, the log scales of the data's coordinates relative to the centre.

    :func:`sensitivity_log_scales` of the re-fits' ``sensitivity`` (the first
    re-fit is the centre); ``None`` if a re-fit lacks it. For the draws' means
    (``follows``) a coordinate whose log scale changes
    by more than ``SETTINGS.max_mean_log_scale`` keeps them only if its re-fitted
    means fit ``m_k = m_0 exp(-ls_k)`` (data-held: a non-centered ``z`` moves
    like ``1 / sigma``) at least as well as ``m_k = m_0`` (in the local sds,
    summed over the profile points); otherwise it stays in q(w)'s coordinates. A
    high-frequency basis coefficient of a Hilbert-space GP, whose column
    scales with its spectral density over orders of magnitude while the prior
    holds it, is such a coordinate. Smaller changes are kept without the check:
    the direction two crossed effects share is data-held even where each
    coordinate alone would fit ``m_0`` better. Past the same change a coordinate
    is data-held at all (``held``: its noise and covariance scale too) only if
    its re-fitted sds follow ``sd_k = sd_0 exp(-ls_k)`` at least as well as they
    stay put (in log sds, summed over the profile points): a prior-held
    coefficient whose scale moves would get far too wide draws. Covariances are
    averaged with the scales of the held coordinates.

    Examples
    --------
    A coordinate whose mean follows ``1 / sigma`` and one whose mean follows
    ``sigma^2``, both with columns ``sigma`` and sds ``1 / sigma`` (precision
    factors ``sigma``; at ``sigma`` 1, 30 and 60, log scales past
    ``SETTINGS.max_mean_log_scale``):

    >>> import numpy as np
    >>> f = lambda s: [s * np.eye(2)[None]]
    >>> sens = lambda s: [np.array([[s * s, s * s]])]
    >>> refits = [Refit(0.0, [np.array([[1.0, 1.0]])], f(1.0), 0, sens(1.0)),
    ...           Refit(0.0, [np.array([[1 / 30, 900.0]])], f(30.0), 0, sens(30.0)),
    ...           Refit(0.0, [np.array([[1 / 60, 3600.0]])], f(60.0), 0, sens(60.0))]
    >>> dc = data_coordinates(refits)
    >>> dc.follows[0].tolist(), [np.round(x[0], 3).tolist() for x in dc.mean_log_scales()]
    ([[True, False]], [[[0.0, 0.0]], [[3.401, 0.0]], [[4.094, 0.0]]])
    """
    if any(r.sensitivity is None for r in refits):
        return None
    nseg = len(refits[0].sensitivity)
    out = [[None] * nseg for _ in refits]
    held, follows = [], []
    grid = np.array([0.0, 1.0])[:, None, None, None]
    for s in range(nseg):
        sens = [np.asarray(r.sensitivity[s], dtype="float64") for r in refits]
        ls = np.stack(sensitivity_log_scales(sens))
        sd = np.stack(
            [
                np.sqrt(np.diagonal(_block_covariance(r.factors[s]), axis1=-2, axis2=-1))
                for r in refits
            ]
        )
        moderate = np.max(np.abs(ls), axis=0) <= SETTINGS.max_mean_log_scale
        # past SETTINGS.max_mean_log_scale a coordinate is data-held only if its re-fitted sds
        # follow the scale (sd_k = sd_0 exp(-ls_k)) at least as well as they stay put
        with np.errstate(invalid="ignore", divide="ignore"):
            log_sd = np.log(sd / sd[0])
            sd_misfit = np.stack([np.sum((log_sd + g * ls) ** 2, axis=0) for g in (0.0, 1.0)])
        sd_misfit = np.where(np.isfinite(sd_misfit), sd_misfit, np.inf)
        held.append(
            (sens[0] > SETTINGS.sensitivity_floor * (np.max(sens[0]) if sens[0].size else 0.0))
            & (moderate | (sd_misfit[1] <= sd_misfit[0]))
        )
        ls = np.where(held[-1], ls, 0.0)
        m = np.stack([np.asarray(r.means[s]) for r in refits])
        with np.errstate(invalid="ignore", over="ignore"):
            misfit = np.sum(((m - m[0] * np.exp(-grid * ls)) / sd) ** 2, axis=1)
        misfit = np.where(np.isfinite(misfit), misfit, np.inf)
        follows.append(held[-1] & (moderate | (misfit[1] <= misfit[0])))
        for i in range(len(refits)):
            out[i][s] = ls[i]
    return DataCoordinates(out, held, follows)


def sensitivity_log_scales(sensitivities, floor=None):
    """``log`` of how strongly each coordinate moves the predictors, relative to the centre.

    ``0.5 log(c_k / c_0)`` for the squared column norms ``c_k`` of the
    predictor's Jacobian at each point (``c_0`` at the centre): a coordinate
    that enters the predictor as ``sigma z`` has ``c_k / c_0 = (sigma_k /
    sigma_0)^2``. Zero where a norm is not positive or the centre's is below
    ``floor`` (default ``SETTINGS.sensitivity_floor``) times the segment's largest (no
    data move the coordinate).

    Examples
    --------
    >>> import numpy as np
    >>> c = [np.array([[4.0, 1.0, 0.0]]), np.array([[16.0, 1.0, 5.0]])]
    >>> [np.round(x, 4).tolist() for x in sensitivity_log_scales(c)]
    [[[0.0, 0.0, 0.0]], [[0.6931, 0.0, 0.0]]]
    """
    if floor is None:
        floor = SETTINGS.sensitivity_floor
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
    ``a`` over the draws of ``sigma`` (too wide and shifted). With two crossed or
    nested factors the data fix ``sb zb + sl zl``, and each ``z`` follows a
    product of both scales, which no sum of per-axis corrections in ``z``
    reproduces. In the data's coordinates ``u = s(h) w`` (``s`` the column
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
        (:func:`data_coordinates`); ``None``: ``s = 1``.

    Returns
    -------
    np.ndarray
        ``M``, ``(n_h, len(NODES), size)``: at each node the mean in the data's
        coordinates minus the centre's (axis 0 also carries the centre's offset
        from the fitted mean: the fitted q(w) optimizes the bound averaged over
        q(h), the centre's re-fit the bound at its mean).

    Examples
    --------
    One coordinate ``z`` whose re-fitted mean is ``exp(-h)`` (``1 / sigma``) and
    whose column norm is ``exp(h)``: in the data's coordinates it does not move.

    >>> import numpy as np
    >>> nodes = np.r_[0.0, AXIS_POINTS]
    >>> refits = [Refit(0.0, [np.exp(-np.array([[z]]))], [None], 0) for z in nodes]
    >>> ls = [[np.array([[z]])] for z in nodes]
    >>> M = conditional_mean_table(
    ...     refits, [np.ones((1, 1))], np.eye(1), np.ones(1),
    ...     [np.zeros((1, 1), dtype=int)], 1, ls)
    >>> bool(np.allclose(M, 0.0))
    True
    """

    def flat(blocks):
        out = np.zeros(size)
        for m, idx in zip(blocks, flat_maps, strict=True):
            out[np.asarray(idx).reshape(-1)] = np.asarray(m).reshape(-1)
        return out

    n = len(scales)
    centre = flat(refits[0].means)
    table = np.zeros((n, len(NODES), size))
    per_axis = len(AXIS_POINTS)
    for j in range(n):
        for k, z in enumerate(AXIS_POINTS):
            node = int(np.flatnonzero(NODES == z)[0])
            i = 1 + j * per_axis + k
            ls = np.zeros(size) if log_scales is None else flat(log_scales[i])
            table[j, node] = np.exp(ls) * flat(refits[i].means) - centre
    table[0] += centre - flat(fitted_means)
    return table


class DrawMoments(NamedTuple):
    """The moments of the Gaussian globals' draws' mean part under the axis marginal.

    With ``t_j`` the draws' coordinates along q(h)'s axes (``h - mu = sum_j
    scales_j t_j directions_j``), the draws are ``m + noise + g(h)``, ``g(h) =
    exp(-LS(h)) (m + sum_j M_j(t_j)) - m`` (:func:`conditional_mean_table`;
    ``LS`` the log scales of the data's coordinates at ``h``), the noise
    independent of ``g`` given ``h``. On :func:`moment_grid`'s points:

    * ``shift = E[g]``: the draws' mean is ``m + shift``;
    * ``R R^T = Cov(g)``: added to the noise's covariance;
    * ``cross = Cov(g, h)``: the cross-covariance with ``h``.
    """

    shift: np.ndarray
    R: np.ndarray
    cross: np.ndarray


def draw_moments(mean_table, grid: MomentGrid, log_scales, fitted, directions, scales):
    """The :class:`DrawMoments` of the mean table of :func:`conditional_mean_table`.

    ``log_scales`` (``(G, size)``) are the data coordinates' log scales at the
    grid's points, ``exp(-LS)`` the factor from those coordinates back to q(w)'s
    (zeros where the means do not follow them); ``directions`` and ``scales`` are
    q(h)'s axes.

    Examples
    --------
    A table that is 1 at the centre and 0 elsewhere, half of the weight at the
    centre: the mean moves by 1/2 and the variance grows by 1/4.

    >>> import numpy as np
    >>> table = np.zeros((1, len(NODES), 1))
    >>> table[0, 4, 0] = 1.0
    >>> am = AxisMarginal(np.eye(1), np.ones(1), None, np.zeros(1), None, None,
    ...                   np.r_[0.5, np.full(8, 0.5 / 8)][None])
    >>> grid = moment_grid(am, np.zeros(1), 1)
    >>> mom = draw_moments(table, grid, np.zeros((9, 1)), np.zeros(1), np.eye(1), np.ones(1))
    >>> float(mom.shift[0]), round(float((mom.R @ mom.R.T)[0, 0]), 12)
    (0.5, 0.25)

    A coordinate ``z = 1 / sigma`` (``log sigma = t``, its data coordinate fixed
    at 1) gets the moments of ``exp(-t)`` on the nodes:

    >>> mom = draw_moments(np.zeros((1, len(NODES), 1)), grid, grid.t, np.ones(1),
    ...                    np.eye(1), np.ones(1))
    >>> bool(np.isclose(1.0 + mom.shift[0], grid.p @ np.exp(-grid.t[:, 0])))
    True
    """
    fitted = np.asarray(fitted, dtype="float64")
    n = mean_table.shape[0]
    p = grid.p
    M = sum(mean_table[j, grid.nodes[:, j]] for j in range(n))
    g = np.exp(-np.asarray(log_scales)) * (fitted + M) - fitted  # (G, size)
    shift = p @ g
    gc = np.sqrt(p)[:, None] * (g - shift)
    tc = grid.t - p @ grid.t
    cross_t = gc.T @ (np.sqrt(p)[:, None] * tc)  # Cov(g, t), (size, n)
    cross = cross_t @ (np.asarray(directions) * scales).T
    if gc.shape[0] <= SETTINGS.max_moment_rank:
        R = gc.T
    else:
        _, sv, Vt = np.linalg.svd(gc, full_matrices=False)
        keep = min(SETTINGS.max_moment_rank, int(np.sum(sv > 1e-12 * max(sv[0], 1e-300))) or 1)
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


def _lower_solve(L, B):
    """``L^{-1} B`` for a stack of lower triangular ``L`` and right-hand sides ``B`` of
    the same shape.

    Few large blocks are solved as triangular (LAPACK ``trsm``, ten times faster than a
    general solve there); many small ones in one batched solve.
    """
    L, B = np.asarray(L), np.asarray(B)
    k = L.shape[-1]
    flat = L.reshape(-1, k, k)
    if k >= 32 and len(flat) <= 64:
        rhs = np.broadcast_to(B, L.shape).reshape(flat.shape)
        return np.stack(
            [solve_triangular(f, b, lower=True) for f, b in zip(flat, rhs, strict=True)]
        ).reshape(L.shape)
    return np.linalg.solve(L, np.broadcast_to(B, L.shape))


def _block_covariance(L):
    """``(L L^T)^{-1} = L^{-T} L^{-1}`` for a stack of lower Cholesky factors of
    precisions."""
    L = np.asarray(L)
    Li = _lower_solve(L, np.eye(L.shape[-1]))  # L^{-1}
    return np.swapaxes(Li, -1, -2) @ Li


def _precision_factor(S):
    """The lower Cholesky factor of ``S^{-1}`` for a stack of covariances ``S``, without
    forming the inverse.

    With ``J`` the reversal permutation and ``J S J = C C^T`` (Cholesky), ``S = U U^T``
    for the upper triangular ``U = J C J``, so ``S^{-1} = U^{-T} U^{-1}``, and ``U^{-T}
    = J C^{-T} J`` is lower triangular with a positive diagonal: the factor. Raises
    ``LinAlgError`` where ``S`` is not positive definite.

    Examples
    --------
    >>> import numpy as np
    >>> S = np.array([[4.0, 1.0], [1.0, 2.0]])
    >>> L = _precision_factor(S)
    >>> bool(np.allclose(L @ L.T @ S, np.eye(2)) and L[0, 1] == 0.0)
    True
    """
    rev = np.asarray(S)[..., ::-1, ::-1]
    # symmetrized: the Cholesky factorization reads one triangle
    C = np.linalg.cholesky(0.5 * (rev + np.swapaxes(rev, -1, -2)))
    return np.ascontiguousarray(
        np.swapaxes(_lower_solve(C, np.eye(C.shape[-1])), -1, -2)[..., ::-1, ::-1]
    )


def table_transform(eps, table):
    """``T_j(e_j)`` for draws ``eps`` of shape ``(draws, n)`` (linear interpolation, symbolic)."""
    lo, step = EPS_GRID[0], EPS_GRID[1] - EPS_GRID[0]
    pos = (pt.clip(eps, EPS_GRID[0], EPS_GRID[-1]) - lo) / step
    i = pt.clip(pt.floor(pos), 0, EPS_GRID.size - 2).astype("int64")
    frac = pos - i
    cols = pt.arange(table.shape[0])[None, :]
    return table[cols, i] * (1.0 - frac) + table[cols, i + 1] * frac
