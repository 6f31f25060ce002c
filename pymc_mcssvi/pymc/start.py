"""The start of a fit: the initial q, its scaling to the data, and restarts.

The initial q puts each Gaussian global's mean at the model's initial point (or
``start=``) with sd ``start_sigma`` in every coordinate, shrunk when that would give
a linear predictor an sd above :data:`START_PREDICTOR_SD` (unstandardized
covariates). When the bound cannot be evaluated at the start, the fit narrows the
start q (:func:`shrink_start`) and then jitters its means (:func:`jitter_start`),
both pure functions of the explicit state.
"""

from __future__ import annotations

import logging

import numpy as np
import pytensor
import pytensor.tensor as pt
from pymc.initial_point import make_initial_point_fn
from pytensor.compile.mode import Mode
from pytensor.graph.replace import graph_replace

from pymc_mcssvi.algorithms.hyperparameters import HyperSpec
from pymc_mcssvi.algorithms.state import KernelState, QState, tree_map
from pymc_mcssvi.backend.modes import python_step_mode
from pymc_mcssvi.estimators.general import flat_indices
from pymc_mcssvi.exceptions import UnsupportedModelError
from pymc_mcssvi.families.gaussian import GaussianBlocks
from pymc_mcssvi.recognize.analysis import covariance_hyperparameters
from pymc_mcssvi.recognize.graph import evaluate_static

__all__ = [
    "MAX_START_JITTERS",
    "MAX_START_SHRINKS",
    "START_JITTER",
    "START_NONCONCAVE_PREDICTOR_SD",
    "START_PREDICTOR_SD",
    "SYMMETRY_JITTER",
    "StartQ",
    "check_start",
    "data_scaled_factors",
    "initial_q",
    "jitter_start",
    "evaluation_error",
    "shrink_start",
    "start_diagnosis",
    "start_sigmas",
]

logger = logging.getLogger("pymc_mcssvi")

#: Largest predictor sd under the start q; larger ones shrink the start covariance
#: (at 10 an unstandardized covariate put quadrature nodes at log rates near 50).
START_PREDICTOR_SD = 5.0
#: The same where a likelihood is not log-concave in its predictor under the start q
#: (a wide start found the bound's second optimum where every observation is an outlier).
START_NONCONCAVE_PREDICTOR_SD = 1.0
#: Times the start q's sd is divided by 10 while its bound is not finite.
MAX_START_SHRINKS = 3
#: Then the times its means are jittered by ``U(-START_JITTER, START_JITTER)`` (PyMC's
#: unconstrained space, as ``pm.sample``'s jitter): a start exactly where a derivative
#: is not finite (``rho ** 0`` at ``rho = 0``).
MAX_START_JITTERS = 3
START_JITTER = 0.5
#: sd of the noise that moves symmetric starts apart (matrix factors at 0, equal topics)
SYMMETRY_JITTER = 0.3


class StartQ:
    """The initial q: per-segment means and factors (in the algorithm's
    parameterization), the flat positions of each segment's coordinates
    (``flat_maps``) and the hyperparameters' :class:`HyperSpec` (or ``None``)."""

    def __init__(self, means, factors, flat_maps, hyper_spec):
        self.means = means
        self.factors = factors
        self.flat_maps = flat_maps
        self.hyper_spec = hyper_spec


def initial_q(
    model, tlm, parameterization, start, start_sigma, hyper_optimizer, random_seed
) -> StartQ:
    """The start q of a recognized model (see the module docstring).

    ``start`` values are checked (:func:`check_start`); a matrix factorization's
    factors are moved off ``U = V = 0`` (a saddle point), and the globals whose Hessian
    diagonal comes from the gradients (a topic model's topic-word logits, equal topics
    at their prior mean) off their initial point, by ``0.3 N(0, 1)`` noise seeded by
    ``random_seed``.
    """
    ipfn = make_initial_point_fn(
        model=model, overrides=start, jitter_rvs={}, return_transformed=True
    )
    point = ipfn(0)
    if start:
        check_start(point, model, start)
    offsets, dim, maps = flat_indices(tlm)
    flat = np.concatenate(
        [np.asarray(point[g.value.name], dtype="float64").reshape(-1) for g in tlm.gaussians]
    )
    sigma, hyper_sd = start_sigmas(start_sigma, tlm, dim, offsets)
    # U = V = 0 is a saddle point of a matrix factorization, and equal topics (topic-word
    # logits at their prior mean 0) one of a topic model: break the symmetry.
    broken = [gid for term in tlm.bilinear_terms for gid in (term.left, term.right)]
    broken += list(tlm.general_diagonal)
    if broken and start is None:
        rng = np.random.default_rng(0 if random_seed is None else random_seed)
        for gid in broken:
            o, n = offsets[gid], tlm.gaussians[gid].size
            flat[o : o + n] = flat[o : o + n] + SYMMETRY_JITTER * rng.standard_normal(n)
    means, factors = [], []
    for seg, idx in zip(tlm.segments, maps, strict=True):
        means.append(flat[idx])
        sd = sigma[idx]  # (rows, k)
        eye = np.broadcast_to(np.eye(seg.k), (seg.rows, seg.k, seg.k))
        if parameterization == "precision":
            factors.append(eye / sd[:, None, :])
        else:
            factors.append(eye * sd[:, None, :])
    spec = None
    if tlm.hypers:
        init = np.concatenate(
            [np.asarray(point[h.value.name], dtype="float64").reshape(-1) for h in tlm.hypers]
        )
        spec = HyperSpec(
            [h.value for h in tlm.hypers],
            [h.shape for h in tlm.hypers],
            init,
            hyper_optimizer,
            init_sd=HyperSpec.init_sd if hyper_sd is None else hyper_sd,
            fixed_shapes=bool(covariance_hyperparameters(tlm, model)),
        )
    return StartQ(means, factors, maps, spec)


def data_scaled_factors(bound, parameterization, means, factors, hyper_spec):
    """The start factors, shrunk when they put a predictor's sd above :data:`START_PREDICTOR_SD`.

    With ``start_sigma = 1`` an unstandardized covariate (an age^2 column in the
    hundreds) gives predictor sds in the hundreds or thousands; the expected curvature
    there is near zero, and the first natural steps are rejected until the step size
    has fallen by orders of magnitude. The start covariance is scaled down uniformly so
    that the largest predictor sd is :data:`START_PREDICTOR_SD`; well-scaled models are
    left as they are. Where a likelihood is not log-concave in its predictor under the
    start q (an expected second derivative above 0 on some entry), the limit is
    :data:`START_NONCONCAVE_PREDICTOR_SD`.
    """
    if not bound.geometries:
        return factors
    states = [
        GaussianBlocks(pt.constant(m), pt.constant(f)) for m, f in zip(means, factors, strict=True)
    ]
    init = None
    if hyper_spec is not None:
        init = hyper_spec.replacements(pt.constant(hyper_spec.init))

    def at_start(graphs):
        return graphs if init is None else graph_replace(graphs, init, strict=False)

    # the covariance blocks in NumPy: as a graph they are a triangular solve per row,
    # which the uncompiled evaluation runs as a Python loop over the rows (4-30 s for
    # the 9,746 rows of a MovieLens-sized factorization)
    covs = [pt.constant(c) for c in _start_covariances(factors, parameterization)]
    var = at_start(bound.predictor_variances(states, covs))
    try:  # no rewriting: a one-off evaluation of a small graph
        values = evaluate_static(var, mode=Mode(linker="py", optimizer=None))
    except Exception as e:  # a predictor that needs more than the start values
        logger.debug(f"start q not data-scaled: {type(e).__name__}: {e}")
        return factors
    vmax = max((float(np.nanmax(v)) for v in values if np.size(v)), default=0.0)
    limit = START_PREDICTOR_SD
    # the curvatures' derivative graphs are built only where they can matter
    if vmax > START_NONCONCAVE_PREDICTOR_SD**2:
        curv = at_start(bound.predictor_curvatures(states))
        entries = sum(np.size(v) for v in values)
        try:
            convex = any(np.any(np.asarray(c) > 0) for c in _evaluate_curvatures(curv, entries))
        except Exception as e:  # as above
            logger.debug(f"start q's curvature not evaluated: {type(e).__name__}: {e}")
            convex = False
        if convex:
            limit = START_NONCONCAVE_PREDICTOR_SD
    if not np.isfinite(vmax) or vmax <= limit**2:
        return factors
    shrink = limit / np.sqrt(vmax)
    if parameterization == "precision":
        return [f / shrink for f in factors]
    return [f * shrink for f in factors]


def _start_covariances(factors, parameterization):
    """Covariance blocks of q from its factors (:func:`~pymc_mcssvi.families.gaussian.covariance`
    in NumPy): ``C^T C``, or ``(L L^T)^{-1}`` for precision factors ``L``."""
    out = []
    for f in factors:
        f = np.asarray(f, dtype="float64")
        if parameterization == "covariance":
            out.append(np.swapaxes(f, -1, -2) @ f)
        else:
            Li = np.linalg.inv(f)  # lower triangular: S = L^{-T} L^{-1}
            out.append(np.swapaxes(Li, -1, -2) @ Li)
    return out


#: Predictor entries above which the start's curvature check is compiled (with the
#: Python backend's rewrites, freeing intermediates) rather than run node by node: its
#: derivative graphs, unrewritten, ran every node of the autodiff graph and held all
#: their intermediates at once (200,000 logistic rows: 20-34 s node by node, against
#: about 1 s compiled).
COMPILED_CURVATURE_ENTRIES = 20_000


def _evaluate_curvatures(curv, entries: int):
    if entries <= COMPILED_CURVATURE_ENTRIES:
        # no rewriting: a one-off evaluation of a small graph
        return evaluate_static(curv, mode=Mode(linker="py", optimizer=None))
    # intermediates freed as the function goes: the step's linker keeps them all
    mode = python_step_mode().clone(link_kwargs={"allow_gc": True})
    return pytensor.function([], curv, mode=mode)()


def shrink_start(kernel, state: KernelState, factor: float) -> KernelState:
    """``state`` restarted from its q with the sd divided by ``factor`` (before any step
    was accepted).

    The default start (``start_sigma``, data-scaled) is wide, and Gauss-Hermite nodes
    sit up to 5-7 sds out: a log density with NaN derivatives at large rates (PyMC's
    ``HurdlePoisson`` above ``log rate = 6``) or a link that leaves the parameter's
    support there (an identity-link Poisson) makes the start's bound non-finite. A
    narrower start keeps the nodes inside.
    """
    scale = factor if kernel.algorithm.parameterization == "precision" else 1.0 / factor
    factors = tuple(f * scale for f in state.base.factors)
    base = QState(state.base.means, factors)
    state = state._replace(base=base, cand=tree_map(np.copy, base))
    hyper, rayleigh = state.hyper, state.rayleigh
    if hyper is not None:
        hyper = kernel.hypers.reset(hyper)
    if rayleigh is not None:
        rayleigh = kernel.rayleighs.reset(rayleigh)
    return state._replace(hyper=hyper, rayleigh=rayleigh)


def jitter_start(kernel, state: KernelState, rng) -> KernelState:
    """``state`` restarted from its means (q(w)'s and q(h)'s) moved by uniform noise, as
    ``pm.sample`` jitters its initial point (before any step was accepted)."""

    def jitter(x):
        return x + rng.uniform(-START_JITTER, START_JITTER, np.shape(x))

    state = state._replace(base=state.base._replace(means=tuple(map(jitter, state.base.means))))
    hyper = state.hyper
    if hyper is not None:
        if kernel.hypers.mode == "point":
            hyper = hyper._replace(base=jitter(hyper.base))
        else:
            hyper = hyper._replace(base_mean=jitter(hyper.base_mean))
    return kernel.reset_candidate(state._replace(hyper=hyper))


def start_diagnosis(model) -> str:
    """Which observed variables have a non-finite log density at the model's initial
    point, and at which entries (the likely cause of a start that cannot be fitted:
    data outside the likelihood's support); ``""`` if none or if it cannot be told."""
    out = []
    try:
        point = model.initial_point()
        for obs in model.observed_RVs:
            (lp,) = model.compile_logp(vars=[obs], sum=False)(point)
            bad = np.flatnonzero(~np.isfinite(np.ravel(lp)))
            if bad.size:
                value = np.ravel(np.asarray(model.rvs_to_values[obs].eval()))
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


def evaluation_error(model) -> UnsupportedModelError | None:
    """The error of the first variable whose log density PyMC cannot evaluate at the
    model's initial point (shapes that do not fit: ``X @ b`` with 3 columns and a
    4-vector), or ``None``.

    Called only when a fit's first step raised: a diagnosis, so that the user sees the
    variable at fault instead of a NumPy traceback from inside the compiled step.
    """
    try:
        point = model.initial_point()
    except Exception as err:  # noqa: BLE001  (the initial point itself fails)
        return UnsupportedModelError(
            "initial point",
            f"the model's initial point cannot be computed ({type(err).__name__}: {err})",
            "check the shapes of the variables and their initvals",
        )
    for rv in [*model.free_RVs, *model.observed_RVs]:
        try:
            model.compile_logp(vars=[rv], sum=False)(point)
        except Exception as err:  # noqa: BLE001  (any failure is the diagnosis)
            first = str(err).splitlines()[0] if str(err) else ""
            return UnsupportedModelError(
                rv.name,
                f"its log density cannot be evaluated at the model's initial point "
                f"({type(err).__name__}: {first})",
                "check the shapes of its data and of the variables in its parameters "
                "(X @ b needs as many entries in b as X has columns)",
            )
    return None


def check_start(point, model, start):
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


def start_sigmas(start_sigma, tlm, dim, offsets):
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
