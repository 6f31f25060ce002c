"""The tuning constants of the posterior computed after a fit, in one place.

Every threshold, budget, tolerance and step count that the modules of
:mod:`pymc_mcssvi.posterior` use is a field of :class:`PosteriorSettings`, and
the modules read it from the module-level instance :data:`SETTINGS` where they
use it (never copied at import), so a change takes effect on the next fit or
draw:

>>> from pymc_mcssvi.posterior.settings import SETTINGS, PosteriorSettings
>>> SETTINGS.refit_tol
1e-05
>>> PosteriorSettings(grid_drop=12.0).grid_drop
12.0

Tests change a field with ``monkeypatch.setattr(SETTINGS, "grid_drop", 12.0)``.
Each field carries a one-line reason; the measurements behind the values are in
the documentation's benchmarks, section *Why the posterior's settings are what
they are*. The node layouts that define the method rather than tune it (the axis
points and nodes of :mod:`~pymc_mcssvi.posterior.marginal`, its grid of the
standard-normal argument, the grid's ladder in
:mod:`~pymc_mcssvi.posterior.profile_grid`) stay constants of their modules: the
tables the approximation holds are shaped by them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SETTINGS", "PosteriorSettings"]


@dataclass
class PosteriorSettings:
    """Thresholds, budgets, tolerances and step counts of :mod:`pymc_mcssvi.posterior`.

    Units: nats for falls and rises of the profile ``L(h)``, standard deviations of
    the linear-response q(h) for steps along its axes, bytes and flops for budgets.
    """

    # -- the skewed axis marginal (pymc_mcssvi.posterior.marginal) --

    #: Accepted range of the profile's second difference at +-1 sd (1 for a Gaussian):
    #: outside it the centre's curvature misstates the axis's width.
    curvature_range: tuple[float, float] = (0.4, 1.6)
    #: Fall (nats) at both outermost axis points that makes a second difference below
    #: ``curvature_range`` a flat top to follow: a unit Gaussian's at 3 sds.
    flat_top_fall: float = 4.5
    #: Largest log-volume correction (nats) of an axis's slice at +-2 sds: above the
    #: corrections seen, so it only stops a Laplace approximation gone wrong.
    volume_cap: float = 2.0
    #: Profile values within this fall (nats) are fitted by the Gaussian kept where the
    #: axis marginal is refused: a unit Gaussian's fall at 4 sds.
    profile_fit_fall: float = 8.0
    #: Averaged misfit (nats) of the per-coordinate scaled noise above which the plain
    #: averaged covariance may replace it (both misfits are proxies: small ones keep it).
    max_scaling_misfit: float = 0.5
    #: Above this many coordinates the skewed marginal must move an axis by
    #: ``min_axis_skew``: slices miss more of the other axes' spread as they multiply.
    max_unchecked_hypers: int = 4
    #: Smallest skew (sds of an axis) for which the slices' gain outweighs their error
    #: above ``max_unchecked_hypers`` coordinates.
    min_axis_skew: float = 0.15
    #: Relative gain of the profile value below which q(w | h)'s natural steps stop.
    refit_tol: float = 1e-5
    #: Most evaluations (natural steps) of one re-fit of q(w | h): converged ones
    #: average 2-4.
    max_refit_steps: int = 12
    #: Consecutive halvings of the step size after a step that lowered the bound.
    max_refit_halvings: int = 3
    #: Finite-difference step of the profile's Hessian (sds): small against the
    #: profile's width, large against the re-fits' tolerance.
    hessian_step: float = 0.25
    #: Times an axis's scale is re-set from the profile's second difference at +-1 sd.
    max_axis_rescales: int = 3
    #: Largest ``sum(R K^3)`` over q(w)'s segments for which the conditional
    #: covariances are averaged into the view (the cost of their inverses).
    max_view_work: float = 3e7
    #: Largest grid points times coordinates of the moments' full tensor grid; above
    #: it the points are drawn from the grid's weights.
    max_moment_grid: float = 2e7
    #: Most points drawn from the grid's weights: a variance's Monte Carlo error is
    #: about ``sqrt(2 / 20000) = 1%``.
    max_moment_draws: int = 20000
    #: Largest rank of the draws' mean covariance factor ``R``: ``9^3``, so a grid of
    #: up to three axes is kept exactly.
    max_moment_rank: int = 729
    #: Corners of an interpolation cell gathered at once: PyTensor's Python VM
    #: refuses an addition of more than 32 operands.
    corner_block: int = 16
    #: Change of a coordinate's log scale (a factor 20) up to which its draws' mean
    #: follows it without checking the re-fitted means.
    max_mean_log_scale: float = 3.0
    #: Squared column norms below this fraction of a segment's largest are rounding,
    #: not data.
    sensitivity_floor: float = 1e-12

    # -- the gridded q(h) (pymc_mcssvi.posterior.profile_grid) --

    #: Nodes whose profile is more than this many nats below the highest do not grow
    #: the grid: their neighbours' mass is negligible.
    grid_drop: float = 9.0
    #: Re-fits at nodes whose profile stays this far (nats) below the growth
    #: threshold stop early, unconverged: they cannot grow the grid.
    grid_floor_margin: float = 3.0
    #: Most grid nodes evaluated (the grid stops growing): bounds the re-fits' cost.
    max_grid_points: int = 600
    #: Spacing of the fine grid the density is interpolated on (conditional sds).
    grid_step: float = 0.05
    #: Most a spline between two grid nodes may rise above the larger of them (nats):
    #: a smooth peak rises by at most an eighth of its curvature.
    spline_cap: float = 0.5
    #: A profile that falls by less than this at 4 sds along an axis (a Gaussian's
    #: falls by 8) has a tail the axis marginal cuts off: the grid is used.
    tail_drop: float = 6.5
    #: Largest departure (nats) of the profile at +-2 sds on two axes from the sum of
    #: the axes' values for which the axes are taken as independent (no grid).
    corner_tol: float = 0.5
    #: Most rows of the conditional quantile table of the second coordinate.
    max_conditional_rows: int = 241

    # -- re-fits of q(w | h) per draw (pymc_mcssvi.posterior.conditional) --

    #: Largest ``draws x expected_steps x flops per draw and step`` (the fit's
    #: estimate) for which the draws are re-fitted: about 9 s on 2 cores.
    exact_conditional_work: float = 3e10
    #: Largest ``draws x expected_steps x bytes per draw and step`` (measured on the
    #: compiled step) for which the draws are re-fitted: the same 9 s.
    exact_conditional_bytes: float = 3e10
    #: Flops a special function's element counts as in the re-fits' budget: its
    #: SciPy evaluation costs that much against the estimate's flops.
    special_function_flops: float = 1500.0
    #: Natural steps a draw's re-fit is expected to take (budgeting only).
    expected_steps: int = 3
    #: Most natural steps of the re-fits of one batch of draws.
    max_conditional_steps: int = 10
    #: A re-fit with a floor stops once it would stay below it even if the rest of
    #: the re-fit gained this many times its last step.
    floor_gains: float = 2.0
    #: Most draws of one ``approx.sample`` whose q(w | h) is re-fitted; the others move
    #: the nearest re-fitted draw's by the linear response. A count, not seconds, so
    #: that a seed gives the same draws on every machine; 192 re-fits took 0.3-0.6 s
    #: on the models whose ``sample(1000)`` took 3-4.6 s.
    max_refit_draws: int = 192
    #: Draws per batch of re-fits.
    refit_batch_draws: int = 64
    #: Largest memory (bytes) of one call's intermediates of the batched re-fits.
    refit_batch_bytes: int = 2**27
    #: Nesting depth of ``OpFromGraph`` inlined before vectorizing the re-fit.
    max_inline_levels: int = 10

    # -- the entry point (pymc_mcssvi.posterior.hyper_marginal) --

    #: Largest departure (in log scale) of the data coordinates' scales from a sum
    #: over q(h)'s axes for which the axes' values are used on the whole grid.
    additive_log_scale_tol: float = 0.02
    #: Largest memory (bytes) of one batch of the conditional view's sensitivities.
    sensitivity_batch_bytes: int = 2**27
    #: Rise of the profile above its centre (nats) that is warned about: the fit
    #: stopped away from the best bound it reaches.
    profile_rise_warn: float = 1.0

    # -- draws of locals and leaves (pymc_mcssvi.posterior.locals, .leaves) --

    #: Adaptive Gauss-Hermite nodes per local for its posterior moments: centred on
    #: each row's mode, more change the moments by less than 1e-6.
    local_nodes: int = 20
    #: Elements (draws x leaf entries) of one batch of leaf draws.
    leaf_batch_elements: int = 2_000_000
    #: Draws of the approximation behind the leaves' marginal means and sds.
    leaf_moment_draws: int = 200


#: The settings the modules of :mod:`pymc_mcssvi.posterior` read.
SETTINGS = PosteriorSettings()
