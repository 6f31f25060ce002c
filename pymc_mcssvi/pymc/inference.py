"""PyMC ``Inference`` classes: ``MCSSVI``, ``HMCSSVI`` and ``SDSVI``.

They are thin adapters: recognize the model, build the structured bound and
the step kernel, compile one PyTensor function per iteration, and run it with
PyMC's progress bar, callbacks and stopping conventions.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import time
import warnings

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
from pymc.initial_point import make_initial_point_fn
from pymc.progress_bar import CustomProgress, default_progress_theme
from pymc.pytensorf import compile as pm_compile
from pymc.pytensorf import resolve_backend_compile_kwargs
from pymc.variational.inference import Inference
from pytensor.compile.mode import Mode, get_mode
from pytensor.graph.replace import graph_replace
from pytensor.graph.rewriting.basic import in2out
from pytensor.graph.traversal import ancestors
from pytensor.tensor.random.type import RandomType
from rich.console import Console
from rich.progress import Progress, TextColumn
from threadpoolctl import threadpool_limits

from pymc_mcssvi.algorithms.averaging import IterateAverage
from pymc_mcssvi.algorithms.hmcssvi import HMCSSVIStep
from pymc_mcssvi.algorithms.hyperparameters import (
    HyperSpec,
    MeanFieldHyperparameters,
    PointHyperparameters,
    shapes_at_fixed,
    unbatch_constant_split,
)
from pymc_mcssvi.algorithms.kernel import MAX_COUPLED_HYPERS, StepKernel
from pymc_mcssvi.algorithms.marginal import (
    AXIS_POINTS,
    EPS_GRID,
    HESSIAN_STEP,
    MAX_CORRECTED_HYPERS,
    MAX_MOMENT_GRID,
    MAX_MOMENT_RANK,
    MAX_UNCHECKED_HYPERS,
    MAX_VIEW_WORK,
    MIN_AXIS_SKEW,
    NODES,
    ConditionalProfile,
    DrawMoments,
    _block_covariance,
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
from pymc_mcssvi.algorithms.mcssvi import MCSSVIStep
from pymc_mcssvi.algorithms.optimizers import make_optimizer
from pymc_mcssvi.algorithms.profile_grid import (
    GRID_DROP,
    GRID_FLOOR_MARGIN,
    LADDER,
    MAX_GRID_HYPERS,
    MAX_GRID_POINTS,
    GridMarginal,
    grid_marginal,
    grid_wanted,
    grow_grid,
)
from pymc_mcssvi.algorithms.rayleigh import RayleighGlobals
from pymc_mcssvi.algorithms.schedules import make_schedule
from pymc_mcssvi.algorithms.sdsvi import SDSVIStep
from pymc_mcssvi.backend.modes import (  # noqa: F401  (re-exported: older import path)
    HELPER_MODE,
    graph_building,
    per_element_ops,
    python_few_calls_mode,
    python_step_mode,
    structure_rewrites,
    trigamma_as_polygamma,
    without_structure_rewrites,
)
from pymc_mcssvi.bounds.structured import StructuredBound
from pymc_mcssvi.estimators.general import flat_indices
from pymc_mcssvi.estimators.quadrature import softplus_of_nonpositive
from pymc_mcssvi.exceptions import DivergenceError
from pymc_mcssvi.families.gaussian import GaussianBlocks, broadcast_products_as_matmul
from pymc_mcssvi.pymc.approximation import (
    ConditionalView,
    PointGroup,
    RayleighGroup,
    StructuredApproximation,
    StructuredGaussianGroup,
)
from pymc_mcssvi.pymc.conditional import (
    BATCH_BYTES,
    ConditionalGlobals,
    GridNodes,
    held_bytes,
    node_corners,
    step_measure,
)
from pymc_mcssvi.pymc.leaves import LeafGroup, initial_leaf_params, leaf_moments, leaf_sampler
from pymc_mcssvi.pymc.locals import (
    LocalGroup,
    LocalMoments,
    conditional_local_sampler,
    initial_local_params,
    local_posteriors,
)
from pymc_mcssvi.recognize.graph import depends_on_any, evaluate_static, static_shape
from pymc_mcssvi.recognize.ir import Segment
from pymc_mcssvi.recognize.model import MIXED_BILINEAR, check_data, recognize
from pymc_mcssvi.recognize.vectorize import vectorize_graph

__all__ = ["HMCSSVI", "MCSSVI", "SDSVI", "StructuredVI"]

logger = logging.getLogger("pymc_mcssvi")

#: Consecutive rejected steps after which the fit is declared divergent.
MAX_REJECTIONS = 40
#: Iterations per window of the stochastic stopping rule (bound averages compared
#: between the last two windows; ``pm.Minibatch`` fits: the averaged q's means too).
STOCHASTIC_WINDOW = 50
#: ``pm.Minibatch`` fits stop only when the iterate average's means moved by at most
#: this many of its sds (root mean square over the coordinates) in the last window.
STOCHASTIC_MEAN_TOL = 0.1
#: Largest departure (in log scale) of the data coordinates' scales from a sum over
#: q(h)'s axes for which the axes' values are used on the whole grid.
ADDITIVE_LOG_SCALE_TOL = 0.02
#: Memory of one batch of the conditional view's sensitivity evaluations.
SENSITIVITY_BATCH_BYTES = 2**27
#: Times the start q's sd is divided by 10 while its bound is not finite.
MAX_START_SHRINKS = 3
#: Then the times its means are moved by ``U(-START_JITTER, START_JITTER)`` (in PyMC's
#: unconstrained space, as ``pm.sample``'s jitter): a start exactly where a derivative
#: is not finite (``rho ** 0`` at ``rho = 0``, the initial point of ``Uniform(-1, 1)``).
MAX_START_JITTERS = 3
START_JITTER = 0.5

#: Below this many estimated flops per iteration BLAS runs on one thread.
BLAS_THREADS_WORK = 5e8
#: Estimated flops per iteration (without the blocks' factorizations) above which
#: ``backend=None`` compiles the step (JAX, or numba without JAX). Uncompiled, the
#: per-observation work costs 12-24 ns per estimated flop (unfused NumPy passes over
#: rows x quadrature nodes x sigma points), JAX runs it 2.5-6x faster after 4-8 s
#: more set-up: it pays from about 17 iterations at this threshold. Measured on 2
#: cores: a logistic GLMM with five grouping factors and 20,000 rows (4.7e7) fits in
#: 95 s uncompiled against 35 s with JAX; one with 60 groups and 20,000 rows (3.1e7,
#: 16 iterations) 5.4 s against 7.5 s, a Poisson random walk of 24 x 30 (2.9e7) 6.2 s
#: against 9.7 s; the 20,000-row GME (2.0e8) 8.8 s per iteration uncompiled
#: against 2 s compiled.
COMPILE_WORK_THRESHOLD = 4e7
#: The same threshold without JAX: a cold numba compilation costs 40-190 s, so the
#: step is compiled from 1e8 (the grouseticks GLMM with mean-field hyperparameters,
#: 299 iterations: 18 s uncompiled against 195 s compiled cold with numba).
NUMBA_COMPILE_WORK_THRESHOLD = 1e8
#: When JAX cannot run an automatically chosen step: uncompiled below this many
#: estimated flops per iteration, numba above (random intercepts and slopes for
#: 150 groups, 2.6e8: 4.8 s uncompiled against 60 s with a cold numba compile).
JAX_FALLBACK_COMPILE_WORK = 1e9

#: Largest predictor sd under the start q; larger ones shrink the start covariance.
#: With 10, a Poisson GLMM with an unstandardized covariate (grouseticks' raw cHEIGHT,
#: -59..71) put quadrature nodes at log rates near 50: the first natural step gave
#: the covariate's coefficient a precision of 1.6e18, and the centered model's fit
#: diverged (Cholesky factors of candidates not finite). At 5 it converges in 25
#: iterations (non-centered 77, was 102); a 100-feature Poisson regression takes 16
#: iterations instead of 42, a logistic one 13 instead of 11.
START_PREDICTOR_SD = 5.0
#: The same where a likelihood is not log-concave in its predictor under the start q.
#: The bound then has a second optimum where q is wide and every observation is an
#: outlier: a Student-t regression with a log link and 10 group effects (start
#: predictor sd 1.7) ended there (b0 0.40 +- 0.72, NUTS 1.00 +- 0.01; -ELBO 1261.5
#: against 394.4), from predictor sds of 2 or less at the optimum.
START_NONCONCAVE_PREDICTOR_SD = 1.0


@functools.cache
def jax_available() -> bool:
    """Whether JAX is installed (the automatic backend of large steps, see ``choose_backend``)."""
    return importlib.util.find_spec("jax") is not None


def covariance_hyperparameters(tlm, model) -> list[str]:
    """Hyperparameters that parameterize a covariance matrix of Gaussian effects.

    An ``LKJCholeskyCov`` / ``LKJCorr`` factor (used as ``z @ chol.T`` or as
    the ``chol`` of a ``pm.MvNormal``), or any hyperparameter in the covariance
    of an ``MvNormal`` Gaussian global. Their mean-field sigma points need the
    step's shapes read at a fixed h
    (:func:`~pymc_mcssvi.algorithms.hyperparameters.shapes_at_fixed`).
    """
    names = []
    hyper_values = [h.value for h in tlm.hypers]
    for h in tlm.hypers:
        op = h.rv.owner.op if h.rv.owner is not None else None
        label = f"{type(op).__name__} {getattr(op, 'name', '')}".lower()
        if "lkj" in label:
            names.append(h.name)
    for g in tlm.gaussians:
        if g.prior != "mvnormal" or g.rv.owner is None:
            continue
        # MvNormal(mu, cov): the covariance is the last input of the RV
        (cov,) = model.replace_rvs_by_values([g.rv.owner.inputs[-1]])
        if depends_on_any(cov, hyper_values):
            names.extend(
                h.name for h in tlm.hypers if h.name not in names and depends_on_any(cov, [h.value])
            )
    return names


def _named_backend_kwargs(backend, compile_kwargs):
    """``compile_kwargs`` with the mode of a backend given by name, without PyTensor's
    matrix-structure rewrites (:func:`without_structure_rewrites`): the step's matrices
    are dense by construction, and asking the assumption system about them cost 1.5-2 s
    of a JAX step's 5 s of rewriting (InstEval binary PMF), with identical iterations.
    A mode passed in ``compile_kwargs`` is used as given."""
    ck = resolve_backend_compile_kwargs(backend, compile_kwargs)
    if backend is not None and isinstance(ck.get("mode"), Mode):
        ck["mode"] = without_structure_rewrites(ck["mode"])
    return ck


#: Iterations a ``"python"`` step runs compiled with merging only
#: (:func:`python_few_calls_mode`) before it is recompiled with the step's
#: rewrites (:func:`python_step_mode`). See :class:`_UpgradingStep`.
UPGRADE_AT = 120
#: Rise of the hyperparameters' profile above its centre (nats) that is warned about:
#: the fit stopped away from the best bound it reaches (a sharp change point: 1.2).
PROFILE_RISE_WARN = 1.0


class _UpgradingStep:
    """A ``"python"`` step compiled cheaply first, fully once the fit runs long.

    PyTensor's canonicalization of a step graph (800-1,300 nodes) costs 1.2-2.5 s
    more than merging alone and makes each iteration 1.3-1.4x cheaper (the six
    GLMMs of ``benchmarks/glmm.py``, nodes run by
    :func:`~pymc_mcssvi.backend.modes.python_linker`: 9-21 ms saved per
    iteration, e.g. Contraception 41 -> 29 ms), so it pays for itself
    after 117-143 iterations (measured twice in-process on the six; 55-70 when
    the nodes ran from PyTensor's Python loop, whose per-node cost the extra
    nodes added to). Most full-batch fits of small and medium models end
    sooner (those six: 16-37 iterations, one 106). This step runs its first
    :data:`UPGRADE_AT` iterations compiled with merging only (0.4-0.9 s) and
    then recompiles with the full rewrites: at most about twice the better
    choice's cost whatever the fit's length (the ski-rental rule, with the
    switch near the break-even). The switch depends on the iteration count
    only, so fits stay reproducible. ``fit(n=...)`` upgrades at once when
    ``n`` reaches past :data:`UPGRADE_AT`, and so does a cheap function that
    would evaluate an element-wise op one element at a time
    (:func:`per_element_ops`). Both functions update the same shared state;
    the second is compiled without reseeding the random generators, so the
    draws continue.

    ``maker`` is the current function's, as for a compiled PyTensor function.
    """

    def __init__(self, compile_fn):
        self._compile = compile_fn
        self._fn = None
        self.calls = 0
        self.upgraded = False

    @property
    def fn(self):
        return self.compile()

    def compile(self):
        """The current function, compiled (merging only) on first use."""
        if self._fn is None:
            self._fn = self._compile(full=False)
            if per_element_ops(self._fn.maker.fgraph):
                # an element-wise op without a NumPy ufunc that only the full rewrites
                # remove would be evaluated one element at a time
                self._fn = self._compile(full=True, reseed=False)
                self.upgraded = True
        return self._fn

    @property
    def maker(self):
        return self.fn.maker

    def __call__(self):
        if not self.upgraded and self.calls >= UPGRADE_AT:
            self.upgrade()
        self.calls += 1
        return self.fn()

    def upgrade(self):
        """Switch to the fully rewritten function now."""
        if not self.upgraded:
            self._fn = self._compile(full=True, reseed=self._fn is None)
            self.upgraded = True


class _HostStateStep:
    """A JAX-compiled step that leaves NumPy arrays in the shared state.

    PyTensor's JAX backend stores JAX arrays in the shared variables it
    updates; every other function of the fit (sampling, local posteriors,
    ``approx.mean.eval()``) runs on the Python/C backends, whose SciPy calls need
    NumPy arrays. The state is ``O(blocks x K^2)``, so the copy is small next
    to the step.
    """

    def __init__(self, fn):

        self.fn = fn
        self.maker = fn.maker
        self.state = [
            i.variable
            for i in fn.maker.inputs
            if i.update is not None and not isinstance(i.variable.type, RandomType)
        ]

    def __call__(self):
        out = self.fn()
        self.to_host()
        return [np.asarray(o) for o in out]

    def to_host(self):
        """Leave NumPy arrays in the updated shared variables."""
        for v in self.state:
            v.set_value(np.array(v.get_value(borrow=True)), borrow=True)


class _TracedOnFirstCall:
    """An automatically chosen JAX step that falls back when JAX cannot trace it.

    PyTensor's JAX functions are traced on their first call, so an operation JAX
    cannot handle with the step's shapes (e.g. a ``Split`` whose sizes are not
    constants) fails there, not at compilation. Then the step is replaced by
    ``fallback()`` (logged at INFO level), which is remembered by the inference.
    """

    def __init__(self, fn, fallback):
        self.fn = fn
        self.maker = fn.maker
        self.fallback = fallback
        self.traced = False

    def __call__(self):
        if self.traced:
            return self.fn()
        try:
            out = self.fn()
        except (KeyboardInterrupt, StopIteration):
            raise
        except Exception as err:  # JAX tracing errors have no common base class
            self.fn.to_host()
            self.fn = self.fallback(err)
            self.maker = self.fn.maker
            out = self.fn()
        self.traced = True
        return out


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
        above :data:`START_PREDICTOR_SD` (unstandardized covariates). As for
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
    bilinear_draws : int or "sigma"
        Matrix factorization: draws of the other factor per observation (the
        paper's ``k1``), or ``"sigma"`` (default) for its ``2K`` sigma points
        (exact second moments). A few fixed draws are cheaper per iteration but
        bias the bound the fit optimizes (measured on InstEval binary: held-out
        NLL 0.749 with 4 draws, 0.643 with sigma points).
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
    linear_response : bool, optional
        Default: True, except with local scales (below).
        With ``hyper="meanfield"``: the returned approximation corrects the
        mean-field q(h) for its independence from q(w). q(h) gets the precision
        of the bound's curvature in ``h`` with q(w) re-optimized (a Schur
        complement, see
        :func:`~pymc_mcssvi.algorithms.hyperparameters.joint_newton_step`), and
        the Gaussian globals' draws follow the hyperparameters' draws through
        ``dm_w/dh = P_w^{-1} E[d g_w / d h]`` (linear response, Giordano,
        Broderick and Jordan 2015). The fit and its bound are unchanged. Measured
        against NUTS on three GLMMs (docs/benchmarks.md), the scales' posterior
        sds go from 0.09-0.54 of NUTS's to 0.93-1.35. Applies when the
        hyperparameter step is coupled (MC-SSVI and H-MC-SSVI in full batch).
        Off by default when a hyperparameter holds one scale per coefficient
        (local shrinkage: a horseshoe's ``lam``, an R2D2 prior's ``phi``;
        :meth:`local_scale_hypers`): the linearization of ``m_w(h)`` is then
        extrapolated far over a wide q(h). On a regularized horseshoe (20
        coefficients) the coefficients came out up to 6.5 NUTS sds off with
        sds up to 10.7x NUTS's; without it within 0.24 sd, sds 1.05-1.44x (an
        R2D2 regression: 1.6 sds off, within 0.22 without).
    hyper_marginal : {"profile", "gaussian"}
        With the linear-response view and at most 8 hyperparameter
        coordinates (:data:`~pymc_mcssvi.algorithms.marginal.MAX_CORRECTED_HYPERS`),
        ``"profile"`` (default) replaces the Gaussian q(h) by a
        skewed one after the fit: the bound with q(w) re-fitted is evaluated
        along each principal axis of q(h) (INLA-style, 33 points for 4
        coordinates after ``n (n + 1)`` for its curvature; one compiled
        function), and its 1-D profiles become the axes' marginals (:mod:`pymc_mcssvi.algorithms.marginal`). Group-level
        scales are skewed in log space, and the Gaussian put their posterior
        means 25-32% above NUTS's on the centered GLMM benchmarks. Kept
        Gaussian where the profile disagrees with the linear response's
        curvature. With one or two coordinates the profile is evaluated on a
        grid grown from the centre instead (:mod:`pymc_mcssvi.algorithms.profile_grid`),
        which follows a scale's long tail towards 0 and the ridge of two
        scales that trade variance. ``"gaussian"`` skips it.
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
        bilinear_draws="sigma",
        row_subsample=None,
        linear_response=None,
        hyper_marginal="profile",
    ):
        self.model = pm.modelcontext(model)
        self.linear_response = True if linear_response is None else bool(linear_response)
        if hyper_marginal not in ("profile", "gaussian"):
            raise ValueError(
                f"hyper_marginal must be 'profile' or 'gaussian', got {hyper_marginal!r}"
            )
        self.hyper_marginal = hyper_marginal
        self._profile_fn = None
        self.random_seed = random_seed
        if hyper not in (None, "point", "meanfield"):
            raise ValueError(f"hyper must be 'point' or 'meanfield', got {hyper!r}")
        self._n_inner = int(n_inner)
        self.hist = np.asarray(())
        self.state = None
        self._step_fns = {}
        self._rejections = 0
        self._start_shrinks = 0
        self._start_jitters = 0
        self._work = {}  # cached work_estimate(), by linear_algebra
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
            # Subsampled bounds are stochastic: schedules and stopping as for minibatches.
            minibatch = self.stochastic = self.tlm.minibatch or row_subsample is not None
            if fixed_draws is None:
                fixed_draws = not minibatch
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
            means, factors, hyper_spec = self._initial_state(start, start_sigma, hyper_opt)
            factors = self._data_scaled_start(means, factors, hyper_spec)
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
                means,
                factors,
                hypers,
                monotone,
                rayleighs,
            )
            self._warn_uncoupled_hypers()
            self._warn_split_crossed()
            if linear_response is None and self.local_scale_hypers():
                self.linear_response = False
            self._approx = self._make_approximation()

    def local_scale_hypers(self) -> list[str]:
        """Hyperparameters that hold one scale per coefficient (local shrinkage).

        A hyperparameter with the shape of a Gaussian global, in the coefficients of
        that global and of no other in some term (its prior's scale, or a
        likelihood's ``z * tau * lam``): a horseshoe's ``lam``, an R2D2 prior's
        ``phi``; not a per-group residual sd, which scales every coefficient of its
        rows. With them the linear-response view is off by default
        (``linear_response``).
        """
        out = []
        for h in self.tlm.hypers:
            shape = tuple(static_shape(h.rv))
            if int(np.prod(shape)) < 2:
                continue
            same = {gid for gid, g in enumerate(self.tlm.gaussians) if tuple(g.shape) == shape}
            if any(self._scales_only(t, same, h.value) for t in self.tlm.affine_predictors):
                out.append(h.name)
        return out

    @staticmethod
    def _scales_only(term, sources, value) -> bool:
        """Whether ``value`` is in the coefficients of one of ``sources`` in ``term`` and in
        no other global's: a per-group residual sd (``Normal(a[g] + b x, sigma[g])``)
        scales every coefficient of its rows, a shrinkage scale only its own."""
        hit = {
            tt.source
            for tt in term.terms
            if tt.vals is not None and depends_on_any(tt.vals, [value])
        }
        return len(hit) == 1 and hit <= sources

    def _warn_uncoupled_hypers(self):
        """Warn when too many mean-field hyperparameter coordinates switch off the joint
        step and the linear-response view (:data:`MAX_COUPLED_HYPERS`)."""
        hyp = self.kernel.hypers
        if hyp is None or hyp.mode != "meanfield":
            return
        if self.tlm.minibatch and self._effects_scaled_by_hypers():
            warnings.warn(
                "With pm.Minibatch the hyperparameters' steps are not coupled with q(w)'s and "
                "the linear-response correction is off: scales of group effects converge "
                "slowly and their posterior sds come out too narrow (a 50,000-row logistic "
                "GLMM with 100 groups: scale 0.52 +- 0.008 against 0.67 +- 0.05 in full "
                "batch, which took 7 s). Fit the full data when it fits in memory.",
                UserWarning,
                stacklevel=4,
            )
            return
        if self.tlm.bilinear_terms and self._effects_scaled_by_hypers():
            names = ", ".join(repr(h.name) for h in self.tlm.hypers)
            warnings.warn(
                f"In a matrix factorization the learned prior scales ({names}: of the "
                "factors, and of effects beside them such as row and column biases) can come "
                "out too small and too narrow where the data are weak: q(U), q(V) and the "
                "effects' q are independent, and that bound itself is highest at small scales "
                "(a 60 x 40 Bernoulli factorization: tau 0.17 +- 0.01 where NUTS gives "
                "0.69 +- 0.15; with tau fixed the bound is 34 nats lower at 0.69 than at "
                "0.17, so hyper='point' ends there too), and the scales' steps are not "
                "coupled with q(U)'s and q(V)'s (no linear-response correction). Fix the "
                "scales (models.pmf(prior_sd=...), or a constant in the model) from domain "
                "knowledge or held-out data, or use NUTS where the scales themselves matter.",
                UserWarning,
                stacklevel=4,
            )
            return
        if hyp.spec.size <= MAX_COUPLED_HYPERS:
            return
        if not (self.kernel.monotone and self.algorithm.parameterization == "precision"):
            return
        sizes = ", ".join(f"{h.name!r} ({h.size})" for h in self.tlm.hypers)
        warnings.warn(
            f"{hyp.spec.size} hyperparameter coordinates ({sizes}) exceed {MAX_COUPLED_HYPERS}: "
            "their steps are not coupled with q(w)'s and the linear-response correction is off, "
            "so the fit may take many iterations and the posterior sds of the Gaussian variables "
            "can be too narrow. Give per-group parameters a pm.Normal prior (a non-centered "
            "`sigma * z`) where the model allows (a pm.CustomDist that wraps a Normal is not "
            "read as one), or use hyper='point'.",
            UserWarning,
            stacklevel=4,
        )

    def _warn_split_crossed(self):
        """Warn when q keeps crossed grouping factors apart and hyperparameters scale
        their effects: the bound then pulls the learned scales down (recognition's note,
        :data:`~pymc_mcssvi.recognize.model.SPLIT_CROSSED_NOTE`)."""
        note = self.tlm.split_crossed_note
        if not note or self.tlm.bilinear_terms or self.kernel.hypers is None:
            return
        if not self._effects_scaled_by_hypers():
            return
        warnings.warn(note + ".", UserWarning, stacklevel=4)

    def _effects_scaled_by_hypers(self) -> bool:
        """Whether a hyperparameter scales Gaussian globals: in their prior (a centered
        effect's sigma) or in the likelihoods' predictor coefficients (``sigma * z``)."""
        values = list(self.kernel.hypers.spec.values)
        for term in self.tlm.affine_predictors:
            if term.kind != "likelihood":  # a prior, whitened: its scale is in the coefficients
                graphs = [t.vals for t in term.terms if t.vals is not None] + [term.logp]
                if any(g is not None and depends_on_any(g, values) for g in graphs):
                    return True
                continue
            # a hyperparameter in a gathered effect's coefficients that the dense ones lack
            # (not a Gaussian likelihood's 1 / sigma, which scales every coefficient)
            dense = [t.vals for t in term.terms if t.is_dense and t.vals is not None]
            for t in term.terms:
                if t.is_dense or t.vals is None:
                    continue
                for v in values:
                    if depends_on_any(t.vals, [v]) and not any(
                        depends_on_any(d, [v]) for d in dense
                    ):
                        return True
        return False

    # ------------------------------------------------------------------ set-up
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

    def _initial_state(self, start, start_sigma, hyper_optimizer):
        ipfn = make_initial_point_fn(
            model=self.model, overrides=start, jitter_rvs={}, return_transformed=True
        )
        point = ipfn(0)
        if start:
            _check_start(point, self.model, start)
        tlm = self.tlm
        offsets, dim, maps = flat_indices(tlm)
        flat = np.concatenate(
            [np.asarray(point[g.value.name], dtype="float64").reshape(-1) for g in tlm.gaussians]
        )
        sigma, hyper_sd = _start_sigmas(start_sigma, tlm, dim, offsets)
        if tlm.bilinear_terms and start is None:
            # U = V = 0 is a saddle point of a matrix factorization: break the symmetry.
            rng = np.random.default_rng(0 if self.random_seed is None else self.random_seed)
            for term in tlm.bilinear_terms:
                for gid in (term.left, term.right):
                    o, n = offsets[gid], tlm.gaussians[gid].size
                    flat[o : o + n] = flat[o : o + n] + 0.3 * rng.standard_normal(n)
        means, factors = [], []
        for seg, idx in zip(tlm.segments, maps, strict=True):
            means.append(flat[idx])
            sd = sigma[idx]  # (rows, k)
            eye = np.broadcast_to(np.eye(seg.k), (seg.rows, seg.k, seg.k))
            if self.algorithm.parameterization == "precision":
                factors.append(eye / sd[:, None, :])
            else:
                factors.append(eye * sd[:, None, :])
        self._flat_maps = maps
        hyper = None
        if tlm.hypers:
            init = np.concatenate(
                [np.asarray(point[h.value.name], dtype="float64").reshape(-1) for h in tlm.hypers]
            )
            hyper = HyperSpec(
                [h.value for h in tlm.hypers],
                [h.shape for h in tlm.hypers],
                init,
                hyper_optimizer,
                init_sd=HyperSpec.init_sd if hyper_sd is None else hyper_sd,
                fixed_shapes=bool(covariance_hyperparameters(tlm, self.model)),
            )
        return means, factors, hyper

    def _data_scaled_start(self, means, factors, hyper_spec):
        """Shrink the start q when it puts a predictor's sd above :data:`START_PREDICTOR_SD`.

        With ``start_sigma = 1`` an unstandardized covariate (an age^2 column in
        the hundreds) gives predictor sds in the hundreds or thousands; the
        expected curvature there is near zero, and the first natural steps are
        rejected until the step size has fallen by orders of magnitude (a
        6-coefficient logistic regression took 100 iterations). The start
        covariance is scaled down uniformly so that the largest predictor sd is
        :data:`START_PREDICTOR_SD`; well-scaled models are left as they are.
        Where a likelihood is not log-concave in its predictor under the start q
        (an expected second derivative above 0 on some entry), the limit is
        :data:`START_NONCONCAVE_PREDICTOR_SD`.
        """
        if not self.bound.geometries:
            return factors
        states = [
            GaussianBlocks(pt.constant(m), pt.constant(f))
            for m, f in zip(means, factors, strict=True)
        ]
        init = None
        if hyper_spec is not None:
            init = hyper_spec.replacements(pt.constant(hyper_spec.init))

        def at_start(graphs):
            return graphs if init is None else graph_replace(graphs, init, strict=False)

        var = at_start(self.bound.predictor_variances(states))
        try:  # no rewriting: a one-off evaluation of a small graph
            values = evaluate_static(var, mode=Mode(linker="py", optimizer=None))
        except Exception as e:  # a predictor that needs more than the start values
            logger.debug(f"start q not data-scaled: {type(e).__name__}: {e}")
            return factors
        vmax = max((float(np.nanmax(v)) for v in values if np.size(v)), default=0.0)
        limit = START_PREDICTOR_SD
        # the curvatures' derivative graphs are built only where they can matter
        if vmax > START_NONCONCAVE_PREDICTOR_SD**2:
            curv = at_start(self.bound.predictor_curvatures(states))
            try:
                convex = any(
                    np.any(np.asarray(c) > 0)
                    for c in evaluate_static(curv, mode=Mode(linker="py", optimizer=None))
                )
            except Exception as e:  # as above
                logger.debug(f"start q's curvature not evaluated: {type(e).__name__}: {e}")
                convex = False
            if convex:
                limit = START_NONCONCAVE_PREDICTOR_SD
        if not np.isfinite(vmax) or vmax <= limit**2:
            return factors
        shrink = limit / np.sqrt(vmax)
        if self.algorithm.parameterization == "precision":
            return [f / shrink for f in factors]
        return [f * shrink for f in factors]

    def _make_approximation(self):
        tlm = self.tlm
        k = self.kernel
        hyper_group, response = None, None
        if tlm.hypers and k.hypers.mode == "point":
            hyper_group = PointGroup(
                [h.rv for h in tlm.hypers], model=self.model, point=k.hypers.base
            )
        elif tlm.hypers:
            n = k.hypers.spec.size
            seg = Segment("full", 1, n, [0])
            lr = self.linear_response and k.coupled
            self._marginal, self._grid = None, None
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
                means=[k.hypers.base_mean],
                factors=[k.hypers.lr_factor if lr else k.hypers.base_factor],
                marginal=self._marginal,
                grid=self._grid,
            )
            if lr:
                response = (hyper_group, k.hypers.lr_responses)
        arrow_view = self.linear_response and k.arrow_head is not None
        self._view = None
        if getattr(self, "_marginal", None) is not None and not arrow_view:
            n_w = sum(g.size for g in tlm.gaussians)
            self._view = ConditionalView(
                pytensor.shared(np.int8(0), name="conditional_view_on"),
                [
                    pytensor.shared(f.get_value(), name=f"conditional_view_factor_{s}")
                    for s, f in enumerate(k.base_factor)
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
                    for s, f in enumerate(k.base_factor)
                ],
            )
        groups = [
            StructuredGaussianGroup(
                [g.rv for g in tlm.gaussians],
                model=self.model,
                segments=tlm.segments,
                flat_maps=self._flat_maps,
                parameterization=self.algorithm.parameterization,
                means=k.base_mean,
                factors=k.base_factor,
                response=response,
                arrow=(k.arrow_head, k.arrow_G, k.arrow_LS) if arrow_view else None,
                view=self._view,
            )
        ]
        if hyper_group is not None:
            groups.append(hyper_group)
        if tlm.rayleighs:
            groups.append(
                RayleighGroup(
                    [r.rv for r in tlm.rayleighs], model=self.model, scales=k.rayleighs.base
                )
            )
        if tlm.locals:
            groups.append(self._local_group())
        if tlm.leaves:
            self._leaf_params = initial_leaf_params(tlm.leaves)
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

    def _local_group(self):
        self._local_params = initial_local_params(self.tlm.locals)
        return LocalGroup(
            [lc.rv for lc in self.tlm.locals],
            model=self.model,
            locals=self.tlm.locals,
            local_params=self._local_params,
        )

    @property
    def approx(self):
        return self._approx

    def choose_backend(self) -> str:
        """The backend used when ``backend=None``.

        Small problems run their step with Python-level (NumPy) operations and
        skip compilation, which would dominate their wall time. Larger ones
        (above :data:`COMPILE_WORK_THRESHOLD`, 4e7 estimated flops per iteration) are
        compiled with JAX when it is installed; otherwise with numba above
        :data:`NUMBA_COMPILE_WORK_THRESHOLD` (1e8: its cold compilation is slow). JAX
        compiles the same step 4-7x sooner and runs it 1.1-1.8x faster on CPU
        (InstEval matrix factorization, K = 10: first iteration after 5.4 s
        against 35 s, 0.65 against 0.98 s per iteration). If JAX cannot
        translate the step, or cannot trace it on its first call, the fit falls back
        to the uncompiled step, or to numba above
        :data:`JAX_FALLBACK_COMPILE_WORK` (see the INFO log).

        The work that decides leaves out the factorizations of q's blocks
        (``linear_algebra=False``): they run in LAPACK whatever the backend,
        and compiling buys the fusion of the per-observation work only. A
        Bernoulli GLMM's step with one 604-dimension covariance (2.2e9 flops,
        nearly all of it Cholesky factors and products of the block) took 1.9 s
        per iteration with JAX and 1.7 s uncompiled; a Poisson model with
        random-walk effects (249 dimensions, 1.5e8) 13.2 s with JAX's
        compilation against 5.1 s uncompiled, a crossed Poisson GLMM (401
        dimensions, 6.5e8) 33 s against 21 s.
        """
        work = self.work_estimate(linear_algebra=False)
        if jax_available():
            return "jax" if work > COMPILE_WORK_THRESHOLD else "python"
        return "numba" if work > NUMBA_COMPILE_WORK_THRESHOLD else "python"

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
        dimensions) is slower with several BLAS threads than with one: the
        threads' start-up and spinning cost more than they save, badly so on a
        busy machine (a 185 x 185 Cholesky: 0.3 ms with one thread, 3 ms with two).
        ``None`` picks one thread below :data:`BLAS_THREADS_WORK` flops per
        iteration and leaves BLAS alone above.
        """
        if blas_threads is None:
            blas_threads = 1 if self.work_estimate() < BLAS_THREADS_WORK else None
        if blas_threads is None:
            return contextlib.nullcontext()
        return threadpool_limits(limits=int(blas_threads), user_api="blas")

    def _step_function(self, backend=None, compile_kwargs=None):
        compile_kwargs = dict(compile_kwargs or {})
        automatic = backend is None and "mode" not in compile_kwargs
        if automatic:
            backend = self.choose_backend()
        key = (backend, repr(sorted(compile_kwargs.items())))
        if key not in self._step_fns:
            try:
                fn = self._compile_step(backend, compile_kwargs)
            except Exception as err:  # noqa: BLE001  (JAX's translation errors share no base class)
                if not (automatic and backend == "jax"):
                    raise
                # a missing JAX translation (NotImplementedError) or a failure inside one
                # (an AttributeError in PyTensor's JAX Reshape for a general likelihood term):
                # the fallback backend compiles the same graph, and re-raises a genuine error
                self._replace_jax_step(key, compile_kwargs, err)
            else:
                if automatic and backend == "jax":
                    fn = _TracedOnFirstCall(
                        fn, lambda err: self._replace_jax_step(key, compile_kwargs, err)
                    )
                self._step_fns[key] = (fn, backend or "custom")
        fn, self.backend_used = self._step_fns[key]
        return fn

    def _jax_fallback_backend(self) -> str:
        """Backend used when JAX cannot run an automatically chosen step.

        Uncompiled below :data:`JAX_FALLBACK_COMPILE_WORK` estimated flops per
        iteration (a cold numba compilation costs about a minute), numba above.
        """
        return "python" if self.work_estimate() < JAX_FALLBACK_COMPILE_WORK else "numba"

    def _replace_jax_step(self, key, compile_kwargs, err):
        """Compile the fallback of a JAX step that failed to compile or trace, and remember it."""
        fallback = self._jax_fallback_backend()
        logger.info(
            "JAX cannot run this step (%s: %s); using the %s backend instead.",
            type(err).__name__,
            str(err).splitlines()[0] if str(err) else "",
            fallback,
        )
        fn = self._compile_step(fallback, compile_kwargs)
        self._step_fns[key] = (fn, fallback)
        self.backend_used = fallback
        return fn

    def _compile_step(self, backend, compile_kwargs):
        ck = _named_backend_kwargs(backend, compile_kwargs) if backend != "python" else {}
        mode = ck.get("mode")
        jax_mode = backend == "jax" or (
            isinstance(mode, Mode) and type(mode.linker).__name__ == "JAXLinker"
        )
        with graph_building():
            outputs, updates = self.kernel.build(by_node=jax_mode)
        if backend == "python":

            def compile_python(full, reseed=True):
                mode = python_step_mode() if full else python_few_calls_mode()
                # an upgrade keeps the generators' state: no reseeding (``False``)
                seed = self.random_seed if reseed else False
                with self.model, warnings.catch_warnings():
                    warnings.filterwarnings("ignore", "The RandomType SharedVariables")
                    return pm_compile(
                        [],
                        outputs,
                        updates=updates,
                        random_seed=seed,
                        **{**compile_kwargs, "mode": mode},
                    )

            return _UpgradingStep(compile_python)
        if jax_mode:
            # static split positions for JAX (sigma-point vectorized gradients of joins),
            # and stacked products of small blocks as batched dots
            ck["mode"] = get_mode(mode if mode is not None else "JAX").register(
                (in2out(broadcast_products_as_matmul), 0.5),
                (in2out(unbatch_constant_split), 59),
                (in2out(softplus_of_nonpositive), 59.1),
            )
        with self.model, warnings.catch_warnings():
            # JAX steps draw from copies of their generators (Monte Carlo draws): expected.
            warnings.filterwarnings("ignore", "The RandomType SharedVariables", UserWarning)
            fn = pm_compile([], outputs, updates=updates, random_seed=self.random_seed, **ck)
        return _HostStateStep(fn) if jax_mode else fn

    # --------------------------------------------------------------------- fit
    def fit(
        self,
        n=None,
        score=None,
        callbacks=None,
        progressbar=True,
        progressbar_theme=default_progress_theme,
        *,
        tol=None,
        max_iter=10_000,
        backend=None,
        include_transformed=False,
        compile_kwargs=None,
        blas_threads=None,
        **kwargs,
    ):
        """Run the algorithm.

        Parameters
        ----------
        n : int, optional
            Number of iterations. ``None`` runs until the bound has converged
            (see ``tol``), at most ``max_iter`` iterations.
        callbacks : list of callable, optional
            Called as ``callback(approx, losses, i)`` after each iteration, as in
            PyMC; raising ``StopIteration`` ends the fit.
        progressbar : bool
        tol : float, optional
            Relative change of the bound that counts as converged (default
            ``1e-7`` for full-batch fits, ``1e-3`` between windowed averages for
            minibatch fits).
        max_iter : int
            Cap on the number of iterations when ``n`` is None.
        backend : {"numba", "c", "jax", "python"}, optional
            PyTensor backend of the compiled step. ``None`` chooses ``"python"``
            (no compilation) for small problems and ``"jax"`` (or ``"numba"``
            when JAX is not installed) for large ones, see :meth:`choose_backend`.
        blas_threads : int, optional
            Threads of BLAS/LAPACK during the fit (the iterations and the re-fits
            after them); ``None`` uses one thread for small and medium problems
            (faster) and leaves larger ones alone.

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
        if n is not None:
            if not isinstance(n, int | np.integer) or n <= 0:
                raise ValueError(f"n must be a positive integer (number of iterations), got {n!r}")
        if max_iter <= 0:
            raise ValueError(f"max_iter must be positive, got {max_iter!r}")
        callbacks = list(callbacks or [])
        if self.approx.changed_data():
            check_data(self.model, [g.value for g in self.tlm.gaussians])
            # ``pm.set_data`` since the last fit: the stored bound (and the derivatives
            # behind the pending candidate) are the old data's, against which every step
            # would be judged. The current q is re-evaluated on the new data and accepted.
            k = self.kernel
            k.reset_candidate()
            k.base_bound.set_value(-np.inf)
            k.base_phase.set_value(np.full_like(k.base_phase.get_value(), -np.inf))
        if getattr(self, "_marginal", None) is not None:
            self._marginal[0].set_value(np.int8(0))  # recomputed at the end of this fit
        if getattr(self, "_grid", None) is not None:
            self._grid[0].set_value(np.int8(0))
        if getattr(self, "_view", None) is not None:
            self._view.on.set_value(np.int8(0))
        step = self._step_function(backend, compile_kwargs)
        if isinstance(step, _UpgradingStep):
            if n is not None and step.calls + n > UPGRADE_AT:
                step.upgrade()
            step.compile()  # before the loop, as for the other backends
        total = int(n) if n is not None else int(max_iter)
        auto_stop = n is None
        if tol is None:
            tol = 1e-3 if self.stochastic else 1e-7
        scores = np.full(total, np.nan)
        gains: list[float] = []
        i = 0
        converged = False
        start_iter = len(self.hist)
        with (
            self._blas_limits(blas_threads),
            # Non-finite candidates are rejected by the step itself (and a run of them
            # raises DivergenceError): NumPy's floating-point warnings are noise here.
            np.errstate(all="ignore"),
            CustomProgress(
                *Progress.get_default_columns(),
                TextColumn("{task.fields[loss]}"),
                console=Console(theme=progressbar_theme),
                disable=not progressbar,
            ) as progress,
        ):
            task = progress.add_task("Fitting", total=total, loss="")
            try:
                for i in range(total):
                    prev = float(self.kernel.base_bound.get_value())
                    base, cand, accepted, rho = step()
                    if self._averaged:
                        self._average_iterate()
                    scores[i] = -float(base)
                    gains.append(float(cand) - prev if np.isfinite(prev) else np.inf)
                    self._track_rejections(bool(accepted), float(cand), start_iter + i)
                    progress.update(task, advance=1)
                    if i % 5 == 0 or i == total - 1:
                        progress.update(
                            task, loss=f"-ELBO = {scores[i]:,.6g}  rho = {float(rho):.3g}"
                        )
                    for cb in callbacks:
                        cb(self.approx, scores[: i + 1], start_iter + i + 1)
                    if auto_stop and self._converged(scores[: i + 1], gains, tol):
                        converged = True
                        progress.update(task, total=i + 1, completed=i + 1)
                        i += 1
                        break
                else:
                    i = total
            except StopIteration as e:
                logger.info(str(e))
                i += 1
            except KeyboardInterrupt:
                pass
        scores = scores[:i]
        if start_iter == 0:
            # iterations spent on a start whose bound was not finite (then narrowed, see
            # ``_shrink_start``) are not part of the fit's history
            scores = scores[np.argmax(np.isfinite(scores)) if np.isfinite(scores).any() else 0 :]
        self.hist = np.concatenate([self.hist, scores])
        self.approx.hist = self.hist
        self.approx.n_iter = len(self.hist)
        self.approx.converged = converged if auto_stop else None
        for group in self.approx.groups:
            group.include_transformed = include_transformed
        if auto_stop:
            msg = "converged" if converged else "stopped at max_iter without converging"
            logger.info(
                f"{type(self).__name__}: {msg} after {i} iterations, -ELBO = {scores[-1]:,.6g}"
            )
        self.state = i
        if self._averaged:
            self._use_average()
        self._warn_collapsed_scales()
        # the re-fits after the loop are small linear algebra too (see ``_blas_limits``)
        with self._blas_limits(blas_threads):
            if getattr(self, "_marginal", None) is not None:
                self._fit_hyper_marginal()
            conditional_globals = None
            if getattr(self, "_view", None) is not None:
                conditional_globals = self._batched_refits()
        factories = []
        if conditional_globals is not None:
            # the factory holds what it returns, not the inference object (whose compiled
            # step does not pickle): a fitted approximation pickles as PyMC's do
            factories.append(lambda: conditional_globals)
        if self.tlm.locals:
            if getattr(self, "_local_moments", None) is None:
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
        return self.approx

    def _batched_refits(self) -> ConditionalGlobals:
        """The re-fits of q(w | h) at a batch of points ``h`` (made once per fit object)."""
        if getattr(self, "_conditional_globals", None) is None:
            k = self.kernel
            work = self.work_estimate() / max(len(k.hypers.w), 1)
            if self.tlm.general_terms or self.tlm.rayleighs:
                # Monte Carlo + autodiff terms: a re-fit per draw is never cheap, and
                # compiling it took PyTensor's rewriting > 5 minutes on a non-centered
                # observation-level effect. A Rayleigh global: the re-fit moves q(w | h)
                # only, and its value would be an input it is never given
                # (MissingInputError in approx.sample). The draws come from the view
                work = np.inf
            self._conditional_globals = ConditionalGlobals(
                k, self.model, self.approx.groups[0], work
            )
        return self._conditional_globals

    @staticmethod
    def _corner_values(prof, centre, am, mu):
        """The profile relative to the centre at ``+-2`` sds on every pair of q(h)'s axes
        (:func:`~pymc_mcssvi.algorithms.marginal.off_axis_nodes`: 4 re-fits per pair), or
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
        profile (:func:`~pymc_mcssvi.algorithms.profile_grid.grid_wanted`; ``corners``
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
        (:meth:`~pymc_mcssvi.pymc.conditional.ConditionalGlobals.affordable` for
        :data:`~pymc_mcssvi.algorithms.profile_grid.MAX_GRID_POINTS` points), judged from
        the memory the profile's own step held (one re-fit at one point, already
        compiled and run; 1.10-1.18x the batched step's per draw on the GLMM benchmark,
        as it also holds the data): the batched step is compiled only for a grid that
        is affordable. Logged at INFO when not, and ``False`` when measuring the
        batched step fails (the axis marginal stays, as for any failure of the grid)."""
        spec = self.kernel.hypers.spec
        measured = (
            step_measure(self._profile_fn.fn)
            if self.backend_used in (None, "python")  # the re-fits' own mode
            else None  # measured on the batched step itself
        )
        try:
            with threadpool_limits(limits=1, user_api="blas"), np.errstate(all="ignore"):
                hs = _by_variable(np.tile(mu, (2, 1)), spec.shapes)
                ok = self._batched_refits().affordable(MAX_GRID_POINTS, hs, measured=measured)
        except Exception as err:  # the batched step failed to compile or run: no grid
            logger.info("q(h) not gridded (%s: %s)", type(err).__name__, err)
            return False
        if not ok:
            logger.info("q(h) not gridded: its re-fits are not affordable")
        return ok

    def _profile_grid(self, mu, P, seeds):
        """``(GridMarginal, D)``: the profile on a grid around ``mu`` in coordinates scaled
        by the conditional sds ``D`` of the Gaussian with precision ``P`` (see
        :mod:`~pymc_mcssvi.algorithms.profile_grid`), or ``None`` when its batched
        re-fits fail (logged at INFO; the axis marginal stays).
        ``seeds`` are ``(h, Refit)`` pairs (the axis marginal's re-fits): the first
        round's re-fits start from the nearest one, moved by the linear response; the
        caller has checked that they are affordable (:meth:`_grid_affordable`)."""
        cg = self._batched_refits()
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
            size = int(max(1, BATCH_BYTES // cg.bytes_per_draw(_by_variable(H[:2], spec.shapes))))
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
                    _by_variable(H[sl], spec.shapes),
                    start=start,
                    floor=top - GRID_DROP - GRID_FLOOR_MARGIN,
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

    def _fit_hyper_marginal(self):
        """Replace the linear-response q(h) by the converged profile's, skewed where trusted.

        See :mod:`pymc_mcssvi.algorithms.marginal`. q(h)'s Gaussian takes the
        curvature of the profile at its centre (finite differences of
        re-fitted bounds); the skewed axis marginal replaces it when the
        profile along its axes is finite and agrees with that curvature; the
        conditional sds and means of q(w | h) at the profile points then shape
        the Gaussian globals' draws. The re-fit function is compiled once per
        fit object; any failure keeps what was reached, logged at INFO.
        """
        hyp = self.kernel.hypers
        on, V_sh, s_sh, T_sh, shift_sh, cov_sh = self._marginal
        if getattr(self, "_conditional_globals", None) is not None:
            self._conditional_globals.nodes = None  # a previous fit's grid
        on.set_value(np.int8(0))
        mu = hyp.base_mean.get_value()[0]
        means = [m.get_value() for m in self.kernel.base_mean]
        responses = [U.get_value() for U in hyp.lr_responses]
        try:
            if self._profile_fn is None:
                self._profile_fn = self._compile_profile()
            prof = ConditionalProfile(
                self._profile_fn,
                mu,
                means,
                [f.get_value() for f in self.kernel.base_factor],
                responses,
            )
            L = hyp.lr_factor.get_value()[0]
            sd = np.sqrt(np.diag(np.linalg.inv(L @ L.T)))
            with np.errstate(all="ignore"):
                centre = prof.refit(mu, *prof.start(mu, prof.fitted, mu))
                H = prof.hessian(centre, HESSIAN_STEP * sd)
                P = -0.5 * (H + H.T)
                L_P = np.linalg.cholesky(P)  # LinAlgError: not concave at the centre
                hyp.lr_factor.set_value(L_P[None])
                lam, V = np.linalg.eigh(np.linalg.inv(P))
                s = np.sqrt(lam)
                along, s = prof.along_axes(centre, V, s)
                refits = [centre, *along]
        except Exception as err:  # the Gaussian q(h) stays
            logger.info("Skewed q(h) not computed (%s: %s)", type(err).__name__, err)
            return
        self._warn_higher_profile(refits, V, s, mu)
        values = [r.value for r in refits]
        am = axis_marginal(values, V, s)
        if am is None:
            # the Gaussian kept is fitted to the profile along the axes, not only to its
            # curvature at the centre (see ``profile_scales``)
            fitted = profile_scales(values, s)
            hyp.lr_factor.set_value(np.linalg.cholesky((V / fitted**2) @ V.T)[None])
            logger.info(
                "Skewed q(h) not used: the profile disagrees with its curvature; Gaussian "
                "q(h) fitted to the profile along its axes (scales %s, curvature's %s)",
                np.round(fitted, 4),
                np.round(s, 4),
            )
            return
        if len(s) > MAX_UNCHECKED_HYPERS and (skew := axis_skew(am)) < MIN_AXIS_SKEW:
            logger.info(
                "Skewed q(h) not used: %d axes, skew %.3f below %s", len(s), skew, MIN_AXIS_SKEW
            )
            return
        corners = self._corner_values(prof, centre, am, mu) if len(s) > 1 else None
        joint = None
        if (
            getattr(self, "_grid", None) is not None
            and self._grid_affordable(mu)
            and self._grid_wanted(am, corners)
        ):
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
            g_on, D_sh, Tg_sh, C_sh, rows_sh = self._grid
            D_sh.set_value(D)
            Tg_sh.set_value(gm.table)
            C_sh.set_value(gm.conditional)
            rows_sh.set_value(gm.rows)
            am = _grid_axis_marginal(am, gm, D)
            g_on.set_value(np.int8(1))
        V_sh.set_value(am.directions)
        s_sh.set_value(am.scales)
        T_sh.set_value(am.table)
        shift_sh.set_value(am.mean_shift)
        cov_sh.set_value(am.cov)
        on.set_value(np.int8(1))
        if self._view is None:
            return
        view = self._view
        n_w = view.mean_table.get_value(borrow=True).shape[-1]
        flat = functools.partial(_flatten, self._flat_maps, n_w)
        factors = [f.get_value() for f in self.kernel.base_factor]
        work = sum(f.shape[0] * f.shape[-1] ** 3 for f in factors)
        # the data's coordinates need the re-fits' covariances (as the averaged view does)
        dc = data_coordinates(refits) if work <= MAX_VIEW_WORK else None
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
                log_sens = self._log_sensitivities(
                    np.vstack([mu, node_table_points(am, mu, nodes)])
                )
                centre = np.where(masks[0] > 0, log_sens[0], 0.0)
                return masks[0] * 0.5 * (log_sens[1:] - centre)

            additive = ls_axes[np.arange(n), pairs].sum(axis=1)
            if len(pairs) and np.max(np.abs(exact(pairs) - additive)) > ADDITIVE_LOG_SCALE_TOL:
                if len(NODES) ** n * n_w > MAX_MOMENT_GRID:
                    dc = None  # the grid of log scales would not fit
                    masks[:] = 0.0
                else:
                    ls_grid = exact(None)
                ls_axes = np.zeros_like(ls_axes)
        mean_table = conditional_mean_table(
            refits, means, V, s, self._flat_maps, n_w, None if dc is None else dc.mean_log_scales()
        )
        view.mean_table.set_value(mean_table)
        view.log_scale_axes.set_value(ls_axes)
        # the draws' log scales off the axes stay within the axes' range (the moments below
        # take the exact ones at the grid's points)
        view.log_scale_grid.set_value(
            within_axis_range(ls_grid, n) if len(ls_grid) > 1 else ls_grid
        )
        view.scale_masks.set_value(masks)
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
                self._conditional_globals.nodes, gm, self._flat_maps, n_w, fitted
            )
        for shared, value in zip(view.moments, moments, strict=True):
            shared.set_value(value)
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
                    factors, ratios, grid, log_scales, self._flat_maps
                )
            if moment_factors is None:
                moment_factors = factors
        else:
            moment_factors = node_factors
        table = np.zeros(view.sd_table.get_value(borrow=True).shape)
        for ratio, idx in zip(ratios, self._flat_maps, strict=True):
            table[:, :, idx.reshape(-1)] = ratio.reshape((*ratio.shape[:2], -1))
        for shared, f in zip(view.factors, factors, strict=True):
            shared.set_value(f)
        for shared, f in zip(view.moment_factors, moment_factors, strict=True):
            shared.set_value(f)
        view.sd_table.set_value(table)
        view.on.set_value(np.int8(1))

    def _sensitivity_graph(self, n_w):
        """``(h, sensitivities)``: the squared column norms of the likelihoods' predictor
        Jacobian (flat, in q(w)'s order) as a graph of the flat hyperparameter vector
        ``h`` (:meth:`~pymc_mcssvi.bounds.structured.StructuredBound.sensitivities`):
        the scales of the data's coordinates at each draw of the conditional view."""
        k = self.kernel
        h = pt.vector("view_h", shape=(k.hypers.spec.size,))
        with graph_building():
            out = pt.zeros((n_w,))
            for c, idx in zip(self.bound.sensitivities(k.nseg), self._flat_maps, strict=True):
                out = pt.set_subtensor(out[idx.reshape(-1)], c.reshape((-1,)))
            out = graph_replace(out, k.hypers.spec.replacements(h), strict=False)
            (out,) = shapes_at_fixed(h, [out])
        return h, out

    def _log_sensitivities(self, hs):
        """``log`` of the view's sensitivities at the rows of ``hs`` (compiled once)."""
        if getattr(self, "_sensitivity_fn", None) is None:
            h, out = self._sensitivity_graph(self._view.mean_table.get_value(borrow=True).shape[-1])
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
        # call): a spline of 12 coefficients through a scaled cumsum held about 30 MB
        # per point, and all 730 points of a three-hyperparameter grid at once 24 GB.
        first = fn(hs[:1])
        per_point = max(held_bytes(fn), 1)
        size = int(max(1, min(len(hs), SENSITIVITY_BATCH_BYTES // per_point)))
        out = [first] + [fn(hs[lo : lo + size]) for lo in range(1, len(hs), size)]
        return np.concatenate(out)

    def _compile_profile(self):
        """The re-fit step ``(h, rho, means, factors) -> (value, means, factors, gain, sensitivity)`` of
        :func:`~pymc_mcssvi.algorithms.marginal.refit_graph`, ``h`` flat."""
        hyp = self.kernel.hypers
        with graph_building(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            inputs, outputs = refit_graph(self.kernel, gain=True, sensitivity=True)
            ck = (
                {"mode": python_few_calls_mode()}
                if self.backend_used in (None, "python", "custom")
                else _named_backend_kwargs(self.backend_used, {})
            )
            # float64 points into a floatX=float32 model's hyperparameters
            fn = pm_compile(inputs, outputs, allow_input_downcast=True, **ck)
        shapes = hyp.spec.shapes
        nseg = self.kernel.nseg

        def step(h, rho, means, factors):
            out = fn(*_by_variable(h, shapes), rho, *means, *factors)
            k = 1 + 2 * nseg
            return out[0], out[1 : 1 + nseg], out[1 + nseg : k], out[k], out[k + 1 :]

        step.fn = fn
        return step

    def _warn_collapsed_scales(self):
        """Warn when a log-transformed hyperparameter's estimate ran off towards 0."""
        hyp = self.kernel.hypers
        if hyp is None:
            return
        flat = hyp.base.get_value() if hyp.mode == "point" else hyp.base_mean.get_value()[0]
        off = 0
        for h in self.tlm.hypers:
            n = h.size
            tr = self.model.rvs_to_transforms.get(h.rv)
            vals = flat[off : off + n]
            off += n
            if tr is not None and type(tr).__name__ == "LogTransform" and np.any(vals < -12.0):
                advice = (
                    f"consider hyper='meanfield', or a prior on {h.name!r} with less mass near 0."
                    if hyp.mode == "point"
                    else f"consider a prior on {h.name!r} with less mass near 0."
                )
                warnings.warn(
                    f"The estimate of {h.name!r} collapsed towards 0 (value {np.exp(vals.min()):.2g}): the "
                    "bound prefers no variation at that level. The rest of the fit is valid given that value; "
                    + advice,
                    UserWarning,
                    stacklevel=3,
                )

    def _warn_higher_profile(self, refits, directions, scales, mu):
        """Warn when, after a converged fit, the profile along q(h)'s axes rises above its
        centre by more than :data:`PROFILE_RISE_WARN` nats: the fit stopped away from the
        highest bound it can reach, as on a rough or multimodal posterior (a sharp change
        point: q(h) stayed at tau = 50 where NUTS puts it at 59, 6.9 sds away, with the
        profile 1.2 nats higher 4 sds out)."""
        if not self.approx.converged:
            return  # n= iterations, or max_iter: not at a maximum anyway
        rise = np.array([r.value for r in refits[1:]], dtype="float64") - refits[0].value
        if not np.any(np.isfinite(rise)) or np.nanmax(rise) <= PROFILE_RISE_WARN:
            return
        j, i = divmod(int(np.nanargmax(rise)), len(AXIS_POINTS))
        step = AXIS_POINTS[i] * np.asarray(directions)[:, j] * scales[j]
        hypers = self.tlm.hypers
        ends = np.cumsum([hh.size for hh in hypers])
        # the hyperparameter of the coordinate that moves most
        h = hypers[int(np.searchsorted(ends, np.argmax(np.abs(step)), side="right"))]
        try:
            expr = self.model.replace_rvs_by_values([h.rv])[0]
            point = self.model.initial_point()
            used = set(ancestors([expr]))
            inputs = [v for v in self.model.value_vars if v in used]
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

    def refine(self, n, progressbar=True, progressbar_theme=default_progress_theme):
        """Continue a fit for ``n`` more iterations."""
        return self.fit(n, progressbar=progressbar, progressbar_theme=progressbar_theme)

    @property
    def _averaged(self) -> bool:
        """Whether q is the average of the iterates: fits on ``pm.Minibatch`` data (with
        ``row_subsample`` alone the factorizations' iterates still drift, and their
        average was no closer to the full-batch fit)."""
        return bool(self.stochastic and self.tlm.minibatch)

    def _average_iterate(self):
        """Add the accepted state to the iterate average, and every
        :data:`STOCHASTIC_WINDOW` iterations keep the average's location."""
        k = self.kernel
        if getattr(self, "_average", None) is None:
            self._average = IterateAverage(self.algorithm.parameterization)
            self._average_locations = []
        hyper = None
        if k.hypers is not None and k.hypers.mode == "point":
            hyper = ("point", np.array(k.hypers.base.get_value()))
        elif k.hypers is not None:
            hyper = ("gaussian", k.hypers.base_mean.get_value(), k.hypers.base_factor.get_value())
        self._average.update(
            [m.get_value(borrow=True) for m in k.base_mean],
            [f.get_value(borrow=True) for f in k.base_factor],
            hyper,
        )
        if self._average.t % STOCHASTIC_WINDOW == 0:
            try:
                self._average_locations = [*self._average_locations[-1:], self._average.location()]
            except np.linalg.LinAlgError:
                self._average_locations = []

    def _use_average(self):
        """Replace the last iterate of a stochastic fit by the iterates' average
        (:mod:`pymc_mcssvi.algorithms.averaging`); the next ``fit`` starts from it."""
        avg = getattr(self, "_average", None)
        if avg is None or avg.blocks is None:
            return
        k = self.kernel
        try:
            means, factors, hyper = avg.result()
        except np.linalg.LinAlgError:
            logger.info("Iterate average not used: an averaged precision is not positive definite")
            return
        if not all(np.all(np.isfinite(x)) for x in [*means, *factors]):
            return
        for shared, value in zip(k.base_mean, means, strict=True):
            shared.set_value(value)
        for shared, value in zip(k.base_factor, factors, strict=True):
            shared.set_value(value)
        if hyper is not None and hyper[0] == "point":
            k.hypers.base.set_value(hyper[1])
        elif hyper is not None:
            k.hypers.base_mean.set_value(hyper[1])
            k.hypers.base_factor.set_value(hyper[2])
        k.reset_candidate()

    def _track_rejections(self, accepted, cand_bound, iteration):
        if not accepted and not np.isfinite(float(self.kernel.base_bound.get_value())):
            if self._start_shrinks < MAX_START_SHRINKS:
                self._shrink_start(cand_bound)
                return
            if self._start_jitters < MAX_START_JITTERS:
                self._jitter_start(cand_bound)
                return
        self._rejections = 0 if accepted else self._rejections + 1
        if self._rejections >= MAX_REJECTIONS:
            self.kernel.reset_candidate()
            self._rejections = 0
            base = float(self.kernel.base_bound.get_value())
            if not np.isfinite(base):
                raise DivergenceError(
                    "The ELBO or its derivatives are not finite at the starting point (ELBO "
                    f"{cand_bound}), nor with a narrower q or at jittered starts. "
                    f"{self._start_diagnosis()}Check the observed data against the likelihood's "
                    "support, the `start` values, and expressions whose derivatives are not "
                    "finite where q puts mass (x ** 0 at x = 0, sqrt(x) at 0); a smaller "
                    "`start_sigma` can help.",
                    approx=self.approx,
                    iteration=iteration,
                )
            raise DivergenceError(
                f"The fit diverged at iteration {iteration}: {MAX_REJECTIONS} consecutive steps gave a "
                f"non-finite or lower ELBO (last candidate: {cand_bound}). The approximation keeps the "
                f"last good state (ELBO {base:,.6g}); it is available as `error.approx`. Try a smaller "
                "`rho0`, or `schedule='power'`.",
                approx=self.approx,
                iteration=iteration,
            )

    def _start_diagnosis(self) -> str:
        """Which observed variables have a non-finite log density at the model's initial
        point, and at which entries (the likely cause of a start that cannot be fitted:
        data outside the likelihood's support); ``""`` if none or if it cannot be told."""
        out = []
        try:
            point = self.model.initial_point()
            for obs in self.model.observed_RVs:
                (lp,) = self.model.compile_logp(vars=[obs], sum=False)(point)
                bad = np.flatnonzero(~np.isfinite(np.ravel(lp)))
                if bad.size:
                    value = np.ravel(np.asarray(self.model.rvs_to_values[obs].eval()))
                    shown = ", ".join(
                        f"{int(i)} ({value[i]:g})" if value.size == np.size(lp) else str(int(i))
                        for i in bad[:5]
                    )
                    more = f" and {bad.size - 5} more" if bad.size > 5 else ""
                    out.append(
                        f"Observed {obs.name!r} has a log density of {np.ravel(lp)[bad[0]]} at "
                        f"the model's initial point at entries {shown}{more}. "
                    )
        except Exception:  # noqa: BLE001  (a diagnosis only)
            return ""
        return "".join(out)

    def _jitter_start(self, cand_bound):
        """Move the start's means (q(w)'s and q(h)'s) by uniform noise, as ``pm.sample``
        jitters its initial point, and start again (before any step was accepted)."""
        k = self.kernel
        seed = self.random_seed if isinstance(self.random_seed, int | np.integer) else 0
        rng = np.random.default_rng([int(seed) % 2**32, self._start_jitters])

        def jitter(shared):
            x = shared.get_value()
            shared.set_value(x + rng.uniform(-START_JITTER, START_JITTER, np.shape(x)))

        for s in range(k.nseg):
            jitter(k.base_mean[s])
        hyp = k.hypers
        if hyp is not None:
            jitter(hyp.base if hyp.mode == "point" else hyp.base_mean)
        k.reset_candidate()
        self._start_jitters += 1
        self._rejections = 0
        logger.info(
            "The bound or its derivatives are not finite at the start (%s); starting again "
            "from jittered means.",
            cand_bound,
        )

    def _shrink_start(self, cand_bound):
        """Start again from q with a 10x smaller sd (before any step was accepted).

        The default start (``start_sigma``, data-scaled) is wide, and Gauss-Hermite
        nodes sit up to 5-7 sds out: a log density with NaN derivatives at large
        rates (PyMC's ``HurdlePoisson`` above ``log rate = 6``) or a link that leaves
        the parameter's support there (an identity-link Poisson) makes the start's
        bound non-finite. A narrower start keeps the nodes inside.
        """
        k = self.kernel
        factor = 10.0 if self.algorithm.parameterization == "precision" else 0.1
        for s in range(k.nseg):
            L = k.base_factor[s].get_value() * factor
            k.base_factor[s].set_value(L)
            k.cand_factor[s].set_value(L)
            k.cand_mean[s].set_value(k.base_mean[s].get_value())
        if k.hypers is not None:
            k.hypers.reset()
        if k.rayleighs is not None:
            k.rayleighs.reset()
        self._start_shrinks += 1
        self._rejections = 0
        logger.info(
            "The bound or its derivatives are not finite at the start (%s); starting again "
            "with q's sd %gx smaller.",
            cand_bound,
            10.0**self._start_shrinks,
        )

    def _converged(self, scores, gains, tol) -> bool:
        """Default stopping rule.

        Full batch: in each of the last three iterations the candidate's bound
        differed from the current one by at most ``tol * (|ELBO| + 10)``, whether
        the step was accepted (it gained little) or rejected (it would have lost
        little: the remaining difference is at the level of quadrature error).
        Minibatch: the averages of the last two windows of 50 iterations differ
        by at most ``tol`` (relative).
        """
        if self.stochastic:
            w = STOCHASTIC_WINDOW
            if len(scores) < 2 * w:
                return False
            a, b = np.mean(scores[-w:]), np.mean(scores[-2 * w : -w])
            if abs(a - b) > tol * abs(b):
                return False
            if not self._averaged:
                return True
            # the averaged q (what the fit returns) must have stopped moving too
            locs = getattr(self, "_average_locations", [])
            if len(locs) < 2:
                return False
            (m0, _), (m1, sd1) = locs
            return float(np.sqrt(np.mean(((m1 - m0) / sd1) ** 2))) <= STOCHASTIC_MEAN_TOL
        k = 3
        if len(scores) <= k or not np.all(np.isfinite(scores[-k - 1 :])):
            return False
        # the absolute part (1e-6 at the default tol) scales with tol, so that a
        # smaller tol is honoured near ELBO = 0 and for tight checks (tol=1e-12)
        limit = tol * (abs(scores[-1]) + 10.0)
        return all(abs(g) <= limit for g in gains[-k:])


def _flatten(flat_maps, size, blocks) -> np.ndarray:
    """Per-segment ``(R, K)`` arrays placed in q(w)'s flat order."""
    out = np.zeros(size)
    for b, idx in zip(blocks, flat_maps, strict=True):
        out[idx.reshape(-1)] = np.asarray(b).reshape(-1)
    return out


def _check_start(point, model, start):
    """Raise for a ``start=`` value of the wrong shape or outside its variable's support.

    ``point`` is the initial point (transformed values) with ``start``: a value of
    another shape was silently cut to the variable's length (or raised a raw
    ``IndexError``), and one outside the support (a negative scale) became a NaN
    mean of q.
    """
    default = model.initial_point()
    rv_name = {v.name: model.values_to_rvs[v].name for v in model.value_vars}
    for name, value in point.items():
        var, want = rv_name.get(name, name), np.shape(default[name])
        if var not in start and name not in start:
            continue
        if np.shape(value) != want:
            raise ValueError(
                f"start value for {var!r} has shape {np.shape(value)}, but {var!r} has shape "
                f"{want}: pass an array of that shape"
            )
        if not np.all(np.isfinite(value)):
            raise ValueError(
                f"start value for {var!r} is outside its support (not finite in PyMC's "
                f"unconstrained space, {name!r}): pass a value inside it, e.g. a positive "
                "value for a scale"
            )


def _start_sigmas(start_sigma, tlm, dim, offsets):
    """Initial sds of q: ``(flat sds of the Gaussian globals, flat sds of q(h) or None)``.

    ``start_sigma`` is a positive number for every Gaussian global, or (as for
    ``pm.ADVI``) a dict from free variables' names (or their value variables') to sds
    of their unconstrained values, scalars or arrays of their shape; a variable not in
    the dict starts at 1 (q(h) at ``HyperSpec.init_sd``).
    """
    if not isinstance(start_sigma, dict):
        try:
            sd = float(start_sigma)
        except (TypeError, ValueError):
            sd = np.nan
        if not np.isfinite(sd) or sd <= 0:
            raise ValueError(
                f"start_sigma must be a positive number or a dict of them by variable name, "
                f"got {start_sigma!r}"
            )
        return np.full(dim, sd), None
    sigma = np.ones(dim)
    n_h = sum(h.size for h in tlm.hypers)
    hyper_sd = np.full(n_h, HyperSpec.init_sd)
    where = {}
    for gid, g in enumerate(tlm.gaussians):
        where[g.name] = where[g.value.name] = (sigma, offsets[gid], g.size, g.shape)
    off = 0
    for h in tlm.hypers:
        where[h.name] = where[h.value.name] = (hyper_sd, off, h.size, h.shape)
        off += h.size
    for name, value in start_sigma.items():
        if name not in where:
            raise ValueError(
                f"start_sigma: {name!r} is not a free variable of the model fitted by the "
                f"structured q (free variables: {', '.join(g.name for g in tlm.gaussians)}"
                + "".join(f", {h.name}" for h in tlm.hypers)
                + ")"
            )
        target, o, n, shape = where[name]
        try:
            sd = np.broadcast_to(np.abs(np.asarray(value, dtype="float64")), shape).reshape(-1)
        except ValueError:
            raise ValueError(
                f"start_sigma[{name!r}] has shape {np.shape(value)}; {name!r} has shape {shape}"
            ) from None
        if not np.all(np.isfinite(sd) & (sd > 0)):
            raise ValueError(f"start_sigma[{name!r}] must be positive and finite, got {value!r}")
        target[o : o + n] = sd
    return sigma, (hyper_sd if n_h else None)


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


def _by_variable(H, shapes) -> list:
    """Flat hyperparameter vectors ``(..., n_h)`` split into one array per value variable,
    ``(..., *shape)`` each.

    Examples
    --------
    >>> [x.shape for x in _by_variable(np.zeros((5, 7)), [(), (2, 3)])]
    [(5,), (5, 2, 3)]
    """
    H = np.asarray(H)
    split = np.cumsum([int(np.prod(shp)) for shp in shapes])[:-1]
    parts = np.split(H, split, axis=-1)
    return [x.reshape((*H.shape[:-1], *shp)) for x, shp in zip(parts, shapes, strict=True)]


def _grid_axis_marginal(am, gm: GridMarginal, D):
    """``am`` with the gridded q(h)'s moments (in ``h``) and, as its axes' weights (the
    averaged view's, :func:`~pymc_mcssvi.algorithms.marginal.averaged_view_factors`),
    the margins of its fine points' masses along each axis, shared linearly between
    the two nearest :data:`~pymc_mcssvi.algorithms.marginal.NODES` (beyond them, at
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
    :meth:`~pymc_mcssvi.pymc.conditional.ConditionalGlobals` draws them, under the
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
    if R.shape[1] > MAX_MOMENT_RANK:
        Ur, sv, _ = np.linalg.svd(R, full_matrices=False)
        R = Ur[:, :MAX_MOMENT_RANK] * sv[:MAX_MOMENT_RANK]
    factors = []
    for L in nodes.factors:
        S = np.einsum("k,k...->...", p, _block_covariance(L))
        prec = np.linalg.inv(S)
        factors.append(np.linalg.cholesky(0.5 * (prec + np.swapaxes(prec, -1, -2))))
    return DrawMoments(mean - fitted, R, (m - mean).T @ Q), factors
