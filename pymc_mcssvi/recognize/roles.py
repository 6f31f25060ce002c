"""Assign a role to every free variable of a PyMC model.

Order of decisions (ARCHITECTURE.md §1, §6):

0. **predictive leaves** -- free variables that no observed variable, potential
   or other free variable (except such leaves) depends on: predictions written
   into the model and PyMC's ``<name>_unobserved`` imputations. They are left out
   of the fit and drawn from their prior given the other variables
   (:class:`~pymc_mcssvi.recognize.ir.PredictiveLeaf`);
1. **locals** -- a ``pm.Normal`` (continuous) or ``pm.Bernoulli`` /
   ``pm.Categorical`` (discrete) variable with one entry per observation of
   exactly one observed variable, used by it elementwise, whose prior is
   univariate (so conditionally independent across entries given the globals)
   and is not read by any other prior;
2. **Rayleigh globals** -- ``pymc_mcssvi.Rayleigh`` variables (not
   ``pm.Weibull(alpha=2)``, a hyperparameter) whose scale involves no other latent
   of the model except hyperparameters;
3. **Gaussian globals** -- the remaining untransformed ``pm.Normal`` /
   ``pm.MvNormal`` variables and ``pm.ZeroSumNormal`` effects (in their
   unconstrained space, see :mod:`~pymc_mcssvi.recognize.zerosum`), and
   Student-t, Laplace, Cauchy and logistic priors on the real line, whose prior
   location is affine in the other
   Gaussian globals and whose prior scale involves none of them (iterative
   demotion: a candidate that sets another variable's scale, enters a location
   non-linearly, or parameterizes a non-Gaussian prior becomes a
   hyperparameter);
4. **hyperparameters** -- every other continuous free variable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytensor
import pytensor.tensor as pt
from pymc.distributions.continuous import (
    AsymmetricLaplaceRV,
    FlatRV,
    MoyalRV,
    SkewStudentTRV,
)
from pymc.distributions.distribution import SymbolicRandomVariable
from pymc.distributions.multivariate import CARRV, ICARRV, MvNormalRV, ZeroSumNormalRV
from pymc.distributions.timeseries import (
    GARCH11RV,
    AutoRegressiveRV,
    EulerMaruyamaRV,
    RandomWalkRV,
)
from pymc.logprob.abstract import _logprob
from pymc.variational.minibatch_rv import MinibatchRandomVariable
from pytensor.compile.rewriting import inline_ofg_node
from pytensor.graph.basic import Constant
from pytensor.graph.traversal import ancestors, graph_inputs
from pytensor.tensor.elemwise import DimShuffle, Elemwise
from pytensor.tensor.random.basic import (
    BernoulliRV,
    CategoricalRV,
    CauchyRV,
    GumbelRV,
    LaplaceRV,
    LogisticRV,
    NormalRV,
    StudentTRV,
)
from pytensor.tensor.random.type import RandomType
from pytensor.tensor.sharedvar import TensorSharedVariable

from pymc_mcssvi.distributions import RayleighRV
from pymc_mcssvi.exceptions import UnsupportedModelError
from pymc_mcssvi.recognize.affine import linearize
from pymc_mcssvi.recognize.graph import (
    depends_on_any,
    float64_constants,
    is_entrywise,
    is_separable,
    lift_gathers,
    remove_checks,
    static_data_shapes,
)
from pymc_mcssvi.recognize.ir import (
    GaussianGlobal,
    Hyperparameter,
    LocalLatent,
    PredictiveLeaf,
    RayleighGlobal,
)
from pymc_mcssvi.recognize.zerosum import LinearZeroSumTransform

__all__ = ["Roles", "assign_roles", "base_op", "dist_name", "dist_params", "loc_and_others"]


def _carrier(rv):
    """The variable carrying ``rv``'s distribution (through minibatching)."""
    op = rv.owner.op
    return _carrier(rv.owner.inputs[0]) if isinstance(op, MinibatchRandomVariable) else rv


def base_op(rv):
    """Distribution op of a variable and the variable carrying it (through minibatching).

    A ``pm.CustomDist`` whose ``dist`` is a plain ``pm.Normal.dist`` of its inputs has
    the Normal's op (:func:`_custom_normal`).
    """
    base = _carrier(rv)
    custom = _custom_normal(base)
    return (base.owner.op if custom is None else custom[0]), base


def _custom_normal(rv):
    """``(normal_op, [mu, sigma])`` of a ``pm.CustomDist`` whose draw is a ``pm.Normal`` of
    its parameters (``dist=lambda mu, sigma, size: pm.Normal.dist(mu, sigma, size=size)``),
    the parameters as graphs of the CustomDist's own inputs; ``None`` otherwise. Such a
    variable is a Normal to the plugin (a random effect written this way was a mean-field
    hyperparameter: 40 groups, the intercept's sd 0.30x NUTS's)."""
    op = rv.owner.op
    if not (isinstance(op, SymbolicRandomVariable) and hasattr(op, "inner_outputs")):
        return None
    if type(op) in _logprob.registry:  # a log density of its own (CustomDist(logp=...))
        return None
    draws = [o for o in op.inner_outputs if not isinstance(o.type, RandomType)]
    if len(draws) != 1 or draws[0].owner is None or not isinstance(draws[0].owner.op, NormalRV):
        return None
    try:  # the inner graph with the CustomDist's inputs in place of its own
        inlined = inline_ofg_node(rv.owner)
    except Exception:  # noqa: BLE001  (an inner graph PyTensor cannot inline)
        return None
    (draw,) = [o for o in inlined if not isinstance(o.type, RandomType)]
    mu, sigma = draw.owner.op.dist_params(draw.owner)
    return draw.owner.op, [mu, sigma]


def dist_params(rv):
    base = _carrier(rv)
    custom = _custom_normal(base)
    if custom is not None:
        return list(custom[1])
    try:
        return list(base.owner.op.dist_params(base.owner))
    except ValueError:
        # a SymbolicRandomVariable without an extended signature (PyMC's pm.Truncated of
        # a discrete distribution, a scan): its inputs other than random generators
        return [i for i in base.owner.inputs if not isinstance(i.type, RandomType)]


def _constant(v):
    while v.owner is not None and v.owner.op.__class__.__name__ in ("DimShuffle", "Cast"):
        v = v.owner.inputs[0]
    if isinstance(v, Constant):
        data = np.asarray(v.data)
        if data.size >= 1 and np.all(data == data.reshape(-1)[0]):
            return float(data.reshape(-1)[0])
    return None


def rayleigh_scale(rv):
    """The Rayleigh scale of ``rv`` (a graph in RVs) or None if ``rv`` is not a
    :class:`~pymc_mcssvi.Rayleigh` variable.

    ``pm.Weibull(alpha=2)`` is the same distribution but not a Rayleigh global: a
    Rayleigh q has one parameter (its sd is 0.52 times its mean), far too wide for a
    scale the data pin down (a residual sd with a ``Weibull(2, 1)`` prior came out
    37 NUTS sds too wide, 53 sds off), so users' Weibull priors are hyperparameters.
    The paper's GME asks for the Rayleigh q by name (``pymc_mcssvi.Rayleigh``).
    """
    op, _ = base_op(rv)
    if isinstance(op, RayleighRV):
        return dist_params(rv)[0]
    return None


def _check_positive_scale(name, scale, point):

    inputs = [
        v for v in graph_inputs([scale]) if not isinstance(v, Constant | TensorSharedVariable)
    ]
    try:
        val = pytensor.function(inputs, scale, mode="FAST_COMPILE", on_unused_input="ignore")(
            *[point[v] for v in inputs]
        )
    except Exception:
        return
    val = np.asarray(val)
    if not np.all(np.isfinite(val) & (val > 0)):
        raise UnsupportedModelError(
            name,
            f"its Rayleigh scale must be positive, got {val.min() if val.size else val}",
            "give the Rayleigh prior a positive `sigma` (the paper's tau)",
        )


@dataclass
class Roles:
    gaussians: list[GaussianGlobal] = field(default_factory=list)
    rayleighs: list[RayleighGlobal] = field(default_factory=list)
    locals: list[LocalLatent] = field(default_factory=list)
    hypers: list[Hyperparameter] = field(default_factory=list)
    leaves: list[PredictiveLeaf] = field(default_factory=list)
    #: Elementwise log densities of the observed variables (checks removed), by RV:
    #: built once here (each ``model.logp`` call rewrites the model's graph).
    observed_logps: dict = field(default_factory=dict)
    #: The model's initial point (by value-variable name), computed once.
    initial_point: dict = field(default_factory=dict)


def _observed_logps(model):
    obs = list(model.observed_RVs)
    lps = model.logp(vars=obs, sum=False) if obs else []  # one call: each rewrites the graph
    # pm.Data without shape=: the likelihoods see the data's current shapes
    lps = static_data_shapes(lps)
    # gathers below element-wise links: invlogit(mu + s * z)[g] reads as a gather GLM
    return {
        o: lift_gathers(float64_constants(remove_checks(lp)))
        for o, lp in zip(obs, lps, strict=True)
    }


def _jittered(point, sd=0.3, seed=0):
    """``point`` (values of value variables: PyMC's unconstrained space) with its
    continuous entries moved by ``N(0, sd^2)`` noise."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, x in point.items():
        x = np.asarray(x)
        out[k] = x + rng.normal(0.0, sd, x.shape).astype(x.dtype) if x.dtype.kind == "f" else x
    return out


def _find_leaves(model, free, values, params, obs_logps) -> list:
    """Free variables that nothing but other such variables (and Deterministics) reads.

    The largest set ``L`` of free RVs such that no observed variable, no potential
    and no free RV outside ``L`` depends on a member's value. Empty when every free
    variable would be in it (a model without data: there is nothing to fit).
    """
    if not obs_logps:
        return []
    readers = list(obs_logps.values())
    if model.potentials:
        readers += model.replace_rvs_by_values(list(model.potentials))
    read = set(ancestors(readers))
    leaves = [rv for rv in free if values[rv] not in read]
    while True:  # drop the candidates read by a free variable outside the set
        read = set(ancestors([p for o in free if o not in leaves for p in params[o]]))
        kept = [rv for rv in leaves if values[rv] not in read]
        if len(kept) == len(leaves):
            break
        leaves = kept
    return [] if len(leaves) == len(free) else leaves


def _find_locals(model, free, values, vshape, params, obs_logps, ip):
    """Free variables that are locals of exactly one observed variable."""
    out = []
    for rv in free:
        op, _ = base_op(rv)
        discrete = isinstance(op, BernoulliRV | CategoricalRV)
        gaussian = isinstance(op, NormalRV) and model.rvs_to_transforms.get(rv) is None
        if not (discrete or gaussian):
            continue
        v = values[rv]
        consumers = [obs for obs, lp in obs_logps.items() if depends_on_any(lp, [v])]
        readers = [
            o for o in free if o is not rv and any(depends_on_any(p, [v]) for p in params[o])
        ]
        if len(consumers) != 1 or readers:
            continue
        (obs,) = consumers
        obs_size = (
            int(np.prod(obs_logps[obs].type.shape, dtype=int))
            if None not in obs_logps[obs].type.shape
            else None
        )
        if obs_size is None:
            try:
                obs_size = int(np.prod(obs_logps[obs].shape.eval(mode="FAST_COMPILE")))
            except Exception:  # pragma: no cover
                continue
        size = int(np.prod(vshape[rv], dtype=int))
        if size != obs_size or size < 2:
            continue
        if not is_separable(obs_logps[obs], v):
            point = {values[o]: ip[values[o].name] for o in free}
            base = np.asarray(ip[v.name]).reshape(vshape[rv])
            # also away from the initial point, where a structure can look diagonal by
            # accident (L(rho) @ eps with the AR powers of rho = 0: the identity)
            if not all(
                is_entrywise(obs_logps[obs], v, p, base=base) for p in (point, _jittered(point))
            ):
                continue
        support = None
        if discrete:
            if isinstance(op, BernoulliRV):
                support = 2
            else:
                p = params[rv][0]
                support = (
                    p.type.shape[-1]
                    if p.type.shape[-1] is not None
                    else int(p.shape[-1].eval(mode="FAST_COMPILE"))
                )
        out.append(
            LocalLatent(
                name=rv.name,
                rv=rv,
                value=v,
                shape=vshape[rv],
                kind="discrete" if discrete else "gaussian",
                observed=obs.name,
                support=support,
            )
        )
    return out


def _demote_likelihood_scales(model, cand, values, vshape, params, local_rvs, demote):
    """Gaussian candidates that only set scales or shapes of likelihoods are hyperparameters.

    For each observed variable the parameter that reads the most Gaussian
    dimensions carries the predictor; a scalar candidate that appears only in
    its other parameters (``sigma = exp(log_sigma)``) and in no prior location
    is treated like a HalfNormal scale would be.
    """
    size = {rv: int(np.prod(vshape[rv], dtype=int)) for rv in cand}
    in_location = set()
    for rv in cand:
        loc, _ = loc_and_others(rv, params[rv])
        in_location.update(c for c in cand if c is not rv and depends_on_any(loc, [values[c]]))
    for rv in local_rvs:
        in_location.update(c for c in cand if depends_on_any(params[rv][0], [values[c]]))
    scale_only: dict = {}
    main_users = set()
    for obs in model.observed_RVs:
        ps = model.replace_rvs_by_values(dist_params(obs))
        deps = [{c for c in cand if depends_on_any(p, [values[c]])} for p in ps]
        if not any(deps):
            continue
        main = max(range(len(ps)), key=lambda i: sum(size[c] for c in deps[i]))
        main_users.update(deps[main])
        for i, d in enumerate(deps):
            if i != main:
                for c in d - deps[main]:
                    scale_only.setdefault(c, (obs.name, i < main))
    for c, (obs_name, before_main) in scale_only.items():
        # Only scalars: a vector of scale coefficients (heteroskedastic regression) keeps
        # its Gaussian posterior through the Monte Carlo + autodiff path.
        if c in cand and size[c] == 1 and c not in main_users and c not in in_location:
            # distribution parameters come location first: a parameter before the main
            # predictor's is the location (the main predictor then sits in the scale)
            what = "the mean" if before_main else "the scale or shape"
            demote(
                c,
                f"sets {what} of {obs_name!r}, whose larger predictor is in another parameter",
            )


def _demote_loadings(model, cand, values, vshape, shapes, demote):
    """A scalar Gaussian candidate that multiplies other Gaussian globals in a likelihood's
    parameter (a loading: ``lam * u[g]``, the same effects entering a second outcome
    scaled) is a hyperparameter, as a scale ``sigma`` in ``sigma * z`` is: the parameter
    is affine in the loading alone and in the others given it, but not in both, and the
    Monte Carlo + autodiff path it went to was 5x slower than NUTS (a 20-dimensional
    model with 731 rows: 21.7 s against 4.4 s). So is one that enters non-linearly while
    the parameter stays affine in the others given it (``exp(log_sigma) * z[g]`` with
    ``log_sigma ~ Normal``): in the joint Gaussian q of the general path its sd was 0.65x
    NUTS's, as a hyperparameter it is a LogNormal scale's."""
    size = {rv: int(np.prod(vshape[rv], dtype=int)) for rv in cand}
    cand_values = [values[c] for c in cand]
    for obs in model.observed_RVs:
        for p in model.replace_rvs_by_values(dist_params(obs)):
            p = _inside_link(p, cand_values)
            deps = [c for c in cand if depends_on_any(p, [values[c]])]
            if len(deps) < 2 or linearize(p, {values[c]: 0 for c in deps}, shapes) is not None:
                continue
            for c in sorted(deps, key=lambda c: size[c]):
                others = {values[o]: 0 for o in deps if o is not c}
                if size[c] == 1 and linearize(p, others, shapes) is not None:
                    # affine in the others given c; c itself enters linearly (a loading)
                    # or not (``exp(log_sigma) * z[g]``: a scale on the log scale)
                    how = (
                        "multiplies Gaussian effects"
                        if linearize(p, {values[c]: 0}, shapes) is not None
                        else "enters non-linearly"
                    )
                    demote(c, f"{how} in the predictor of {obs.name!r}")
                    break


def _inside_link(p, wrt):
    """The node of ``p`` where the variables ``wrt`` first meet, below element-wise
    links and factors free of them (``exp(eta) * exposure`` -> ``eta``)."""
    while p.owner is not None and isinstance(p.owner.op, Elemwise | DimShuffle):
        inner = [i for i in p.owner.inputs if depends_on_any(i, wrt)]
        if len(inner) != 1:
            break
        p = inner[0]
    return p


#: Priors on the real line, not Gaussian, whose variables still get the Gaussian q:
#: op -> (family name, index of the location among the distribution parameters). Their
#: log density enters the bound as a one-dimensional term in the variable (quadrature),
#: like a likelihood (robust effects ``a ~ StudentT(nu, 0, sigma)``, Laplace shrinkage).
NON_GAUSSIAN_PRIORS = {
    StudentTRV: ("studentt", 1),
    LaplaceRV: ("laplace", 0),
    CauchyRV: ("cauchy", 0),
    LogisticRV: ("logistic", 0),
    GumbelRV: ("gumbel", 0),
    MoyalRV: ("moyal", 0),
    AsymmetricLaplaceRV: ("asymmetriclaplace", 2),
    SkewStudentTRV: ("skewstudentt", 2),
}


def series_params(op, ps):
    """``(locations, others)`` of a Gaussian time series' prior.

    ``pm.GaussianRandomWalk`` (``ps``: the initial and the innovation
    distributions, both Normal): their means and their sds. ``pm.AR`` (``ps``:
    ``rhos, sigma, init_dist``, the initial distribution Normal): the initial
    mean and the constant term (``rhos[..., 0]`` with ``constant=True``), and
    ``sigma``, the initial sd and the coefficients.
    """
    if isinstance(op, RandomWalkRV):
        (m0, s0), (m1, s1) = (dist_params(d)[:2] for d in ps[:2])
        return [m0, m1], [s0, s1]
    rhos, sigma, init = ps[:3]
    m0, s0 = dist_params(init)[:2]
    locs = [m0, rhos[..., 0]] if op.constant_term else [m0]
    return locs, [sigma, s0, rhos]


def gaussian_series(rv) -> str | None:
    """``"randomwalk"`` or ``"ar"`` for a time series that is Gaussian given its
    parameters (Normal initial values and innovations), else None."""
    op, _ = base_op(rv)
    if isinstance(op, RandomWalkRV):
        kind, dists = "randomwalk", rv.owner.inputs[:2]
    elif isinstance(op, AutoRegressiveRV):
        kind, dists = "ar", rv.owner.inputs[2:3]
    else:
        return None
    ok = all(d.owner is not None and isinstance(d.owner.op, NormalRV) for d in dists)
    return kind if ok else None


def loc_and_others(rv, ps):
    """The location parameter of ``rv``'s prior and its other parameters."""
    op, _ = base_op(rv)
    if isinstance(op, RandomWalkRV | AutoRegressiveRV):
        locs, others = series_params(op, ps)
        return pt.add(*(pt.sum(m) for m in locs)), others
    # zero mean; parameters (sigma, support shape) and (W, sigma, zero_sum_stdev)
    if isinstance(op, ZeroSumNormalRV | ICARRV):
        return pt.constant(0.0), list(ps)
    if isinstance(op, FlatRV):  # no parameters
        return pt.constant(0.0), []
    spec = NON_GAUSSIAN_PRIORS.get(type(op))
    i = 0 if spec is None else spec[1]
    return ps[i], [p for j, p in enumerate(ps) if j != i]


def dist_name(rv) -> str:
    """The name of ``rv``'s distribution as the user wrote it (``"HalfNormal"``,
    ``"LKJCholeskyCov"``).

    Examples
    --------
    >>> import pymc as pm
    >>> with pm.Model() as m:
    ...     _ = pm.LKJCholeskyCov("chol", n=2, eta=2, sd_dist=pm.Exponential.dist(1))
    ...     _ = pm.HalfNormal("s", 1)
    >>> [dist_name(rv) for rv in m.free_RVs]
    ['LKJCholeskyCov', 'HalfNormal']
    """
    op, _ = base_op(rv)
    name = getattr(op, "_print_name", None)
    if name and not name[0].startswith("_"):
        return name[0]
    # a private op's print name (``_lkjcholeskycov``): the op's class name reads as the
    # distribution the user wrote
    return type(op).__name__.strip("_").removesuffix("RV")


def assign_roles(model) -> Roles:
    """Split the free variables of ``model`` into the roles of a two-level model.

    Raises
    ------
    UnsupportedModelError
        A discrete free variable that is not a local; no Gaussian or Rayleigh global.
    """
    free = list(model.free_RVs)
    if not free:
        raise UnsupportedModelError(
            ", ".join(rv.name for rv in model.observed_RVs) or model.name or "(model)",
            "the model has no free random variables: there is nothing to infer",
            "give the unknown quantities priors, or simulate from the model with "
            "pm.sample_prior_predictive",
        )
    values = {rv: model.rvs_to_values[rv] for rv in free}
    ip = model.initial_point()
    vshape = {rv: tuple(np.shape(ip[values[rv].name])) for rv in free}
    for rv in free:
        if 0 in vshape[rv]:
            raise UnsupportedModelError(
                rv.name,
                f"it has no entries (shape {vshape[rv]})",
                "leave it out of the model (an empty set of effects adds nothing to a predictor)",
            )
    params = {rv: model.replace_rvs_by_values(dist_params(rv)) for rv in free}
    obs_logps = _observed_logps(model)
    leaf_rvs = _find_leaves(model, free, values, params, obs_logps)
    leaves = [PredictiveLeaf(rv.name, rv, values[rv], vshape[rv]) for rv in leaf_rvs]
    free = [rv for rv in free if rv not in leaf_rvs]

    locals_ = _find_locals(model, free, values, vshape, params, obs_logps, ip)
    local_rvs = {lc.rv for lc in locals_}
    for rv in free:
        if rv.type.dtype.startswith(("int", "uint", "bool")) and rv not in local_rvs:
            raise UnsupportedModelError(
                rv.name,
                "it is a discrete free variable that is not a marginalizable local (one entry per observation "
                "of a single observed variable, used elementwise)",
                "marginalize it in the model (e.g. pm.Mixture, pm.ZeroInflatedPoisson) or use pm.sample",
            )

    rest = [rv for rv in free if rv not in local_rvs]
    rayleighs = []
    for rv in rest:
        scale = rayleigh_scale(rv)
        if scale is None:
            continue
        scale_v = model.replace_rvs_by_values([scale])[0]
        _check_positive_scale(rv.name, scale_v, {values[o]: ip[values[o].name] for o in free})
        rayleighs.append(RayleighGlobal(rv.name, rv, values[rv], vshape[rv], scale_v))
    rayleigh_rvs = {r.rv for r in rayleighs}

    cand = {}
    for rv in rest:
        op, _ = base_op(rv)
        if isinstance(op, ZeroSumNormalRV) and isinstance(
            model.rvs_to_transforms.get(rv), LinearZeroSumTransform
        ):
            cand[rv] = "zerosum"
            continue
        if rv in rayleigh_rvs or model.rvs_to_transforms.get(rv) is not None:
            continue
        if isinstance(op, MvNormalRV):
            cand[rv] = "mvnormal"
        elif isinstance(op, ICARRV | CARRV) and len(vshape[rv]) == 1:
            # Gaussian with a sparse precision (improper for the ICAR): spatial effects
            cand[rv] = "icar" if isinstance(op, ICARRV) else "car"
        elif isinstance(op, NormalRV):
            cand[rv] = "normal"
        elif series := gaussian_series(rv):
            # a GaussianRandomWalk or AR: a Gaussian with a banded precision
            cand[rv] = series
        elif type(op) in NON_GAUSSIAN_PRIORS:
            cand[rv] = NON_GAUSSIAN_PRIORS[type(op)][0]
        elif isinstance(op, FlatRV):
            # an improper uniform prior on the real line (an intercept written
            # pm.Flat): a Gaussian global with prior precision 0
            cand[rv] = "flat"
    shapes = {values[rv]: vshape[rv] for rv in cand}
    reasons: dict = {}

    def demote(c, why):
        reasons[c] = why
        del cand[c]

    _demote_likelihood_scales(model, cand, values, vshape, params, local_rvs, demote)
    _demote_loadings(model, cand, values, vshape, shapes, demote)

    changed = True
    while changed:
        changed = False
        cvals = {values[rv]: rv for rv in cand}
        for rv in free:
            ps = params[rv]
            if rv in cand:
                loc, scales = loc_and_others(rv, ps)
                others = {v for v in cvals if v is not values[rv]}
                hit = [cvals[v] for v in others if any(depends_on_any(s, [v]) for s in scales)]
                for c in hit:
                    demote(c, f"sets the scale of {rv.name!r}")
                if hit:
                    changed = True
                    break
                if (
                    depends_on_any(loc, others)
                    and linearize(loc, dict.fromkeys(others, 0), shapes) is None
                ):
                    for v in others:
                        if depends_on_any(loc, [v]):
                            demote(cvals[v], f"enters the mean of {rv.name!r} non-linearly")
                    changed = True
                    break
            else:
                is_local = rv in local_rvs
                # a discrete local is summed out by enumeration, log sum_k p(z = k | w)
                # p(y | z = k): its probabilities may read the Gaussian globals (a topic
                # model's per-token topic, p = softmax(eta)[doc]); a Gaussian local's
                # mean may, its scale may not
                if not is_local:
                    checked = ps
                elif isinstance(base_op(rv)[0], NormalRV):
                    checked = ps[1:]
                else:
                    checked = ()
                hit = [cvals[v] for v in cvals if any(depends_on_any(p, [v]) for p in checked)]
                for c in hit:
                    demote(c, f"is a parameter of the prior of {rv.name!r}")
                if hit:
                    changed = True
                    break

    def reason_for(rv):
        if rv in reasons:
            return reasons[rv]
        op, _ = base_op(rv)
        name = dist_name(rv)
        if isinstance(op, NormalRV | MvNormalRV) and model.rvs_to_transforms.get(rv) is not None:
            tr = type(model.rvs_to_transforms[rv]).__name__.replace("Transform", "").lower()
            return f"{name} prior with a transform ({tr})"
        return f"{name} prior"

    roles = Roles(
        locals=locals_,
        rayleighs=rayleighs,
        leaves=leaves,
        observed_logps=obs_logps,
        initial_point=ip,
    )
    for rv in rest:
        if rv in rayleigh_rvs:
            continue
        if rv in cand:
            roles.gaussians.append(GaussianGlobal(rv.name, rv, values[rv], vshape[rv], cand[rv]))
        else:
            roles.hypers.append(Hyperparameter(rv.name, rv, values[rv], vshape[rv], reason_for(rv)))
    _reject_time_series_latents(roles)
    if not roles.gaussians and not roles.rayleighs:
        names = ", ".join(rv.name for rv in free) or "(none)"
        marginal_gp = [
            obs.name for obs in model.observed_RVs if isinstance(base_op(obs)[0], MvNormalRV)
        ]
        transformed = [
            rv.name
            for rv in free
            if isinstance(base_op(rv)[0], NormalRV) and model.rvs_to_transforms.get(rv) is not None
        ]
        # pm.gp.MarginalApprox writes its likelihood as a Potential of this name
        sparse_gp = [
            pot.name
            for pot in model.potentials
            if (pot.name or "").startswith("marginalapprox_loglik")
        ]
        hint = (
            f"{', '.join(map(repr, transformed))} "
            f"{'is a pm.Normal' if len(transformed) == 1 else 'are pm.Normals'} with a "
            "`transform=` (e.g. ordered), which the structured q cannot follow: drop the "
            "transform (order mixture components by their weights' or means' prior "
            "locations instead, or build the means as mu0 + cumsum of positive "
            "increments), "
            if transformed
            else f"{marginal_gp[0]!r} is an MvNormal with every latent integrated out (as "
            "pm.gp.Marginal writes a GP): write the GP with pm.gp.Latent (or pm.gp.HSGP) "
            "and a pm.Normal likelihood, so that its values are the Gaussian global, "
            if marginal_gp
            else f"{sparse_gp[0]!r} is a sparse GP's likelihood with every latent integrated "
            "out (as pm.gp.MarginalApprox writes it): put the inducing values in the model, "
            "`u = pm.gp.Latent(cov_func=cov).prior('u', Xu)` and `f = cov(X, Xu) @ "
            "pt.linalg.solve(cov(Xu), u)` with a "
            "pm.Normal likelihood, so that they are the Gaussian global (user guide: sparse "
            "GP on inducing points), "
            if sparse_gp
            else "give the regression coefficients Normal priors (for probabilities, "
            "pm.math.invlogit of Normal effects instead of pm.Beta ones; for proportions such "
            "as a Dirichlet topic model's, softmax of Normal logits: a correlated topic "
            "model), "
        )
        raise UnsupportedModelError(
            names,
            "the model has no Gaussian (pm.Normal / pm.MvNormal) or Rayleigh global variable for the structured q",
            hint + "or use pm.fit(method='advi') for this model",
        )
    return roles


#: Time-series latents. A GaussianRandomWalk or AR with Normal initial values is a
#: Gaussian global (:func:`gaussian_series`); the others, left to the hyperparameters,
#: would get a mean-field q.
_TIME_SERIES_OPS = (RandomWalkRV, AutoRegressiveRV, GARCH11RV, EulerMaruyamaRV)


def _reject_time_series_latents(roles):
    """Raise for a latent time series that is not a Gaussian global: GARCH11,
    EulerMaruyama, a random walk or AR from a non-Normal start, or one whose
    parameters involve the Gaussian globals.

    Left to the hyperparameters, its whole path would get an independent Gaussian per
    time point, uncorrelated with the rest: a GaussianRandomWalk under a Gaussian
    likelihood took 2228 iterations and gave posterior sds of 0.07-0.2 of NUTS's.
    Written with Normal innovations, the same model is a plain Gaussian global.
    """
    for h in roles.hypers:
        op, _ = base_op(h.rv)
        if not isinstance(op, _TIME_SERIES_OPS):
            continue
        kind = type(op).__name__.removesuffix("RV")
        if isinstance(op, AutoRegressiveRV):
            example = (
                "for an AR(1) `eps = pm.Normal('eps', 0, 1, shape=T)`, "
                "`lag = pt.arange(T)[:, None] - pt.arange(T)[None, :]` and "
                "`x = pm.Deterministic('x', pt.tril(rho ** pt.maximum(lag, 0)) @ (sigma * eps))` "
                "(x_t = rho x_(t-1) + sigma eps_t)"
            )
        else:
            example = (
                "for a random walk `eps = pm.Normal('eps', 0, 1, shape=T)` and "
                "`x = pm.Deterministic('x', pt.cumsum(sigma * eps))`"
            )
        raise UnsupportedModelError(
            h.name,
            f"a latent time series ({kind}) is not one of the structured q's Gaussian globals "
            "(its prior couples neighbouring time points)",
            f"write it with Normal innovations, e.g. {example}, which makes the innovations "
            "Gaussian globals; or fit this model with pm.sample() or pm.fit(method='advi')",
        )
