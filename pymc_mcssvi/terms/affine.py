r"""A log density through one affine predictor: GLMs, GLMMs and the Gaussian priors.

For ``sum_i l_i(eta_i)`` with ``eta_i = o_i + a_i^T w`` the predictor is Gaussian
under q, ``N(o_i + a_i^T m, a_i^T S a_i)``, so the expectations are
one-dimensional (:mod:`~pymc_mcssvi.estimators.quadrature`) and ``g`` and ``H``
are ``sum_i alpha_i a_i`` and ``sum_i beta_i a_i a_i^T``, formed in predictor space
by the term's :class:`~pymc_mcssvi.estimators.predictor.PredictorGeometry`. A
whitened Gaussian prior residual (``standard normal in eta``) has closed-form
expectations.
"""

from __future__ import annotations

import numpy as np
import pytensor.tensor as pt
from pytensor.gradient import NullTypeGradError
from pytensor.graph.utils import MethodNotDefined

from pymc_mcssvi.estimators.chunks import predictor_chunkable, restrict_predictor
from pymc_mcssvi.estimators.predictor import PredictorGeometry
from pymc_mcssvi.estimators.quadrature import (
    expected_derivatives,
    expected_predictive,
    expected_standard_normal,
)
from pymc_mcssvi.exceptions import UnsupportedModelError
from pymc_mcssvi.recognize.ir import PredictorTerm
from pymc_mcssvi.terms.base import EvalOptions, QView, Term, TermStats, add_to

__all__ = ["KINKED_POINTS", "AffineTerm", "predictor_expectations"]

#: Quadrature nodes (at least) for a log density with kinks in its predictor: its
#: expectations come from Stein's lemma on the values, whose quadrature converges
#: more slowly than for a smooth integrand.
KINKED_POINTS = 32


def predictor_expectations(term, mu, var, estimator, n_points, need_hessian=True, by_node=False):
    """``(T, alpha, beta)`` of a non-Gaussian predictor term (flat ``alpha``, ``beta``).

    Raises
    ------
    UnsupportedModelError
        When PyTensor cannot differentiate the log density twice in the predictor.
    """
    shape = term.eta_shape
    try:
        T, alpha, beta = expected_derivatives(
            term.logp,
            term.placeholder,
            mu.reshape(shape) if shape else mu[0],
            var.reshape(shape) if shape else var[0],
            method=estimator,
            n_points=n_points if term.smooth else max(n_points, KINKED_POINTS),
            need_hessian=need_hessian,
            derivatives="direct" if term.smooth else "stein",
            by_node=by_node,
        )
    except (MethodNotDefined, NullTypeGradError) as err:
        raise UnsupportedModelError(
            term.name,
            "PyTensor cannot differentiate its log density twice in the predictor "
            f"({type(err).__name__}: {err})",
            "fit this model with pm.sample() or pm.fit(method='advi'), or write the "
            "likelihood with functions PyTensor differentiates",
        ) from err
    return T, alpha.reshape((-1,)), None if beta is None else beta.reshape((-1,))


class AffineTerm(Term):
    """``sum_i l_i(eta_i)`` with ``eta`` affine in the Gaussian globals.

    Parameters
    ----------
    term : PredictorTerm
    geometry : PredictorGeometry
    estimator : {"quadrature", "mc"}
    n_points : int
        Gauss-Hermite nodes (or Monte Carlo draws) per predictor entry.
    """

    def __init__(self, term: PredictorTerm, geometry: PredictorGeometry, estimator, n_points):
        self.term = term
        self.geometry = geometry
        self.estimator = estimator
        self.n_points = int(n_points)
        self.name = term.name
        self.form = term.form or ("whitened prior" if term.gaussian else "affine")
        self.data = term.kind == "likelihood"
        self.n_obs = predictor_chunkable(term) if self.data else None

    def _expectations(self, term, mu, var, opts):
        if term.gaussian:
            return expected_standard_normal(mu, var)
        if term.predictive:
            shape = term.eta_shape
            T, alpha, beta = expected_predictive(
                term.logp,
                term.placeholder,
                mu.reshape(shape) if shape else mu[0],
                var.reshape(shape) if shape else var[0],
                n_points=self.n_points,
                need_hessian=opts.need_hessian,
            )
            return T, alpha.reshape((-1,)), None if beta is None else beta.reshape((-1,))
        return predictor_expectations(
            term, mu, var, self.estimator, self.n_points, opts.need_hessian, opts.by_node
        )

    def accumulate(self, q: QView, stats: TermStats, opts: EvalOptions, chunk=None) -> TermStats:
        geom, term = self.geometry, self.term
        if chunk is not None:
            term, geom, weight = restrict_predictor(self.term, self.geometry, chunk)
        designs = geom.prepare()
        mu, var = geom.moments(q.means, q.covs, designs)
        var = pt.maximum(var, 0.0)
        T, alpha, beta = self._expectations(term, mu, var, opts)
        if chunk is not None:
            T, alpha, beta = weighted(T, alpha, beta, weight)
        value = add_to(stats.value, pt.sum(T))
        grads, hessians, crosses = stats.grads, stats.hessians, stats.crosses
        if opts.need_derivatives:
            grads, hessians = geom.accumulate(
                alpha, beta if opts.need_hessian else None, grads, hessians, designs
            )
            if opts.head is not None:
                crosses = geom.accumulate_cross(beta, opts.head, crosses, designs)
        return TermStats(value, grads, hessians, crosses, stats.phase_values)

    def predictor_variances(self, q: QView):
        """Variance under q of each predictor entry."""
        return self.geometry.moments(q.means, q.covs, self.geometry.prepare())[1]

    def predictor_curvatures(self, q: QView):
        """``E_q[d^2 l / d eta^2]`` per predictor entry (non-Gaussian terms only)."""
        mu, var = self.geometry.moments(q.means, q.covs, self.geometry.prepare())
        return predictor_expectations(
            self.term, mu, pt.maximum(var, 0.0), self.estimator, self.n_points
        )[2]

    def bytes_per_observation(self, scans: bool = True) -> float:
        """Per predictor entry: the quadrature's values at its nodes (a few graphs'
        worth) and the design rows."""
        per_node = 0 if self.term.gaussian else 12 * self.n_points
        width = sum(
            max(1, int(np.prod([d or 1 for d in (t.cols.type.shape[-1:] or (1,))])))
            for t in self.term.terms
        )
        return 8.0 * (per_node + 4 * width + 8)


def weighted(T, alpha, beta, w):
    """``T``, ``alpha``, ``beta`` times a chunk's weights per predictor entry (flat)."""
    T = T * w.reshape(T.shape)
    alpha = alpha * w
    beta = None if beta is None else beta * w
    return T, alpha, beta
