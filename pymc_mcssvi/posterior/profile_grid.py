r"""q(h) from the profile on a grid, for one or two hyperparameter coordinates.

The axis marginal (:mod:`pymc_mcssvi.posterior.marginal`) evaluates the
profile ``L(h) = max_{q(w)} bound(q(w), h)`` on straight lines along q(h)'s
principal axes, out to 4 sds, and draws the axes independently. A group scale's
log has a long, curved tail that neither follows: with crossed intercepts, one
scale's log runs towards ``-inf`` along a ridge where the other scale takes over
the variance, its density falling about as the HalfNormal prior's ``exp(log
sigma)``; the axis marginal cuts that tail off and puts the scale's mean high.

With at most :data:`MAX_GRID_HYPERS` coordinates the profile is evaluated on a
grid instead, as INLA's grid strategy does: coordinates ``t`` of ``h = mu + D
t`` with ``D`` the Gaussian q(h)'s conditional sds (so the ridge of a scale
that goes to 0, along its own coordinate, stays on one grid line), at the
nodes :data:`LADDER` (unit spacing to 4, then wider). The grid starts with the
nodes within 4 of the centre and grows by the neighbours of every node whose
profile is within ``SETTINGS.grid_drop`` of the largest (:func:`grow_grid`); each
round's re-fits are one batched call. The density interpolated between the
nodes (cubic splines, in each coordinate in turn) is drawn from by a
triangular map (:func:`grid_marginal`): ``t_1`` from its marginal, ``t_2``
from its conditional given ``t_1``, both through tabulated quantile
functions of standard-normal draws (:func:`conditional_transform`).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
import pytensor.tensor as pt
from scipy.interpolate import CubicSpline
from scipy.special import ndtr

from pymc_mcssvi.posterior.marginal import AXIS_POINTS, EPS_GRID
from pymc_mcssvi.posterior.settings import SETTINGS

__all__ = [
    "LADDER",
    "MAX_GRID_HYPERS",
    "grid_wanted",
    "GridMarginal",
    "conditional_transform",
    "grid_marginal",
    "grow_grid",
]

#: Most hyperparameter coordinates whose q(h) is the profile on a grid: its nodes
#: multiply with each coordinate. Read by :mod:`pymc_mcssvi.pymc.inference` at import (a
#: constant until that module reads :data:`~pymc_mcssvi.posterior.settings.SETTINGS`).
MAX_GRID_HYPERS = 2
#: Grid nodes of each coordinate, in the Gaussian q(h)'s conditional sds: unit
#: spacing where the density is, wider in the tails (a log scale's density towards
#: 0 falls by about one nat per unit of ``log sigma``, 3-30 conditional sds).
LADDER = np.array(
    [-48, -32, -24, -16, -12, -8, -6, -4, -3, -2, -1, 0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48],
    dtype="float64",
)


def _centre_index() -> int:
    return int(np.flatnonzero(LADDER == 0.0)[0])


def grow_grid(evaluate, start_log_density, n: int) -> dict:
    """Profile values at grid nodes, grown from the centre.

    Parameters
    ----------
    evaluate : callable
        ``(nodes, parents) -> values``: the profile at ``LADDER[nodes]`` (``(m, n)``
        index arrays), each re-fit starting from its ``parents`` node's (a row of
        indices already evaluated, or ``-1`` rows: from the fitted q(w)).
    start_log_density : callable
        ``t -> log density`` of the Gaussian q(h) in the grid's coordinates
        (``(m, n) -> (m,)``), which picks the first round's nodes.
    n : int
        Number of coordinates.

    Returns
    -------
    dict
        ``{node index tuple: value}``.

    Examples
    --------
    A Gaussian profile with an exponential left tail (a log scale's) along the
    first coordinate: the grid follows the tail and stops where it has fallen by
    ``SETTINGS.grid_drop``.

    >>> import numpy as np
    >>> def logp(t):
    ...     return np.where(t[:, 0] < 0, 0.5 * t[:, 0], -0.5 * t[:, 0] ** 2) - 0.5 * t[:, 1] ** 2
    >>> vals = grow_grid(lambda nodes, parents: logp(LADDER[nodes]),
    ...                  lambda t: -0.5 * (t**2).sum(1), 2)
    >>> lo = min(LADDER[i] for i, _ in vals)
    >>> float(lo), bool(max(vals.values()) == 0.0)
    (-24.0, True)
    """
    c = _centre_index()
    box = np.array(list(itertools.product(range(c - 4, c + 5), repeat=n)))
    keep = start_log_density(LADDER[box]) > -(SETTINGS.grid_drop + 1.0)
    nodes = box[keep]
    values: dict = {}
    parents = np.full_like(nodes, -1)
    steps = np.array([d for d in itertools.product((-1, 0, 1), repeat=n) if any(d)])
    while len(nodes) and len(values) < SETTINGS.max_grid_points:
        out = np.asarray(evaluate(nodes, parents), dtype="float64")
        for idx, v in zip(map(tuple, nodes), out, strict=True):
            values[idx] = float(v) if np.isfinite(v) else -np.inf
        top = max(values.values())
        new = {}
        for idx, v in values.items():
            if not v > top - SETTINGS.grid_drop:
                continue
            for d in steps:
                nb = tuple(np.add(idx, d))
                if nb in values or nb in new or min(nb) < 0 or max(nb) >= len(LADDER):
                    continue
                new[nb] = idx
        nodes = np.array(list(new), dtype="int64").reshape(-1, n)
        parents = np.array(list(new.values()), dtype="int64").reshape(-1, n)
    return values


def grid_wanted(axis_values, corner_values) -> tuple[bool, float, float]:
    """Whether the axis marginal misses what the grid follows, and the two checks.

    Parameters
    ----------
    axis_values : np.ndarray
        ``(n, len(AXIS_POINTS))`` the profile along q(h)'s axes, relative to the
        centre (:attr:`~pymc_mcssvi.posterior.marginal.AxisMarginal.log_density`).
    corner_values : np.ndarray
        The profile relative to the centre at ``+-2`` sds on each pair of axes, in the
        order of :func:`~pymc_mcssvi.posterior.marginal.off_axis_nodes`.

    Returns
    -------
    wanted, tail, corner : bool, float, float
        ``tail``: the smallest fall at ``+-4`` sds (a heavy tail falls by less than
        ``SETTINGS.tail_drop``); ``corner``: the largest departure of a corner from the
        sum of its axes' values (a ridge that bends, above ``SETTINGS.corner_tol``).

    Examples
    --------
    A Gaussian profile with independent axes needs no grid; a slow tail does:

    >>> import numpy as np
    >>> d = np.tile(-0.5 * AXIS_POINTS**2, (2, 1))
    >>> grid_wanted(d, np.full(4, -4.0))[0]
    False
    >>> d[1, 0] = -3.0  # -4 sds on the second axis
    >>> grid_wanted(d, np.full(4, -4.0))[0]
    True
    """
    d = np.asarray(axis_values, dtype="float64")
    ends = d[:, np.abs(AXIS_POINTS) == 4.0]
    tail = float(-np.max(ends)) if np.all(np.isfinite(ends)) else np.inf
    corner = 0.0
    n, at = d.shape[0], {z: i for i, z in enumerate(AXIS_POINTS)}
    k = 0
    for j in range(n):
        for m in range(j + 1, n):
            for a in (-2.0, 2.0):
                for b in (-2.0, 2.0):
                    additive = d[j, at[a]] + d[m, at[b]]
                    corner = max(corner, float(abs(corner_values[k] - additive)))
                    k += 1
    return bool(tail < SETTINGS.tail_drop or corner > SETTINGS.corner_tol), tail, corner


class GridMarginal(NamedTuple):
    """q(h) from the profile on a grid: ``h = mu + D t`` with ``t`` drawn by a triangular map.

    Attributes
    ----------
    table : np.ndarray
        ``(n, len(EPS_GRID))``: row 0 the quantile function of ``t_1`` at
        ``Phi(EPS_GRID)``; row 1 (two coordinates) that of ``t_2``'s marginal
        (reported, not drawn from).
    conditional : np.ndarray
        ``(M, len(EPS_GRID))``: the quantile functions of ``t_2`` given ``t_1`` at
        ``rows`` (one placeholder row for one coordinate).
    rows : np.ndarray
        ``(M,)`` evenly spaced values of ``t_1``.
    mean, cov : np.ndarray
        Moments of ``t``.
    points, mass : np.ndarray
        ``(F, n)`` fine-grid points of ``t`` and their probabilities (for moments of
        functions of ``h``).
    """

    table: np.ndarray
    conditional: np.ndarray
    rows: np.ndarray
    mean: np.ndarray
    cov: np.ndarray
    points: np.ndarray
    mass: np.ndarray


def _fill(values: dict, n: int):
    """The grid's values on the bounding box of its nodes; nodes not evaluated (beyond
    ``SETTINGS.grid_drop`` of every evaluated neighbour) and non-finite values get a floor
    well below the evaluated ones."""
    idx = np.array(list(values), dtype="int64").reshape(-1, n)
    v = np.array(list(values.values()))
    lo, hi = idx.min(0), idx.max(0)
    finite = v[np.isfinite(v)]
    floor = finite.min() - 2.0 * SETTINGS.grid_drop
    box = np.full(tuple(hi - lo + 1), floor)
    box[tuple((idx - lo).T)] = np.where(np.isfinite(v), v, floor)
    return [LADDER[lo[j] : hi[j] + 1] for j in range(n)], box - finite.max()


def _interpolate(nodes, values, fine, axis):
    """Cubic spline of ``values`` along ``axis`` at ``fine``, capped at ``SETTINGS.spline_cap``
    above the larger of the two nodes around each point: a spline's overshoot next
    to the floor of :func:`_fill` would make a bump, while a smooth peak between two
    nodes rises above both by at most an eighth of its curvature (unit spacing)."""
    if len(nodes) < 2:
        return np.repeat(values, len(fine), axis=axis)
    out = CubicSpline(nodes, values, axis=axis)(fine)
    i = np.clip(np.searchsorted(nodes, fine, side="right") - 1, 0, len(nodes) - 2)
    cap = np.maximum(np.take(values, i, axis=axis), np.take(values, i + 1, axis=axis))
    return np.minimum(out, cap + SETTINGS.spline_cap)


def _quantiles(p, fine):
    """Quantile function at ``Phi(EPS_GRID)`` of the density ``p`` on ``fine`` (rows)."""
    # mass at the points' centres (a cumulative sum up to each point would put every
    # quantile half a step low)
    cdf = np.cumsum(p, axis=-1) - 0.5 * p
    cdf /= np.sum(p, axis=-1, keepdims=True)
    u = ndtr(EPS_GRID)
    if p.ndim == 1:
        return np.interp(u, cdf, fine)
    return np.stack([np.interp(u, c, fine) for c in cdf])


def grid_marginal(values: dict, n: int) -> GridMarginal:
    """The triangular map and moments of the density interpolated between the grid's nodes.

    Log densities are interpolated by cubic splines (capped at the nodes around each
    point) along each coordinate in turn onto a grid of spacing ``SETTINGS.grid_step``
    inside the nodes' box.

    Examples
    --------
    A correlated Gaussian (correlation 0.6) on the grid: the map's moments are
    the Gaussian's.

    >>> import numpy as np, itertools
    >>> P = np.array([[1.0, -0.6], [-0.6, 1.0]]) / 0.64  # the covariance's inverse
    >>> c = int(np.flatnonzero(LADDER == 0)[0])
    >>> vals = {i: -0.5 * LADDER[list(i)] @ P @ LADDER[list(i)]
    ...         for i in itertools.product(range(c - 6, c + 7), repeat=2)}
    >>> gm = grid_marginal(vals, 2)
    >>> np.round(gm.cov, 2).tolist(), bool(np.abs(gm.mean).max() < 1e-6)
    ([[1.0, 0.6], [0.6, 1.0]], True)
    """
    axes, box = _fill(values, n)
    fine = [np.arange(a[0], a[-1] + 0.5 * SETTINGS.grid_step, SETTINGS.grid_step) for a in axes]
    lg = box
    for j in range(n):
        lg = _interpolate(axes[j], lg, fine[j], j)
    p = np.exp(lg - lg.max())
    p /= p.sum()
    grids = np.meshgrid(*fine, indexing="ij")
    points = np.stack([g.ravel() for g in grids], axis=1)
    mass = p.ravel()
    mean = mass @ points
    centred = points - mean
    cov = (centred * mass[:, None]).T @ centred
    marginals = [p.sum(axis=tuple(k for k in range(n) if k != j)) for j in range(n)]
    table = np.stack([_quantiles(m, f) for m, f in zip(marginals, fine, strict=True)])
    if n == 1:
        conditional, rows = table[:1], fine[0][:1]
    else:
        every = int(np.ceil(len(fine[0]) / SETTINGS.max_conditional_rows))
        pick = np.arange(0, len(fine[0]), every)
        rows = fine[0][pick]
        cond = np.exp(lg[pick] - lg[pick].max(axis=1, keepdims=True))
        conditional = _quantiles(cond, fine[1])
    return GridMarginal(table, conditional, rows, mean, cov, points, mass)


def conditional_transform(t1, e2, conditional, rows):
    """``t_2`` for draws ``t_1`` and standard-normal ``e2`` (``(draws,)`` each): the
    conditional quantile tables bilinearly interpolated in ``t_1`` and ``e2``
    (clipped to the tables), symbolic.

    Examples
    --------
    >>> import numpy as np, pytensor.tensor as pt
    >>> rows = np.array([0.0, 1.0])
    >>> cond = np.stack([EPS_GRID, 2.0 * EPS_GRID + 1.0])  # t2 | t1: shifted and wider
    >>> out = conditional_transform(pt.as_tensor([0.5]), pt.as_tensor([1.0]), cond, rows)
    >>> np.round(out.eval(), 6).tolist()
    [2.0]
    """
    conditional, rows = pt.as_tensor(conditional), pt.as_tensor(rows)
    m = rows.shape[0]
    r_pos = (pt.clip(t1, rows[0], rows[-1]) - rows[0]) / (rows[1] - rows[0])
    i = pt.clip(pt.floor(r_pos), 0, m - 2).astype("int64")
    a = r_pos - i
    lo, step = EPS_GRID[0], EPS_GRID[1] - EPS_GRID[0]
    e_pos = (pt.clip(e2, EPS_GRID[0], EPS_GRID[-1]) - lo) / step
    j = pt.clip(pt.floor(e_pos), 0, EPS_GRID.size - 2).astype("int64")
    b = e_pos - j

    def along_eps(r):
        return conditional[r, j] * (1.0 - b) + conditional[r, j + 1] * b

    return along_eps(i) * (1.0 - a) + along_eps(i + 1) * a
