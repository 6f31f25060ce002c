"""Recognition of an observed variable as an ordered list of rules.

Each observed variable (its log density already marginalized over its local, if
it has one) is offered to :data:`RULES` in order; the first rule that returns a
:class:`Claim` decides its term. A rule is a pure function of an
:class:`Observed` record and the :class:`Globals` it may depend on: it either
returns ``None`` (not its form) or a claim naming the term(s) and ``describe``'s
form. Adding a family means adding one rule and one term type, not editing the
recognizer.

The order is the order of preference: the cheapest exact estimator first (a
constant, an affine predictor), the Monte Carlo + autodiff path last.

Examples
--------
>>> [rule.__name__ for rule in RULES]  # doctest: +NORMALIZE_WHITESPACE
['constant', 'gather_indices_in_range', 'whitened_mvnormal_outcome',
 'multivariate', 'affine_predictor', 'two_affine_predictors', 'bilinear',
 'general']
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pymc as pm
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Constant, Variable
from pytensor.graph.traversal import ancestors, graph_inputs, io_toposort

from pymc_mcssvi.exceptions import UnsupportedModelError
from pymc_mcssvi.recognize.graph import checks_to_ninf, depends_on_any, evaluate_static
from pymc_mcssvi.recognize.ir import (
    BilinearTerm,
    ConstantTerm,
    GeneralTerm,
    LocalLatent,
    PairTerm,
    PredictorTerm,
)
from pymc_mcssvi.recognize.likelihood import (
    bilinear_term,
    check_gather_indices,
    find_bilinear,
    form_name,
    likelihood_term,
    pair_term,
)
from pymc_mcssvi.recognize.marks import scored_predictive
from pymc_mcssvi.recognize.roles import base_op
from pymc_mcssvi.recognize.whiten import whitened_mvnormal

__all__ = [
    "BILINEAR_PLUS",
    "MIXED_BILINEAR",
    "PAIR_FORM",
    "RULES",
    "Claim",
    "Globals",
    "Observed",
    "RecognizedTerms",
    "classify",
]

#: ``describe``'s form (and the general term's reason) of a bilinear product with
#: other terms of the globals next to it.
MIXED_BILINEAR = "general (bilinear + other terms)"
#: ``describe``'s form of a likelihood with two affine predictors (:class:`PairTerm`).
PAIR_FORM = "two affine predictors"
#: ``describe``'s form of a bilinear product plus terms affine in other globals.
BILINEAR_PLUS = "bilinear + affine"


@dataclass(frozen=True)
class Globals:
    """What the rules may read about the Gaussian globals.

    Attributes
    ----------
    model : pm.Model
    values : dict
        Value variable of each Gaussian global -> its id.
    shapes : dict
        Value variable -> shape.
    point : dict
        Value variable -> its value at the model's initial point (for the rules
        that test a form numerically, e.g. elementwise in a predictor).
    """

    model: pm.Model
    values: dict
    shapes: dict
    point: dict


@dataclass(frozen=True)
class Observed:
    """One observed variable, as the rules see it.

    Attributes
    ----------
    rv : Variable
        The observed random variable.
    logp : Variable
        Its log density, marginalized over its local if it has one.
    local : LocalLatent or None
        The local latent marginalized out of ``logp``.
    scaling : str
        Its likelihood scaling (``"1"`` unless minibatched).
    """

    rv: Variable
    logp: Variable
    local: LocalLatent | None = None
    scaling: str = "1"

    @property
    def name(self) -> str:
        return self.rv.name

    @property
    def multivariate(self) -> bool:
        """Whether its distribution has a support dimension (Multinomial, MvNormal)."""
        return getattr(base_op(self.rv)[0], "ndim_supp", 0) > 0

    @property
    def suffix(self) -> str:
        """``describe``'s note on the local marginalized out of it."""
        if self.local is None:
            return ""
        if self.local.kind == "gaussian":
            return f", through local {self.local.name!r}"
        return f", with discrete local {self.local.name!r}"


@dataclass(frozen=True)
class Claim:
    """A rule's decision: the term(s) of one observed variable.

    Exactly one of ``predictor``, ``pair``, ``bilinear``, ``general`` is set,
    or none when the variable only adds ``constants``.

    Attributes
    ----------
    form : str
        ``describe``'s form of the variable.
    constants : tuple of ConstantTerm
        Terms that do not involve the Gaussian globals (a whitened MvNormal's
        normalizer, a likelihood free of the globals).
    row_sources : frozenset of int
        Gaussian globals read as rows of a product (their blocks are rows).
    """

    form: str
    predictor: PredictorTerm | None = None
    pair: PairTerm | None = None
    bilinear: BilinearTerm | None = None
    general: GeneralTerm | None = None
    constants: tuple = ()
    row_sources: frozenset = frozenset()


Rule = Callable[[Observed, Globals], "Claim | None"]


# --------------------------------------------------------------------- the rules
def constant(obs: Observed, g: Globals) -> Claim | None:
    """A log density that does not involve the Gaussian globals is added as is."""
    if depends_on_any(obs.logp, g.values):
        return None
    return Claim(
        "constant (no Gaussian global)" + obs.suffix,
        constants=(ConstantTerm(obs.name, obs.logp),),
    )


def gather_indices_in_range(obs: Observed, g: Globals) -> Claim | None:
    """Never claims: refuses index arrays that gather outside a global's rows
    (:class:`~pymc_mcssvi.UnsupportedModelError`) before any form is tried."""
    check_gather_indices(obs.name, obs.logp, g.values)
    return None


def whitened_mvnormal_outcome(obs: Observed, g: Globals) -> Claim | None:
    """An MvNormal outcome with a mean affine in the globals and a fixed covariance is
    an elementwise Gaussian likelihood after whitening by its Cholesky factor."""
    if not obs.multivariate or obs.local is not None or obs.scaling != "1":
        return None
    white = whitened_mvnormal(g.model, obs.rv, g.values)
    if white is None:
        return None
    term = likelihood_term(obs.name, white[0], g.values, g.shapes, g.point)
    if term is None:
        return None
    return Claim(
        form_name(term) + " (MvNormal, whitened)" + obs.suffix,
        predictor=term,
        constants=(ConstantTerm(f"normalizer of {obs.name}", white[1]),),
    )


def multivariate(obs: Observed, g: Globals) -> Claim | None:
    """Any other multivariate outcome (a Multinomial's counts, an MvNormal with a
    covariance of the globals) is not elementwise in a predictor: its log density over
    the support goes to Monte Carlo + autodiff."""
    if not obs.multivariate:
        return None
    op = base_op(obs.rv)[0]
    return _general(obs, g, f"general ({type(op).__name__}: multivariate)" + obs.suffix)


def affine_predictor(obs: Observed, g: Globals) -> Claim | None:
    """Elementwise in one predictor affine in the globals (GLMs, mixed models, GME):
    the affine estimator's exact moments or quadrature."""
    term = likelihood_term(obs.name, obs.logp, g.values, g.shapes, g.point)
    if term is None:
        return None
    check_finite_predictor(obs.name, term)
    if scored_predictive(obs.rv):
        term = dataclasses.replace(term, predictive=True)
        return Claim(form_name(term) + " (predictive score)" + obs.suffix, predictor=term)
    return Claim(form_name(term) + obs.suffix, predictor=term)


def two_affine_predictors(obs: Observed, g: Globals) -> Claim | None:
    """Elementwise in two predictors affine in disjoint globals (a location and a
    log-scale regression): two-dimensional quadrature."""
    if obs.local is not None:
        return None
    pair = pair_term(obs.name, obs.logp, g.values, g.shapes)
    if pair is None:
        return None
    return Claim(PAIR_FORM + obs.suffix, pair=pair)


def bilinear(obs: Observed, g: Globals) -> Claim | None:
    """Elementwise in a row-wise product of two gathered factors (matrix
    factorization), possibly plus terms affine in other globals."""
    bil = bilinear_term(obs.name, obs.logp, g.values, g.shapes, g.point)
    if bil is None:
        return None
    form = "bilinear" if bil.affine is None else BILINEAR_PLUS
    return Claim(form + obs.suffix, bilinear=bil, row_sources=frozenset({bil.left, bil.right}))


def general(obs: Observed, g: Globals) -> Claim:
    """Everything else: Monte Carlo + autodiff over the globals it reads. A bilinear
    product next to other terms of the globals (row and column biases) lands here,
    with its factors' blocks laid out as rows."""
    found = find_bilinear(obs.logp, g.values, g.shapes)
    if found is None:
        return _general(obs, g, "general" + obs.suffix)
    rows = frozenset(found[1].sources | found[2].sources)
    return _general(obs, g, MIXED_BILINEAR + obs.suffix, row_sources=rows)


#: The rules, in order of preference; ``general`` always claims.
RULES: tuple[Rule, ...] = (
    constant,
    gather_indices_in_range,
    whitened_mvnormal_outcome,
    multivariate,
    affine_predictor,
    two_affine_predictors,
    bilinear,
    general,
)


def classify(obs: Observed, g: Globals, rules=RULES) -> Claim:
    """The first claim of ``rules`` on ``obs``."""
    for rule in rules:
        claim = rule(obs, g)
        if claim is not None:
            if scored_predictive(obs.rv) and (
                claim.predictor is None or not claim.predictor.predictive
            ):
                raise UnsupportedModelError(
                    obs.name,
                    f"it is marked to be scored by its predictive density, which needs one "
                    f"predictor affine in the Gaussian globals (it is {claim.form})",
                    "score it by the bound (drop the mark), or write its mean affine in the "
                    "Gaussian globals",
                )
            return claim
    raise AssertionError(f"no rule claimed {obs.name!r}: the last rule must always claim")


# ------------------------------------------------------------------ collecting
@dataclass
class RecognizedTerms:
    """The claims of all observed variables, by term type, in the model's order."""

    predictor: list = field(default_factory=list)
    pair: list = field(default_factory=list)
    bilinear: list = field(default_factory=list)
    general: list = field(default_factory=list)
    constant: list = field(default_factory=list)
    forms: dict = field(default_factory=dict)
    row_sources: set = field(default_factory=set)
    by_column: set = field(default_factory=set)

    def add(self, name: str, claim: Claim) -> None:
        """Record ``claim`` as the term(s) of observed variable ``name``."""
        for kind in ("predictor", "pair", "bilinear", "general"):
            term = getattr(claim, kind)
            if term is not None:
                getattr(self, kind).append(term)
        self.constant.extend(claim.constants)
        self.forms[name] = claim.form
        self.row_sources |= claim.row_sources
        if claim.bilinear is not None:  # factors stored (K, rows): blocks are columns
            self.by_column |= claim.bilinear.transposed


# ------------------------------------------------------------------ helpers
def check_finite_predictor(name: str, term: PredictorTerm) -> None:
    """Refuse an infinite covariate or offset of an affine predictor, naming the data.

    An ``inf`` in ``X`` made the bound not finite at the start, and the error blamed
    the observed data's support (with NumPy's "invalid value" warnings). NaN is refused
    before (with the observed data's checks); coefficients that need a free variable's
    value are not checked here.
    """
    parts = [t.vals for t in term.terms if t.vals is not None]
    if term.offset is not None:
        parts.append(term.offset)
    for part in parts:
        try:
            (value,) = evaluate_static([part])
        except Exception:  # noqa: BLE001  (reads a free variable: not a data array)
            continue
        value = np.asarray(value)
        if np.all(np.isfinite(value)):
            continue
        bad = np.argwhere(~np.isfinite(value))[0]
        what = "an array of the predictor"
        for v in ancestors([part]):
            data = v.data if isinstance(v, Constant) else None
            if isinstance(v, SharedVariable):
                data = v.get_value(borrow=True)
            if data is not None and np.size(data) > 1 and not np.all(np.isfinite(data)):
                what = f"data {v.name!r}" if v.name else f"a data array of shape {np.shape(data)}"
                break
        raise UnsupportedModelError(
            name,
            f"{what} in its predictor holds {value[tuple(bad)]} (at index {tuple(int(i) for i in bad)})"
            ": the predictor is not finite there",
            "remove or impute those entries (or rescale the covariate) before building the model",
        )


def _general(obs: Observed, g: Globals, form: str, row_sources=frozenset()) -> Claim:
    _warn_scan_in_general_term(obs.name, obs.logp, g.values)
    # a failed parameter check is -inf (the candidate is rejected) inside scans too
    logp = checks_to_ninf(obs.logp)
    return Claim(form, general=GeneralTerm(obs.name, logp, form), row_sources=row_sources)


def _warn_scan_in_general_term(name, logp, gvalues):
    """Warn when a Monte Carlo + autodiff term runs a ``pytensor.scan`` over the
    Gaussian globals: its derivatives, batched over draws and sigma points, loop in
    Python (an AR(1) trend of 4 x 30 points written with ``scan``: 122 s for two
    iterations, where NUTS took 20 s for the whole fit)."""
    for node in io_toposort(list(graph_inputs([logp])), [logp]):
        if type(node.op).__name__ == "Scan" and any(
            depends_on_any(x, gvalues) for x in node.inputs
        ):
            warnings.warn(
                f"The likelihood {name!r} runs a pytensor.scan over the Gaussian globals: the "
                "Monte Carlo + autodiff path evaluates its derivatives in Python, draw by draw, "
                "which can take many minutes. Write the recursion as a linear map where it is "
                "one (a random walk is pt.cumsum of the innovations; an AR(1) with a known "
                "coefficient is a triangular matrix of its powers times them), or fit this "
                "model with pm.sample().",
                UserWarning,
                stacklevel=6,
            )
            return
