"""Pareto-smoothed importance sampling (PSIS) of the joint density against q.

After a fit, :func:`diagnose` draws from q, evaluates the model's joint log
density ``log p(y, theta)`` (PyMC's, in the unconstrained space, Jacobians
included) and q's exact log density at each draw, and smooths the importance
ratios ``p / q`` with ArviZ's PSIS. The Pareto shape ``k-hat`` of their upper
tail says how far q is from the posterior (Yao, Vehtari, Simpson & Gelman,
2018, *Yes, but did it work?*): below 0.7 the fit is trustworthy and the
importance-reweighted draws correct what is left; above it q misses mass the
posterior has, and neither q's draws nor reweighted ones can be trusted. In
more than about 180 coordinates k-hat passes 0.7 even when every marginal of q
is right, so the threshold grows with q's dimension (:func:`khat_threshold`).

q's log density is exact for every group of the structured approximation:

* the Gaussian globals and the hyperparameters: their draws are
  ``w = m + A eps_w + U (h - mu_h)`` and ``h = mu_h + B eps_h`` with ``A`` and
  ``B`` (block) triangular, so ``log q(w, h) = -|eps|^2 / 2 - log|det A| -
  log|det B| - d log(2 pi) / 2``; with the arrow view the head segment's noise
  ``G L_S^{-T} e_head`` adds the head rows' ``log|det|``;
* Rayleigh globals: the Rayleigh density in PyMC's log space;
* point-estimated hyperparameters are held at their estimates: k-hat then
  diagnoses ``q(w)`` against the posterior *given* them;
* predictive leaves (variables nothing reads) are drawn from their prior given
  the others, which is also their factor of the joint density: both cancel.

The diagnosis is of the *Gaussian* q that the bound fitted: the post-fit
tables (skewed hyperparameter marginals, conditional views) are switched off
while drawing, since their densities are not available in closed form.
Local latents integrated out of the bound (``approx.marginal_locals``) are not
handled yet: :func:`diagnose` says so.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from dataclasses import dataclass, field

import numpy as np
import pytensor
import pytensor.tensor as pt
from arviz_stats.base import array_stats
from pymc.variational.minibatch_rv import MinibatchRandomVariable
from pytensor.compile.mode import Mode
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.replace import graph_replace, vectorize_graph
from pytensor.tensor.variable import TensorConstant
from scipy.special import logsumexp

from pymc_mcssvi.backend.modes import graph_building
from pymc_mcssvi.recognize.graph import checks_to_ninf
from pymc_mcssvi.recognize.model import uses_minibatch

__all__ = [
    "KHAT_TRUSTWORTHY",
    "Diagnosis",
    "PSISWarning",
    "after_fit",
    "diagnose",
    "khat_threshold",
]

logger = logging.getLogger(__name__)

# the approximation's groups by ``short_name`` (this module is imported by theirs)
GAUSSIAN, POINT, RAYLEIGH, LOCALS, LEAVES = (
    "structured_gaussian",
    "point",
    "rayleigh",
    "local_marginals",
    "predictive_leaves",
)

#: Pareto k-hat below which importance sampling (and q) is trustworthy.
KHAT_TRUSTWORTHY = 0.7
#: Tolerance behind :func:`khat_threshold`: every coordinate of q off by this many
#: posterior sds in its mean, and by this factor's log in its sd, is still a good fit.
TOLERANCE_MEAN, TOLERANCE_LOG_SD = 0.1, 0.1
#: ``pm.fit(diagnose="auto")`` diagnoses fits with at most this many coordinates in q
#: (and no minibatches or integrated-out locals); k-hat is then judged against
#: :func:`khat_threshold` of q's dimension.
AUTO_MAX_COORDINATES = 2000
#: ... and at most this many observed values times q's coordinates (per draw of the
#: joint density: a 50,000 x 100 GLM's diagnosis took 9.6 s after a 3.4 s fit).
AUTO_MAX_WORK = 2_000_000
#: Compile mode of the draws and the joint density: one call each on a batch of draws,
#: so the rewrites of a full compile would cost more than they save.
DIAGNOSE_MODE = Mode(linker="py", optimizer=None)
#: Bytes of one batch of vectorized log-density evaluations (draws x data).
BATCH_BYTES = 64 * 2**20


class PSISWarning(UserWarning):
    """PSIS found q a poor match to the posterior (k-hat at or above 0.7, or the
    higher :func:`khat_threshold` of a q in many dimensions)."""


@dataclass
class Diagnosis:
    """The result of :func:`diagnose` (``approx.diagnose()``).

    Attributes
    ----------
    khat : float
        Pareto shape of the importance ratios' upper tail: below 0.7 the fit is
        trustworthy (below 0.5 very good); at 0.7 or above, q misses posterior
        mass. ``-inf`` when all ratios are equal (q is the posterior).
    ess : float
        Effective sample size of the smoothed weights, ``1 / sum(w^2)``.
    log_weights : numpy.ndarray
        Normalized Pareto-smoothed log weights of the ``draws`` draws.
    log_ratios : numpy.ndarray
        Raw ``log p(y, theta) - log q(theta)`` of the draws.
    points : dict
        The draws, by value variable (PyMC's unconstrained space).
    conditional_on : list of str
        Point-estimated variables held at their estimates.
    dimension : int
        Coordinates of q the draws vary in.
    threshold : float
        k-hat at or above which the fit is a poor match: 0.7, or more in many
        dimensions (:func:`khat_threshold`).
    """

    khat: float
    ess: float
    log_weights: np.ndarray
    log_ratios: np.ndarray
    points: dict
    conditional_on: list[str] = field(default_factory=list)
    approx: object = field(default=None, repr=False)
    dimension: int = 0
    threshold: float = KHAT_TRUSTWORTHY

    @property
    def draws(self) -> int:
        """Number of draws the diagnosis used."""
        return int(self.log_weights.shape[0])

    @property
    def trustworthy(self) -> bool:
        """Whether k-hat is below :attr:`threshold` (0.7 up to about 180 coordinates)."""
        return bool(self.khat < self.threshold)

    @property
    def log_evidence(self) -> float:
        """Importance-sampling estimate of ``log p(y)`` (of the unsmoothed ratios).

        With point-estimated variables it is the evidence given them."""
        r = self.log_ratios
        return float(logsumexp(r) - np.log(r.size))

    def summary(self) -> str:
        """One paragraph: k-hat, what it means, the ESS and what to do."""
        k = "-inf" if not np.isfinite(self.khat) else f"{self.khat:.2f}"
        given = (
            f" (q of the others given the point estimates of {', '.join(self.conditional_on)})"
            if self.conditional_on
            else ""
        )
        head = f"PSIS k-hat {k}, ESS {self.ess:.0f} of {self.draws} draws{given}: "
        raised = self.threshold > KHAT_TRUSTWORTHY
        limit = (
            f"{self.threshold:.2f} (the k-hat a q of {self.dimension} coordinates reaches when "
            f"each is off by {TOLERANCE_MEAN} posterior sd)"
            if raised
            else f"{self.threshold:.1f}"
        )
        if self.trustworthy:
            if raised and self.khat >= KHAT_TRUSTWORTHY:
                return head + (
                    f"above 0.7 but below {limit}: no sign that q is a poor match to the "
                    "posterior, though importance reweighting corrects little in this many "
                    "dimensions."
                )
            return head + "q is a good match to the posterior; the fit is trustworthy."
        return head + (
            f"q is a poor match to the posterior (k-hat >= {limit}): its means, sds and draws "
            "may be off (a posterior with several modes, heavy tails or a funnel does "
            "that), and importance reweighting cannot repair them. Check the fit against "
            "NUTS (pm.sample) on this model or a subset of its data."
        )

    def __str__(self) -> str:
        return self.summary()

    def sample(self, draws: int = 1000, *, random_seed=None, return_inferencedata=True):
        """Importance-resampled draws: the diagnosis' draws resampled with replacement
        by their smoothed weights, returned like ``approx.sample`` (constrained space,
        coords and dims).

        Only meaningful when :attr:`trustworthy`; a warning says so otherwise.
        """
        if not isinstance(draws, int | np.integer) or isinstance(draws, bool) or draws < 1:
            raise ValueError(f"draws must be a positive integer, got {draws!r}")
        if not self.trustworthy:
            warnings.warn(self.summary(), PSISWarning, stacklevel=2)
        rng = np.random.default_rng(random_seed)
        w = np.exp(self.log_weights - logsumexp(self.log_weights))
        pick = rng.choice(self.draws, size=draws, replace=True, p=w / w.sum())
        samples = {name: values[pick] for name, values in self.points.items()}
        return self.approx.trace_from_samples(samples, return_inferencedata=return_inferencedata)


def diagnose(approx, draws: int = 1000, *, random_seed=None) -> Diagnosis:
    """PSIS diagnosis of a fitted approximation; see the module docstring.

    Parameters
    ----------
    approx : StructuredApproximation
        What ``pm.fit(method="mcssvi" | "hmcssvi" | "sdsvi")`` returned.
    draws : int
        Number of draws from q (1,000 is the usual; k-hat is less reliable below 200).
    random_seed : int, optional
        Seed of q's draws.

    Returns
    -------
    Diagnosis

    Examples
    --------
    >>> import numpy as np, pymc as pm, pymc_mcssvi
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(200, 3))
    >>> y = rng.binomial(1, 1 / (1 + np.exp(-X @ [1.0, -0.5, 0.2])))
    >>> with pm.Model():
    ...     w = pm.Normal("w", 0, 1, shape=3)
    ...     _ = pm.Bernoulli("y", logit_p=X @ w, observed=y)
    ...     approx = pm.fit(method="hmcssvi", progressbar=False)
    >>> d = approx.diagnose(random_seed=1)
    >>> d.trustworthy
    True
    """
    if not isinstance(draws, int | np.integer) or isinstance(draws, bool) or draws < 10:
        raise ValueError(f"draws must be an integer of at least 10, got {draws!r}")
    locals_ = [g for g in approx.groups if g.short_name == LOCALS]
    if locals_:
        names = ", ".join(repr(lc.name) for g in locals_ for lc in g.locals)
        raise NotImplementedError(
            f"approx.diagnose() needs q's joint density, and the local latents {names} are "
            "integrated out of the bound (drawn from their conditionals afterwards): PSIS of "
            "such fits is not implemented yet. Compare with pm.sample on a subset instead"
        )
    if _uses_minibatch(approx.model):
        raise NotImplementedError(
            "approx.diagnose() needs the full data's log density, and this model reads "
            "its data through pm.Minibatch: build the same model on the full data "
            "(without pm.Minibatch), pm.fit it with start=approx, and diagnose that fit"
        )
    seed = (
        random_seed
        if isinstance(random_seed, np.random.SeedSequence)
        else np.random.SeedSequence(random_seed)
    )
    with graph_building(), _views_off(approx), approx.fitted_data():
        points, log_q = _draw_with_density(approx, draws, np.random.default_rng(seed))
        log_p = _joint_log_density(approx, points)
    ratios = log_p - log_q
    bad = ~np.isfinite(ratios)
    if np.all(bad):
        raise FloatingPointError(
            "the model's log density is not finite at any of q's draws: "
            "q and the posterior do not overlap (k-hat is infinite)"
        )
    # draws where p vanishes (or q's tail underflows) get no weight
    ratios = np.where(bad, np.min(ratios[~bad]) - 1e3, ratios)
    khat, log_weights = _psis(ratios)
    ess = float(1.0 / np.sum(np.exp(2.0 * log_weights)))
    dim = _dimension(approx)
    return Diagnosis(
        khat=khat,
        ess=ess,
        log_weights=log_weights,
        log_ratios=ratios,
        points=points,
        conditional_on=list(approx.point_estimates),
        approx=approx,
        dimension=dim,
        threshold=khat_threshold(dim, draws),
    )


def khat_threshold(dimension: int, draws: int = 1000) -> float:
    r"""k-hat at or above which a fit of ``dimension`` coordinates is a poor match.

    k-hat of a joint importance ratio grows with the dimension even when every
    marginal of q is right: each coordinate's small mismatch adds to the variance of
    ``log p - log q``. The threshold is the larger of 0.7 and the k-hat that a q
    off by :data:`TOLERANCE_MEAN` posterior sd in every coordinate's mean and by
    ``exp(TOLERANCE_LOG_SD)`` in its sd would reach: with ``q = N(0, 1)`` and
    ``p = N(a, e^{2b})`` per coordinate, the log ratio's variance under q is
    ``c^2 / 2 + a^2 e^{-4b}`` with ``c = 1 - e^{-2b}``; over ``dimension``
    coordinates it is nearly Gaussian, and the threshold is the median k-hat of
    ``draws`` such ratios (31 fixed-seed replicates). It is 0.7 up to about 180
    coordinates, 0.92 at 300 and 2.5 at 2,000; a q whose coordinates are off by
    0.25 sd has k-hat far above it. A miss confined to a few coordinates (one
    scale far off, the rest right) is diluted in many dimensions and can pass.

    Examples
    --------
    >>> khat_threshold(50)
    0.7
    >>> 0.85 < khat_threshold(300) < 1.0
    True
    """
    return _khat_threshold(int(dimension), int(draws))


@functools.lru_cache(maxsize=64)
def _khat_threshold(dimension: int, draws: int) -> float:
    a, b = TOLERANCE_MEAN, TOLERANCE_LOG_SD
    c = 1.0 - np.exp(-2.0 * b)
    sd = np.sqrt(max(dimension, 1) * (0.5 * c**2 + a**2 * np.exp(-4.0 * b)))
    rng = np.random.default_rng(0)
    ks = [_psis(sd * rng.normal(size=draws))[0] for _ in range(31)]
    return float(max(KHAT_TRUSTWORTHY, np.median(ks)))


def _dimension(approx) -> int:
    """Coordinates of q that the diagnosis' draws vary in."""
    return int(sum(g.ddim for g in approx.groups if g.short_name in (GAUSSIAN, RAYLEIGH)))


def after_fit(approx, policy, random_seed=None):
    """The diagnosis ``pm.fit(diagnose=policy)`` makes at the end of a fit, or ``None``.

    ``True`` diagnoses every fit (an error if it cannot), ``False`` none, and
    ``"auto"`` the ones that it can at a small cost (:data:`AUTO_MAX_COORDINATES`,
    :data:`AUTO_MAX_WORK`) whose draws come from the Gaussian q; its warning
    needs k-hat at or above the threshold in two independent sets of draws. A fit
    whose k-hat is at or above :func:`khat_threshold` of q's dimension (0.7 up to
    about 180 coordinates) warns (:class:`PSISWarning`). The diagnosis is kept as
    ``approx.diagnosis``.
    """
    if policy is False:
        return None
    if policy not in (True, "auto"):
        raise ValueError(f"diagnose must be True, False or 'auto', got {policy!r}")
    if policy == "auto":
        # an unconverged fit has said so already
        if approx.converged is False or not _cheap(approx):
            return None
        seeds = np.random.SeedSequence(random_seed).spawn(2)
        try:
            found = diagnose(approx, random_seed=seeds[0])
            if not found.trustworthy:
                # k-hat of 1,000 draws crossed 0.7 on 5 of 100 seeds of a logistic
                # regression whose q matches NUTS: a second, independent set confirms
                again = diagnose(approx, random_seed=seeds[1])
                if again.trustworthy:
                    return again
        except Exception as err:  # a model whose joint density PyTensor cannot batch
            logger.info(f"diagnose='auto' skipped the PSIS diagnosis: {err}")
            return None
    else:
        found = diagnose(approx, random_seed=random_seed)
    if not found.trustworthy:
        warnings.warn(
            found.summary() + " (approx.diagnosis has the details)", PSISWarning, stacklevel=4
        )
    return found


def _cheap(approx) -> bool:
    """Whether ``diagnose="auto"`` diagnoses this fit."""
    groups = approx.groups
    if any(g.short_name == LOCALS for g in groups) or _uses_minibatch(approx.model):
        return False
    if _view_flags(approx) and any(int(f.get_value()) for f in _view_flags(approx)):
        # ``approx.sample`` draws from the post-fit tables (skewed q(h), q(w | h) per
        # draw), not from the Gaussian the diagnosis checks: a centered radon model
        # warned at k-hat 1.04 while its draws were within 0.05 NUTS sd
        return False
    coords = _dimension(approx)
    work = _data_size(approx.model) * max(coords, 1)
    return coords <= AUTO_MAX_COORDINATES and work <= AUTO_MAX_WORK


def _psis(ratios: np.ndarray) -> tuple[float, np.ndarray]:
    """``(k-hat, normalized smoothed log weights)``; equal ratios give ``-inf``."""
    spread = np.ptp(ratios)
    if spread <= 1e-10 * max(1.0, np.abs(ratios).max()):
        return float("-inf"), np.full(ratios.shape, -np.log(ratios.size))
    log_weights, khat = array_stats.psislw(-ratios)
    return float(khat), np.asarray(log_weights)


def _uses_minibatch(model) -> bool:
    """Whether any observed variable reads its data through ``pm.Minibatch``."""
    return any(
        isinstance(obs.owner.op, MinibatchRandomVariable) or uses_minibatch(model, obs)
        for obs in model.observed_RVs
    )


def _view_flags(approx) -> list:
    """The ``on`` switches of the Gaussian groups' post-fit tables."""
    flags = []
    for g in approx.groups:
        if g.short_name == GAUSSIAN:
            for part in (g.marginal, g.grid, g.view):
                if part is not None:
                    flags.append(part[0])
    return flags


@contextlib.contextmanager
def _views_off(approx):
    """Switch the post-fit tables of the Gaussian groups off for the block."""
    flags = _view_flags(approx)
    saved = [f.get_value() for f in flags]
    for f in flags:
        f.set_value(np.int8(0))
    try:
        yield
    finally:
        for f, v in zip(flags, saved, strict=True):
            f.set_value(v)


def _draw_with_density(approx, draws: int, rng) -> tuple[dict, np.ndarray]:
    """q's draws by value variable, and their exact ``log q`` (see the module docstring)."""
    groups = approx.groups
    eps = [pt.matrix(f"eps_{i}") for i in range(len(groups))]
    replace = {g.symbolic_initial: e for g, e in zip(groups, eps, strict=True)}
    outputs = graph_replace([g.symbolic_random for g in groups], replace, strict=False)
    values = [rng.standard_normal((draws, g.ddim)) for g in groups]
    fn = pytensor.function(eps, outputs, on_unused_input="ignore", mode=DIAGNOSE_MODE)
    # the blocks' draws hold draws x rows x K x K intermediates: a batch at a time
    widest = max([seg.k for g in groups if g.short_name == GAUSSIAN for seg in g.segments] or [1])
    per_draw = 8 * widest * sum(g.ddim for g in groups)
    batch = max(1, min(draws, BATCH_BYTES // max(per_draw, 1)))
    parts = [fn(*[v[lo : lo + batch] for v in values]) for lo in range(0, draws, batch)]
    flat = [
        np.concatenate([np.asarray(p[i], dtype=np.float64) for p in parts])
        for i in range(len(groups))
    ]
    log_q = np.zeros(draws)
    for g, e, x in zip(groups, values, flat, strict=True):
        if g.short_name == GAUSSIAN:
            log_q += -0.5 * np.sum(e**2, axis=1) - 0.5 * g.ddim * np.log(2 * np.pi)
            log_q -= _log_abs_det_sqrt(g)
        elif g.short_name == RAYLEIGH:
            sigma = np.asarray(g._scale_vector().eval(), dtype=np.float64)
            # x = log r, r ~ Rayleigh(sigma): log q(x) = 2x - 2 log sigma - e^{2x} / (2 sigma^2)
            log_q += np.sum(2 * x - 2 * np.log(sigma) - np.exp(2 * x) / (2 * sigma**2), axis=1)
        elif g.short_name not in (POINT, LEAVES):
            raise NotImplementedError(f"approx.diagnose(): no density for the group {g!r}")
    points = {}
    for g, x in zip(groups, flat, strict=True):
        for name, slc, shape, _ in g.ordering.values():
            points[name] = x[:, slc].reshape((draws, *shape))
    return points, log_q


def _log_abs_det_sqrt(g) -> float:
    """``log |det|`` of the map from the group's noise to its draws (given the others)."""
    head = None if g.arrow is None else g.arrow[0]
    total = 0.0
    for s, factor in enumerate(g.shared_factors):
        if s == head:
            continue
        d = np.diagonal(np.asarray(factor.get_value(borrow=True)), axis1=-2, axis2=-1)
        half_log_det = np.sum(np.log(np.abs(d)))
        total += -half_log_det if g.parameterization == "precision" else half_log_det
    if head is not None:
        rows = np.asarray(g._arrow_covariance().eval())[g.flat_maps[head].reshape(-1)]
        total += np.linalg.slogdet(rows)[1]
    return float(total)


def _joint_log_density(approx, points: dict) -> np.ndarray:
    """``log p(y, theta)`` at each draw (PyMC's, unconstrained, leaves left out)."""
    model = approx.model
    leaves = {v.name for g in approx.groups if g.short_name == LEAVES for v in g.group}
    rvs = [
        rv
        for rv in model.free_RVs
        if model.rvs_to_values[rv].name not in leaves and rv.name not in leaves
    ]
    # parameters out of their support give -inf, as in PyMC's compiled log densities
    logp = checks_to_ninf(model.logp(vars=rvs + list(model.observed_RVs), jacobian=True, sum=True))
    values = [model.rvs_to_values[rv] for rv in rvs]
    draws = next(iter(points.values())).shape[0]
    batch = max(1, min(draws, BATCH_BYTES // max(1, 8 * _data_size(model))))
    batched = [pt.tensor(shape=(None, *v.type.shape), dtype=v.dtype) for v in values]
    try:
        out = vectorize_graph(logp, replace=dict(zip(values, batched, strict=True)))
        fn = pytensor.function(batched, out, on_unused_input="ignore", mode=DIAGNOSE_MODE)
        vectorized = True
    except Exception:  # an Op without a batched form: one draw at a time
        fn = pytensor.function(values, logp, on_unused_input="ignore", mode=DIAGNOSE_MODE)
        vectorized = False
    res = np.empty(draws)
    with np.errstate(all="ignore"):
        if vectorized:
            for start in range(0, draws, batch):
                stop = min(draws, start + batch)
                args = [np.asarray(points[v.name][start:stop], dtype=v.dtype) for v in values]
                res[start:stop] = fn(*args)
        else:
            for i in range(draws):
                res[i] = fn(*[np.asarray(points[v.name][i], dtype=v.dtype) for v in values])
    return res


def _data_size(model) -> int:
    """Number of observed values (the length of a vectorized evaluation's rows)."""
    total = 0
    for obs in model.observed_RVs:
        value = model.rvs_to_values[obs]
        if isinstance(value, SharedVariable):
            total += np.size(value.get_value(borrow=True))
        elif isinstance(value, TensorConstant):
            total += np.size(value.data)
        elif all(d is not None for d in value.type.shape):
            # data cast to the variable's dtype (integer pm.Data as int32 observing an
            # int64 variable): its static shape
            total += int(np.prod(value.type.shape, dtype=np.int64))
        else:
            try:
                total += int(np.prod(value.shape.eval()))
            except Exception:  # noqa: BLE001  (a shape that needs free inputs)
                total += 100_000
    return max(1, int(total))
