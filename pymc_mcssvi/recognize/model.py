"""Recognize a two-level latent variable model in an ordinary PyMC model.

:func:`recognize` assigns roles (:mod:`pymc_mcssvi.recognize.roles`), writes the
Gaussian prior of the globals as whitened affine residuals, classifies every
observed variable by how it depends on the globals
(:mod:`pymc_mcssvi.recognize.likelihood`) and chooses the covariance layout of q
(:mod:`pymc_mcssvi.recognize.layout`). Everything the engine cannot handle
raises :class:`~pymc_mcssvi.UnsupportedModelError` before any compilation.
"""

from __future__ import annotations

import warnings

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
from pymc.data import MinibatchOp
from pymc.variational.minibatch_rv import MinibatchRandomVariable
from pytensor.graph.basic import Constant
from pytensor.graph.fg import MissingInputError
from pytensor.graph.traversal import ancestors, graph_inputs, io_toposort
from pytensor.tensor.random.op import RandomVariable
from pytensor.tensor.sharedvar import TensorSharedVariable
from pytensor.tensor.subtensor import AdvancedSubtensor

from pymc_mcssvi.exceptions import UnsupportedModelError
from pymc_mcssvi.recognize.affine import linearize
from pymc_mcssvi.recognize.count_data import check_count_data
from pymc_mcssvi.recognize.graph import (
    as_float,
    check_static_data,
    depends_on_any,
    evaluate_static,
    gather_index,
    remove_checks,
    shape64,
    static_data_twins,
)
from pymc_mcssvi.recognize.ir import (
    ConstantTerm,
    GaussianGlobal,
    GeneralTerm,
    PredictorTerm,
    TwoLevelModel,
)
from pymc_mcssvi.recognize.layout import (
    ARROW_MAX_HEAD,
    MAX_CROSSED_FULL_DIM,
    SMALL_GLOBAL,
    build_segments,
    resolve_structure,
)
from pymc_mcssvi.recognize.likelihood import (
    check_gather_indices,
    check_whole,
    flatten_terms,
    float_to_int_casts,
    likelihood_term,
)
from pymc_mcssvi.recognize.marginalize import marginal_logp
from pymc_mcssvi.recognize.marks import bound_of, builder_of
from pymc_mcssvi.recognize.roles import (
    NON_GAUSSIAN_PRIORS,
    assign_roles,
    dist_params,
    loc_and_others,
)
from pymc_mcssvi.recognize.rules import Globals, Observed, RecognizedTerms, classify
from pymc_mcssvi.recognize.separable import hessian_colors, separable_rows
from pymc_mcssvi.recognize.series import series_residuals
from pymc_mcssvi.recognize.zerosum import zerosum_as_linear

__all__ = [
    "AUTO_GENERAL_DIRECTIONS",
    "MAX_GENERAL_DIM",
    "MIN_STEIN_BLOCK",
    "MIN_STEIN_DIAGONAL",
    "check_data",
    "evaluation_failure",
    "general_reads",
    "recognize",
    "uses_minibatch",
]

#: Largest Gaussian dimension the Monte Carlo + autodiff path accepts (it forms D x D Hessians).
MAX_GENERAL_DIM = 2000
#: Hessian directions above which the automatic layout gives the largest coupled globals
#: a diagonal q (:func:`stein_diagonal`): every direction is one Hessian-vector product
#: per draw over all the data. A CTM with 50 documents, V = 200, K = 3 (702 directions
#: under one full covariance): 2.3 s an iteration; with its topics' diagonal q (102
#: directions) 0.35 s (JAX, 2 loaded cores). The user's ``cov=`` may go up to
#: :data:`MAX_GENERAL_DIM`.
AUTO_GENERAL_DIRECTIONS = 512
#: A global with a diagonal q and at least this many entries whose rows the general terms
#: couple (a topic model's topic-word logits) takes its Hessian diagonal from the
#: gradients (Stein's identity, :class:`~pymc_mcssvi.estimators.general.GeneralEstimator`)
#: instead of one Hessian-vector product per entry.
MIN_STEIN_DIAGONAL = 256
#: Per-row blocks of at least this size, of a global whose rows the general terms never
#: couple (a topic model's document logits at K >= 25), take their Hessian blocks from
#: the gradients (Stein's identity, ``E[g (w - m)^T] Sigma^-1``) instead of one
#: Hessian-vector product per block coordinate: the cost of a draw no longer grows with
#: the block size. Exact for a quadratic log density (the fixed draws' moments are
#: exact); the estimator takes at least ``2 (k + 1)`` draws. Below this size the
#: products are cheap and exact per draw.
MIN_STEIN_BLOCK = 24


def recognize(
    model: pm.Model | None = None,
    cov: str | dict | None = None,
    bound: str = "optimal",
    inner: str = "quadrature",
    n_inner: int = 12,
) -> TwoLevelModel:
    """Read a PyMC model as a two-level latent variable model.

    Parameters
    ----------
    model : pm.Model, optional
        Defaults to the model on the context stack.
    cov : {"auto", "full", "block", "diag"} or dict, optional
        Covariance structure of q per Gaussian global (see
        :func:`~pymc_mcssvi.recognize.layout.resolve_structure`).
    bound : {"optimal", "jensen"}
        How local latents are marginalized (:mod:`pymc_mcssvi.recognize.marginalize`).
    inner, n_inner
        Inner quadrature (``"quadrature"``) or Monte Carlo (``"mc"``) for
        Gaussian locals, and its number of nodes or draws.

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
    with zerosum_as_linear(model):
        try:
            return _recognize(model, cov, bound, inner, n_inner)
        except (ValueError, TypeError, IndexError, AssertionError) as err:
            if isinstance(err, UnsupportedModelError):
                raise
            found = evaluation_failure(model)
            if found is None:
                raise
            raise found from err


def evaluation_failure(model) -> UnsupportedModelError | None:
    """The error of the first variable whose log density PyMC cannot build or evaluate
    at the model's initial point, or ``None``.

    A diagnosis after recognition failed inside PyTensor: shapes that do not fit (a
    Multinomial's ``n`` one row short, ``softmax(eta) @ topics`` with a topics matrix
    of the wrong shape) raised PyTensor's own errors from deep inside the log density
    or a compiled check.
    """
    try:
        point = model.initial_point()
    except Exception as err:  # noqa: BLE001  (the initial point itself fails)
        return UnsupportedModelError(
            "initial point",
            f"the model's initial point cannot be computed ({type(err).__name__}: {_first_line(err)})",
            "check the shapes of the variables, their data and their initvals",
        )
    # the likelihoods first: PyMC builds every log density to compile one, so a bad
    # data array fails each variable's; the likelihood that reads it is the culprit
    for rv in [*model.observed_RVs, *model.free_RVs]:
        try:
            model.compile_logp(vars=[rv], sum=False)(point)
        except Exception as err:  # noqa: BLE001  (any failure is the diagnosis)
            return UnsupportedModelError(
                rv.name,
                "its log density cannot be built or evaluated at the model's initial point "
                f"({type(err).__name__}: {_first_line(err)})",
                "check the shapes of its data and of the variables in its parameters "
                "(X @ b needs as many entries in b as X has columns, and every data array "
                "of a likelihood one row per observation)",
            )
    for pot in model.potentials:
        try:
            model.compile_fn(pot, inputs=model.value_vars, on_unused_input="ignore")(point)
        except Exception as err:  # noqa: BLE001  (any failure is the diagnosis)
            return UnsupportedModelError(
                pot.name,
                "this Potential cannot be evaluated at the model's initial point "
                f"({type(err).__name__}: {_first_line(err)})",
                "check its indices and shapes (an index past the end of an axis, such as "
                "a word index beyond the vocabulary, or arrays one row short)",
            )
    return None


def _first_line(err) -> str:
    return str(err).splitlines()[0] if str(err) else ""


def _recognize(model, cov, bound, inner, n_inner) -> TwoLevelModel:
    for obs in model.observed_RVs:
        _check_observed_data(model, obs)
    _check_observed_shapes(model)

    roles = assign_roles(model)
    point = {v: roles.initial_point[v.name] for v in model.value_vars}
    gaussians = roles.gaussians
    gvalues = {g.value: i for i, g in enumerate(gaussians)}
    gshapes = {g.value: g.shape for g in gaussians}
    local_of = {lc.observed: lc for lc in roles.locals}

    predictor_terms: list[PredictorTerm] = []
    constant_terms: list[ConstantTerm] = []
    scaling: dict[str, str] = {}
    notes: list[str] = []

    for g in gaussians:
        if g.prior == "flat":  # log density 0: no term (prior precision 0)
            continue
        term, const = _prior_term(model, g, gvalues, gshapes)
        predictor_terms.append(term)
        constant_terms.append(const)
    if roles.hypers:  # one model.logp call for all of them
        lps = model.logp(vars=[h.rv for h in roles.hypers], jacobian=True, sum=False)
        for h, lp in zip(roles.hypers, lps, strict=True):
            constant_terms.append(ConstantTerm(f"prior of {h.name}", remove_checks(pt.sum(lp))))

    minibatch = False
    found = RecognizedTerms(predictor=predictor_terms, constant=constant_terms)
    seen = Globals(model, gvalues, gshapes, point)
    for obs in model.observed_RVs:
        scaling[obs.name] = _scaling(model, obs)
        if isinstance(obs.owner.op, MinibatchRandomVariable):
            minibatch = True
        elif uses_minibatch(model, obs):
            minibatch = True
            warnings.warn(
                f"Observed variable {obs.name!r} uses pm.Minibatch data but has no `total_size`: "
                "the likelihood is not rescaled to the full data set and the posterior will be too wide. "
                f"Pass total_size=<number of rows> to {obs.name!r}.",
                UserWarning,
                stacklevel=2,
            )
        lc = local_of.get(obs.name)
        if lc is not None:
            logp = marginal_logp(
                model,
                lc,
                bound=bound_of(lc.rv, bound),
                inner=inner,
                n_inner=n_inner,
                fixed=list(gvalues),
            )
            if lc.kind == "gaussian" and inner == "quadrature":
                _check_marginal_finite(logp, lc, obs, point)
        else:
            logp = roles.observed_logps[obs]
        found.add(obs.name, classify(Observed(obs, logp, lc, scaling[obs.name]), seen))
    general_terms, bilinear_terms, pair_terms = found.general, found.bilinear, found.pair
    forms, bilinear_sources, by_column = found.forms, found.row_sources, found.by_column

    _warn_learned_projection(model, predictor_terms, local_of, roles.hypers, notes)
    for pot in model.potentials:
        lp = remove_checks(model.replace_rvs_by_values([pot])[0])
        name = pot.name or "potential"
        if depends_on_any(lp, gvalues):
            general_terms.append(GeneralTerm(name, lp, "pm.Potential"))
            notes.append(
                f"pm.Potential {name!r} depends on the Gaussian globals: included by Monte Carlo + autodiff."
            )
        else:
            constant_terms.append(ConstantTerm(name, lp))
            notes.append(
                f"pm.Potential {name!r} does not involve the Gaussian globals: added to the bound as is."
            )

    # the terms added to a bilinear product read the globals as any affine predictor
    affine_terms = predictor_terms + [b.affine for b in bilinear_terms if b.affine is not None]
    affine_terms += [p.parts[2] for p in pair_terms]  # both predictors' globals, as one
    joint = _joint_blocks(affine_terms, gaussians)
    crossed_ids = _crossed_factors(affine_terms, gaussians, joint, minibatch)
    crossed = bool(crossed_ids)
    arrow = not (crossed or general_terms or bilinear_terms) and _arrow_suffices(
        affine_terms, gaussians
    )
    structure = resolve_structure(
        gaussians, cov, joint, row_blocks=bilinear_sources, crossed=crossed, arrow=arrow
    )
    _warn_diagonal_dense_prior(gaussians, structure, notes)
    segments = build_segments(gaussians, structure, joint, by_column=by_column)
    split_crossed = _split_crossed(gaussians, segments, crossed_ids)
    crossed_note = ""
    if split_crossed:
        dim = sum(g.size for i, g in enumerate(gaussians) if i not in bilinear_sources)
        crossed_note = SPLIT_CROSSED_NOTE.format(
            names=", ".join(repr(n) for n in split_crossed), dim=dim, limit=MAX_CROSSED_FULL_DIM
        )
        notes.append(crossed_note)
    tlm = TwoLevelModel(
        model=model,
        gaussians=gaussians,
        segments=segments,
        hypers=roles.hypers,
        predictor_terms=predictor_terms,
        general_terms=general_terms,
        constant_terms=constant_terms,
        observed=forms,
        minibatch=minibatch,
        rayleighs=roles.rayleighs,
        locals=roles.locals,
        leaves=roles.leaves,
        scaling=scaling,
        notes=notes,
        bilinear_terms=bilinear_terms,
        pair_terms=pair_terms,
        split_crossed_note=crossed_note,
        static_data=tuple(static_data_twins(list(roles.observed_logps.values()))),
    )
    if general_terms:

        def rebuild(structure):
            return build_segments(gaussians, structure, joint, by_column=by_column)

        fixed = _user_structured(cov, gaussians)
        _check_general_dim(tlm, roles.initial_point, structure, fixed, rebuild)
        if minibatch:
            _check_rows_of_a_batch(tlm, model)
    return tlm


def _check_rows_of_a_batch(tlm, model) -> None:
    """Refuse a Gaussian global with one row per row of a ``pm.Minibatch`` batch.

    A CTM written with ``pm.Minibatch`` documents and ``eta`` of shape
    ``(batch_size, K)`` pairs row ``i`` of ``eta`` with a different document in every
    batch: its q would average over documents, a silently wrong fit (and the
    likelihood's ``total_size`` scaling would count each document ``N / batch_size``
    times). Such a global is one whose rows the general terms never couple
    (:attr:`general_rows`) and whose leading dimension is a minibatched observed
    variable's number of rows.
    """
    batches = {}
    for obs in model.observed_RVs:
        if not isinstance(obs.owner.op, MinibatchRandomVariable):
            continue
        rows = obs.owner.inputs[0].type.shape[:1]
        if rows and rows[0] is not None:
            batches.setdefault(int(rows[0]), obs.name)
    if not batches:
        return
    nodes = io_toposort(
        list(graph_inputs([t.logp for t in tlm.general_terms])), [t.logp for t in tlm.general_terms]
    )
    for gid in tlm.general_rows:
        g = tlm.gaussians[gid]
        if not (len(g.shape) and int(g.shape[0]) in batches):
            continue
        # read through a gather (group effects eta[group]) its rows are groups, not rows
        direct = any(
            g.value in node.inputs
            and not (node.inputs[0] is g.value and gather_index(node) is not None)
            for node in nodes
        )
        if direct:
            obs = batches[int(g.shape[0])]
            raise UnsupportedModelError(
                g.name,
                f"it has one row per row of the pm.Minibatch batch of {obs!r} "
                f"({int(g.shape[0])}), so each iteration would pair its rows with other "
                "documents (rows): per-row latent variables cannot be fitted from minibatches",
                f"fit all the rows at once: pass the full data instead of pm.Minibatch and "
                f"give {g.name!r} one row per row of the data (the step's memory stays "
                "bounded: it is reduced chunk by chunk; pm.fit(..., row_batch=B) then moves "
                "B rows a step)",
            )


def _user_structured(cov, gaussians) -> set[int]:
    """Ids of the globals whose q structure the user chose (``cov``)."""
    if isinstance(cov, dict):
        return {i for i, g in enumerate(gaussians) if cov.get(g.name, "auto") != "auto"}
    if cov not in (None, "auto"):
        return set(range(len(gaussians)))
    return set()


# ------------------------------------------------------------------------ checks
#: Ops whose presence in a dense design marks a projection onto inducing values.
_PROJECTION_OPS = {"Solve", "SolveTriangular", "CholeskySolve", "Cholesky", "MatrixInverse"}


def _warn_learned_projection(model, terms, local_of, hypers, notes):
    """Warn when a likelihood reads a Gaussian global through a dense design that solves
    with a learned kernel matrix: ``f = K_fu K_uu^-1 u`` with Gaussian noise and
    learned hyperparameters is the DTC model, whose kernel hyperparameters differ
    from the variational (VFE) ones (n = 500, M = 20: lengthscale 4.29 against 5.27,
    test NLL 0.795 against 0.769)."""
    hyper_values = [h.value for h in hypers]
    if not hyper_values:
        return
    names = []
    for t in terms:
        obs = model.named_vars.get(t.name)
        if t.kind != "likelihood" or t.name in local_of or obs is None or builder_of(obs):
            continue
        for lt in t.terms:
            if lt.vals is None or not lt.is_dense or not depends_on_any(lt.vals, hyper_values):
                continue
            ops = {
                type(getattr(n.op, "core_op", n.op)).__name__
                for n in io_toposort(graph_inputs([lt.vals]), [lt.vals])
            }
            if ops & _PROJECTION_OPS:
                names.append(t.name)
                break
    if not names:
        return
    msg = (
        f"{', '.join(map(repr, names))} reads the inducing values through a projection "
        "K_fu K_uu^-1 u with a learned kernel: this is the DTC sparse GP, which learns the "
        "kernel without the variational (VFE, Titsias) trace term. For VFE build the model "
        "with pymc_mcssvi.models.sparse_gp(..., bound='titsias'); for the paper's V1 add the "
        "local f ~ Normal(K_fu K_uu^-1 u, sqrt(K_ii - Q_ii)) and observe y through f "
        "(user guide: sparse GPs)."
    )
    notes.append(msg)
    warnings.warn(msg, UserWarning, stacklevel=3)


def _warn_diagonal_dense_prior(gaussians, structure, notes):
    """Warn when q is diagonal over a vector whose one MvNormal prior couples all its
    entries (a GP's values): the posterior's correlations are lost and its sds are far
    too small (an n = 300 GP under a diagonal q: sds 0.02-0.5x the exact ones)."""
    names = [
        g.name
        for i, g in enumerate(gaussians)
        if structure[i] == "diag" and g.prior == "mvnormal" and len(g.shape) == 1 and g.size > 1
    ]
    if not names:
        return
    msg = (
        f"q is diagonal over {', '.join(map(repr, names))}: an MvNormal whose covariance "
        "couples all its entries (as a GP's values). The fit loses their correlations and "
        "underestimates their sds. Pass cov='full' (cubic in the size), or write the GP on "
        "inducing points (pymc_mcssvi.models.sparse_gp)."
    )
    notes.append(msg)
    warnings.warn(msg, UserWarning, stacklevel=3)


def _check_general_dim(tlm, point, structure=None, fixed=(), rebuild=None):
    """Record the Gaussian globals whose rows the general terms never couple, and refuse
    Hessians of more than :data:`MAX_GENERAL_DIM` directions.

    Above :data:`AUTO_GENERAL_DIRECTIONS` directions, the largest globals whose rows the
    terms couple and whose structure the user left to the automatic choice get a
    diagonal q, whose Hessian diagonal comes from the gradients (:func:`stein_diagonal`),
    until that budget is met: a topic model's topic-word logits (``K x V``), which a
    block per topic would give ``K V`` products.
    ``rebuild`` makes the segments of a structure.
    """
    gaussians = tlm.gaussians
    tlm.general_rows = separable_rows(gaussians, tlm.general_terms, tlm.model, point)
    read = general_reads(tlm)

    def n_directions():
        no_products = stein_diagonal(tlm, read) + stein_blocks(tlm, read, fixed)
        colors = hessian_colors(gaussians, tlm.general_rows, read, no_products)
        return int(colors[:, 0].max()) + 1

    size = n_directions()
    if size > AUTO_GENERAL_DIRECTIONS and rebuild is not None:
        candidates = sorted(
            (i for i in read if _steinable(tlm, i) and i not in fixed and structure[i] != "diag"),
            key=lambda i: -gaussians[i].size,
        )
        changed = []
        for i in candidates:
            structure[i] = "diag"
            changed.append(gaussians[i].name)
            tlm.segments = rebuild(structure)
            size = n_directions()
            if size <= AUTO_GENERAL_DIRECTIONS:
                break
        if changed:
            tlm.notes.append(
                f"q is diagonal for {', '.join(repr(n) for n in changed)}: the terms couple "
                "its entries, and one full or per-row covariance would take a Hessian-vector "
                "product per entry; the diagonal of its Hessian comes from the gradients "
                "(Stein's identity). Pass cov={name: 'block'} to keep the blocks."
            )
    tlm.general_diagonal = stein_diagonal(tlm, read)
    tlm.general_stein_blocks = stein_blocks(tlm, read, fixed)
    if tlm.general_stein_blocks:
        names = ", ".join(repr(gaussians[i].name) for i in tlm.general_stein_blocks)
        tlm.notes.append(
            f"the Hessian blocks of {names} come from the gradients (Stein's identity): "
            f"blocks of {MIN_STEIN_BLOCK} or more coordinates would take one Hessian-vector "
            "product per coordinate. Pass cov={name: 'block'} to keep the products."
        )
    if size > MAX_GENERAL_DIM:
        names = ", ".join(t.name for t in tlm.general_terms)
        raise UnsupportedModelError(
            names,
            f"depends on the {tlm.dim} Gaussian dimensions non-affinely and couples their rows; "
            f"the Monte Carlo + autodiff path forms Hessians of {size} directions and is "
            f"limited to {MAX_GENERAL_DIM}",
            "write the likelihood through an affine predictor (e.g. X @ w) or reduce the "
            "number of Gaussian globals",
        )


def stein_diagonal(tlm, read) -> tuple[int, ...]:
    """Ids of the globals whose Hessian diagonal the general terms' estimator takes from
    the gradients: a diagonal q, read by the general terms, rows coupled, and at least
    :data:`MIN_STEIN_DIAGONAL` entries (below that one product per entry is cheap and
    exact per draw)."""
    diag = {i for seg in tlm.segments if seg.kind == "diag" for i in seg.members}
    return tuple(i for i in sorted(diag & set(read)) if _steinable(tlm, i))


def stein_blocks(tlm, read, fixed=()) -> tuple[int, ...]:
    """Ids of the globals whose per-row Hessian blocks the general terms' estimator takes
    from the gradients: read by the general terms, rows never coupled, in a ``"block"``
    segment of at least :data:`MIN_STEIN_BLOCK` coordinates per row whose members all
    qualify, and q's structure left to the automatic choice (not in ``fixed``)."""
    out = []
    for seg in tlm.segments:
        if seg.kind != "block" or seg.k < MIN_STEIN_BLOCK:
            continue
        members = set(seg.members)
        if members <= set(read) & set(tlm.general_rows) and not members & set(fixed):
            out += sorted(members)
    return tuple(sorted(out))


def _steinable(tlm, i) -> bool:
    """Whether global ``i`` would take its Hessian diagonal from the gradients under a
    diagonal q: rows coupled by the general terms, at least :data:`MIN_STEIN_DIAGONAL`
    entries."""
    return i not in tlm.general_rows and tlm.gaussians[i].size >= MIN_STEIN_DIAGONAL


def general_reads(tlm) -> set[int]:
    """Ids of the Gaussian globals the general terms read."""
    return {
        i
        for i, g in enumerate(tlm.gaussians)
        if any(depends_on_any(t.logp, [g.value]) for t in tlm.general_terms)
    }


def _check_observed_shapes(model):
    """The parameters of each univariate likelihood must broadcast to its observed data.

    After ``pm.set_data`` of the predictors alone (a new length, the observed data
    left at the old one) the step failed deep in the first iteration with NumPy's
    "operands could not be broadcast together". The shapes of all likelihoods are
    evaluated at once (one variable at a time when some need a free variable's value).
    """

    checks = []
    for obs in model.observed_RVs:
        value = model.rvs_to_values.get(obs)
        op = obs.owner.op if obs.owner is not None else None
        if value is None or not isinstance(op, RandomVariable) or op.ndim_supp != 0:
            continue
        # each parameter's batch shape (without its core dimensions: a Categorical's p)
        params = [
            (p, core)
            for p, core in zip(op.dist_params(obs.owner), op.ndims_params, strict=True)
            if p.ndim > core
        ]
        if params:
            shapes = [p.shape[: p.ndim - c] for p, c in params]
            checks.append((obs, [p for p, _ in params], [value.shape, *shapes]))
    if not checks:
        return
    try:
        flat = evaluate_static([e for _, _, exprs in checks for e in exprs])
    except Exception:  # noqa: BLE001  (one needs a free variable: check one by one)
        flat = None
    at = 0
    for obs, params, exprs in checks:
        if flat is not None:
            shapes, at = flat[at : at + len(exprs)], at + len(exprs)
        else:
            try:
                shapes = evaluate_static(exprs)
            except Exception:  # noqa: BLE001  (shapes that need free variables: not checked)
                continue
        data = tuple(int(d) for d in shapes[0])
        for p, shape in zip(params, shapes[1:], strict=True):
            shape = tuple(int(d) for d in shape)
            tail = data[len(data) - len(shape) :] if len(shape) <= len(data) else None
            if tail is None or any(a != b and a != 1 for a, b in zip(shape, tail, strict=True)):
                what = f"{p.name!r}" if p.name else "a parameter"
                raise UnsupportedModelError(
                    obs.name,
                    f"its observed data have shape {data} but {what} of its distribution has "
                    f"shape {shape}",
                    "after pm.set_data of the predictors, set the observed data to the same "
                    "length too (pm.set_data({..., 'y': y_new}), with the observed data as "
                    "pm.Data), or make the shapes agree",
                )


def check_data(model, gaussian_values, static_data=()) -> None:
    """Recognition's checks of the data, again: for data changed by ``pm.set_data``
    after the model was recognized (a fit continued with ``refine`` or ``fit``).

    Data whose shapes recognition fixed (``static_data``, the
    :attr:`~pymc_mcssvi.recognize.ir.TwoLevelModel.static_data` twins) and that
    changed shape raise ``ValueError`` (:func:`~pymc_mcssvi.recognize.graph.check_static_data`).
    NaN or infinite observations, NaN in the data a likelihood reads, and gather
    indices of the Gaussian globals (``gaussian_values``) out of range raise
    :class:`~pymc_mcssvi.UnsupportedModelError` as they do before a first fit;
    they made a continued fit's bound infinite, silently, or raised PyTensor's
    own ``IndexError``.
    """
    check_static_data(static_data)
    for obs in model.observed_RVs:
        _check_observed_data(model, obs)
    logps = model.logp(vars=list(model.observed_RVs), sum=False)
    for obs, logp in zip(model.observed_RVs, logps, strict=True):
        check_gather_indices(obs.name, logp, list(gaussian_values))


def _check_observed_data(model, obs):
    """Empty, NaN or infinite observed data; NaN in data arrays the likelihood reads;
    floats cast to integer indices that are not whole; ``pm.Minibatch`` arrays.

    Parameters may legitimately be infinite (censoring and truncation bounds),
    so only NaN is an error outside the observed values.
    """
    value = model.rvs_to_values.get(obs)
    roots = [obs] if value is None else [obs, value]
    for v in ancestors(roots):
        if v.owner is not None and isinstance(v.owner.op, MinibatchOp):
            _check_minibatch(obs, v.owner, value)
        data = None
        if isinstance(v, Constant):
            data = v.data
        elif isinstance(v, TensorSharedVariable):
            data = v.get_value(borrow=True)
        if data is None:
            continue
        data = np.asarray(data)
        if v is value and data.size == 0:
            raise UnsupportedModelError(
                obs.name,
                f"its observed data are empty (shape {data.shape}): there is nothing to fit",
                "check the data (a filter or a split that removed every row?), or remove the "
                "likelihood and use pm.sample_prior_predictive for the prior",
            )
        if data.dtype.kind != "f":
            continue
        if v is value and not np.all(np.isfinite(data)):
            raise UnsupportedModelError(
                obs.name,
                "its observed data contain NaN or infinite values",
                "remove or impute those entries before building the model",
            )
        if v is not value and data.size > 1 and np.isnan(data).any():
            raise UnsupportedModelError(
                obs.name,
                f"{_data_label(v, data)} that it depends on contains NaN values",
                "remove or impute those entries before building the model",
            )
    _check_constant_index_casts(model, obs)
    check_count_data(model, obs)


def _check_constant_index_casts(model, obs):
    """Group codes cast to integers from a float NumPy array (``a[pt.cast(g, "int64")]``)
    must be whole and finite.

    PyMC's log density folds the cast of a constant into truncated integers (2.5 became
    group 2) before :func:`~pymc_mcssvi.recognize.likelihood.check_gather_indices`
    sees it, so the model's own graph is read here; casts of ``pm.Data`` are checked
    there, on the log density.
    """
    free = set(model.free_RVs)
    for node in io_toposort(list(graph_inputs([obs])), [obs]):
        if not isinstance(node.op, AdvancedSubtensor):
            continue
        x, *index_inputs = node.inputs
        casts = [c for idx in index_inputs for c in float_to_int_casts(idx)]
        for cast in casts:
            if not isinstance(cast, Constant):
                continue
            found = [rv for rv in ancestors([x]) if rv in free]
            # the indexed variables, not their parents (a scale ``sa`` of ``a``)
            below = {p for rv in found for p in ancestors(rv.owner.inputs)}
            indexed = [rv.name for rv in found if rv not in below]
            what = f"it indexes {', '.join(map(repr, indexed))}" if indexed else "it is an index"
            check_whole(obs.name, _data_label(cast, cast.data), cast.data, what)


def _data_label(v, data) -> str:
    return f"data {v.name!r}" if v.name else f"a data array of shape {np.shape(data)}"


def _check_minibatch(obs, node, value):
    """The arrays of one ``pm.Minibatch`` call must have as many rows, and the ones the
    likelihood reads no infinite values (NaN is refused with the other data arrays).

    Rows that do not match failed in the first iteration with PyTensor's own
    ``AssertionError`` ("All variables shape[0] in Minibatch should be equal"); an
    infinite covariate or observation in the full data was fitted silently (a batch
    holding it gave a rejected step).
    """
    arrays = []
    for x in node.inputs:
        if isinstance(x, Constant):
            arrays.append(np.asarray(x.data))
        elif isinstance(x, TensorSharedVariable):
            arrays.append(np.asarray(x.get_value(borrow=True)))
        else:
            arrays.append(None)
    rows = [a.shape[0] for a in arrays if a is not None and a.ndim]
    if len(set(rows)) > 1:
        raise UnsupportedModelError(
            obs.name,
            f"the arrays of its pm.Minibatch have different numbers of rows ({', '.join(map(str, rows))})",
            "pass arrays of the same length to pm.Minibatch(X, y, batch_size=...)",
        )
    observed = {
        i for i, out in enumerate(node.outputs) if value is not None and out in ancestors([value])
    }
    for i, a in enumerate(arrays):
        if a is None or a.dtype.kind != "f" or np.all(np.isfinite(a)):
            continue
        bad = tuple(int(j) for j in np.argwhere(~np.isfinite(a))[0])
        if i in observed:
            reason = "its observed data (the full array of its pm.Minibatch) contain NaN or infinite values"
        else:
            reason = (
                f"a data array of shape {a.shape} it reads through pm.Minibatch holds "
                f"{a[bad]} (at index {bad})"
            )
        raise UnsupportedModelError(
            obs.name, reason, "remove or impute those entries before building the model"
        )


def uses_minibatch(model, obs) -> bool:
    """Whether the observed data of ``obs`` come through ``pm.Minibatch``."""
    value = model.rvs_to_values.get(obs)
    if value is None:
        return False
    return any(
        v.owner is not None and isinstance(v.owner.op, MinibatchOp) for v in ancestors([value])
    )


def _scaling(model, obs) -> str:
    if not isinstance(obs.owner.op, MinibatchRandomVariable):
        return "1"
    inner = obs.owner.inputs[0]
    total = obs.owner.inputs[1:]
    try:
        batch = int(np.prod(inner.shape.eval(mode="FAST_COMPILE")))
        tot = [
            int(np.asarray(t.eval(mode="FAST_COMPILE"))) if not isinstance(t, type(None)) else None
            for t in total
        ]
        return f"N/|M| = {tot[0]}/{batch}" if tot else "total_size"
    except Exception:
        return "total_size (minibatch)"


# ------------------------------------------------------------------ prior terms
def _prior_term(model, g: GaussianGlobal, gvalues, gshapes):
    """Gaussian prior of ``g`` as a whitened residual plus its normalizer.

    A non-Gaussian prior on the real line (``g.prior`` not ``"normal"``,
    ``"mvnormal"`` or ``"zerosum"``) becomes a predictor term in ``g`` with its
    own log density, whose expectations the bound computes by quadrature. A
    ``ZeroSumNormal``'s unconstrained value is ``N(0, sigma^2)`` entrywise
    (:mod:`~pymc_mcssvi.recognize.zerosum`).
    """
    if g.prior not in ("normal", "mvnormal", "zerosum", "icar", "car", "randomwalk", "ar"):
        return _non_gaussian_prior_term(model, g, gvalues, gshapes)
    params = model.replace_rvs_by_values(dist_params(g.rv))
    value = g.value
    if g.prior in ("randomwalk", "ar"):
        resid, const = series_residuals(g, value, params)
    elif g.prior == "icar":
        resid, const = _icar_residuals(value, params)
    elif g.prior == "car":
        resid, const = _car_residuals(value, params)
    elif g.prior in ("normal", "zerosum"):
        mu, (sigma, *_) = loc_and_others(g.rv, params)
        mu, sigma = as_float(mu), as_float(sigma)
        sigma_b = pt.broadcast_to(sigma, shape64(g.shape))
        resid = pt.broadcast_to((value - mu) / sigma, shape64(g.shape))
        const = -pt.sum(pt.log(sigma_b))
    else:
        mu, cov = (as_float(p) for p in params)
        chol = pt.linalg.cholesky(cov, lower=True)
        k = g.shape[-1]
        chol_inv = pt.linalg.solve_triangular(
            chol, pt.broadcast_to(pt.eye(k), chol.shape), lower=True
        )
        centered = pt.broadcast_to(value - mu, shape64(g.shape))
        resid = pt.matmul(chol_inv, centered[..., None])[..., 0]
        logdiag = pt.log(pt.diagonal(chol, axis1=-2, axis2=-1))
        const = -pt.sum(pt.broadcast_to(logdiag, shape64(g.shape)))
    form = linearize(resid, gvalues, gshapes)
    if form is None:  # pragma: no cover - roles guarantee an affine location
        raise UnsupportedModelError(
            g.name, "its prior mean is not affine in the other Gaussian variables"
        )
    eta_shape = resid.type.shape if g.prior in ("icar", "randomwalk", "ar") else tuple(g.shape)
    term = PredictorTerm(
        name=f"prior of {g.name}",
        eta_shape=eta_shape,
        offset=form.offset,
        terms=flatten_terms(form.terms, eta_shape),
        placeholder=None,
        logp=None,
        gaussian=True,
        kind="prior",
    )
    return term, ConstantTerm(f"normalizer of {g.name}", const)


def _constant_data(x, name):
    """The value of a constant adjacency matrix (dense, sparse, or with expanded dims)."""
    while x.owner is not None and len(x.owner.inputs) == 1:  # DimShuffle, DenseFromSparse
        x = x.owner.inputs[0]
    data = getattr(x, "data", None)
    if isinstance(x, Constant) and hasattr(data, "toarray"):  # a scipy.sparse matrix
        return np.asarray(data.toarray())
    if not isinstance(x, Constant):
        raise UnsupportedModelError(
            name,
            "its adjacency matrix W is not a constant array (sparse or symbolic)",
            "pass W as a dense NumPy array of 0s and 1s",
        )
    return np.asarray(x.data)


def _icar_residuals(value, params):
    """``pm.ICAR(W, sigma, zero_sum_stdev)``: PyMC's log density is
    ``-sum_edges (phi_i - phi_j)^2 / (2 sigma^2)`` plus a soft sum-to-zero term
    ``log N(sum(phi) / N; 0, zero_sum_stdev)``: the whitened residuals are the
    edges' scaled differences and the scaled sum (an improper prior made proper by
    the soft constraint, with no ``log sigma`` normalizer, as PyMC writes it).
    Returns the residuals and the constant that makes their standard-normal log
    densities add up to PyMC's."""
    W, sigma, zero_sum_sd = params
    W = _constant_data(W, "ICAR")
    node1, node2 = np.nonzero(np.tril(W) == 1)
    n = W.shape[-1]
    sigma, zero_sum_sd = as_float(sigma), as_float(zero_sum_sd)
    diff = (value[node1] - value[node2]) / sigma
    total = pt.sum(value) / (zero_sum_sd * n)
    resid = pt.specify_shape(pt.concatenate([diff, total[None]]), (len(node1) + 1,))
    const = -pt.log(zero_sum_sd * n) + 0.5 * len(node1) * np.log(2 * np.pi)
    return resid, const


def _car_residuals(value, params):
    """``pm.CAR(mu, W, alpha, tau)``: Gaussian with precision ``Q = tau (D - alpha W)``
    (``D`` the neighbour counts); residuals ``L^T (phi - mu)`` with ``Q = L L^T``, and
    the constant that makes their standard-normal log densities add up to PyMC's
    ``(log det Q - sum log D - (phi - mu)^T Q (phi - mu)) / 2`` (which leaves out the
    constants ``sum log D`` and ``n log 2 pi``)."""
    mu, W, alpha, tau = params[:4]
    W = _constant_data(W, "CAR").astype("float64")
    D = W.sum(axis=0)
    alpha, tau = as_float(alpha), as_float(tau)
    Q = tau * (pt.as_tensor(np.diag(D)) - alpha * pt.as_tensor(W))
    L = pt.linalg.cholesky(Q, lower=True)
    resid = pt.dot(L.T, value - as_float(mu))
    n = W.shape[-1]
    const = (
        pt.sum(pt.log(pt.diagonal(L)))
        - 0.5 * float(np.sum(np.log(D)))
        + 0.5 * n * np.log(2 * np.pi)
    )
    return resid, const


def _non_gaussian_prior_term(model, g: GaussianGlobal, gvalues, gshapes):
    """``log p(g | ...)`` entrywise, as a predictor term (and a zero normalizer)."""
    logp = remove_checks(model.logp(vars=[g.rv], jacobian=False, sum=False)[0])
    term = likelihood_term(f"prior of {g.name}", logp, gvalues, gshapes)
    if term is None:  # pragma: no cover - roles guarantee an affine location
        raise UnsupportedModelError(
            g.name, f"its {g.prior} prior is not a function of one affine predictor entrywise"
        )
    term.kind = "prior"
    return term, ConstantTerm(f"normalizer of {g.name}", pt.constant(0.0))


def _check_marginal_finite(logp, lc, obs, point):
    """The marginal over a Gaussian local must be finite for every observation.

    A likelihood with a restricted parameter (a Poisson rate ``f`` without a
    positive link, a Beta mean ...) gets ``log 0`` at the quadrature nodes that
    fall outside its support: the Gaussian local cannot be integrated out.
    """

    inputs = [v for v in graph_inputs([logp]) if not isinstance(v, Constant | TensorSharedVariable)]
    try:
        fn = pytensor.function(inputs, logp, mode="FAST_COMPILE", on_unused_input="ignore")
        vals = fn(*[point[v] for v in inputs])
    except Exception:
        return
    if not np.all(np.isfinite(vals)):
        raise UnsupportedModelError(
            lc.name,
            f"it is a Gaussian local of {obs.name!r}, but the log density of {obs.name!r} is not finite over the "
            "real line of the local (quadrature nodes fall outside the likelihood's support)",
            f"map {lc.name!r} into the support with a link (e.g. pm.math.exp or pm.math.log1pexp for a rate)",
        )


def _joint_blocks(terms: list[PredictorTerm], gaussians) -> list[list[int]]:
    """Globals gathered by the same grouping index in one likelihood term.

    Two globals with the same number of rows share a block segment when, for
    every observation, they are read at the same row (``a[g]`` and ``b[g] * x``).
    """
    groups = []
    for t in terms:
        if t.kind != "likelihood":
            continue
        gathered = [tt for tt in t.terms if not tt.is_dense and gaussians[tt.source].shape]
        by_rows: dict[int, list] = {}
        for tt in gathered:
            by_rows.setdefault(gaussians[tt.source].shape[0], []).append(tt)
        for tts in by_rows.values():
            sources = sorted({tt.source for tt in tts})
            if len(sources) < 2:
                continue
            same = _same_rows(tts, gaussians)
            for grp in same:
                if len(grp) > 1 and grp not in groups:
                    groups.append(grp)
    return groups


#: A small grouping factor read together with a large one counts as crossed with it
#: (:func:`_crossed_factors`) when the large factor's levels have fewer rows than this
#: on average. Gaussian data, 300 students crossed with 60 lecturers: with 2, 4 and 8
#: ratings per student the arrow q put sigma_s 1.05, 0.38 and 0.15 posterior sds below
#: one full covariance's (which matched NUTS); a logistic GLMM with 1,500 groups of 6.7
#: rows crossed with 8 levels gave the same scales with both (5.9 s with the arrow,
#: 70 s with the full covariance). ``benchmarks/crossed_scales.py``.
SPARSE_ROWS_PER_LEVEL = 5


def _crossed_factors(
    terms: list[PredictorTerm], gaussians, joint, minibatch: bool = False
) -> set[int]:
    """Ids of the effect vectors that one likelihood term gathers at different rows:
    crossed or nested grouping factors, coupled through every observation that reads
    both. Empty when there are none.

    Two large factors (more than :data:`~pymc_mcssvi.recognize.layout.SMALL_GLOBAL`
    entries) always count. A small factor read with one large factor counts when the
    large one has few rows per level (:data:`SPARSE_ROWS_PER_LEVEL`): the arrow q
    (:mod:`~pymc_mcssvi.algorithms.arrow`) would put the small factor's effects in
    its head and the large one's in independent blocks, and the bound with q's
    blocks independent pulls the large factor's scale down where few rows tie its
    effects to the data. With ``pm.Minibatch`` the index holds one
    batch, whose rows per level say nothing of the data's: the rule is not applied."""
    out: set[int] = set()
    for t in terms:
        if t.kind != "likelihood":
            continue
        factors: dict[tuple, list] = {}
        for tt in t.terms:
            g = gaussians[tt.source]
            if tt.is_dense or not g.shape or g.size < 2:
                continue
            grp = next((tuple(j) for j in joint if tt.source in j), (tt.source,))
            factors.setdefault(grp, []).append(tt)
        large = [grp for grp in factors if any(gaussians[i].size > SMALL_GLOBAL for i in grp)]
        if len(factors) < 2 or not large:
            continue
        sparse = (
            len(large) == 1
            and not minibatch
            and any(_rows_per_level(tt) < SPARSE_ROWS_PER_LEVEL for tt in factors[large[0]])
        )
        if len(large) > 1 or sparse:
            out.update(i for grp in factors for i in grp)
    return out


def _rows_per_level(term) -> float:
    """Mean number of rows per level a gather reads (infinite when its index is not
    fixed data)."""

    try:
        (cols,) = evaluate_static([term.cols])
    except MissingInputError:  # an index that depends on free variables
        return np.inf
    cols = np.asarray(cols).ravel()
    return cols.size / max(np.unique(cols).size, 1)


#: What the independent segments of crossed factors cost, measured (:func:`_split_crossed`).
SPLIT_CROSSED_NOTE = (
    "The Gaussian q keeps the effects of crossed (or nested) grouping factors {names} in independent "
    "segments ({dim} Gaussian dimensions; the automatic layout keeps one full covariance "
    "over crossed factors up to {limit}), "
    "so the coupling the data put between them is lost from q: where few observations "
    "per group tie the factors together, the factors' learned scales come out too small "
    "and their effects' sds too narrow (a 5,000-row subsample of lme4 InstEval, "
    "students x lecturers with 2.3 ratings per student: sigma_s 0.17 +- 0.06 where NUTS "
    "gives 0.30 +- 0.04 and the exact marginal likelihood peaks at 0.31; with all 73,421 "
    "rows, 25 ratings per student, sigma_s and sigma_d are within 1.2% of the marginal "
    "likelihood's maximum but sigma_dept, 14 departments, comes out 0.008 against its "
    "0.077). Check such a fit against pm.sample() on a subsample"
)


def _split_crossed(gaussians, segments, crossed: set[int]) -> tuple[str, ...]:
    """Names of the crossed factors' effect vectors when q puts them in more than one
    segment (empty when one full covariance keeps them together)."""
    if not crossed:
        return ()
    seg_of = {gid: s for s, seg in enumerate(segments) for gid in seg.members}
    if len({seg_of[i] for i in crossed}) < 2:
        return ()
    return tuple(gaussians[i].name for i in sorted(crossed))


#: Priors of an effect vector under which its entries are independent given the
#: hyperparameters (an MvNormal: its rows), so that the arrow keeps their posterior.
_ROW_INDEPENDENT_PRIORS = (
    "normal",
    "mvnormal",
    "flat",
    *(v[0] for v in NON_GAUSSIAN_PRIORS.values()),
)


def _arrow_suffices(terms: list[PredictorTerm], gaussians) -> bool:
    """Whether the arrow q keeps the posterior's structure given the hyperparameters.

    True when the effect vectors larger than :data:`~pymc_mcssvi.recognize.layout.SMALL_GLOBAL`
    (the body) have row-independent priors and every likelihood reads them through
    gathers only (no dense design, no spatial or time-series prior coupling their
    entries), and the other globals (the head) fit
    :data:`~pymc_mcssvi.algorithms.arrow.ARROW_MAX_HEAD`. The caller has checked that
    no observation reads two grouping factors at different rows and that no term is
    general or bilinear.
    """
    body = {i for i, g in enumerate(gaussians) if g.size > SMALL_GLOBAL}
    if not body or any(gaussians[i].prior not in _ROW_INDEPENDENT_PRIORS for i in body):
        return False
    if any(len(gaussians[i].shape) > 2 for i in body):
        return False
    if any(gaussians[i].prior == "mvnormal" and len(gaussians[i].shape) == 1 for i in body):
        # one MvNormal over the whole vector (a GP's values): its covariance couples
        # every entry, which neither the arrow's body nor a diagonal q keeps
        return False
    for t in terms:
        if t.kind != "likelihood":
            # a prior mean in another large effect vector (counties within many states)
            # couples two body segments, which the arrow does not keep
            if len({tt.source for tt in t.terms} & body) > 1:
                return False
            continue
        reads = [tt for tt in t.terms if tt.source in body]
        if any(tt.is_dense for tt in reads):
            return False
        for src in {tt.source for tt in reads}:
            if not _one_row_per_observation([tt for tt in reads if tt.source == src], gaussians):
                return False
    head = sum(g.size for i, g in enumerate(gaussians) if i not in body)
    return 0 < head <= ARROW_MAX_HEAD


def _one_row_per_observation(tts, gaussians) -> bool:
    """Whether the gathers ``tts`` of one global read, for every observation, entries of
    a single row (the same one in every term), and not all observations the same row.

    False for ``a[home] - a[away]`` (two rows per observation: their posterior is
    coupled) and for effects stored ``(effects, groups)`` (a row is an effect, read by
    every observation).
    """
    rows = _gather_rows(tts, gaussians)
    if rows is None:
        return False
    first = None
    for r in rows:
        r = np.asarray(r).reshape(r.shape[0], -1) if np.ndim(r) > 1 else np.asarray(r)[:, None]
        if np.any(r != r[:, :1]):
            return False
        if first is None:
            first = r[:, 0]
        elif r.shape[0] != first.shape[0] or np.any(r[:, 0] != first):
            return False
    return first is not None and np.unique(first).size > 1


def _gather_rows(tts, gaussians) -> list[np.ndarray] | None:
    """The rows of its global each gather term reads, per observation (its flat
    columns over the global's row width), or ``None`` when they depend on free
    variables."""

    exprs = []
    for tt in tts:
        g = gaussians[tt.source]
        exprs.append(tt.cols // (g.size // g.shape[0]))
    try:
        return evaluate_static(exprs)
    except pytensor.graph.fg.MissingInputError:
        return None


def _same_rows(tts, gaussians):
    """Partition the sources of gather terms by identical per-observation rows."""
    rows = _gather_rows(tts, gaussians)
    if rows is None:
        return []  # rows that depend on free variables: nothing to join
    groups: list[list[int]] = []
    reps: list[np.ndarray] = []
    for tt, r in zip(tts, (np.asarray(r)[:, 0] for r in rows), strict=True):
        for grp, rep in zip(groups, reps, strict=True):
            if rep.shape == r.shape and np.array_equal(rep, r):
                if tt.source not in grp:
                    grp.append(tt.source)
                break
        else:
            groups.append([tt.source])
            reps.append(np.asarray(r))
    return [sorted(g) for g in groups]
