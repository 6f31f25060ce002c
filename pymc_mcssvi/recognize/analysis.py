"""Questions about a recognized model that choose how it is fitted.

Each function reads a :class:`~pymc_mcssvi.recognize.ir.TwoLevelModel` (and the
PyMC model behind it) and answers one question: which hyperparameters parameterize
a covariance matrix, which hold one scale per coefficient (local shrinkage), and
whether hyperparameters scale the Gaussian effects.
"""

from __future__ import annotations

import numpy as np

from pymc_mcssvi.recognize.graph import depends_on_any, static_shape
from pymc_mcssvi.recognize.ir import TwoLevelModel

__all__ = [
    "covariance_hyperparameters",
    "effects_scaled_by_hypers",
    "local_scale_hypers",
]


def covariance_hyperparameters(tlm: TwoLevelModel, model) -> list[str]:
    """Hyperparameters that parameterize a covariance matrix of Gaussian effects.

    An ``LKJCholeskyCov`` / ``LKJCorr`` factor (used as ``z @ chol.T`` or as
    the ``chol`` of a ``pm.MvNormal``), or any hyperparameter in the covariance
    of an ``MvNormal`` Gaussian global. Their mean-field sigma points need the
    step's shapes read at a fixed h
    (:func:`~pymc_mcssvi.recognize.vectorize.shapes_at_fixed`).
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


def local_scale_hypers(tlm: TwoLevelModel) -> list[str]:
    """Hyperparameters that hold one scale per coefficient (local shrinkage).

    A hyperparameter with the shape of a Gaussian global, in the coefficients of
    that global and of no other in some term (its prior's scale, or a
    likelihood's ``z * tau * lam``): a horseshoe's ``lam``, an R2D2 prior's
    ``phi``; not a per-group residual sd, which scales every coefficient of its
    rows. With them the linear-response view is off by default.
    """
    out = []
    for h in tlm.hypers:
        shape = tuple(static_shape(h.rv))
        if int(np.prod(shape)) < 2:
            continue
        same = {gid for gid, g in enumerate(tlm.gaussians) if tuple(g.shape) == shape}
        if any(_scales_only(t, same, h.value) for t in tlm.affine_predictors):
            out.append(h.name)
    return out


def _scales_only(term, sources, value) -> bool:
    """Whether ``value`` is in the coefficients of one of ``sources`` in ``term`` and in
    no other global's: a per-group residual sd (``Normal(a[g] + b x, sigma[g])``)
    scales every coefficient of its rows, a shrinkage scale only its own."""
    hit = {
        tt.source for tt in term.terms if tt.vals is not None and depends_on_any(tt.vals, [value])
    }
    return len(hit) == 1 and hit <= sources


def effects_scaled_by_hypers(tlm: TwoLevelModel) -> bool:
    """Whether a hyperparameter scales Gaussian globals: in their prior (a centered
    effect's sigma) or in the likelihoods' predictor coefficients (``sigma * z``)."""
    values = [h.value for h in tlm.hypers]
    if not values:
        return False
    for term in tlm.affine_predictors:
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
                if depends_on_any(t.vals, [v]) and not any(depends_on_any(d, [v]) for d in dense):
                    return True
    return False
