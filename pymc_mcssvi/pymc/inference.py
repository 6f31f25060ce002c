"""PyMC ``Inference`` classes: ``MCSSVI``, ``HMCSSVI`` and ``SDSVI``.

Thin adapters over the engine: recognize the model
(:mod:`~pymc_mcssvi.recognize`), build the structured bound and the step kernel,
keep the fit's explicit state in shared variables
(:class:`~pymc_mcssvi.algorithms.state.SharedState`), compile the step
(:mod:`~pymc_mcssvi.backend.compile`), run the one fit loop
(:mod:`~pymc_mcssvi.pymc.fit_loop`) and, after it, compute the posterior parts
q does not hold directly (:mod:`~pymc_mcssvi.posterior`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import warnings

import numpy as np
import pymc as pm
import pytensor
from pymc.progress_bar import default_progress_theme
from pymc.variational.inference import Inference
from pytensor.compile.mode import get_mode
from threadpoolctl import threadpool_limits

from pymc_mcssvi.algorithms.averaging import IterateAverage
from pymc_mcssvi.algorithms.hmcssvi import HMCSSVIStep
from pymc_mcssvi.algorithms.hyperparameters import MeanFieldHyperparameters, PointHyperparameters
from pymc_mcssvi.algorithms.kernel import StepKernel
from pymc_mcssvi.algorithms.mcssvi import MCSSVIStep
from pymc_mcssvi.algorithms.optimizers import make_optimizer
from pymc_mcssvi.algorithms.rayleigh import RayleighGlobals
from pymc_mcssvi.algorithms.schedules import Schedule, make_schedule
from pymc_mcssvi.algorithms.sdsvi import SDSVIStep
from pymc_mcssvi.algorithms.state import SharedState, tree_map
from pymc_mcssvi.backend import compile as compile_module
from pymc_mcssvi.backend.compile import (
    TracedOnFirstCall,
    UpgradingStep,
    blas_threads_for,
    choose_backend,
    compile_step,
    fallback_backend,
    jax_available,
)
from pymc_mcssvi.backend.modes import graph_building
from pymc_mcssvi.bounds.structured import StructuredBound
from pymc_mcssvi.posterior.hyper_marginal import HyperMarginal, HyperMarginalResult
from pymc_mcssvi.posterior.leaves import leaf_moments, leaf_sampler
from pymc_mcssvi.posterior.locals import LocalMoments, conditional_local_sampler, local_posteriors
from pymc_mcssvi.posterior.marginal import EPS_GRID, MAX_CORRECTED_HYPERS, NODES, DrawMoments
from pymc_mcssvi.posterior.profile_grid import MAX_GRID_HYPERS
from pymc_mcssvi.pymc import diagnostics, fit_loop
from pymc_mcssvi.pymc.approximation import (
    ConditionalView,
    PointGroup,
    RayleighGroup,
    StructuredApproximation,
    StructuredGaussianGroup,
)
from pymc_mcssvi.pymc.dask_data import DaskStep, dask_statistics, has_dask_data
from pymc_mcssvi.pymc.fit_warnings import (
    check_hyper_size,
    warn_collapsed_scales,
    warn_improper_posterior,
    warn_split_crossed,
    warn_uncoupled_hypers,
)
from pymc_mcssvi.pymc.full_data import full_data_model
from pymc_mcssvi.pymc.leaves import LeafGroup, initial_leaf_params
from pymc_mcssvi.pymc.locals import LocalGroup, initial_local_params
from pymc_mcssvi.pymc.start import (
    SYMMETRY_JITTER,
    data_scaled_factors,
    evaluation_error,
    initial_q,
)
from pymc_mcssvi.recognize.analysis import local_scale_hypers
from pymc_mcssvi.recognize.ir import Segment
from pymc_mcssvi.recognize.model import check_data, recognize
from pymc_mcssvi.recognize.rules import MIXED_BILINEAR
from pymc_mcssvi.recognize.separable import flat_offsets

__all__ = ["HMCSSVI", "MCSSVI", "SDSVI", "StructuredVI"]

#: Most full-data iterations that end a ``pm.Minibatch`` fit (see ``StructuredVI._polish``).
POLISH_MAX_ITER = 200

logger = logging.getLogger("pymc_mcssvi")


class StructuredVI(Inference):
    """Base class of the structured natural-gradient VI methods.

    Parameters
    ----------
    model : pm.Model, optional
    random_seed : int, optional
        Seeds minibatch draws and Monte Carlo estimators; the same seed gives
        bit-identical results.
    start : dict, optional
        Starting values (constrained space, by variable name).
    start_sigma : float or dict, default 1.0
        Initial standard deviation of q for every Gaussian global; scaled down
        (all coordinates alike) when it would give a linear predictor an sd
        above :data:`~pymc_mcssvi.pymc.start.START_PREDICTOR_SD` (unstandardized covariates). As for
        ``pm.ADVI``, a dict gives sds by variable name (unconstrained space,
        scalars or arrays of the variable's shape; others start at 1, and
        q(h) of a named hyperparameter starts at the given sd instead of 0.1).
    cov : {"auto", "full", "block", "diag"} or dict, optional
        Covariance structure of q per Gaussian global.
    hyper : {"meanfield", "point"}, optional
        Treatment of hyperparameters (free variables without a Gaussian or
        Rayleigh prior): a Gaussian q in PyMC's unconstrained space,
        independent of q(w) (default; closer to NUTS for group-level scales,
        see docs/benchmarks.md), or type-II ML / MAP point estimates of the
        bound (the paper's choice). See
        :mod:`pymc_mcssvi.algorithms.hyperparameters`. By default
        ``"meanfield"``, also for covariance matrices (``LKJCholeskyCov``).
    schedule : {"auto", "adaptive", "inverse", "power", "constant"} or float
        Step-size schedule; ``"auto"`` is ``"adaptive"`` for full-batch fits and
        ``"power"`` for minibatch fits. See :mod:`pymc_mcssvi.algorithms.schedules`.
    rho0, tau, kappa : float
        Schedule parameters. ``tau`` defaults to 1, and with ``row_subsample``
        to the mean weight ``|O_j| / |M_j|`` of the rows (at most 100): heavily
        subsampled rows make the early natural steps noisy, and on a bilinear
        predictor that noise feeds back (a 200 x 200 binary factorization with
        K = 20 and 2 of 160 observations per row diverged within 20 iterations
        at ``tau = 1``).
    mean_optimizer, factor_optimizer : str, tuple or Optimizer
        First-order rules (``"adagrad"``, ``"adam"``, ``"sgd"`` or ``(name, lr)``).
    hyper_optimizer : "newton" or optimizer spec
        Point hyperparameters take damped Newton steps on the bound (exact
        Hessian in the unconstrained hyperparameters, default) or a first-order
        rule such as the paper's ``("adagrad", 1.0)``.
    estimator : {"quadrature", "mc"}
        One-dimensional expectations in predictor space.
    n_points : int
        Gauss-Hermite nodes (or MC draws) per predictor entry.
    n_draws : int
        Draws of the Monte Carlo + autodiff estimator for non-affine terms.
    fixed_draws : bool, optional
        Reuse those draws every iteration (default: for full-batch fits).
    bound : {"optimal", "jensen"}
        Marginalize local latents inside the log (the optimal structured bound,
        paper eq. vlbi; default) or outside it (the Jensen bound, eq. vlb).
    inner : {"quadrature", "mc"}
        Gauss-Hermite quadrature or fresh Monte Carlo draws (the paper: 100) for
        the integral over a Gaussian local.
    n_inner : int
        Nodes (or draws) of that integral.
    n_rayleigh_nodes : int
        Quadrature nodes for expectations over a Rayleigh global's q.
    bilinear_draws : "auto", "sigma" or int
        Matrix factorization: the points of the other factor each observation's
        expectations average over. ``"sigma"``: its ``2K`` sigma points (exact second
        moments; for a Gaussian likelihood the conjugate update is exact). An
        integer: that many fixed draws per row of the other factor (the paper's
        ``k1``), each row its own, ``K / 2``-times cheaper at ``4``; their errors
        average out over the many rows a row's update sums over, but a few draws
        still bias the bound slightly. ``"auto"`` (default): sigma points while an
        iteration evaluates at most
        :data:`~pymc_mcssvi.estimators.bilinear.SIGMA_POINT_BUDGET` of them
        (observations x ``2K``; InstEval's 45,000 ratings at ``K = 10``), else 4
        draws (a 1000 x 1000 matrix at ``K = 20``: 3-4 s an iteration instead of 25).
    row_subsample : int, optional
        Matrix factorization: in each iteration every row of the factor being
        updated uses at most this many of its observations, weighted by
        ``|O_j| / |M_j|`` (the paper's per-row subsampling for dense rows): a
        window of a once-shuffled order of the row's observations that starts
        at a random offset and moves on by ``row_subsample`` at each step of
        the factor, so that each is used with probability ``|M_j| / |O_j|`` and
        every ``|O_j| / |M_j|`` steps use each once.
        The bound estimate is then stochastic, so the default schedule is
        ``"power"`` and convergence is judged on windowed averages, as with
        ``pm.Minibatch``.
    row_batch : int, optional
        Move a per-row global (one block of q per row, read by ``pm.Potential`` or
        other Monte Carlo terms: a topic model's document logits) ``row_batch`` rows at
        a time, round robin: each step evaluates the terms on those rows'
        observations only, takes a whole natural step for those rows (their optimum
        given the other globals) and keeps the others, and steps the other globals
        with the terms scaled by the number of windows (the paper's CTM algorithm, one
        document a step at ``row_batch=1``). The priors, hyperparameters included, are
        evaluated on all rows every step. The bound estimate is stochastic: the
        default schedule is ``"power"`` counted in passes over the rows, and
        convergence is judged on windowed averages, as with ``pm.Minibatch``. The
        terms must be sums over observations that each read one row through a
        constant index (``theta[d]``); anything else is refused. The terms' part of a
        step costs about ``row_batch / rows`` of a full-batch step; drawing and
        stepping the other globals costs as much as in full batch (12.7 s against
        30.2 s a step for a topic model's 500,000 topic logits), and per pass over the
        rows the fit progresses more slowly than full batch (docs/benchmarks.md, "CTM
        at NIPS scale").
    linear_response : bool, optional
        Default: True, except with local scales (below).
        With ``hyper="meanfield"``: the returned approximation corrects the
        mean-field q(h) for its independence from q(w). q(h) gets the precision
        of the bound's curvature in ``h`` with q(w) re-optimized (a Schur
        complement, see
        :func:`~pymc_mcssvi.algorithms.hyperparameters.joint_newton_step`), and
        the Gaussian globals' draws follow the hyperparameters' draws through
        ``dm_w/dh = P_w^{-1} E[d g_w / d h]`` (linear response, Giordano,
        Broderick and Jordan 2015). The fit and its bound are unchanged; the
        scales' posterior sds come much closer to NUTS's (docs/benchmarks.md,
        "Options of pm.fit"). Applies when the hyperparameter step is coupled
        (MC-SSVI and H-MC-SSVI in full batch). Off by default when a
        hyperparameter holds one scale per coefficient (local shrinkage: a
        horseshoe's ``lam``, an R2D2 prior's ``phi``;
        :func:`~pymc_mcssvi.recognize.analysis.local_scale_hypers`), where the
        linearization of ``m_w(h)`` would be extrapolated far over a wide q(h).
    hyper_marginal : {"profile", "gaussian"}
        With the linear-response view and at most 8 hyperparameter
        coordinates (:data:`~pymc_mcssvi.posterior.marginal.MAX_CORRECTED_HYPERS`),
        ``"profile"`` (default) replaces the Gaussian q(h) by a
        skewed one after the fit: the bound with q(w) re-fitted is evaluated
        along each principal axis of q(h) (INLA-style, 33 points for 4
        coordinates after ``n (n + 1)`` for its curvature; one compiled
        function), and its 1-D profiles become the axes' marginals
        (:mod:`pymc_mcssvi.posterior.marginal`): group-level scales are skewed in
        log space, which a Gaussian misses. Kept Gaussian where the profile disagrees with the linear response's
        curvature. With one or two coordinates the profile is evaluated on a
        grid grown from the centre instead (:mod:`pymc_mcssvi.posterior.profile_grid`),
        which follows a scale's long tail towards 0 and the ridge of two
        scales that trade variance. ``"gaussian"`` skips it.
    chunk_size : int, optional
        Observations per chunk. A likelihood whose per-iteration intermediates would
        pass :data:`~pymc_mcssvi.algorithms.kernel.CHUNK_BYTES` (32 MB) is reduced
        chunk by chunk inside the compiled step (a scan), so that the step's memory
        stays a few chunks plus q whatever the number of observations (matrix
        factorizations of millions of ratings, the Monte Carlo path's draws). This
        option forces every such likelihood into chunks of this many observations
        (the same results up to rounding); ``None`` chooses by the memory budget.
    dask_batch : int, optional
        Data in Dask arrays (:func:`~pymc_mcssvi.pymc.dask_data.dask_data`): the
        number of the arrays' chunks each iteration reads, drawn at random (without
        replacement) and weighted by the rows of all over the rows drawn; a Zarr
        store is then read a few chunks at a time. The bound estimate is stochastic:
        schedules, the iterates' average and the stopping rule are those of
        ``pm.Minibatch``. ``None`` (default) reads every chunk (full batch).
    n_starts : int
        Full-batch fits: run the fit from this many starts and keep the one with the
        best bound (the same draws, so the bounds compare). The first start is the
        usual one; the others move the globals whose rows the likelihood couples (a
        topic model's topic-word logits, a matrix factorization's factors) by
        ``0.3 N(0, 1)`` noise. Topic models and other mixtures have local optima: a
        50-document CTM's default fit reached NUTS's mode in 3 of 6 seeds. Costs up to
        ``n_starts`` fits; ``approx.start_bounds`` holds each start's final -ELBO.
    polish : bool
        ``pm.Minibatch`` fits: after the stochastic steps, go on from the iterates'
        average with full-data steps (the same model on all rows, the full-batch
        schedule and stopping rule; at most 200 iterations, within ``n``), so that
        the fit lands on the full-batch optimum; ``approx.converged`` is then that
        rule's verdict. ``False`` keeps the iterate average (within about
        ``sqrt(N / B) / 10`` posterior sds after the stochastic rule; 0.5-0.6 sd
        for 20,000 rows in batches of 500).
    """

    algorithm_cls = MCSSVIStep
    default_mean_optimizer = None
    default_factor_optimizer = None

    def __init__(
        self,
        model=None,
        *,
        random_seed=None,
        start=None,
        start_sigma=1.0,
        cov=None,
        hyper=None,
        schedule="auto",
        rho0=None,
        tau=None,
        kappa=0.7,
        mean_optimizer=None,
        factor_optimizer=None,
        hyper_optimizer="newton",
        estimator="quadrature",
        n_points=12,
        n_draws=64,
        fixed_draws=None,
        bound="optimal",
        inner="quadrature",
        n_inner=12,
        n_rayleigh_nodes=6,
        bilinear_draws="auto",
        row_subsample=None,
        row_batch=None,
        linear_response=None,
        hyper_marginal="profile",
        chunk_size=None,
        polish=True,
        n_starts=1,
        dask_batch=None,
    ):
        #: The constructor's options (what :func:`~pymc_mcssvi.pymc.persist.save` records
        #: to build the same inference again).
        self.options = {k: v for k, v in locals().items() if k not in ("self", "model")}
        self.model = pm.modelcontext(model)
        check_options(self.options, self.model)
        self.linear_response = True if linear_response is None else bool(linear_response)
        if hyper_marginal not in ("profile", "gaussian"):
            raise ValueError(
                f"hyper_marginal must be 'profile' or 'gaussian', got {hyper_marginal!r}"
            )
        self.hyper_marginal = hyper_marginal
        self.random_seed = random_seed
        if hyper not in (None, "point", "meanfield"):
            raise ValueError(f"hyper must be 'point' or 'meanfield', got {hyper!r}")
        self._n_inner = int(n_inner)
        self.hist = np.asarray(())
        self.state = None
        self.fitted_state = None
        self._step_fns = {}  # compiled steps, by (backend, compile_kwargs)
        self._work = {}  # work_estimate(), by linear_algebra
        self.backend_used = None
        with graph_building():
            t0 = time.perf_counter()
            self.tlm = recognize(self.model, cov=cov, bound=bound, inner=inner, n_inner=n_inner)
            self.recognition_time = time.perf_counter() - t0
            # covariance matrices (covariance_hyperparameters) are mean-field too
            self.hyper_mode = hyper = hyper or "meanfield"
            if row_subsample is not None and not self.tlm.bilinear_terms:
                mixed = [
                    t.name for t in self.tlm.general_terms if t.reason.startswith(MIXED_BILINEAR)
                ]
                if mixed:
                    raise ValueError(
                        f"row_subsample needs a likelihood that depends on the factors only through "
                        f"the product (U[s] * V[d]).sum(-1), plus terms affine in other variables "
                        f"(biases, an intercept); the predictor of {mixed[0]!r} adds other terms to "
                        "it or transforms it, so it is fitted by Monte Carlo + autodiff over all of "
                        "them: drop row_subsample"
                    )
                raise ValueError(
                    "row_subsample applies to matrix factorization (bilinear predictors); "
                    "this model has none: use pm.Minibatch to subsample its rows"
                )
            if dask_batch is not None and not has_dask_data(self.model):
                raise ValueError(
                    "dask_batch applies to data in Dask arrays (pymc_mcssvi.dask_data); this "
                    "model has none: use pm.Minibatch to subsample its rows"
                )
            # Subsampled bounds are stochastic: schedules and stopping as for minibatches.
            subsampled = self.tlm.minibatch or row_subsample is not None or dask_batch is not None
            if row_batch is not None and subsampled:
                raise ValueError(
                    "row_batch moves all rows of the data in turn: use it without "
                    "pm.Minibatch, row_subsample or dask_batch"
                )
            minibatch = self.stochastic = subsampled or row_batch is not None
            if fixed_draws is None:
                # row_batch keeps the full-batch fit's draws (a window's chunks of draws
                # are reduced in the step, as in full batch): the same fixed point
                fixed_draws = not subsampled
            if n_starts > 1 and minibatch:
                raise ValueError(
                    "n_starts compares the starts' bounds, which a pm.Minibatch or row_subsample "
                    "fit only estimates: use n_starts=1 (or fit the full data)"
                )
            self.algorithm = self._make_algorithm(mean_optimizer, factor_optimizer)
            seed = (
                0
                if random_seed is None
                else int(np.random.SeedSequence(random_seed).generate_state(1)[0])
            )
            self.bound = StructuredBound(
                self.tlm,
                parameterization=self.algorithm.parameterization,
                estimator=estimator,
                n_points=n_points,
                n_draws=n_draws,
                fixed_draws=fixed_draws,
                seed=seed,
                bilinear_draws=bilinear_draws,
                row_subsample=row_subsample,
                row_batch=row_batch,
            )
            if tau is None:
                tau = self.bound.bilinear.mean_row_weight() if row_subsample is not None else 1.0
            sched_kw = {"tau": tau, "kappa": kappa}
            if rho0 is not None:
                sched_kw["rho0"] = rho0
            self.schedule = make_schedule(schedule, minibatch=minibatch, **sched_kw)
            deterministic = (
                estimator == "quadrature"
                and inner == "quadrature"
                and (fixed_draws or not self.tlm.general_terms)
            )
            monotone = self.schedule.monotone and deterministic and not minibatch
            hyper_opt = (
                None if hyper_optimizer == "newton" else make_optimizer(hyper_optimizer, 0.05)
            )
            hyper_opt = check_hyper_size(self.tlm, hyper, hyper_opt, hyper_optimizer)
            q0 = initial_q(
                self.model,
                self.tlm,
                self.algorithm.parameterization,
                start,
                start_sigma,
                hyper_opt,
                random_seed,
            )
            self.flat_maps = q0.flat_maps
            hyper_spec = q0.hyper_spec
            factors = data_scaled_factors(
                self.bound, self.algorithm.parameterization, q0.means, q0.factors, hyper_spec
            )
            hypers = None
            if hyper_spec is not None:
                cls = PointHyperparameters if hyper == "point" else MeanFieldHyperparameters
                hypers = cls(hyper_spec)
            rayleighs = None
            if self.tlm.rayleighs:
                natural = self.algorithm.parameterization == "precision"
                opt = self.algorithm.mean_optimizer or make_optimizer(("adam", 0.05), 0.05)
                rayleighs = RayleighGlobals(
                    self.model,
                    self.tlm.rayleighs,
                    natural=natural,
                    optimizer=opt,
                    n_nodes=n_rayleigh_nodes,
                )
            self.kernel = StepKernel(
                self.bound,
                self.algorithm,
                self.schedule,
                hypers,
                monotone,
                rayleighs,
                nseg=len(q0.means),
                chunk_size=chunk_size,
                # noisy estimates only: a deterministic full-batch step is taken whole
                trust_region=minibatch or not deterministic,
            )
            #: The fit's explicit state (:class:`~pymc_mcssvi.algorithms.state.KernelState`)
            #: in the shared variables the compiled step updates.
            self.store = SharedState(self.kernel.init_state(q0.means, factors), "fit")
            self._start = (q0.means, factors)
            #: The data terms summed over the chunks of Dask arrays
            #: (:func:`~pymc_mcssvi.pymc.dask_data.dask_data`), or ``None``.
            self._dask = dask_statistics(
                self.kernel, self.store, self.model, batch=dask_batch, random_seed=random_seed
            )
            warn_uncoupled_hypers(self.tlm, self.kernel)
            warn_split_crossed(self.tlm, self.kernel)
            if linear_response is None and local_scale_hypers(self.tlm):
                self.linear_response = False
            #: The iterates' average (``pm.Minibatch`` fits) and its locations at the
            #: windows' ends (the stochastic stopping rule reads them).
            self._average = (
                IterateAverage(self.algorithm.parameterization) if self._averaged else None
            )
            self._average_locations = []
            self._rejections = fit_loop.Rejections(self.kernel, self.store, self.model, random_seed)
            self._local_params = initial_local_params(self.tlm.locals) if self.tlm.locals else None
            self._local_moments = None
            self._leaf_params = initial_leaf_params(self.tlm.leaves) if self.tlm.leaves else None
            self._approx = self._make_approximation()
            # q(h)'s profile re-evaluates the bound on the data, which a model with
            # Dask data holds one chunk of: such a fit keeps q(h) from its iterations
            self._posterior = self._make_posterior() if self._dask is None else None

    def _make_algorithm(self, mean_optimizer, factor_optimizer):
        mo = (
            make_optimizer(mean_optimizer or self.default_mean_optimizer, 1.0)
            if (mean_optimizer or self.default_mean_optimizer)
            else None
        )
        fo = (
            make_optimizer(factor_optimizer or self.default_factor_optimizer, 1.0)
            if (factor_optimizer or self.default_factor_optimizer)
            else None
        )
        return self.algorithm_cls(mean_optimizer=mo, factor_optimizer=fo)

    def _make_approximation(self):
        tlm = self.tlm
        k = self.kernel
        st = self.store.symbolic
        hyper_group, response = None, None
        self._marginal, self._grid, self._view = None, None, None
        if tlm.hypers and k.hypers.mode == "point":
            hyper_group = PointGroup(
                [h.rv for h in tlm.hypers], model=self.model, point=st.hyper.base
            )
        elif tlm.hypers:
            n = k.hypers.spec.size
            seg = Segment("full", 1, n, [0])
            lr = self.linear_response and k.coupled
            if lr and self.hyper_marginal == "profile" and n <= MAX_CORRECTED_HYPERS:
                self._marginal = (
                    pytensor.shared(np.int8(0), name="hyper_marginal_on"),
                    pytensor.shared(np.eye(n), name="hyper_marginal_axes"),
                    pytensor.shared(np.ones(n), name="hyper_marginal_scales"),
                    pytensor.shared(np.tile(EPS_GRID, (n, 1)), name="hyper_marginal_table"),
                    pytensor.shared(np.zeros(n), name="hyper_marginal_shift"),
                    pytensor.shared(np.eye(n), name="hyper_marginal_cov"),
                )
            if self._marginal is not None and n <= MAX_GRID_HYPERS:
                self._grid = (
                    pytensor.shared(np.int8(0), name="hyper_grid_on"),
                    pytensor.shared(np.ones(n), name="hyper_grid_scales"),
                    pytensor.shared(np.tile(EPS_GRID, (n, 1)), name="hyper_grid_table"),
                    pytensor.shared(np.tile(EPS_GRID, (2, 1)), name="hyper_grid_conditional"),
                    pytensor.shared(np.array([0.0, 1.0]), name="hyper_grid_rows"),
                )
            hyper_group = StructuredGaussianGroup(
                [h.rv for h in tlm.hypers],
                model=self.model,
                segments=[seg],
                flat_maps=[np.arange(n)[None]],
                parameterization="precision",
                means=[st.hyper.base_mean],
                factors=[st.hyper.lr_factor if lr else st.hyper.base_factor],
                marginal=self._marginal,
                grid=self._grid,
            )
            if lr:
                response = (hyper_group, list(st.hyper.lr_responses))
        arrow_view = self.linear_response and k.arrow_head is not None
        if self._marginal is not None and not arrow_view:
            n_w = sum(g.size for g in tlm.gaussians)
            self._view = ConditionalView(
                pytensor.shared(np.int8(0), name="conditional_view_on"),
                [
                    pytensor.shared(f.get_value(), name=f"conditional_view_factor_{s}")
                    for s, f in enumerate(st.base.factors)
                ],
                pytensor.shared(
                    np.zeros((k.hypers.spec.size, len(NODES), n_w)), name="conditional_view_sd"
                ),
                pytensor.shared(
                    np.zeros((k.hypers.spec.size, len(NODES), n_w)), name="conditional_view_mean"
                ),
                pytensor.shared(
                    np.zeros((k.hypers.spec.size, len(NODES), n_w)),
                    name="conditional_view_axis_log_scales",
                ),
                pytensor.shared(
                    np.zeros((1, n_w)), name="conditional_view_log_scales", shape=(None, n_w)
                ),
                pytensor.shared(np.zeros((2, n_w)), name="conditional_view_scale_masks"),
                DrawMoments(
                    pytensor.shared(np.zeros(n_w), name="conditional_view_mean_shift"),
                    pytensor.shared(
                        np.zeros((n_w, 1)), name="conditional_view_R", shape=(n_w, None)
                    ),
                    pytensor.shared(
                        np.zeros((n_w, k.hypers.spec.size)), name="conditional_view_cross"
                    ),
                ),
                [
                    pytensor.shared(f.get_value(), name=f"conditional_view_moment_factor_{s}")
                    for s, f in enumerate(st.base.factors)
                ],
            )
        groups = [
            StructuredGaussianGroup(
                [g.rv for g in tlm.gaussians],
                model=self.model,
                segments=tlm.segments,
                flat_maps=self.flat_maps,
                parameterization=self.algorithm.parameterization,
                means=list(st.base.means),
                factors=list(st.base.factors),
                response=response,
                arrow=(k.arrow_head, list(st.arrow.G), st.arrow.LS) if arrow_view else None,
                view=self._view,
            )
        ]
        if hyper_group is not None:
            groups.append(hyper_group)
        if tlm.rayleighs:
            groups.append(
                RayleighGroup(
                    [r.rv for r in tlm.rayleighs],
                    model=self.model,
                    scales=list(st.rayleigh.base),
                )
            )
        if tlm.locals:
            groups.append(
                LocalGroup(
                    [lc.rv for lc in tlm.locals],
                    model=self.model,
                    locals=tlm.locals,
                    local_params=self._local_params,
                )
            )
        if tlm.leaves:
            groups.append(
                LeafGroup(
                    [leaf.rv for leaf in tlm.leaves],
                    model=self.model,
                    leaves=tlm.leaves,
                    leaf_params=self._leaf_params,
                )
            )
        approx = StructuredApproximation(groups, model=self.model)
        approx.point_estimates = [h.name for h in tlm.hypers] if self.hyper_mode == "point" else []
        return approx

    def _make_posterior(self):
        """The hyperparameters' posterior after a fit (the skewed q(h)), or ``None``."""
        if self._marginal is None:
            return None
        n_w = sum(g.size for g in self.tlm.gaussians)
        return HyperMarginal(
            self.kernel,
            self.store,
            self.model,
            self.tlm,
            self.approx.groups[0],
            self.flat_maps,
            work=self.work_estimate(),
            backend=None,
            gridded=self._grid is not None,
            view_size=n_w if self._view is not None else None,
        )

    def _clear_posterior(self):
        """Switch off the approximation's posterior tables (recomputed after a fit)."""
        for tables in (self._marginal, self._grid):
            if tables is not None:
                tables[0].set_value(np.int8(0))
        if self._view is not None:
            self._view.on.set_value(np.int8(0))

    def _set_posterior(self, found: HyperMarginalResult):
        """Put what :meth:`~pymc_mcssvi.posterior.hyper_marginal.HyperMarginal.compute`
        found into the fit's state (q(h)'s precision) and the approximation's tables."""
        if found.lr_factor is not None:
            state = self.store.get()
            self.store.set(state._replace(hyper=state.hyper._replace(lr_factor=found.lr_factor)))
        if found.grid is not None:
            on, *shared = self._grid
            for sh, value in zip(shared, found.grid, strict=True):
                sh.set_value(value)
            on.set_value(np.int8(1))
        if found.marginal is not None:
            on, *shared = self._marginal
            for sh, value in zip(shared, found.marginal, strict=True):
                sh.set_value(value)
            on.set_value(np.int8(1))
        if found.view is not None:
            view, v = self._view, found.view
            for sh, value in zip(view.moments, v.moments, strict=True):
                sh.set_value(value)
            for sh, f in zip(view.factors, v.factors, strict=True):
                sh.set_value(f)
            for sh, f in zip(view.moment_factors, v.moment_factors, strict=True):
                sh.set_value(f)
            view.mean_table.set_value(v.mean_table)
            view.log_scale_axes.set_value(v.log_scale_axes)
            view.log_scale_grid.set_value(v.log_scale_grid)
            view.scale_masks.set_value(v.scale_masks)
            view.sd_table.set_value(v.sd_table)
            view.on.set_value(np.int8(1))

    @property
    def approx(self):
        return self._approx

    def choose_backend(self) -> str:
        """The backend used when ``backend=None``: ``"python"`` (no compilation) for
        small problems, JAX (or numba without JAX) for large ones
        (:func:`~pymc_mcssvi.backend.compile.choose_backend`, from
        :meth:`work_estimate` without the factorizations of q's blocks)."""
        return choose_backend(self.work_estimate(linear_algebra=False))

    def work_estimate(self, linear_algebra: bool = True) -> float:
        """Estimated flops of one iteration (drives the backend and BLAS-thread choices);
        ``linear_algebra=False``: without the factorizations of q's blocks."""
        if linear_algebra not in self._work:
            with graph_building():
                work = self.bound.work_estimate(
                    self._n_inner if self.tlm.locals else 1, linear_algebra=linear_algebra
                )
            k = self.kernel
            if k.rayleighs is not None:
                work *= k.rayleighs.n_nodes ** len(k.rayleighs.rayleighs)
            if k.hypers is not None and k.hypers.mode == "meanfield":
                work *= len(k.hypers.w)
            self._work[linear_algebra] = float(work)
        return self._work[linear_algebra]

    def _blas_limits(self, blas_threads):
        """Thread limits for BLAS/LAPACK during the fit.

        The linear algebra of small and medium problems (blocks of a few hundred
        dimensions) is slower with several BLAS threads than with one: the threads'
        start-up and spinning cost more than they save. ``None`` picks one thread
        unless an iteration is large, q has a block of a few hundred dimensions and a
        core is idle (:func:`~pymc_mcssvi.backend.compile.blas_threads_for`).
        """
        if blas_threads is None:
            largest = max((seg.k for seg in self.tlm.segments), default=0)
            blas_threads = blas_threads_for(self.work_estimate(), largest)
        if blas_threads is None:
            return contextlib.nullcontext()
        return threadpool_limits(limits=int(blas_threads), user_api="blas")

    def _step_function(self, backend=None, compile_kwargs=None):
        """The compiled step for ``backend`` (chosen when ``None``), compiled once."""
        compile_kwargs = dict(compile_kwargs or {})
        automatic = backend is None and "mode" not in compile_kwargs
        if self._dask is not None:
            # the data terms run in the chunks' function, compiled with JAX when all the
            # chunks' work would choose it (the model holds one chunk: 0.15 s against 0.3 s
            # for a chunk of 100,000 x 20 logistic rows); the step on their sums is small
            # and runs uncompiled unless a backend is named
            chunks = self._dask.batch or self._dask.n_chunks
            work = self.work_estimate(linear_algebra=False) * chunks
            chosen = choose_backend(work) if automatic else backend
            self._dask.chunk.backend = "jax" if chosen == "jax" else "python"
            if automatic:
                backend, automatic = "python", False
        if automatic:
            backend = self.choose_backend()
        key = (backend, repr(sorted(compile_kwargs.items())))
        if key not in self._step_fns:
            if automatic and backend == "jax":
                # a missing JAX translation (NotImplementedError) or a failure inside one:
                # the fallback backend compiles the same graph (and re-raises a genuine
                # error), remembered under this key by _replace_jax_step
                fn = self._guarded_jax_step(
                    compile_kwargs, lambda err: self._replace_jax_step(key, compile_kwargs, err)
                )
                self._step_fns.setdefault(key, (fn, "jax"))
            else:
                switch = None
                if automatic and backend == "python" and jax_available():
                    # slow uncompiled iterations move to JAX (JAX_SWITCH_SECONDS)
                    switch = functools.partial(self._switch_to_jax, compile_kwargs)
                fn = self._compile(backend, compile_kwargs, switch=switch)
                self._step_fns[key] = (fn, backend or "custom")
        fn, self.backend_used = self._step_fns[key]
        if self._posterior is not None:
            self._posterior.backend = self.backend_used
        if isinstance(fn, UpgradingStep) and fn.switched is not None:
            self.backend_used = "jax"  # the step only: post-fit functions stay uncompiled
        return fn

    def _compile(self, backend, compile_kwargs, switch=None):
        dask = self._dask
        fn = compile_step(
            self.kernel,
            self.store,
            self.model,
            backend,
            compile_kwargs,
            self.random_seed,
            switch,
            external=dask.external if dask is not None else None,
        )
        return DaskStep(dask, fn) if dask is not None else fn

    def _switch_to_jax(self, compile_kwargs, fallback):
        """The JAX step that an automatically chosen ``"python"`` step hands over to
        once its iterations have taken :data:`~pymc_mcssvi.backend.compile.JAX_SWITCH_SECONDS`
        (``fallback(error)``: the Python step again, if JAX cannot run it)."""
        logger.info(
            "The uncompiled iterations have taken %.0f s: compiling the step with JAX for the rest",
            compile_module.JAX_SWITCH_SECONDS,
        )

        def stay_uncompiled(err):
            self.backend_used = "python"
            return fallback(err)

        self.backend_used = "jax"
        return self._guarded_jax_step(compile_kwargs, stay_uncompiled)

    def _guarded_jax_step(self, compile_kwargs, fallback):
        """The JAX step, or ``fallback(error)`` when JAX cannot compile it or (on the first
        call, when PyTensor's JAX functions are traced) run it."""
        try:
            fn = self._compile("jax", compile_kwargs)
        except Exception as err:  # noqa: BLE001  (JAX's translation errors share no base class)
            return fallback(err)
        return TracedOnFirstCall(fn, fallback)

    def _jax_fallback_backend(self) -> str:
        """Backend used when JAX cannot run an automatically chosen step."""
        return fallback_backend(self.work_estimate())

    def _replace_jax_step(self, key, compile_kwargs, err):
        """Compile the fallback of a JAX step that failed to compile or trace, and remember it."""
        fallback = self._jax_fallback_backend()
        logger.info(
            "JAX cannot run this step (%s: %s); using the %s backend instead.",
            type(err).__name__,
            str(err).splitlines()[0] if str(err) else "",
            fallback,
        )
        fn = self._compile(fallback, compile_kwargs)
        self._step_fns[key] = (fn, fallback)
        self.backend_used = fallback
        if self._posterior is not None:
            self._posterior.backend = fallback
        return fn

    # --------------------------------------------------------------------- fit
    def fit(
        self,
        n=None,
        score=None,
        callbacks=None,
        progressbar=True,
        progressbar_theme=default_progress_theme,
        *,
        tol="auto",
        max_iter=10_000,
        backend=None,
        include_transformed=False,
        compile_kwargs=None,
        blas_threads=None,
        diagnose="auto",
        **kwargs,
    ):
        """Run the algorithm.

        Parameters
        ----------
        n : int, optional
            The most iterations: the fit stops earlier when the bound has
            converged (see ``tol``), and warns when it stops at ``n`` without
            converging. ``None`` caps at ``max_iter``. With ``tol=None`` exactly
            ``n`` iterations run (PyMC's ADVI habit; ``approx.converged`` is then
            ``None``).
        callbacks : list of callable, optional
            Called as ``callback(approx, losses, i)`` after each iteration, as in
            PyMC; raising ``StopIteration`` ends the fit.
        progressbar : bool
        tol : float, "auto" or None
            Relative change of the bound that counts as converged (``"auto"``:
            ``1e-7`` for full-batch fits, ``1e-3`` between windowed averages for
            minibatch fits; full-batch matrix factorizations of at least
            :data:`~pymc_mcssvi.pymc.fit_loop.PER_OBSERVATION_MIN` observations
            also stop when the bound gains at most
            :data:`~pymc_mcssvi.pymc.fit_loop.PER_OBSERVATION_GAIN` nats per
            observation an iteration, as their bound creeps on long after the
            predictions have settled). ``None`` turns the stopping rule off: ``n``
            iterations run.
        max_iter : int
            Cap on the number of iterations when ``n`` is None.
        backend : {"numba", "c", "jax", "python"}, optional
            PyTensor backend of the compiled step. ``None`` chooses ``"python"``
            (no compilation) for small problems and ``"jax"`` (or ``"numba"``
            when JAX is not installed) for large ones, see :meth:`choose_backend`;
            an uncompiled step whose iterations have taken 5 s at over 0.2 s each
            (:data:`~pymc_mcssvi.backend.compile.JAX_SWITCH_SECONDS`) is compiled
            with JAX for the rest of the fit. That hand-over depends on measured
            time: a backend given by name is kept, for fits that must repeat to
            the last digit.
        blas_threads : int, optional
            Threads of BLAS/LAPACK during the fit (the iterations and the re-fits
            after them); ``None`` uses one thread unless an iteration is large, q has
            a block of a few hundred dimensions and a core is idle (see
            :func:`~pymc_mcssvi.backend.compile.blas_threads_for`): several threads
            are slower for many small products, and on busy cores.

        diagnose : bool or "auto"
            PSIS diagnosis of the fitted q against the model's joint density
            (:meth:`StructuredApproximation.diagnose`), kept as
            ``approx.diagnosis``; a fit whose Pareto k-hat is 0.7 or more (more in
            over about 180 dimensions, where k-hat grows even for a good q:
            :func:`~pymc_mcssvi.pymc.diagnostics.khat_threshold`) warns
            (:class:`~pymc_mcssvi.pymc.diagnostics.PSISWarning`). ``"auto"``
            diagnoses fits that it can at a small cost (up to 2,000 coordinates in q
            and 2,000,000 observed values times coordinates, no ``pm.Minibatch`` or
            integrated-out locals); ``True`` every fit, ``False`` none.

        Returns
        -------
        StructuredApproximation
        """
        if kwargs:
            unknown = ", ".join(sorted(kwargs))
            raise TypeError(
                f"{type(self).__name__}.fit() got unexpected arguments: {unknown}. The natural-"
                "gradient steps take no optimizer or Monte Carlo settings: the step size is set "
                "by `schedule` and `rho0`, the mean step by `mean_optimizer`, passed to the "
                "inference (`pm.fit(..., inf_kwargs=...)` or directly to pm.fit)"
            )
        if not (diagnose is True or diagnose is False or diagnose == "auto"):
            raise ValueError(f"diagnose must be True, False or 'auto', got {diagnose!r}")
        if diagnose is True and self._dask is not None:
            raise ValueError(
                "diagnose=True: the PSIS diagnosis needs the model's log density on all the "
                "data, and a model with Dask data holds one chunk of it; fit with "
                "diagnose='auto' (which skips it) or False"
            )
        if n is not None and not _is_positive_int(n):
            raise ValueError(f"n must be a positive integer (number of iterations), got {n!r}")
        if not _is_positive_int(max_iter):
            raise ValueError(f"max_iter must be a positive integer, got {max_iter!r}")
        _check_fit_options(backend, blas_threads, callbacks, compile_kwargs)
        if self.approx.changed_data():
            check_data(self.model, self.tlm.gaussian_values, self.tlm.static_data)
            # ``pm.set_data`` since the last fit: the stored bound (and the derivatives
            # behind the pending candidate) are the old data's, against which every step
            # would be judged. The current q is re-evaluated on the new data and accepted.
            state = self.kernel.reset_candidate(self.store.get())
            self.store.set(
                state._replace(
                    bound=np.asarray(-np.inf),
                    phase_bounds=np.full_like(state.phase_bounds, -np.inf),
                )
            )
        self._clear_posterior()  # recomputed at the end of this fit
        step = self._step_function(backend, compile_kwargs)
        if isinstance(step, UpgradingStep):
            if n is not None and step.calls + n > compile_module.UPGRADE_AT:
                step.upgrade()
            step.compile()  # before the loop, as for the other backends
        total = int(n) if n is not None else int(max_iter)
        auto_tol = isinstance(tol, str) and tol == "auto"
        if auto_tol:
            tol = 1e-3 if self.stochastic else 1e-7
        elif tol is not None and not (isinstance(tol, int | float) and tol > 0):
            raise ValueError(f"tol must be a positive number, 'auto' or None, got {tol!r}")
        if n is None and tol is None:
            raise ValueError("tol=None runs exactly n iterations: pass n as well")
        auto_stop = tol is not None
        start_iter = len(self.hist)
        with (
            self._blas_limits(blas_threads),
            # Non-finite candidates are rejected by the step itself (and a run of them
            # raises DivergenceError): NumPy's floating-point warnings are noise here.
            np.errstate(all="ignore"),
        ):
            run = functools.partial(
                self._run_loop,
                step,
                total=total,
                auto_stop=auto_stop,
                stop_rule=functools.partial(self._converged, tol=tol, auto_tol=auto_tol),
                current_bound=self.store.symbolic.bound.get_value,
                after_step=self._after_step,
                callbacks=list(callbacks or []),
                approx=self.approx,
                start_iter=start_iter,
                progressbar=progressbar,
                progressbar_theme=progressbar_theme,
            )
            n_starts = self.options["n_starts"]
            if n_starts > 1 and start_iter == 0 and not self.stochastic:
                result = self._best_of_starts(run, n_starts)
            else:
                result = run()
        scores = result.scores
        if start_iter == 0:
            # iterations spent on a start whose bound was not finite (then narrowed, see
            # :func:`~pymc_mcssvi.pymc.start.shrink_start`) are not part of the history
            finite = np.isfinite(scores)
            first = np.argmax(finite) if finite.any() else (len(scores) if result.error else 0)
            scores = scores[first:]
        self.hist = np.concatenate([self.hist, scores])
        self.approx.hist = self.hist
        self.approx.n_iter = len(self.hist)
        if result.error is not None:
            raise result.error
        if result.iterations and not np.isfinite(float(self.store.symbolic.bound.get_value())):
            # ``n`` ran out before the start could be narrowed and jittered to the end: no
            # step was ever accepted, and the approximation is the start
            raise fit_loop.start_not_finite(
                self.model,
                -scores[-1] if len(scores) else np.nan,
                self.approx,
                len(self.hist),
                f" after {result.iterations} iterations",
            )
        self.state = result.iterations
        if self._averaged:
            self._use_average()
            budget = min(POLISH_MAX_ITER, total - result.iterations)
            if auto_stop and self.options["polish"] and budget > 0:
                polished = self._polish(
                    budget, progressbar, progressbar_theme, backend, blas_threads
                )
                if polished is not None:
                    self.hist = np.concatenate([self.hist, polished.hist])
                    self.approx.hist = self.hist
                    self.approx.n_iter = len(self.hist)
                    scores = polished.hist
                    result.converged = bool(polished.converged)
        self.approx.converged = result.converged if auto_stop else None
        if auto_stop:
            msg = "converged" if result.converged else "stopped without converging"
            logger.info(
                f"{type(self).__name__}: {msg} after {result.iterations} iterations, "
                f"-ELBO = {scores[-1] if len(scores) else np.nan:,.6g}"
            )
            if not result.converged and result.iterations == total:
                cap = f"n={total}" if n is not None else f"max_iter={total}"
                warnings.warn(
                    f"The fit stopped at {cap} iterations without converging (-ELBO "
                    f"{scores[-1] if len(scores) else np.nan:,.6g}); approx.converged is False. "
                    f"Go on with pm.fit(method={type(self).__name__.lower()!r}, start=approx) "
                    "or inference.refine(n), or raise the cap; tol=None runs exactly n "
                    "iterations without this check.",
                    UserWarning,
                    stacklevel=3,
                )
        warn_collapsed_scales(self.model, self.tlm, self.kernel, self.store.get())
        warn_improper_posterior(self.model, self.tlm, self.approx)
        approx = self.finish(include_transformed, blas_threads)
        if self._dask is not None and diagnose is not False:
            # the model's own log density holds the Dask data's first chunk only
            logger.info("The PSIS diagnosis is skipped: the data are in Dask arrays")
            diagnose = False
        if self._dask is not None and self._marginal is not None:
            logger.info(
                "q(h) stays the fit's Gaussian (hyper_marginal='gaussian'): its post-fit "
                "profile would re-evaluate the bound on all the data, in Dask arrays"
            )
        approx.diagnosis = diagnostics.after_fit(approx, diagnose, self.random_seed)
        return approx

    def _best_of_starts(self, run, n_starts):
        """``run()`` from ``n_starts`` starts (see ``n_starts``), the state with the best
        bound kept; each start's final -ELBO in ``approx.start_bounds``."""
        moved = self._coupled_globals()
        if not moved:
            warnings.warn(
                f"n_starts={n_starts}: the model has no Gaussian global whose rows its likelihood "
                "couples (topics, factors) for the other starts to move; one start is run",
                UserWarning,
                stacklevel=4,
            )
            return run()
        best, bounds = None, []
        for j in range(n_starts):
            if j:
                self.store.set(self.kernel.init_state(self._moved_start(j, moved), self._start[1]))
                self._rejections = fit_loop.Rejections(
                    self.kernel, self.store, self.model, self.random_seed
                )
            result = run()
            bound = float(self.store.symbolic.bound.get_value())
            bounds.append(-bound)
            if result.error is not None:
                best = (bound, self.store.get(), result)
                break
            if best is None or bound > best[0]:
                best = (bound, self.store.get(), result)
        self.store.set(best[1])
        self.approx.start_bounds = np.asarray(bounds)
        logger.info("starts' -ELBO: %s; kept %.6g", np.round(bounds, 3), -best[0])
        return best[2]

    def _coupled_globals(self) -> set:
        """Ids of the Gaussian globals the other starts move: a matrix factorization's
        factors and the matrices whose rows the general terms couple (topics)."""
        tlm = self.tlm
        moved = {gid for term in tlm.bilinear_terms for gid in (term.left, term.right)}
        moved |= {
            gid
            for gid in self.bound.general.reads
            if gid not in tlm.general_rows and len(tlm.gaussians[gid].shape) >= 2
        }
        return moved

    def _moved_start(self, j, moved):
        """The start's means with the globals ``moved`` (:meth:`_coupled_globals`) moved by
        ``0.3 N(0, 1)`` noise (seeded by ``random_seed`` and ``j``)."""
        tlm = self.tlm
        seed = (
            np.random.SeedSequence(self.random_seed).entropy if self.random_seed is not None else 0
        )
        rng = np.random.default_rng([int(seed) % 2**32, j])
        offsets = flat_offsets(tlm.gaussians)
        flat = np.zeros(int(offsets[-1]))
        for m, idx in zip(self._start[0], self.flat_maps, strict=True):
            flat[idx] = m
        for gid in sorted(moved):
            o, n = int(offsets[gid]), tlm.gaussians[gid].size
            flat[o : o + n] += SYMMETRY_JITTER * rng.standard_normal(n)
        return [flat[idx] for idx in self.flat_maps]

    def _run_loop(self, step, **kwargs):
        """:func:`~pymc_mcssvi.pymc.fit_loop.run`; a first step that raises (shapes that
        do not fit) is diagnosed on PyMC's own log densities, naming the variable."""
        try:
            return fit_loop.run(step, **kwargs)
        except (ValueError, IndexError, TypeError) as err:
            found = evaluation_error(self.model) if not len(self.hist) else None
            if found is None:
                raise
            raise found from err

    def finish(self, include_transformed=False, blas_threads=None):
        """The approximation of the current state: the work after the iterations (q(h)
        from the profile of the bound, the locals' and leaves' posteriors). Called at the
        end of :meth:`fit`, and by :func:`~pymc_mcssvi.pymc.persist.load` on a restored
        state."""
        for group in self.approx.groups:
            group.include_transformed = include_transformed
        #: The state the iterations left, before the post-fit work below writes q(h)'s
        #: precision into it (what :func:`~pymc_mcssvi.pymc.persist.snapshot` saves).
        self.fitted_state = self.store.get()
        # the re-fits after the loop are small linear algebra too (see ``_blas_limits``)
        conditional_globals = None
        with self._blas_limits(blas_threads):
            if self._posterior is not None:
                found = self._posterior.compute(self.store.get(), bool(self.approx.converged))
                self._set_posterior(found)
                if self._view is not None:
                    conditional_globals = self._posterior.conditional_globals()
        self._conditional_samplers(conditional_globals)
        self.approx.inference = self
        return self.approx

    def _conditional_samplers(self, conditional_globals):
        """The approximation's draws that condition on its other draws: q(w | h) re-fitted
        at each draw of ``h``, the locals given the globals, the predictive leaves; and the
        locals' and leaves' moments."""
        factories = []
        if conditional_globals is not None:
            # the factory holds what it returns, not the inference object (whose compiled
            # step does not pickle): a fitted approximation pickles as PyMC's do
            factories.append(lambda: conditional_globals)
        if self.tlm.locals:
            if self._local_moments is None:
                self._local_moments = {
                    lc.name: LocalMoments(self.model, lc, self.tlm.locals)
                    for lc in self.tlm.locals
                    if lc.kind == "gaussian"
                }
            factories += [
                functools.partial(
                    conditional_local_sampler, lc, self._local_params, self._local_moments[lc.name]
                )
                for lc in self.tlm.locals
                if lc.kind == "gaussian"
            ]
        if self.tlm.leaves:
            # last: a leaf may read any other variable, locals included
            factories.append(functools.partial(leaf_sampler, self.model, self.tlm.leaves))
        self.approx.conditional_factories = factories
        self.approx.fitted_data_values = _data_values(self.model)
        self.approx.fitted_coords = {k: v for k, v in self.model.coords.items() if v is not None}
        self.approx._conditional = None
        if self.tlm.locals:
            with graph_building():
                local_posteriors(
                    self.model,
                    self.approx,
                    self.tlm.locals,
                    self._local_params,
                    self._local_moments,
                )
            self.approx.marginal_locals = [lc.name for lc in self.tlm.locals]
        if self.tlm.leaves:
            with graph_building():
                leaf_moments(self.approx, self.tlm.leaves, self._leaf_params)
            self.approx.predictive_leaves = [leaf.name for leaf in self.tlm.leaves]

    def refine(self, n, progressbar=True, progressbar_theme=default_progress_theme):
        """Continue a fit for ``n`` more iterations (exactly: PyMC's ``refine``)."""
        return self.fit(n, progressbar=progressbar, progressbar_theme=progressbar_theme, tol=None)

    # --------------------------------------------------------- loop callbacks
    @property
    def _averaged(self) -> bool:
        """Whether q is the average of the iterates: fits on ``pm.Minibatch`` data (with
        ``row_subsample`` alone the factorizations' iterates still drift, and their
        average was no closer to the full-batch fit)."""
        return bool(
            self.stochastic and (self.tlm.minibatch or self.options["dask_batch"] is not None)
        )

    def _after_step(self, info, iteration):
        if self._averaged:
            self._average_iterate()
        self._rejections.track(
            bool(info.accepted), float(info.candidate_bound), iteration, self.approx
        )

    def _average_iterate(self):
        """Add the accepted state to the iterate average, and every
        :data:`~pymc_mcssvi.pymc.fit_loop.STOCHASTIC_WINDOW` iterations keep the
        average's location."""
        state = self.store.get(borrow=True)
        hyper = None
        if state.hyper is not None and self.kernel.hypers.mode == "point":
            hyper = ("point", np.array(state.hyper.base))
        elif state.hyper is not None:
            hyper = ("gaussian", np.array(state.hyper.base_mean), np.array(state.hyper.base_factor))
        self._average.update(list(state.base.means), list(state.base.factors), hyper)
        if self._average.t % fit_loop.STOCHASTIC_WINDOW == 0:
            try:
                self._average_locations = [*self._average_locations[-1:], self._average.location()]
            except np.linalg.LinAlgError:
                self._average_locations = []

    def _polish(self, budget, progressbar, progressbar_theme, backend, blas_threads):
        """Full-data natural steps from the iterates' average of a ``pm.Minibatch`` fit.

        A minibatch step's noise is ``sqrt(N / B)`` posterior sds in its mean (6.3 for
        batches of 500 of 20,000 rows), so averaging alone needs of the order of
        ``100 N / B`` steps to come within 0.1 posterior sd; a 20,000-row logistic
        regression stopped 0.5-0.6 sd off. ``pm.Minibatch`` slices arrays held in
        memory, so the same model on all rows (:func:`~pymc_mcssvi.pymc.full_data.full_data_model`)
        is fitted from the average with the full-batch schedule and stopping rule
        (a few passes over the data, in chunks), and its state replaces this fit's.
        At most ``budget`` iterations (what is left of ``n``, and at most
        :data:`POLISH_MAX_ITER`). Returns that fit's approximation (its ``hist`` and
        ``converged``), or ``None`` when the full data's q has another layout.
        """
        # Dask data are all there: the same model, every chunk at each step
        dask_batch = self.options["dask_batch"] is not None
        full = self.model if dask_batch else full_data_model(self.model)
        options = {
            **self.options,
            "dask_batch": None,
            "polish": False,
            "schedule": "auto",
            "rho0": None,
            "tau": None,
            "fixed_draws": None,
            "start": None,
        }
        inner = type(self)(full, **options)
        there = _layout_map(self.tlm, inner.tlm)
        back = _layout_map(inner.tlm, self.tlm)
        if there is None or back is None or not inner.kernel.monotone:
            # another layout, or a bound that is not deterministic (``estimator="mc"``):
            # the full-batch stopping rule would never be met
            logger.info("No full-data steps: the full data's q has another layout or bound")
            return None
        param = self.algorithm.parameterization
        start = _moved(inner.store.get(), self.store.get(), there, param)
        start = start._replace(
            bound=np.asarray(-np.inf), phase_bounds=np.full_like(start.phase_bounds, -np.inf)
        )
        inner.store.set(inner.kernel.reset_candidate(start))
        approx = inner.fit(
            n=budget,
            progressbar=progressbar,
            progressbar_theme=progressbar_theme,
            backend=backend,
            blas_threads=blas_threads,
            diagnose=False,
        )
        end = _moved(self.store.get(), inner.store.get(), back, param)
        self.store.set(self.kernel.reset_candidate(end))
        return approx

    def _use_average(self):
        """Replace the last iterate of a stochastic fit by the iterates' average
        (:mod:`pymc_mcssvi.algorithms.averaging`); the next ``fit`` starts from it."""
        avg = self._average
        if avg is None or avg.blocks is None:
            return
        try:
            means, factors, hyper = avg.result()
        except np.linalg.LinAlgError:
            logger.info("Iterate average not used: an averaged precision is not positive definite")
            return
        if not all(np.all(np.isfinite(x)) for x in [*means, *factors]):
            return
        state = self.store.get()
        state = state._replace(base=state.base._replace(means=tuple(means), factors=tuple(factors)))
        if hyper is not None and hyper[0] == "point":
            state = state._replace(hyper=state.hyper._replace(base=hyper[1]))
        elif hyper is not None:
            state = state._replace(
                hyper=state.hyper._replace(base_mean=hyper[1], base_factor=hyper[2])
            )
        self.store.set(self.kernel.reset_candidate(state))

    def _converged(self, scores, gains, tol, auto_tol=False) -> bool:
        """The stopping rule: :func:`~pymc_mcssvi.pymc.fit_loop.converged_stochastic`
        (minibatches, row subsampling) or
        :func:`~pymc_mcssvi.pymc.fit_loop.converged_full_batch`, and for matrix
        factorizations under ``tol="auto"`` also
        :func:`~pymc_mcssvi.pymc.fit_loop.converged_per_observation`."""
        if self.stochastic:
            locations = self._average_locations if self._averaged else None
            return fit_loop.converged_stochastic(scores, tol, locations)
        if fit_loop.converged_full_batch(scores, gains, tol):
            return True
        n_obs = self.bound.bilinear.n_observations if auto_tol else None
        if not n_obs or n_obs < fit_loop.PER_OBSERVATION_MIN:
            return False
        return fit_loop.converged_per_observation(scores, gains, n_obs)


def _is_positive_int(x) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_) and x > 0


def _is_number(x) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(
        x, bool | np.bool_
    )


#: Options of the inference classes that take one of a few names.
_CHOICES = {
    "bound": ("optimal", "jensen"),
    "inner": ("quadrature", "mc"),
    "estimator": ("quadrature", "mc"),
}


def check_options(options: dict, model) -> None:
    """Refuse values of the inference classes' options (``StructuredVI.__init__``'s
    arguments, by name) that the fit cannot use, naming the option.

    Each of these failed deep inside the fit with an error that named nothing (a
    Hermite degree of 0 from NumPy, a division by a zero chunk size) or was
    ignored (``bound="elbo"``, ``n_draws=0``, ``linear_response="no"`` read as true).
    """
    for key, allowed in _CHOICES.items():
        if options[key] not in allowed:
            raise ValueError(
                f"{key} must be one of {', '.join(map(repr, allowed))}, got {options[key]!r}"
            )
    for key in ("n_points", "n_draws", "n_inner", "n_rayleigh_nodes", "n_starts"):
        if not _is_positive_int(options[key]):
            raise ValueError(f"{key} must be a positive integer, got {options[key]!r}")
    if options["chunk_size"] is not None and not _is_positive_int(options["chunk_size"]):
        raise ValueError(
            "chunk_size must be a positive integer (observations per chunk) or None, "
            f"got {options['chunk_size']!r}"
        )
    if options["row_batch"] is not None and not _is_positive_int(options["row_batch"]):
        raise ValueError(
            f"row_batch must be a positive integer (rows per step) or None, got "
            f"{options['row_batch']!r}"
        )
    if options["dask_batch"] is not None and not _is_positive_int(options["dask_batch"]):
        raise ValueError(
            "dask_batch must be a positive integer (chunks of the Dask data per iteration) or "
            f"None, got {options['dask_batch']!r}"
        )
    draws = options["bilinear_draws"]
    if draws not in ("sigma", "auto") and not _is_positive_int(draws):
        raise ValueError(
            f"bilinear_draws must be 'auto', 'sigma' or a positive integer, got {draws!r}"
        )
    for key in ("fixed_draws", "linear_response"):
        if options[key] is not None and not isinstance(options[key], bool | np.bool_):
            raise TypeError(f"{key} must be True, False or None, got {options[key]!r}")
    for key, sign in (("rho0", "positive"), ("tau", "non-negative"), ("kappa", "positive")):
        value = options[key]
        if value is None:
            continue
        if (
            not (_is_number(value) and np.isfinite(value))
            or value < 0
            or (value == 0 and sign == "positive")
        ):
            raise ValueError(f"{key} must be a finite {sign} number, got {value!r}")
    schedule = options["schedule"]
    if _is_number(schedule) and not (np.isfinite(schedule) and schedule > 0):
        raise ValueError(
            f"schedule as a number is a constant step size, which must be positive, got {schedule!r}"
        )
    if not (_is_number(schedule) or isinstance(schedule, str | Schedule)):
        raise TypeError(
            "schedule must be 'auto', 'adaptive', 'inverse', 'power', 'constant' or a "
            f"positive number (a constant step size), got {schedule!r}"
        )
    for key in ("mean_optimizer", "factor_optimizer", "hyper_optimizer"):
        spec = options[key]
        if spec is None or (key == "hyper_optimizer" and spec == "newton"):
            continue
        try:
            make_optimizer(spec, 1.0)
        except (ValueError, TypeError) as err:
            extra = "'newton' or " if key == "hyper_optimizer" else ""
            raise ValueError(
                f"{key} must be {extra}'adagrad', 'adam', 'sgd', a (name, learning rate) pair "
                f"or an Optimizer, got {spec!r} ({err})"
            ) from None
    seed = options["random_seed"]
    if seed is not None:
        try:
            np.random.SeedSequence(seed)
        except (TypeError, ValueError):
            raise TypeError(
                f"random_seed must be a non-negative integer (or a sequence of them), got {seed!r}"
            ) from None
    start = options["start"]
    if start is not None:
        if not isinstance(start, dict):
            raise TypeError(
                "start must be a dict of starting values by variable name, a saved fit or a "
                f"fitted approximation, got {type(start).__name__}"
            )
        known = {rv.name for rv in model.free_RVs} | {v.name for v in model.value_vars}
        unknown = [k for k in start if k not in known]
        if unknown:
            raise ValueError(
                f"start names {unknown[0]!r}, which is not a free variable of the model "
                f"(free variables: {', '.join(rv.name for rv in model.free_RVs)})"
            )


def _check_fit_options(backend, blas_threads, callbacks, compile_kwargs) -> None:
    """Refuse values of ``fit``'s options that the fit cannot use, naming the option
    (an unknown backend failed in PyTensor's mode table, ``blas_threads=0`` was ignored,
    a callback that is not callable failed after the first iteration)."""
    if backend is not None and backend != "python":
        try:
            if not isinstance(backend, str):
                raise TypeError
            get_mode(backend)
        except (TypeError, ValueError):
            raise ValueError(
                "backend must be 'numba', 'c', 'jax' or 'python' (or the name of a PyTensor "
                f"mode), or None to choose by the problem's size, got {backend!r}"
            ) from None
    if blas_threads is not None and not _is_positive_int(blas_threads):
        raise ValueError(f"blas_threads must be a positive integer or None, got {blas_threads!r}")
    if compile_kwargs is not None and not isinstance(compile_kwargs, dict):
        raise TypeError(
            f"compile_kwargs must be a dict of pytensor.function arguments, got {compile_kwargs!r}"
        )
    if callbacks is not None:
        if isinstance(callbacks, str) or not hasattr(callbacks, "__iter__"):
            raise TypeError(f"callbacks must be a list of callables, got {callbacks!r}")
        for cb in callbacks:
            if not callable(cb):
                raise TypeError(
                    f"callbacks must be callables callback(approx, losses, i), got {cb!r}"
                )


def _layout_map(source, target):
    """Where each coordinate of ``source``'s q (a two-level model) sits in ``target``'s,
    for the same model's variables: per source segment ``(target segment, row map,
    column map)``; ``None`` unless the layouts differ only by the order of the
    segments, of their rows and of the columns within them, and the
    hyperparameters are the same, in the same order."""
    if [h.name for h in source.hypers] != [h.name for h in target.hypers]:
        return None
    where = {}
    for t, seg in enumerate(target.segments):
        for gid in seg.members:
            name = target.gaussians[gid].name
            for i, (r, c) in enumerate(zip(seg.row_of[gid], seg.col_of[gid], strict=True)):
                where[(name, i)] = (t, int(r), int(c))
    out = []
    for seg in source.segments:
        rows, cols, to = np.full(seg.rows, -1), np.full(seg.k, -1), set()
        for gid in seg.members:
            name = source.gaussians[gid].name
            for i, (r, c) in enumerate(zip(seg.row_of[gid], seg.col_of[gid], strict=True)):
                if (name, i) not in where:
                    return None
                t, r2, c2 = where[(name, i)]
                to.add(t)
                if rows[r] not in (-1, r2) or cols[c] not in (-1, c2):
                    return None
                rows[r], cols[c] = r2, c2
        t = to.pop() if len(to) == 1 else None
        if t is None or target.segments[t].rows != seg.rows or target.segments[t].k != seg.k:
            return None
        out.append((t, rows, cols))
    if sorted(t for t, _, _ in out) != list(range(len(target.segments))):
        return None
    return out


def _moved(state, source, layout, parameterization):
    """``state`` with q's parameters (Gaussian blocks, hyperparameters) of ``source``,
    moved to ``state``'s layout by ``layout`` (:func:`_layout_map` from ``source``'s)."""
    means, factors = list(state.base.means), list(state.base.factors)
    for (t, rows, cols), m, f in zip(layout, source.base.means, source.base.factors, strict=True):
        m, f = np.asarray(m), np.asarray(f)
        new_m = np.empty_like(m)
        new_m[np.ix_(rows, cols)] = m
        # the factor's matrix (precision L L^T, or covariance C^T C), permuted, refactored
        M = (
            f @ np.swapaxes(f, -1, -2)
            if parameterization == "precision"
            else np.swapaxes(f, -1, -2) @ f
        )
        moved = np.empty_like(M)
        moved[rows[:, None, None], cols[None, :, None], cols[None, None, :]] = M
        L = np.linalg.cholesky(0.5 * (moved + np.swapaxes(moved, -1, -2)))
        means[t], factors[t] = (
            new_m,
            L if parameterization == "precision" else np.swapaxes(L, -1, -2),
        )
    state = state._replace(base=state.base._replace(means=tuple(means), factors=tuple(factors)))
    if source.hyper is not None:
        state = state._replace(hyper=tree_map(np.array, source.hyper))
    return state


def _data_values(model) -> dict:
    """Copies of the values of a model's shared data containers and dim lengths."""
    # pm.Data frozen into constants (freeze_dims_and_data) cannot change: nothing to copy
    shared = [
        v
        for v in [*model.data_vars, *model.dim_lengths.values()]
        if isinstance(v, pytensor.compile.SharedVariable)
    ]
    return {v: np.array(v.get_value(borrow=True), copy=True) for v in dict.fromkeys(shared)}


class MCSSVI(StructuredVI):
    """Monte Carlo structured SVI with natural-gradient steps for mean and precision.

    Paper eq. generalSVIupdate: ``theta <- (1 - rho) theta + rho (theta_p + G)``.

    Examples
    --------
    >>> import numpy as np, pymc as pm, pymc_mcssvi
    >>> X = np.random.default_rng(0).normal(size=(200, 2))
    >>> y = (X @ [1.0, -1.0] + np.random.default_rng(1).normal(size=200) > 0).astype(int)
    >>> with pm.Model():
    ...     w = pm.Normal("w", 0, 1, shape=2)
    ...     _ = pm.Bernoulli("y", logit_p=X @ w, observed=y)
    ...     approx = pymc_mcssvi.MCSSVI().fit(progressbar=False)
    >>> approx.converged
    True
    """

    algorithm_cls = MCSSVIStep


class HMCSSVI(StructuredVI):
    """Hybrid MC-SSVI: natural-gradient step for the precision, Adam/Adagrad for the mean.

    The paper's recommended algorithm.

    Examples
    --------
    >>> import numpy as np, pymc as pm, pymc_mcssvi
    >>> X = np.random.default_rng(0).normal(size=(200, 2))
    >>> y = np.random.default_rng(1).poisson(np.exp(X @ [0.5, -0.3]))
    >>> with pm.Model():
    ...     w = pm.Normal("w", 0, 1, shape=2)
    ...     _ = pm.Poisson("y", mu=pm.math.exp(X @ w), observed=y)
    ...     approx = pm.fit(method="hmcssvi", progressbar=False)
    >>> approx.sample(100).posterior["w"].shape
    (1, 100, 2)
    """

    algorithm_cls = HMCSSVIStep
    default_mean_optimizer = None


class SDSVI(StructuredVI):
    """Structured DSVI: standard gradients on the mean and the Cholesky factor (baseline)."""

    algorithm_cls = SDSVIStep
    default_mean_optimizer = ("adam", 0.1)
    default_factor_optimizer = ("adam", 0.1)
