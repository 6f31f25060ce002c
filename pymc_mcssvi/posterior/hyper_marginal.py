"""The hyperparameters' posterior after a fit: the profile of the bound in ``h``.

One entry point, :meth:`HyperMarginal.compute`: from the fitted state it re-fits
q(w | h) along q(h)'s axes (and on a grid for one or two coordinates), and returns
plain arrays (:class:`HyperMarginalResult`) for the approximation to use: q(h)'s
precision factor, the skewed axis marginal's tables, the grid's tables and the
Gaussian globals' conditional view. The modules it builds on:
:mod:`~pymc_mcssvi.posterior.marginal` (the profile along axes, the view),
:mod:`~pymc_mcssvi.posterior.profile_grid` (the grid) and
:mod:`~pymc_mcssvi.posterior.conditional` (batched re-fits of q(w | h)).
"""

from __future__ import annotations

import functools
import logging
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pytensor
import pytensor.tensor as pt
from pymc.pytensorf import compile as pm_compile
from pytensor.graph.replace import graph_replace
from pytensor.graph.traversal import ancestors
from scipy.linalg import solve_triangular
from threadpoolctl import threadpool_limits

from pymc_mcssvi.backend.compile import named_backend_kwargs
from pymc_mcssvi.backend.modes import graph_building, python_few_calls_mode
from pymc_mcssvi.posterior.conditional import (
    ConditionalGlobals,
    GridNodes,
    held_bytes,
    node_corners,
    step_measure,
)
from pymc_mcssvi.posterior.marginal import (
    AXIS_POINTS,
    NODES,
    ConditionalProfile,
    DrawMoments,
    _block_covariance,
    _precision_factor,
    averaged_view_factors,
    axis_marginal,
    axis_node_table,
    axis_skew,
    conditional_mean_table,
    corrected_axis_values,
    data_coordinates,
    draw_moments,
    moment_grid,
    node_table_points,
    noise_moment_factors,
    off_axis_nodes,
    profile_scales,
    refit_graph,
    volume_corrections,
    within_axis_range,
)
from pymc_mcssvi.posterior.profile_grid import (
    LADDER,
    GridMarginal,
    grid_marginal,
    grid_wanted,
    grow_grid,
)
from pymc_mcssvi.posterior.settings import SETTINGS
from pymc_mcssvi.recognize.vectorize import shapes_at_fixed, vectorize_graph

__all__ = [
    "AxisTables",
    "GridTables",
    "HyperMarginal",
    "HyperMarginalResult",
    "ViewTables",
    "by_variable",
    "principal_axes",
    "warn_higher_profile",
]

logger = logging.getLogger("pymc_mcssvi")


class AxisTables(NamedTuple):
    """The skewed q(h) along its axes (:class:`~pymc_mcssvi.posterior.marginal.AxisMarginal`):
    ``directions``, ``scales``, the quantile ``table``, the moments' ``mean_shift``, ``cov``."""

    directions: np.ndarray
    scales: np.ndarray
    table: np.ndarray
    mean_shift: np.ndarray
    cov: np.ndarray


class GridTables(NamedTuple):
    """The gridded q(h) (:mod:`~pymc_mcssvi.posterior.profile_grid`): the coordinates'
    scales ``D``, the first coordinate's quantile ``table``, the second's
    ``conditional`` tables at ``rows`` of the first."""

    scales: np.ndarray
    table: np.ndarray
    conditional: np.ndarray
    rows: np.ndarray


class ViewTables(NamedTuple):
    """The Gaussian globals' draws given the hyperparameters' draws
    (:class:`~pymc_mcssvi.pymc.approximation.ConditionalView`'s contents)."""

    factors: list
    sd_table: np.ndarray
    mean_table: np.ndarray
    log_scale_axes: np.ndarray
    log_scale_grid: np.ndarray
    scale_masks: np.ndarray
    moments: DrawMoments
    moment_factors: list


@dataclass
class HyperMarginalResult:
    """What :meth:`HyperMarginal.compute` found (``None`` for what it did not):
    the precision factor of q(h) ``(1, n_h, n_h)``, the axis marginal, the grid and
    the conditional view."""

    lr_factor: np.ndarray | None = None
    marginal: AxisTables | None = None
    grid: GridTables | None = None
    view: ViewTables | None = None


class HyperMarginal:
    """The profile of the bound in the hyperparameters, and the q(h) it gives.

    Parameters
    ----------
    kernel : StepKernel
        The fit's kernel (its bound and mean-field hyperparameters).
    store : SharedState
        The fit's state (read by the re-fits' starting points and the draws).
    model, tlm
        The PyMC model and its recognition.
    group : StructuredGaussianGroup
        The Gaussian globals' group of the approximation (the draws' layout).
    flat_maps : list of np.ndarray
        Per segment, the flat positions of its coordinates.
    work : float
        Estimated flops of one iteration (the re-fits' budget).
    backend : str
        The backend the step ran on (the profile's re-fit is compiled alike).
    gridded : bool
        Whether q(h) may be gridded (one or two coordinates).
    view_size : int or None
        The Gaussian globals' dimension when the conditional view is computed.
    """

    def __init__(
        self, kernel, store, model, tlm, group, flat_maps, work, backend, gridded, view_size
    ):
        self.kernel = kernel
        self.store = store
        self.model = model
        self.tlm = tlm
        self.group = group
        self.flat_maps = flat_maps
        self.work = float(work)
        self.backend = backend
        self.gridded = bool(gridded)
        self.view_size = view_size
        self._profile_fn = None
        self._sensitivity_fn = None
        self._conditional_globals = None

    def conditional_globals(self) -> ConditionalGlobals:
        """The re-fits of q(w | h) at a batch of points ``h`` (made once per fit object)."""
        if self._conditional_globals is None:
            k = self.kernel
            work = self.work / max(len(k.hypers.w), 1)
            if self.tlm.general_terms or self.tlm.rayleighs:
                # Monte Carlo + autodiff terms: a re-fit per draw is never cheap, and
                # PyTensor's rewriting of its graph can take minutes. A Rayleigh global:
                # the re-fit moves q(w | h) only, and its value would be an input it is
                # never given (MissingInputError in approx.sample). The draws come from
                # the view
                work = np.inf
            self._conditional_globals = ConditionalGlobals(
                k, self.store, self.model, self.group, work
            )
        return self._conditional_globals

    @staticmethod
    def _corner_values(prof, centre, am, mu):
        """The profile relative to the centre at ``+-2`` sds on every pair of q(h)'s axes
        (:func:`~pymc_mcssvi.posterior.marginal.off_axis_nodes`: 4 re-fits per pair), or
        ``None`` where the bound is not finite at one of them."""
        V, s = np.asarray(am.directions), np.asarray(am.scales)
        corners = []
        try:
            with np.errstate(all="ignore"):
                for idx in off_axis_nodes(len(s)):
                    h = mu + V @ (s * NODES[idx])
                    corners.append(prof.refit(h, *prof.start(h, centre, mu)).value - centre.value)
        except FloatingPointError:
            return None
        return np.asarray(corners)

    def _grid_wanted(self, am, corners) -> bool:
        """Whether the axis marginal ``am`` misses a heavy tail or a bending ridge of the
        profile (:func:`~pymc_mcssvi.posterior.profile_grid.grid_wanted`; ``corners``
        from :meth:`_corner_values`). Logged at INFO."""
        if corners is None:  # the bound is not finite at a corner: not a Gaussian's corner
            return True
        wanted, tail, corner = grid_wanted(am.log_density, corners)
        logger.info(
            "q(h) %s: profile falls %.2f nats at 4 sds, corners depart %.2f nats",
            "gridded" if wanted else "not gridded",
            tail,
            corner,
        )
        return wanted

    def _grid_affordable(self, mu) -> bool:
        """Whether the grid's batched re-fits fit the re-fits' budget
        (:meth:`~pymc_mcssvi.posterior.conditional.ConditionalGlobals.affordable` for
        ``SETTINGS.max_grid_points`` points), judged from the memory the profile's own
        step held (one re-fit at one point, already compiled and run; a little more
        than the batched step's per draw, as it also holds the data): the batched step
        is compiled only for a grid that is affordable. Logged at INFO when not, and
        ``False`` when measuring the batched step fails (the axis marginal stays, as for
        any failure of the grid)."""
        spec = self.kernel.hypers.spec
        measured = (
            step_measure(self._profile_fn.fn)
            if self.backend in (None, "python")  # the re-fits' own mode
            else None  # measured on the batched step itself
        )
        try:
            with threadpool_limits(limits=1, user_api="blas"), np.errstate(all="ignore"):
                hs = by_variable(np.tile(mu, (2, 1)), spec.shapes)
                ok = self.conditional_globals().affordable(
                    SETTINGS.max_grid_points, hs, measured=measured
                )
        except Exception as err:  # the batched step failed to compile or run: no grid
            logger.info("q(h) not gridded (%s: %s)", type(err).__name__, err)
            return False
        if not ok:
            logger.info("q(h) not gridded: its re-fits are not affordable")
        return ok

    def _profile_grid(self, mu, P, seeds):
        """``(GridMarginal, D)``: the profile on a grid around ``mu`` in coordinates scaled
        by the conditional sds ``D`` of the Gaussian with precision ``P`` (see
        :mod:`~pymc_mcssvi.posterior.profile_grid`), or ``None`` when its batched
        re-fits fail (logged at INFO; the axis marginal stays).
        ``seeds`` are ``(h, Refit)`` pairs (the axis marginal's re-fits): the first
        round's re-fits start from the nearest one, moved by the linear response; the
        caller has checked that they are affordable (:meth:`_grid_affordable`)."""
        cg = self.conditional_globals()
        spec = self.kernel.hypers.spec
        n = len(mu)
        D = 1.0 / np.sqrt(np.diag(P))
        R = P * D[:, None] * D[None, :]

        store = {}
        seed_h = np.array([h for h, _ in seeds])
        # the highest profile value so far: nodes re-fitted to well below the grid's
        # growth threshold under it stop early (their mass is below e^-12 of the top's)
        top = max(r.value for _, r in seeds)

        def evaluate(nodes, parents):
            nonlocal top
            H = mu + LADDER[nodes] * D
            per_draw = cg.bytes_per_draw(by_variable(H[:2], spec.shapes))
            size = int(max(1, SETTINGS.refit_batch_bytes // per_draw))
            values = np.empty(len(nodes))
            for lo in range(0, len(nodes), size):
                sl = slice(lo, lo + size)
                if np.all(parents[sl] < 0):
                    near = np.argmin((((H[sl, None] - seed_h[None]) / D) ** 2).sum(-1), axis=1)
                    refits = [seeds[i][1] for i in near]
                    start = (
                        [np.stack(seg) for seg in zip(*(r.means for r in refits), strict=True)],
                        [np.stack(seg) for seg in zip(*(r.factors for r in refits), strict=True)],
                        seed_h[near],
                    )
                else:
                    held = [store[tuple(p)] for p in parents[sl]]
                    start = (
                        [np.stack(seg) for seg in zip(*(m for m, _ in held), strict=True)],
                        [np.stack(seg) for seg in zip(*(f for _, f in held), strict=True)],
                        H[sl],  # not moved by the response of the fitted q(w): it
                        # overshoots from far nodes (the ladder spacing there is 8-16 sds)
                    )
                means, factors, values[sl] = cg.refit(
                    by_variable(H[sl], spec.shapes),
                    start=start,
                    floor=top - SETTINGS.grid_drop - SETTINGS.grid_floor_margin,
                )
                top = max(top, float(np.max(values[sl])))
                for i, node in enumerate(nodes[sl]):
                    store[tuple(node)] = ([m[i] for m in means], [f[i] for f in factors])
            return values

        try:
            with threadpool_limits(limits=1, user_api="blas"), np.errstate(all="ignore"):
                values = grow_grid(evaluate, lambda t: -0.5 * np.einsum("mi,ij,mj->m", t, R, t), n)
                gm = grid_marginal(values, n)
        except Exception as err:  # the axis marginal stays
            logger.info("q(h) not gridded (%s: %s)", type(err).__name__, err)
            return None
        # q(w | h) at the nodes: the draws' where re-fitting each one is not affordable
        held = [idx for idx, v in values.items() if np.isfinite(v)]
        cg.nodes = GridNodes(
            mu,
            D,
            np.array(held, dtype="int64"),
            [np.stack(seg) for seg in zip(*(store[i][0] for i in held), strict=True)],
            [np.stack(seg) for seg in zip(*(store[i][1] for i in held), strict=True)],
            np.array([values[i] for i in held]),
        )
        return gm, D

    def compute(self, state, converged: bool) -> HyperMarginalResult:
        """The q(h) of the converged profile, skewed where trusted, and the Gaussian
        globals' conditional view.

        See :mod:`pymc_mcssvi.posterior.marginal`. q(h)'s Gaussian takes the
        curvature of the profile at its centre (finite differences of
        re-fitted bounds); the skewed axis marginal replaces it when the
        profile along its axes is finite and agrees with that curvature; the
        conditional sds and means of q(w | h) at the profile points then shape
        the Gaussian globals' draws. The re-fit function is compiled once per
        fit object; any failure keeps what was reached, logged at INFO.

        Parameters
        ----------
        state : KernelState
            The fitted state (values).
        converged : bool
            Whether the fit met its stopping rule (a profile above the fit is then
            warned about).
        """
        result = HyperMarginalResult()
        if self._conditional_globals is not None:
            self._conditional_globals.nodes = None  # a previous fit's grid
        mu = state.hyper.base_mean[0]
        means = list(state.base.means)
        responses = list(state.hyper.lr_responses)
        try:
            if self._profile_fn is None:
                self._profile_fn = self._compile_profile()
            prof = ConditionalProfile(
                self._profile_fn, mu, means, list(state.base.factors), responses
            )
            L = state.hyper.lr_factor[0]  # lower Cholesky factor of q(h)'s precision
            # q(h)'s sds: diag((L L^T)^{-1}) = diag(L^{-T} L^{-1}), the squared column
            # norms of L^{-1} (a triangular solve)
            sd = np.linalg.norm(solve_triangular(L, np.eye(len(L)), lower=True), axis=0)
            with np.errstate(all="ignore"):
                centre = prof.refit(mu, *prof.start(mu, prof.fitted, mu))
                H = prof.hessian(centre, SETTINGS.hessian_step * sd)
                P = -0.5 * (H + H.T)
                L_P = np.linalg.cholesky(P)  # LinAlgError: not concave at the centre
                result.lr_factor = L_P[None]
                V, s = principal_axes(P)
                along, s = prof.along_axes(centre, V, s)
                refits = [centre, *along]
        except Exception as err:  # the Gaussian q(h) stays
            logger.info("Skewed q(h) not computed (%s: %s)", type(err).__name__, err)
            return result
        if converged:
            warn_higher_profile(self.model, self.tlm, refits, V, s, mu)
        values = [r.value for r in refits]
        am = axis_marginal(values, V, s)
        if am is None:
            # the Gaussian kept is fitted to the profile along the axes, not only to its
            # curvature at the centre (see ``profile_scales``)
            fitted = profile_scales(values, s)
            result.lr_factor = np.linalg.cholesky((V / fitted**2) @ V.T)[None]
            logger.info(
                "Skewed q(h) not used: the profile disagrees with its curvature; Gaussian "
                "q(h) fitted to the profile along its axes (scales %s, curvature's %s)",
                np.round(fitted, 4),
                np.round(s, 4),
            )
            return result
        if (
            len(s) > SETTINGS.max_unchecked_hypers
            and (skew := axis_skew(am)) < SETTINGS.min_axis_skew
        ):
            logger.info(
                "Skewed q(h) not used: %d axes, skew %.3f below %s",
                len(s),
                skew,
                SETTINGS.min_axis_skew,
            )
            return result
        corners = self._corner_values(prof, centre, am, mu) if len(s) > 1 else None
        joint = None
        if self.gridded and self._grid_affordable(mu) and self._grid_wanted(am, corners):
            seeds = [mu] + [mu + z * s[j] * V[:, j] for j in range(len(s)) for z in AXIS_POINTS]
            joint = self._profile_grid(mu, P, list(zip(seeds, refits, strict=True)))
        if joint is None and corners is not None:
            # slices through the centre leave out how the other axes' spread changes
            # along each axis: their log volume, from the corners (``volume_corrections``)
            corrections = volume_corrections(am.log_density, corners)
            corrected = axis_marginal(corrected_axis_values(values, corrections), V, s)
            if corrected is None:
                logger.info(
                    "Skewed q(h) without the other axes' volume: it disagrees with "
                    "the curvature once corrected"
                )
            else:
                am = corrected
        if joint is not None:
            gm, D = joint
            result.grid = GridTables(D, gm.table, gm.conditional, gm.rows)
            am = _grid_axis_marginal(am, gm, D)
        result.marginal = AxisTables(am.directions, am.scales, am.table, am.mean_shift, am.cov)
        if self.view_size is None:
            return result
        n_w = self.view_size
        flat = functools.partial(_flatten, self.flat_maps, n_w)
        factors = list(state.base.factors)
        work = sum(f.shape[0] * f.shape[-1] ** 3 for f in factors)
        # the data's coordinates need the re-fits' covariances (as the averaged view does)
        dc = data_coordinates(refits) if work <= SETTINGS.max_view_work else None
        n = len(s)
        masks = np.zeros((2, n_w))
        ls_axes = np.zeros((n, len(NODES), n_w))
        ls_grid = np.zeros((1, n_w))  # a placeholder row: the log scales add up
        if dc is not None:
            masks = np.stack([flat(dc.held), flat(dc.follows)]).astype("float64")
            # From the profile points when the log scales add up across the axes (log
            # sigma of a non-centered effect: exactly), checked on each pair of axes;
            # else evaluated on the whole grid (an HSGP's spectral density) if it fits,
            # else not followed (q(w)'s own coordinates).
            ls_axes = axis_node_table([flat(ls) for ls in dc.log_scales])
            pairs = off_axis_nodes(n)

            def exact(nodes):
                log_sens = self.log_sensitivities(np.vstack([mu, node_table_points(am, mu, nodes)]))
                centre = np.where(masks[0] > 0, log_sens[0], 0.0)
                return masks[0] * 0.5 * (log_sens[1:] - centre)

            additive = ls_axes[np.arange(n), pairs].sum(axis=1)
            if (
                len(pairs)
                and np.max(np.abs(exact(pairs) - additive)) > SETTINGS.additive_log_scale_tol
            ):
                if len(NODES) ** n * n_w > SETTINGS.max_moment_grid:
                    dc = None  # the grid of log scales would not fit
                    masks[:] = 0.0
                else:
                    ls_grid = exact(None)
                ls_axes = np.zeros_like(ls_axes)
        mean_table = conditional_mean_table(
            refits, means, V, s, self.flat_maps, n_w, None if dc is None else dc.mean_log_scales()
        )
        fitted = flat(means)
        if joint is None:
            grid = moment_grid(am, mu, n_w)
            if len(ls_grid) > 1:
                log_scales = ls_grid[np.ravel_multi_index(grid.nodes.T, (len(NODES),) * n)]
            else:  # summed axis by axis: one (points, n_w) array at a time, not (points, n, n_w)
                log_scales = np.zeros((len(grid.p), n_w))
                for j in range(n):
                    log_scales += ls_axes[j, grid.nodes[:, j]]
            moments = draw_moments(mean_table, grid, masks[1] * log_scales, fitted, V, s)
        else:
            # the draws come from q(w | h) re-fitted at each draw or at the grid's nodes:
            # their moments from the nodes, not from the view's tables (constant beyond
            # 4 sds of the axes, where the gridded q(h) reaches)
            moments, node_factors = _node_moments(
                self._conditional_globals.nodes, gm, self.flat_maps, n_w, fitted
            )
        ratios = [np.zeros((len(s), len(NODES), *f.shape[:-1])) for f in factors]
        if dc is not None:
            with np.errstate(all="ignore"):
                averaged = averaged_view_factors(
                    am.weights, [r.factors for r in refits], dc.log_scales
                )
            if averaged is None:
                logger.info("Conditional covariance of q(w) not averaged: not positive definite")
            else:
                factors, ratios = averaged
        if joint is None:
            with np.errstate(all="ignore"):
                moment_factors = noise_moment_factors(
                    factors, ratios, grid, log_scales, self.flat_maps
                )
            if moment_factors is None:
                moment_factors = factors
        else:
            moment_factors = node_factors
        table = np.zeros((n, len(NODES), n_w))
        for ratio, idx in zip(ratios, self.flat_maps, strict=True):
            table[:, :, idx.reshape(-1)] = ratio.reshape((*ratio.shape[:2], -1))
        result.view = ViewTables(
            factors=list(factors),
            sd_table=table,
            mean_table=mean_table,
            log_scale_axes=ls_axes,
            # the draws' log scales off the axes stay within the axes' range (the
            # moments take the exact ones at the grid's points)
            log_scale_grid=within_axis_range(ls_grid, n) if len(ls_grid) > 1 else ls_grid,
            scale_masks=masks,
            moments=moments,
            moment_factors=list(moment_factors),
        )
        return result

    def _sensitivity_graph(self, n_w):
        """``(h, sensitivities)``: the squared column norms of the likelihoods' predictor
        Jacobian (flat, in q(w)'s order) as a graph of the flat hyperparameter vector
        ``h`` (:meth:`~pymc_mcssvi.bounds.structured.StructuredBound.sensitivities`):
        the scales of the data's coordinates at each draw of the conditional view."""
        k = self.kernel
        h = pt.vector("view_h", shape=(k.hypers.spec.size,))
        with graph_building():
            out = pt.zeros((n_w,))
            for c, idx in zip(k.bound.sensitivities(k.nseg), self.flat_maps, strict=True):
                out = pt.set_subtensor(out[idx.reshape(-1)], c.reshape((-1,)))
            out = graph_replace(out, k.hypers.spec.replacements(h), strict=False)
            (out,) = shapes_at_fixed(h, [out])
        return h, out

    def log_sensitivities(self, hs):
        """``log`` of the view's sensitivities at the rows of ``hs`` (compiled once)."""
        if self._sensitivity_fn is None:
            h, out = self._sensitivity_graph(self.view_size)
            H = pt.matrix("view_hs", shape=(None, h.type.shape[0]))
            # unbatched when the sensitivities do not depend on h (centered effects)
            batched = pt.broadcast_to(
                vectorize_graph(out, {h: H}), (H.shape[0], out.type.shape[-1])
            )
            with graph_building():
                self._sensitivity_fn = pytensor.function(
                    [H],
                    pt.log(pt.maximum(batched, 1e-300)),
                    mode=python_few_calls_mode(),
                    on_unused_input="ignore",
                    allow_input_downcast=True,
                )
        hs = np.asarray(hs, dtype="float64")
        fn = self._sensitivity_fn
        # Batched by the memory one point's intermediates hold (measured on the first
        # call): a spline through a scaled cumsum holds a large array per point.
        first = fn(hs[:1])
        per_point = max(held_bytes(fn), 1)
        size = int(max(1, min(len(hs), SETTINGS.sensitivity_batch_bytes // per_point)))
        out = [first] + [fn(hs[lo : lo + size]) for lo in range(1, len(hs), size)]
        return np.concatenate(out)

    def _compile_profile(self):
        """The re-fit step ``(h, rho, means, factors) -> (value, means, factors, gain, sensitivity)`` of
        :func:`~pymc_mcssvi.posterior.marginal.refit_graph`, ``h`` flat."""
        hyp = self.kernel.hypers
        with graph_building(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            inputs, outputs = refit_graph(
                self.kernel.bound, hyp.spec, self.store.symbolic.base, gain=True, sensitivity=True
            )
            ck = (
                {"mode": python_few_calls_mode()}
                if self.backend in (None, "python", "custom")
                else named_backend_kwargs(self.backend, {})
            )
            # float64 points into a floatX=float32 model's hyperparameters
            fn = pm_compile(inputs, outputs, allow_input_downcast=True, **ck)
        shapes = hyp.spec.shapes
        nseg = self.kernel.nseg

        def step(h, rho, means, factors):
            out = fn(*by_variable(h, shapes), rho, *means, *factors)
            k = 1 + 2 * nseg
            return out[0], out[1 : 1 + nseg], out[1 + nseg : k], out[k], out[k + 1 :]

        step.fn = fn
        return step


def warn_higher_profile(model, tlm, refits, directions, scales, mu):
    """Warn when, after a converged fit, the profile along q(h)'s axes rises above its
    centre by more than ``SETTINGS.profile_rise_warn`` nats: the fit stopped away from
    the highest bound it can reach, as on a rough or multimodal posterior (a sharp
    change point)."""
    rise = np.array([r.value for r in refits[1:]], dtype="float64") - refits[0].value
    if not np.any(np.isfinite(rise)) or np.nanmax(rise) <= SETTINGS.profile_rise_warn:
        return
    j, i = divmod(int(np.nanargmax(rise)), len(AXIS_POINTS))
    step = AXIS_POINTS[i] * np.asarray(directions)[:, j] * scales[j]
    hypers = tlm.hypers
    ends = np.cumsum([hh.size for hh in hypers])
    # the hyperparameter of the coordinate that moves most
    h = hypers[int(np.searchsorted(ends, np.argmax(np.abs(step)), side="right"))]
    try:
        expr = model.replace_rvs_by_values([h.rv])[0]
        point = model.initial_point()
        used = set(ancestors([expr]))
        inputs = [v for v in model.value_vars if v in used]
        flat_h = {
            hh.value.name: part.reshape(hh.shape)
            for hh, part in zip(hypers, np.split(mu + step, ends[:-1]), strict=True)
        }
        fn = pytensor.function(inputs, expr, on_unused_input="ignore")
        there = fn(*[flat_h.get(v.name, point[v.name]) for v in inputs])
        at = f" (at {h.name} = {np.array2string(np.asarray(there), precision=3)})"
    except Exception:  # the value is a courtesy; the warning is not
        at = ""
    warnings.warn(
        f"The bound is {np.nanmax(rise):.2g} nats higher{at} than at the fitted "
        f"hyperparameters, along the direction that moves {h.name!r} most: the fit "
        "stopped away from its best value, as on a rough or multimodal posterior (a sharp "
        "change point, separated modes). Check with pm.sample, or refit with start= "
        "near that value.",
        UserWarning,
        stacklevel=4,
    )


def principal_axes(P):
    """The principal axes and sds of the Gaussian of precision ``P``: ``(V, s)`` with
    ``P^{-1} = V diag(s^2) V^T``, ``s`` ascending.

    From the eigendecomposition of ``P`` itself (no inverse): its eigenvalues
    ``lam`` ascending are the covariance's ``1 / lam`` descending, so both are
    reversed. Each axis's sign, which the eigendecomposition leaves open, is fixed:
    its largest component (the first of equal ones) is positive.

    Examples
    --------
    >>> V, s = principal_axes(np.array([[4.0, 0.0], [0.0, 0.25]]))
    >>> V.tolist(), s.tolist()
    ([[1.0, 0.0], [0.0, 1.0]], [0.5, 2.0])
    >>> u, v = np.array([0.6, 0.8]), np.array([-0.8, 0.6])
    >>> V, s = principal_axes(4.0 * np.outer(u, u) + np.outer(v, v))
    >>> np.round(V, 12).tolist(), np.round(s, 12).tolist()
    ([[0.6, 0.8], [0.8, -0.6]], [0.5, 1.0])
    """
    lam, U = np.linalg.eigh(P)
    V = U[:, ::-1]
    big = np.argmax(np.abs(V), axis=0)
    V = V * np.where(V[big, np.arange(V.shape[1])] < 0, -1.0, 1.0)
    return V, 1.0 / np.sqrt(lam[::-1])


def _flatten(flat_maps, size, blocks) -> np.ndarray:
    """Per-segment ``(R, K)`` arrays placed in q(w)'s flat order."""
    out = np.zeros(size)
    for b, idx in zip(blocks, flat_maps, strict=True):
        out[idx.reshape(-1)] = np.asarray(b).reshape(-1)
    return out


def by_variable(H, shapes) -> list:
    """Flat hyperparameter vectors ``(..., n_h)`` split into one array per value variable,
    ``(..., *shape)`` each.

    Examples
    --------
    >>> [x.shape for x in by_variable(np.zeros((5, 7)), [(), (2, 3)])]
    [(5,), (5, 2, 3)]
    """
    H = np.asarray(H)
    split = np.cumsum([int(np.prod(shp)) for shp in shapes])[:-1]
    parts = np.split(H, split, axis=-1)
    return [x.reshape((*H.shape[:-1], *shp)) for x, shp in zip(parts, shapes, strict=True)]


def _grid_axis_marginal(am, gm: GridMarginal, D):
    """``am`` with the gridded q(h)'s moments (in ``h``) and, as its axes' weights (the
    averaged view's, :func:`~pymc_mcssvi.posterior.marginal.averaged_view_factors`),
    the margins of its fine points' masses along each axis, shared linearly between
    the two nearest :data:`~pymc_mcssvi.posterior.marginal.NODES` (beyond them, at
    the last)."""
    t = ((gm.points * D) @ np.asarray(am.directions)) / np.asarray(am.scales)
    pos = np.clip(t, NODES[0], NODES[-1]) - NODES[0]
    lower = np.clip(np.floor(pos), 0, len(NODES) - 2).astype("int64")
    frac = pos - lower
    at = [int(np.flatnonzero(NODES == z)[0]) for z in np.r_[0.0, AXIS_POINTS]]
    weights = np.stack(
        [
            np.bincount(
                np.r_[lower[:, j], lower[:, j] + 1],
                weights=np.r_[gm.mass * (1.0 - frac[:, j]), gm.mass * frac[:, j]],
                minlength=len(NODES),
            )[at]
            for j in range(len(D))
        ]
    )
    return am._replace(
        mean_shift=D * gm.mean,
        cov=D[:, None] * gm.cov * D[None, :],
        weights=weights / weights.sum(axis=1, keepdims=True),
    )


def _node_moments(nodes: GridNodes, gm: GridMarginal, flat_maps, size, fitted):
    """``(DrawMoments, factors)``: the moments of draws of the Gaussian globals from
    q(w | h) at the grid's nodes, interpolated between them as
    :meth:`~pymc_mcssvi.posterior.conditional.ConditionalGlobals` draws them, under the
    gridded q(h) (its fine points ``gm.points``, each sharing its mass out to the
    corners of its cell by linear weights ``phi``; a corner not evaluated passes its
    share to the nearest node). With ``W = E[phi phi^T]`` and ``M`` the nodes' means,
    the means' covariance is ``(M - mean)^T W (M - mean)`` and their cross-covariance
    with ``h`` is ``(M - mean)^T E[phi (h - E h)^T]``, exact for means linear within
    each cell. Returned: the mean's shift from ``fitted``, ``R`` with ``R R^T`` that
    covariance, the cross-covariance, and per segment the lower Cholesky factor of the
    inverse of the nodes' covariances averaged with weights ``E[phi]``."""
    k, n_h = nodes.index.shape
    h = nodes.centre + gm.points * nodes.scales
    h_mean = gm.mass @ h
    corners = node_corners(nodes.index, gm.points)
    W = np.zeros(k * k)
    Q = np.zeros((k, n_h))
    for rows, w in corners:
        for j in range(n_h):
            Q[:, j] += np.bincount(rows, weights=gm.mass * w * (h[:, j] - h_mean[j]), minlength=k)
        for rows2, w2 in corners:
            W += np.bincount(rows * k + rows2, weights=gm.mass * w * w2, minlength=k * k)
    W = W.reshape(k, k)
    p = W.sum(axis=1)
    m = np.zeros((k, size))
    for seg, fmap in zip(nodes.means, flat_maps, strict=True):
        m[:, fmap.reshape(-1)] = seg.reshape(k, -1)
    mean = p @ m
    lam, U = np.linalg.eigh(0.5 * (W + W.T))
    C = U * np.sqrt(np.maximum(lam, 0.0))  # C C^T = W
    R = (m - mean).T @ C
    rank = SETTINGS.max_moment_rank
    if R.shape[1] > rank:
        Ur, sv, _ = np.linalg.svd(R, full_matrices=False)
        R = Ur[:, :rank] * sv[:rank]
    factors = []
    for L in nodes.factors:
        S = np.einsum("k,k...->...", p, _block_covariance(L))
        factors.append(_precision_factor(S))
    return DrawMoments(mean - fitted, R, (m - mean).T @ Q), factors
