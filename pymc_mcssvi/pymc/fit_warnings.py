"""Warnings about fits whose structure limits what q can represent.

Each function looks at a recognized model and its kernel (or, after a fit, its
state) and warns, naming the variables and what to do, where the fitted q is known
to be a poor match to the posterior.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytensor

from pymc_mcssvi.algorithms import kernel as kernel_module
from pymc_mcssvi.algorithms.optimizers import make_optimizer
from pymc_mcssvi.exceptions import UnsupportedModelError
from pymc_mcssvi.recognize.analysis import effects_scaled_by_hypers
from pymc_mcssvi.recognize.roles import dist_name

__all__ = [
    "IMPROPER_DISTANCES",
    "IMPROPER_TOL",
    "MAX_HESSIAN_COORDINATES",
    "MAX_IMPROPER_AXES",
    "MAX_MEANFIELD_HYPERS",
    "MAX_NEWTON_HYPERS",
    "check_hyper_size",
    "improper_directions",
    "warn_collapsed_scales",
    "warn_improper_posterior",
    "warn_split_crossed",
    "warn_uncoupled_hypers",
]

#: Most hyperparameter coordinates of a mean-field q(h): its sigma points are
#: ``2 (n + 8)`` evaluations of the whole bound per iteration.
MAX_MEANFIELD_HYPERS = 1000
#: Most point-hyperparameter coordinates that take Newton steps (an ``n x n`` Hessian
#: from ``n`` Hessian-vector products); more take Adam steps.
MAX_NEWTON_HYPERS = 1000


def warn_uncoupled_hypers(tlm, kernel):
    """Warn when too many mean-field hyperparameter coordinates switch off the joint
    step and the linear-response view (:data:`~pymc_mcssvi.algorithms.kernel.MAX_COUPLED_HYPERS`)."""
    hyp = kernel.hypers
    if hyp is None or hyp.mode != "meanfield":
        return
    if tlm.minibatch and effects_scaled_by_hypers(tlm):
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
    if tlm.bilinear_terms and effects_scaled_by_hypers(tlm):
        names = ", ".join(repr(h.name) for h in tlm.hypers)
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
    if hyp.spec.size <= kernel_module.MAX_COUPLED_HYPERS:
        return
    if not (kernel.monotone and kernel.algorithm.parameterization == "precision"):
        return
    sizes = ", ".join(f"{h.name!r} ({h.size})" for h in tlm.hypers)
    warnings.warn(
        f"{hyp.spec.size} hyperparameter coordinates ({sizes}) exceed {kernel_module.MAX_COUPLED_HYPERS}: "
        "their steps are not coupled with q(w)'s and the linear-response correction is off, "
        "so the fit may take many iterations and the posterior sds of the Gaussian variables "
        "can be too narrow. Give per-group parameters a pm.Normal prior (a non-centered "
        "`sigma * z`) where the model allows (a pm.CustomDist that wraps a Normal is not "
        "read as one), or use hyper='point'.",
        UserWarning,
        stacklevel=4,
    )


def warn_split_crossed(tlm, kernel):
    """Warn when q keeps crossed grouping factors apart and hyperparameters scale
    their effects: the bound then pulls the learned scales down (recognition's note,
    :data:`~pymc_mcssvi.recognize.model.SPLIT_CROSSED_NOTE`)."""
    note = tlm.split_crossed_note
    if not note or tlm.bilinear_terms or kernel.hypers is None:
        return
    if not effects_scaled_by_hypers(tlm):
        return
    warnings.warn(note + ".", UserWarning, stacklevel=4)


def warn_collapsed_scales(model, tlm, kernel, state):
    """Warn when a log-transformed hyperparameter's estimate ran off towards 0."""
    hyp = kernel.hypers
    if hyp is None:
        return
    flat = state.hyper.base if hyp.mode == "point" else state.hyper.base_mean[0]
    off = 0
    for h in tlm.hypers:
        n = h.size
        tr = model.rvs_to_transforms.get(h.rv)
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


def check_hyper_size(tlm, hyper, hyper_opt, hyper_optimizer):
    """The point hyperparameters' optimizer for this many coordinates, or an error for a
    mean-field q(h) over more than :data:`MAX_MEANFIELD_HYPERS` of them.

    Point estimates of more than :data:`MAX_NEWTON_HYPERS` coordinates (a topic
    model's topics) take Adam steps instead of Newton's, with a warning; a mean-field
    q(h) over that many would evaluate the bound ``2 (n + 8)`` times per iteration.
    """
    n = sum(h.size for h in tlm.hypers)
    if not n:
        return hyper_opt
    largest = max(tlm.hypers, key=lambda h: h.size)
    if hyper in (None, "meanfield") and n > MAX_MEANFIELD_HYPERS:
        raise UnsupportedModelError(
            largest.name,
            f"the hyperparameters have {n} coordinates ({largest.name!r}: {largest.size}); "
            f"a mean-field q over them takes {2 * (n + 8)} evaluations of the bound per "
            "iteration",
            "fit them as point estimates, pm.fit(method='hmcssvi', hyper='point') (with Adam "
            "steps for this many coordinates), or give the variable a Normal prior so that "
            "it joins the Gaussian q",
        )
    if hyper == "point" and hyper_optimizer == "newton" and n > MAX_NEWTON_HYPERS:
        warnings.warn(
            f"The point hyperparameters have {n} coordinates ({largest.name!r}: "
            f"{largest.size}): they take Adam steps (learning rate 0.05) instead of Newton "
            f"steps, whose Hessian would be {n} x {n}. Pass hyper_optimizer=('adam', lr) to "
            "choose the rate.",
            UserWarning,
            stacklevel=4,
        )
        return make_optimizer(("adam", 0.05), 0.05)
    return hyper_opt


#: Distances from q's mean, in q's sds along each axis, at which the log density of a
#: model with improper priors is compared (:func:`improper_directions`).
IMPROPER_DISTANCES = (10.0, 100.0, 1000.0)
#: Distances, in PyMC's unconstrained units, for an improper hyperparameter (a
#: ``HalfFlat`` scale: its log).
IMPROPER_HYPER_DISTANCES = (8.0, 16.0, 32.0)
#: A smaller decrease of the log density (nats) between two of those distances counts as
#: none: rounding far out (``X @ w`` with ``w`` of 1e9 along a null direction of ``X``);
#: a proper posterior falls by tens of nats or more.
IMPROPER_TOL = 1e-3
#: Directions over the ``pm.Flat`` globals that are tried (:func:`_least_curved_axes`).
MAX_IMPROPER_AXES = 5
#: Most ``pm.Flat`` coordinates whose directions come from the log density's Hessian.
MAX_HESSIAN_COORDINATES = 100
#: Improper priors: Gaussian globals with ``g.prior == "flat"`` and these hyperparameters.
IMPROPER_HYPER_PRIORS = ("HalfFlat",)


def improper_directions(model, tlm, approx) -> list[tuple[str, ...]]:
    """Directions in which the posterior of the improper-prior variables is improper.

    Each direction is returned as the names of the variables it moves. Along the
    least curved directions over the ``pm.Flat`` globals (:func:`_least_curved_axes`),
    both ways, and along each ``pm.HalfFlat`` hyperparameter's unconstrained
    coordinate, the model's log density (PyMC's, Jacobians included) is evaluated at
    q's mean moved by :data:`IMPROPER_DISTANCES` of q's sds along the direction
    (:data:`IMPROPER_HYPER_DISTANCES` for a hyperparameter), the other variables at
    q's mean. A direction in which it does not decrease over those three points is
    one in which it does not go to -inf: for a log-concave model (a GLM with
    ``pm.Flat`` coefficients) the conditional density then has a superlevel set
    that contains a ray, and the posterior has infinite mass.

    Notes
    -----
    A proper posterior is many nats lower 10 sds out (50 for a Gaussian, about 10 for
    an exponential tail) and lower again further out; under complete separation the
    logistic log likelihood rises to 0 along the separating direction, and along a
    direction that a collinear design leaves uninformed it is constant. The q's sds
    themselves are no criterion: under separation the fit can stop with finite,
    moderate-looking means and sds. Models with integrated-out locals or
    ``pm.Minibatch`` data are not checked (their log density needs the locals'
    values, or a batch that changes between evaluations). A non-finite value
    (``exp`` overflowing far out) counts as a decrease, NaN as no evidence.
    """
    flat = [g for g in tlm.gaussians if g.prior == "flat"]
    hypers = [h for h in tlm.hypers if dist_name(h.rv) in IMPROPER_HYPER_PRIORS]
    if not (flat or hypers) or tlm.locals or tlm.minibatch:
        return []
    names = [g.value.name for g in tlm.gaussians] + [h.value.name for h in tlm.hypers]
    order = approx.ordering
    group = approx.groups[0]
    mean, gcov = pytensor.function([], [approx.mean, group.cov], mode="FAST_COMPILE")()
    point = dict(model.initial_point())
    for name in names:
        _, slc, shape, _ = order[name]
        point[name] = np.reshape(mean[slc], shape)
    logp = model.compile_logp(jacobian=True, mode="FAST_COMPILE")
    base = float(logp(point))
    if not np.isfinite(base):
        return []

    def rises(moves, distances) -> bool:
        """Whether the log density does not decrease along ``moves(d)``."""
        values = []
        for d in distances:
            moved = dict(point)
            for name, delta in moves(d).items():
                moved[name] = point[name] + np.reshape(delta, np.shape(point[name]))
            values.append(float(logp(moved)))
        if np.any(np.isnan(values)):
            return False
        tol = IMPROPER_TOL + 1e-8 * abs(base)
        return all(b >= a - tol for a, b in zip(values, values[1:], strict=False))

    found = []
    if flat:
        slices = [group.ordering[g.value.name][1] for g in flat]
        idx = np.concatenate([np.arange(s.start, s.stop) for s in slices])
        owner = np.concatenate(
            [[g.name] * (s.stop - s.start) for g, s in zip(flat, slices, strict=True)]
        )
        cov = gcov[np.ix_(idx, idx)]
        for u in _least_curved_axes(model, flat, point, cov):
            sd = float(np.sqrt(max(u @ cov @ u, 0.0)))
            if not sd > 0:
                continue
            for sign in (1.0, -1.0):

                def moves(d, u=u, sd=sd, sign=sign):
                    step = sign * d * sd * u
                    return {g.value.name: step[owner == g.name] for g in flat}

                if rises(moves, IMPROPER_DISTANCES):
                    moved = {str(n) for n in owner[np.abs(u) > 0.1]}
                    found.append(tuple(g.name for g in flat if g.name in moved))
                    break
    for h in hypers:
        for sign in (1.0, -1.0):
            if rises(
                lambda d, h=h, sign=sign: {h.value.name: np.full(h.shape, sign * d)},
                IMPROPER_HYPER_DISTANCES,
            ):
                found.append((h.name,))
                break
    return list(dict.fromkeys(found))


def _least_curved_axes(model, flat, point, cov) -> list[np.ndarray]:
    """Unit directions over the ``pm.Flat`` globals' coordinates to try, least curved
    first: the eigenvectors of the log density's curvature at q's mean (PyMC's
    Hessian) with the :data:`MAX_IMPROPER_AXES` smallest eigenvalues, for up to
    :data:`MAX_HESSIAN_COORDINATES` coordinates; beyond, q's principal axes with the
    largest sds.

    The curvature finds an uninformed direction exactly (the null space of a collinear
    design) also while q is still far from converged along it.
    """
    if cov.shape[0] <= MAX_HESSIAN_COORDINATES:
        curvature = model.compile_d2logp(vars=[g.rv for g in flat], mode="FAST_COMPILE")(point)
        curvature = np.asarray(curvature, dtype="float64")
        if np.all(np.isfinite(curvature)):
            vals, vecs = np.linalg.eigh((curvature + curvature.T) / 2)
            return [vecs[:, j] for j in np.argsort(vals)[:MAX_IMPROPER_AXES]]
    vals, vecs = np.linalg.eigh((cov + cov.T) / 2)
    return [vecs[:, j] for j in np.argsort(vals)[::-1][:MAX_IMPROPER_AXES]]


def warn_improper_posterior(model, tlm, approx):
    """Warn when the posterior of ``pm.Flat`` / ``pm.HalfFlat`` variables is improper
    (:func:`improper_directions`): complete separation of a logistic regression with
    flat priors converged to finite values without a word."""
    directions = improper_directions(model, tlm, approx)
    if not directions:
        return
    names = ", ".join(dict.fromkeys(repr(n) for d in directions for n in d))
    warnings.warn(
        f"The posterior of {names} is improper: along a direction of {names} the model's "
        "log density does not decrease away from q's mean (checked up to 1000 of q's sds "
        "out). Improper priors, pm.Flat or pm.HalfFlat, with data that do not pin that "
        "direction down do this: "
        "complete separation of a binary outcome, a column that is constant or collinear "
        "with others, a group without observations. There is no posterior for q to "
        "approximate: its means and sds are where the fit stopped. Give those variables "
        "proper priors (e.g. pm.Normal(name, 0, 2.5) on logistic coefficients), or drop "
        "the covariate or level the data do not inform.",
        UserWarning,
        stacklevel=4,
    )
