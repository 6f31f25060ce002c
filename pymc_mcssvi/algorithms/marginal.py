r"""A skewed marginal for the hyperparameters: profile slices along q(h)'s axes.

The linear-response q(h) is Gaussian in PyMC's unconstrained space with the
curvature of the bound at its mean (a Laplace approximation of the profile
``L(h) = max_{q(w)} bound(q(w), h)``). A group-level scale's marginal is
usually skewed in log space (long tail towards 0): on the radon data the
Gaussian puts the posterior mean of ``sigma_county`` 26-32% above the exact
value. As INLA does, the correction evaluates the profile along each principal
axis of q(h) at ``z = -4, ..., 4`` standard deviations, with q(w) re-fitted at
every point (the linear response of its mean, then one natural step with
``rho = 1``: exact for a Gaussian likelihood), and uses the interpolated 1-D
densities along the axes as independent marginals of the axis coordinates.

The correction is applied only when the profile agrees with the curvature the
linear response found (second difference at ``z = +-1`` within
:data:`CURVATURE_RANGE` of 1 on every axis) and all values are finite;
otherwise the Gaussian is kept. Draws are ``h = mu + V diag(s) T(e)`` with
``e ~ N(0, I)`` and ``T`` the monotone map from standard normal to each axis
marginal (its quantile function at ``Phi(e)``), tabulated on a grid of ``e``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytensor.tensor as pt
from scipy.interpolate import PchipInterpolator
from scipy.special import ndtr

from pymc_mcssvi.families.gaussian import GaussianBlocks, natural_step

__all__ = [
    "AXIS_POINTS",
    "CURVATURE_RANGE",
    "EPS_GRID",
    "AxisMarginal",
    "NODES",
    "averaged_view_factors",
    "axis_marginal",
    "node_interpolation",
    "profile_graph",
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


def profile_graph(kernel):
    """Profile ``max_{q(w)} bound(q(w), h)`` as a graph of the hyperparameters' value variables.

    q(w) at ``h`` starts from the linear response of the fitted q(w),
    ``m + U (h - mu)``, and takes one natural step with ``rho = 1``; the bound
    is evaluated there (no q(h) entropy: ``h`` is a point). Returns
    ``(inputs, value, factors)`` with ``inputs`` the model's value variables of
    the hyperparameters (no graph replacement: cloning the bound's graph costs
    more than building it) and ``factors`` the precision Cholesky factors of
    the re-fitted q(w | h), one per segment (see :func:`averaged_view_factors`).
    """
    hyp = kernel.hypers
    spec = hyp.spec
    h = pt.concatenate([pt.as_tensor(v).reshape((-1,)) for v in spec.values])
    mu = hyp.base_mean[0]
    lin = [
        GaussianBlocks(m + pt.tensordot(U, h - mu, [[-1], [0]]), f)
        for m, f, U in zip(kernel.base_mean, kernel.base_factor, hyp.lr_responses, strict=True)
    ]
    ev = kernel.bound.evaluate(lin)
    new = [natural_step(st, g, H, 1.0) for st, g, H in zip(lin, ev.grads, ev.hessians, strict=True)]
    value = kernel.bound.evaluate(new, need_derivatives=False).value
    return list(spec.values), value, [st.factor for st in new]


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


def averaged_view_factors(weights, factors):
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

    Parameters
    ----------
    weights : np.ndarray
        ``AxisMarginal.weights``, ``(n, 1 + len(AXIS_POINTS))``.
    factors : list of list of np.ndarray
        Per profile point (the centre, then ``AXIS_POINTS`` along each axis in
        turn), per segment, the ``(R, K, K)`` lower precision Cholesky factors.

    Returns
    -------
    (list of np.ndarray, list of np.ndarray) or None
        Per segment, the lower Cholesky factor of the inverse averaged
        covariance, and the log ratios of ``sd(w | h)`` at :data:`NODES` along
        each axis, ``(n, len(NODES), R, K)``: their sum over the axes at a
        draw's coordinates is ``log(sd(w | h) / sd_avg)`` (relative to the centre
        on each axis, axis 0 carrying ``log(sd_centre / sd_avg)``). ``None`` when a result is not positive
        definite or not finite. Axes combine additively around the centre:
        ``S_c + sum_j (E_j[S] - S_c)``.

    Examples
    --------
    Conditional variances 1 at the centre and 4 at every other point of one
    axis, half of the weight at the centre: the average is 2.5.

    >>> import numpy as np
    >>> w = np.r_[0.5, np.full(8, 0.5 / 8)][None]
    >>> f = [[np.ones((1, 1, 1))]] + [[np.full((1, 1, 1), 0.5)]] * 8
    >>> L, log_ratio = averaged_view_factors(w, f)
    >>> float(1 / L[0][0, 0, 0] ** 2), float(np.exp(2 * log_ratio[0][0, 4, 0, 0]))
    (2.5, 0.4)
    """
    n, per_axis = weights.shape[0], weights.shape[1] - 1
    if len(factors) != 1 + n * per_axis:
        raise ValueError(f"expected {1 + n * per_axis} profile points, got {len(factors)}")
    centre_at = int(np.flatnonzero(NODES == 0.0)[0])
    out, ratios = [], []
    for s in range(len(factors[0])):
        covs = [_block_covariance(f[s]) for f in factors]
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
        variances = [np.diagonal(c, axis1=-2, axis2=-1) for c in covs]
        ratio = np.empty((n, len(NODES), *var_avg.shape))
        for j in range(n):
            along = variances[1 + j * per_axis : 1 + (j + 1) * per_axis]
            along.insert(centre_at, variances[0])
            ratio[j] = 0.5 * np.log(np.stack(along) / variances[0])
        # the axes multiply the centre's sd; the average over them is the averaged sd
        ratio[0] += 0.5 * np.log(variances[0] / var_avg)
        if not (np.all(np.isfinite(L)) and np.all(np.isfinite(ratio))):
            return None
        out.append(L)
        ratios.append(ratio)
    return out, ratios


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
