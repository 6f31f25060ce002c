"""Recognize a two-level latent variable model in an ordinary PyMC model.

Roles (ARCHITECTURE.md §1, §6):

* **Gaussian globals** -- free ``pm.Normal`` / ``pm.MvNormal`` variables (no
  transform) whose prior location is affine in other Gaussian globals and whose
  prior scale involves none of them. Together their prior is one Gaussian.
* **hyperparameters** -- every other continuous free variable (scales, shapes,
  cutpoints, correlation matrices ...).
* **likelihood terms** -- each observed variable, classified by how its log
  density depends on the Gaussian globals: through one affine predictor
  (predictor-space estimators), some other way (Monte Carlo + autodiff), or not
  at all.

Everything the engine cannot handle raises :class:`UnsupportedModelError`
before any compilation.
"""

from __future__ import annotations

import warnings

import numpy as np
import pymc as pm
import pytensor.tensor as pt
from pymc.data import MinibatchOp
from pymc.distributions.multivariate import MvNormalRV
from pymc.variational.minibatch_rv import MinibatchRandomVariable
from pytensor.graph.basic import Constant, Variable
from pytensor.graph.replace import graph_replace
from pytensor.graph.traversal import ancestors
from pytensor.tensor.random.basic import NormalRV
from pytensor.tensor.sharedvar import TensorSharedVariable

from pymc_mcssvi.exceptions import UnsupportedModelError
from pymc_mcssvi.recognize.affine import LinearTerm, _Linearizer, linearize
from pymc_mcssvi.recognize.graph import (
    as_float,
    depends_on_any,
    is_separable,
    remove_checks,
)
from pymc_mcssvi.recognize.ir import (
    ConstantTerm,
    GaussianGlobal,
    GeneralTerm,
    Hyperparameter,
    PredictorTerm,
    TwoLevelModel,
)
from pymc_mcssvi.recognize.layout import build_segments, resolve_structure
from pymc_mcssvi.recognize.stabilize import stable_logp

__all__ = ["recognize"]

#: Largest Gaussian dimension the Monte Carlo + autodiff path accepts (it forms D x D Hessians).
MAX_GENERAL_DIM = 2000


def _base_op(rv):
    """The distribution op of a variable, looking through ``MinibatchRandomVariable``."""
    op = rv.owner.op
    if isinstance(op, MinibatchRandomVariable):
        inner = rv.owner.inputs[0]
        return inner.owner.op, inner
    return op, rv


def _dist_params(rv):
    op, base = _base_op(rv)
    return list(op.dist_params(base.owner))


def recognize(model: pm.Model | None = None, cov: str | dict | None = None) -> TwoLevelModel:
    """Read a PyMC model as a two-level latent variable model.

    Parameters
    ----------
    model : pm.Model, optional
        Defaults to the model on the context stack.
    cov : {"auto", "full", "block", "diag"} or dict, optional
        Covariance structure of q per Gaussian global (see
        :func:`~pymc_mcssvi.recognize.layout.resolve_structure`).

    Returns
    -------
    TwoLevelModel

    Raises
    ------
    UnsupportedModelError
        Naming the variable, the reason and what to do instead.

    Examples
    --------
    >>> import numpy as np, pymc as pm
    >>> X = np.random.default_rng(0).normal(size=(50, 3))
    >>> with pm.Model() as m:
    ...     w = pm.Normal("w", 0, 1, shape=3)
    ...     y = pm.Bernoulli("y", logit_p=X @ w, observed=(X[:, 0] > 0).astype(int))
    >>> tlm = recognize(m)
    >>> [g.name for g in tlm.gaussians], tlm.observed["y"]
    (['w'], 'dense affine')
    """
    model = pm.modelcontext(model)
    _check_imputation(model)
    for obs in model.observed_RVs:
        _check_observed_data(model, obs)

    gaussians, hypers = _assign_roles(model)
    gvalues = {g.value: i for i, g in enumerate(gaussians)}
    gshapes = {g.value: g.shape for g in gaussians}

    predictor_terms: list[PredictorTerm] = []
    general_terms: list[GeneralTerm] = []
    constant_terms: list[ConstantTerm] = []
    observed_forms: dict[str, str] = {}

    for g in gaussians:
        term, const = _prior_term(model, g, gvalues, gshapes)
        predictor_terms.append(term)
        constant_terms.append(const)

    for h in hypers:
        lp = model.logp(vars=[h.rv], jacobian=True, sum=True)
        constant_terms.append(ConstantTerm(f"prior of {h.name}", remove_checks(lp)))

    minibatch = False
    for obs in model.observed_RVs:
        op, _ = _base_op(obs)
        if isinstance(obs.owner.op, MinibatchRandomVariable):
            minibatch = True
        elif _uses_minibatch(model, obs):
            minibatch = True
            warnings.warn(
                f"Observed variable {obs.name!r} uses pm.Minibatch data but has no `total_size`: "
                "the likelihood is not rescaled to the full data set and the posterior will be too wide. "
                f"Pass total_size=<number of rows> to {obs.name!r}.",
                UserWarning,
                stacklevel=2,
            )
        if getattr(op, "ndim_supp", 0) > 0:
            raise UnsupportedModelError(
                obs.name,
                f"its likelihood ({type(op).__name__}) is multivariate, so its log density is not "
                "elementwise in a predictor",
                "write it with univariate observed variables (one per column), or fit it with pm.fit(method='fullrank_advi')",
            )
        logp = remove_checks(model.logp(vars=[obs], sum=False)[0])
        if not depends_on_any(logp, gvalues):
            constant_terms.append(ConstantTerm(obs.name, logp))
            observed_forms[obs.name] = "constant (no Gaussian global)"
            continue
        term = _likelihood_term(obs.name, logp, gvalues, gshapes)
        if term is None:
            general_terms.append(
                GeneralTerm(obs.name, logp, "not a function of one affine predictor")
            )
            observed_forms[obs.name] = "general"
        else:
            predictor_terms.append(term)
            observed_forms[obs.name] = _form_name(term)

    for pot in model.potentials:
        lp = remove_checks(model.replace_rvs_by_values([pot])[0])
        if depends_on_any(lp, gvalues):
            general_terms.append(GeneralTerm(pot.name or "potential", lp, "pm.Potential"))
        else:
            constant_terms.append(ConstantTerm(pot.name or "potential", lp))

    dim = sum(g.size for g in gaussians)
    if general_terms and dim > MAX_GENERAL_DIM:
        names = ", ".join(t.name for t in general_terms)
        raise UnsupportedModelError(
            names,
            f"depends on the {dim} Gaussian dimensions non-affinely; the Monte Carlo + autodiff path forms "
            f"{dim} x {dim} Hessians and is limited to {MAX_GENERAL_DIM} dimensions",
            "write the likelihood through an affine predictor (e.g. X @ w) or reduce the number of Gaussian globals",
        )

    joint = _joint_blocks(predictor_terms, gaussians)
    structure = resolve_structure(gaussians, cov, joint)
    segments = build_segments(gaussians, structure, joint)
    return TwoLevelModel(
        model=model,
        gaussians=gaussians,
        segments=segments,
        hypers=hypers,
        predictor_terms=predictor_terms,
        general_terms=general_terms,
        constant_terms=constant_terms,
        observed=observed_forms,
        minibatch=minibatch,
    )


# ------------------------------------------------------------------------ checks
def _check_imputation(model):
    free = {rv.name for rv in model.free_RVs}
    for obs in model.observed_RVs:
        if obs.name.endswith("_observed"):
            base = obs.name[: -len("_observed")]
            if f"{base}_unobserved" in free:
                raise UnsupportedModelError(
                    base,
                    f"the observed data contain missing values, and PyMC added '{base}_unobserved' to impute them",
                    "drop the rows with missing values before building the model (or impute them yourself)",
                )


def _check_observed_data(model, obs):
    """NaN or infinite values in the observed data or in data the likelihood reads."""
    value = model.rvs_to_values.get(obs)
    roots = [obs] if value is None else [obs, value]
    for v in ancestors(roots):
        data = None
        if isinstance(v, Constant):
            data = v.data
        elif isinstance(v, TensorSharedVariable):
            data = v.get_value(borrow=True)
        if data is None:
            continue
        data = np.asarray(data)
        if data.dtype.kind == "f" and not np.all(np.isfinite(data)):
            what = (
                "its observed data"
                if v is value
                else f"the data {v.name or 'array'!r} it depends on"
            )
            raise UnsupportedModelError(
                obs.name,
                f"{what} contain NaN or infinite values",
                "remove or impute those entries before building the model",
            )


def _uses_minibatch(model, obs) -> bool:
    value = model.rvs_to_values.get(obs)
    if value is None:
        return False
    return any(
        v.owner is not None and isinstance(v.owner.op, MinibatchOp) for v in ancestors([value])
    )


# ------------------------------------------------------------------------- roles
def _gaussian_kind(model, rv) -> str | None:
    op = rv.owner.op
    if model.rvs_to_transforms.get(rv) is not None:
        return None
    if isinstance(op, MvNormalRV):
        return "mvnormal"
    if isinstance(op, NormalRV):
        return "normal"
    return None


def _assign_roles(model):
    """Split free RVs into Gaussian globals and hyperparameters (iterative demotion)."""
    free = list(model.free_RVs)
    discrete = [rv for rv in free if rv.type.dtype.startswith(("int", "uint", "bool"))]
    if discrete:
        rv = discrete[0]
        raise UnsupportedModelError(
            rv.name,
            "it is a discrete free variable that is not a marginalizable local of an observed variable",
            "marginalize it in the model (e.g. pm.Mixture, pm.ZeroInflatedPoisson) or use pm.sample",
        )
    values = {rv: model.rvs_to_values[rv] for rv in free}
    ip = model.initial_point()
    vshape = {rv: tuple(np.shape(ip[values[rv].name])) for rv in free}
    params = {rv: model.replace_rvs_by_values(_dist_params(rv)) for rv in free}
    cand = {rv: kind for rv in free if (kind := _gaussian_kind(model, rv))}
    shapes = {values[rv]: vshape[rv] for rv in cand}
    reasons: dict = {}
    changed = True
    while changed:
        changed = False
        cvals = {values[rv] for rv in cand}
        for rv in free:
            ps = params[rv]
            if rv in cand:
                loc, scales = ps[0], ps[1:]
                others = cvals - {values[rv]}
                for s in scales:
                    for c in list(cand):
                        if values[c] in others and depends_on_any(s, [values[c]]):
                            reasons[c] = f"sets the scale of {rv.name!r}"
                            del cand[c]
                            changed = True
                if (
                    depends_on_any(loc, others)
                    and linearize(loc, {v: 0 for v in others}, shapes) is None
                ):
                    for c in list(cand):
                        if values[c] in others and depends_on_any(loc, [values[c]]):
                            reasons[c] = f"enters the mean of {rv.name!r} non-linearly"
                            del cand[c]
                            changed = True
            else:
                for p in ps:
                    for c in list(cand):
                        if depends_on_any(p, [values[c]]):
                            reasons[c] = f"is a parameter of the prior of {rv.name!r}"
                            del cand[c]
                            changed = True
            if changed:
                break
    gaussians, hypers = [], []
    for rv in free:
        shape = vshape[rv]
        if rv in cand:
            gaussians.append(GaussianGlobal(rv.name, rv, values[rv], shape, cand[rv]))
        else:
            reason = reasons.get(rv, "not a Normal/MvNormal prior")
            hypers.append(Hyperparameter(rv.name, rv, values[rv], shape, reason))
    if not gaussians:
        names = ", ".join(rv.name for rv in free) or "(none)"
        raise UnsupportedModelError(
            names,
            "the model has no Gaussian (pm.Normal / pm.MvNormal) global variable for the structured q",
            "give the regression coefficients Normal priors, or use pm.fit(method='advi') for this model",
        )
    return gaussians, hypers


# ------------------------------------------------------------------ prior terms
def _prior_term(model, g: GaussianGlobal, gvalues, gshapes):
    """Gaussian prior of ``g`` as a whitened residual plus its normalizer."""
    params = model.replace_rvs_by_values(_dist_params(g.rv))
    value = g.value
    if g.prior == "normal":
        mu, sigma = (as_float(p) for p in params)
        sigma_b = pt.broadcast_to(sigma, g.shape)
        resid = pt.broadcast_to((value - mu) / sigma, g.shape)
        const = -pt.sum(pt.log(sigma_b))
    else:
        mu, cov = (as_float(p) for p in params)
        chol = pt.linalg.cholesky(cov, lower=True)
        k = g.shape[-1]
        eye = pt.eye(k)
        chol_inv = pt.linalg.solve_triangular(chol, pt.broadcast_to(eye, chol.shape), lower=True)
        centered = pt.broadcast_to(value - mu, g.shape)
        resid = pt.matmul(chol_inv, centered[..., None])[..., 0]
        logdiag = pt.log(pt.diagonal(chol, axis1=-2, axis2=-1))
        n_rows = int(np.prod(g.shape[:-1], dtype=int)) if len(g.shape) > 1 else 1
        rows_in_chol = (
            int(np.prod(chol.type.shape[:-2], dtype=int))
            if chol.ndim > 2 and None not in chol.type.shape[:-2]
            else 1
        )
        const = -pt.sum(logdiag) * (n_rows // max(rows_in_chol, 1))
    form = linearize(resid, gvalues, gshapes)
    if form is None:
        raise UnsupportedModelError(
            g.name,
            "its prior mean is not affine in the other Gaussian variables",
            "report this model as a bug",
        )
    term = PredictorTerm(
        name=f"prior of {g.name}",
        eta_shape=tuple(g.shape),
        offset=form.offset,
        terms=_flatten_terms(form.terms, g.shape),
        placeholder=None,
        logp=None,
        gaussian=True,
        kind="prior",
    )
    return term, ConstantTerm(f"normalizer of {g.name}", const)


# ------------------------------------------------------------- likelihood terms
def _likelihood_term(name, logp, gvalues, gshapes) -> PredictorTerm | None:
    """Find the affine predictor through which ``logp`` depends on the globals."""
    lin = _Linearizer(gvalues, gshapes)
    cuts: list[Variable] = []
    seen = set()
    stack = [logp]
    while stack:
        v = stack.pop()
        if v in seen or not lin.depends(v):
            continue
        seen.add(v)
        if v.dtype.startswith("float") and lin(v) is not None and lin(v).terms:
            if v not in cuts:
                cuts.append(v)
            continue
        if v.owner is None:
            continue
        stack.extend(i for i in v.owner.inputs if lin.depends(i))
    if len(cuts) != 1:
        return None
    (eta,) = cuts
    placeholder = eta.type()
    placeholder.name = f"{name}_predictor"
    replaced = graph_replace(logp, {eta: placeholder}, strict=False)
    if depends_on_any(replaced, gvalues):
        return None
    if not is_separable(replaced, placeholder):
        return None
    stable = stable_logp(replaced)
    form = lin(eta)
    shape = lin.shape_of(eta)
    return PredictorTerm(
        name=name,
        eta_shape=shape,
        offset=form.offset,
        terms=_flatten_terms(form.terms, shape),
        placeholder=placeholder,
        logp=stable,
    )


def _flatten_terms(terms: list[LinearTerm], shape) -> list[LinearTerm]:
    """Give every term exactly one leading (row) axis."""
    out = []
    nd = len(shape)
    for t in terms:
        if t.ndim < nd:
            t = t.map(lambda c, d=nd - t.ndim: pt.shape_padleft(c, d))
        if nd == 0:
            out.append(t.map(lambda c: c[None]))
        elif nd == 1:
            out.append(t)
        elif t.is_dense:
            out.append(t.map(lambda c: c.reshape((1, c.shape[-1]), ndim=2)))
        else:
            k = pt.maximum(t.cols.shape[-1], 1 if t.vals is None else t.vals.shape[-1])
            full = (*shape, k)

            def flat(c, full=full):
                return pt.broadcast_to(c, full).reshape((-1, full[-1]), ndim=2)

            out.append(t.map(flat))
    return out


def _form_name(term: PredictorTerm) -> str:
    kinds = {"dense affine" if t.is_dense else "gather" for t in term.terms}
    if kinds == {"dense affine"}:
        return "dense affine"
    if kinds == {"gather"}:
        return "gather"
    return "dense affine + gather"


def _joint_blocks(terms: list[PredictorTerm], gaussians) -> list[list[int]]:
    """Globals gathered together in one likelihood term with the same number of rows."""
    groups = []
    for t in terms:
        if t.kind != "likelihood":
            continue
        gathered = sorted({tt.source for tt in t.terms if not tt.is_dense})
        by_rows: dict[int, list[int]] = {}
        for gid in gathered:
            shp = gaussians[gid].shape
            if shp:
                by_rows.setdefault(shp[0], []).append(gid)
        for members in by_rows.values():
            if len(members) > 1 and members not in groups:
                groups.append(members)
    return groups
