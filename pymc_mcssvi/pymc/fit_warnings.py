"""Warnings about fits whose structure limits what q can represent.

Each function looks at a recognized model and its kernel (or, after a fit, its
state) and warns, naming the variables and what to do, where the fitted q is known
to be a poor match to the posterior.
"""

from __future__ import annotations

import warnings

import numpy as np

from pymc_mcssvi.algorithms import kernel as kernel_module
from pymc_mcssvi.algorithms.optimizers import make_optimizer
from pymc_mcssvi.exceptions import UnsupportedModelError
from pymc_mcssvi.recognize.analysis import effects_scaled_by_hypers

__all__ = [
    "MAX_MEANFIELD_HYPERS",
    "MAX_NEWTON_HYPERS",
    "check_hyper_size",
    "warn_collapsed_scales",
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
