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
    "axis_marginal",
    "profile_graph",
    "table_transform",
]

#: Points along each axis, in standard deviations of the linear-response q(h).
AXIS_POINTS = np.array([-4.0, -3.0, -2.0, -1.0, 1.0, 2.0, 3.0, 4.0])
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
    """

    directions: np.ndarray
    scales: np.ndarray
    table: np.ndarray
    mean_shift: np.ndarray
    cov: np.ndarray
    log_density: np.ndarray


def profile_graph(kernel):
    """Profile ``max_{q(w)} bound(q(w), h)`` as a graph of the hyperparameters' value variables.

    q(w) at ``h`` starts from the linear response of the fitted q(w),
    ``m + U (h - mu)``, and takes one natural step with ``rho = 1``; the bound
    is evaluated there (no q(h) entropy: ``h`` is a point). Returns
    ``(inputs, value)`` with ``inputs`` the model's value variables of the
    hyperparameters (no graph replacement: cloning the bound's graph costs more
    than building it).
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
    return list(spec.values), kernel.bound.evaluate(new, need_derivatives=False).value


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
    >>> bool(abs(am.cov[0, 0] - 1) < 1e-3 and abs(am.mean_shift[0]) < 1e-6)
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
    for j in range(n):
        lg = np.r_[d[j, AXIS_POINTS < 0], 0.0, d[j, AXIS_POINTS > 0]]
        lg = _unimodal(lg, int(np.flatnonzero(z_nodes == 0.0)[0]))
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


def table_transform(eps, table):
    """``T_j(e_j)`` for draws ``eps`` of shape ``(draws, n)`` (linear interpolation, symbolic)."""
    lo, step = EPS_GRID[0], EPS_GRID[1] - EPS_GRID[0]
    pos = (pt.clip(eps, EPS_GRID[0], EPS_GRID[-1]) - lo) / step
    i = pt.clip(pt.floor(pos), 0, EPS_GRID.size - 2).astype("int64")
    frac = pos - i
    cols = pt.arange(table.shape[0])[None, :]
    return table[cols, i] * (1.0 - frac) + table[cols, i + 1] * frac
