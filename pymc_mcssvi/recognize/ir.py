"""The engine's intermediate representation of a two-level PyMC model.

:func:`pymc_mcssvi.recognize.recognize` turns a ``pm.Model`` into a
:class:`TwoLevelModel`. Everything downstream (estimators, bounds, algorithms,
the PyMC adapter) reads only this representation, never the PyMC graph itself.

The bound of the paper (eq. vlb / vlbi) is split into

* :class:`PredictorTerm` -- a sum of elementwise log densities that depends on the
  Gaussian globals only through an affine predictor (likelihoods of GLMs and
  GLMMs, and the Gaussian prior of the globals written as a whitened residual);
  its expectation, gradient ``g`` and Hessian ``H`` are formed in predictor space;
* :class:`GeneralTerm` -- any other log density of the globals, handled by Monte
  Carlo with automatic differentiation;
* :class:`ConstantTerm` -- log densities that do not involve the Gaussian globals
  (priors of hyperparameters, ``-log sigma`` normalizers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pytensor.graph.basic import Variable

from pymc_mcssvi.recognize.affine import LinearTerm

__all__ = [
    "BilinearTerm",
    "ConstantTerm",
    "GaussianGlobal",
    "GeneralTerm",
    "Hyperparameter",
    "LocalLatent",
    "PairTerm",
    "PredictiveLeaf",
    "PredictorTerm",
    "RayleighGlobal",
    "Segment",
    "TwoLevelModel",
]

CovStructure = Literal["full", "block", "diag"]


@dataclass
class GaussianGlobal:
    """A free RV with a Gaussian prior, approximated by the structured Gaussian q.

    Attributes
    ----------
    name : str
        Name of the PyMC random variable.
    rv, value : TensorVariable
        The random variable and its value variable (untransformed).
    shape : tuple of int
        Static shape of the variable.
    prior : {"normal", "mvnormal", "zerosum", "icar", "car", "flat", "studentt", \
"laplace", "cauchy", "logistic", "gumbel", "moyal", "asymmetriclaplace", "skewstudentt"}
        Family of the prior as written in the model. The Gaussian ones (with the
        spatial ``pm.ICAR`` and ``pm.CAR``) enter the bound as whitened residuals
        (closed form); ``pm.Flat`` (log density 0) enters not at all; the others
        as a one-dimensional log density term in the variable, like a likelihood.
    """

    name: str
    rv: Variable
    value: Variable
    shape: tuple[int, ...]
    prior: str

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=int))


@dataclass
class RayleighGlobal:
    """A free RV with a Rayleigh prior (``pymc_mcssvi.Rayleigh`` or ``pm.Weibull(alpha=2)``).

    Attributes
    ----------
    prior_scale : TensorVariable
        The prior scale ``tau`` as a graph of value variables (hyperparameters).
    """

    name: str
    rv: Variable
    value: Variable
    shape: tuple[int, ...]
    prior_scale: Variable

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=int))


@dataclass
class LocalLatent:
    """A latent with one entry per observation of one observed variable.

    Attributes
    ----------
    kind : {"gaussian", "discrete"}
        Marginalized by quadrature (or exactly) / by enumeration of ``support`` values.
    observed : str
        The observed variable that uses it elementwise.
    """

    name: str
    rv: Variable
    value: Variable
    shape: tuple[int, ...]
    kind: str
    observed: str
    support: int | None = None


@dataclass
class PredictiveLeaf:
    """A free RV that nothing in the model depends on: a prediction written into the
    model (``pm.Poisson("y_new", mu_new)``) or PyMC's ``<name>_unobserved`` for missing
    observations.

    Its factor of the posterior is its prior given the other variables, so the fit
    leaves it out (it integrates to one in the bound) and ``approx.sample`` draws it
    from that conditional at each draw of the others: exactly, for any distribution.
    """

    name: str
    rv: Variable
    value: Variable
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=int))


@dataclass
class Hyperparameter:
    """A free RV that is neither a Gaussian global nor a marginalized local."""

    name: str
    rv: Variable
    value: Variable
    shape: tuple[int, ...]
    reason: str = ""

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=int))


@dataclass
class Segment:
    """A factor of the Gaussian q: ``rows`` independent blocks of size ``k``.

    ``kind="full"`` is a single block over all its members; ``"block"`` has one
    ``k x k`` block per leading index (row) of its members; ``"diag"`` has ``k=1``.

    Attributes
    ----------
    members : list of int
        Ids of the :class:`GaussianGlobal` objects this segment covers.
    row_of, col_of : dict[int, np.ndarray]
        For each member, the block row and within-block column of every entry of
        the member's flattened value.
    """

    kind: CovStructure
    rows: int
    k: int
    members: list[int]
    row_of: dict[int, np.ndarray] = field(default_factory=dict)
    col_of: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def dim(self) -> int:
        return self.rows * self.k


@dataclass
class PredictorTerm:
    """``sum(l(eta))`` with ``eta`` affine in the Gaussian globals.

    Attributes
    ----------
    name : str
        The observed variable (or ``"prior of <global>"``) this term comes from.
    eta_shape : tuple
        Symbolic shape of the predictor.
    offset : TensorVariable or None
        Part of ``eta`` that does not depend on the globals (may depend on
        hyperparameters).
    terms : list of LinearTerm
        Linear part, leading axes flattened to one (rows) axis.
    placeholder : TensorVariable
        Stand-in for ``eta`` inside :attr:`logp`.
    logp : TensorVariable
        Elementwise log density as a function of :attr:`placeholder` (and of the
        hyperparameter value variables).
    gaussian : bool
        True when ``logp`` is the standard normal log density of ``eta`` (the
        whitened prior residual): expectations are then exact and closed form.
    smooth : bool
        False when ``logp`` has kinks or jumps in ``eta`` (``abs``, ``switch``
        on ``eta``...): its expected Hessian is then computed from ``l'`` by
        Stein's lemma (see :func:`~pymc_mcssvi.estimators.quadrature.expected_derivatives`).
    predictive : bool
        True when the observed variable is scored by its predictive density
        ``log E_q[exp(l(eta))]`` (:func:`~pymc_mcssvi.recognize.marks.predictive`, the
        paper's sparse-GP variant V2) instead of ``E_q[l(eta)]``.
    """

    name: str
    eta_shape: tuple
    offset: Variable | None
    terms: list[LinearTerm]
    placeholder: Variable | None
    logp: Variable | None
    gaussian: bool = False
    kind: str = "likelihood"
    form: str = ""
    smooth: bool = True
    predictive: bool = False


@dataclass
class BilinearTerm:
    """``sum(l(f))`` with ``f_n = U[left_rows[n]] . V[right_rows[n]]`` (matrix factorization).

    Attributes
    ----------
    left, right : int
        Ids of the Gaussian globals ``U`` (rows x K) and ``V`` (columns x K).
    left_rows, right_rows : TensorVariable
        Integer row indices, one per observation.
    placeholder, logp
        Elementwise log density as a function of the predictor: the product
        ``f``, plus :attr:`affine` when there is one.
    affine : PredictorTerm or None
        Terms added to the product that are affine in the other Gaussian
        globals (row and column biases, an intercept, fixed effects): the
        predictor is ``f + affine`` (its ``logp`` and ``placeholder`` are unused).
    transposed : frozenset of int
        The factors stored as ``(K, rows)`` (a factor analysis' ``W @ F`` with
        ``F`` of shape ``(K, n)``): their blocks are columns.
    """

    name: str
    left: int
    right: int
    left_rows: Variable
    right_rows: Variable
    placeholder: Variable
    logp: Variable
    affine: PredictorTerm | None = None
    transposed: frozenset = frozenset()


@dataclass
class PairTerm:
    """``sum(l(eta_1, eta_2))`` with two predictors affine in the Gaussian globals.

    A likelihood with a second parameter that is also a regression (a distributional
    model: ``Normal(X @ b, exp(Z @ c))``, bambi's ``sigma ~ x``).

    Attributes
    ----------
    name : str
        The observed variable.
    placeholders : tuple of TensorVariable
        Stand-ins for ``eta_1`` and ``eta_2`` inside :attr:`logp` (same shape).
    logp : TensorVariable
        Elementwise log density: entry ``n`` reads entry ``n`` of each placeholder.
    parts : tuple of PredictorTerm
        ``eta_1``, ``eta_2`` and their sum as affine predictors (only their terms,
        offsets and shape are used): the expected Hessian's cross term between the
        two predictors is written with the sum's (polarization,
        :meth:`~pymc_mcssvi.bounds.structured.StructuredBound.evaluate`).
    """

    name: str
    placeholders: tuple
    logp: Variable
    parts: tuple


@dataclass
class GeneralTerm:
    """A log density handled by Monte Carlo and automatic differentiation."""

    name: str
    logp: Variable
    reason: str = ""


@dataclass
class ConstantTerm:
    """A log density that does not depend on the Gaussian globals."""

    name: str
    logp: Variable


@dataclass
class TwoLevelModel:
    """What the engine needs to know about a PyMC model."""

    model: object
    gaussians: list[GaussianGlobal]
    segments: list[Segment]
    hypers: list[Hyperparameter]
    predictor_terms: list[PredictorTerm]
    general_terms: list[GeneralTerm]
    constant_terms: list[ConstantTerm]
    observed: dict[str, str] = field(default_factory=dict)
    minibatch: bool = False
    rayleighs: list[RayleighGlobal] = field(default_factory=list)
    locals: list[LocalLatent] = field(default_factory=list)
    leaves: list[PredictiveLeaf] = field(default_factory=list)
    scaling: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    bilinear_terms: list[BilinearTerm] = field(default_factory=list)
    pair_terms: list[PairTerm] = field(default_factory=list)
    #: Ids of the Gaussian globals (matrices with the same number of rows) whose rows
    #: the general terms never couple: their Hessian comes from colored
    #: Hessian-vector products (:func:`~pymc_mcssvi.recognize.separable.separable_rows`).
    general_rows: tuple[int, ...] = ()
    #: Ids of the Gaussian globals with a diagonal q whose Hessian diagonal the general
    #: terms' estimator takes from the gradients (Stein's identity), without products.
    general_diagonal: tuple[int, ...] = ()
    #: Ids of the row-separable Gaussian globals whose per-row Hessian blocks the
    #: general terms' estimator takes from the gradients (Stein's identity).
    general_stein_blocks: tuple[int, ...] = ()
    #: Recognition's note when q keeps crossed (or nested) factors' effect vectors in
    #: independent segments (empty when one full covariance holds them).
    split_crossed_note: str = ""
    #: Twins of the likelihoods' data with their shapes fixed at recognition
    #: (:func:`~pymc_mcssvi.recognize.graph.static_data_shapes`).
    static_data: tuple = ()

    @property
    def affine_predictors(self) -> list[PredictorTerm]:
        """The affine predictor terms and each two-predictor term's two predictors."""
        return self.predictor_terms + [t for p in self.pair_terms for t in p.parts[:2]]

    @property
    def gaussian_values(self) -> list[Variable]:
        return [g.value for g in self.gaussians]

    @property
    def hyper_values(self) -> list[Variable]:
        return [h.value for h in self.hypers]

    @property
    def dim(self) -> int:
        return sum(g.size for g in self.gaussians)
