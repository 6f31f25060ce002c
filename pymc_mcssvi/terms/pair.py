r"""A log density of two affine predictors (a distributional model: ``Normal(X b, exp(Z c))``).

The two predictors are jointly Gaussian under q entry by entry; their covariance is
half the variance of their sum minus theirs, so three predictor geometries (``eta_1``,
``eta_2``, ``eta_1 + eta_2``) give every moment and, with the expected second
derivatives ``b_jk``, the Hessian
``J_1' b_11 J_1 + J_2' b_22 J_2 + J_1' b_12 J_2 + J_2' b_12 J_1``, accumulated as
``J_1' (b_11 - b_12) J_1 + J_2' (b_22 - b_12) J_2 + (J_1 + J_2)' b_12 (J_1 + J_2)``
(polarization): nothing is formed per pair of predictors.
"""

from __future__ import annotations

import pytensor.tensor as pt

from pymc_mcssvi.estimators.chunks import (
    observation_subset,
    predictor_chunkable,
    restrict_predictor,
    subset_is_clean,
)
from pymc_mcssvi.estimators.quadrature import expected_pair_derivatives
from pymc_mcssvi.recognize.ir import PairTerm
from pymc_mcssvi.terms.base import EvalOptions, QView, Term, TermStats, add_to

__all__ = ["PAIR_POINTS", "TwoPredictorTerm"]

#: Gauss-Hermite nodes per predictor of a two-predictor likelihood (their square in all).
PAIR_POINTS = 7


class TwoPredictorTerm(Term):
    """``sum_i l_i(eta_1i, eta_2i)`` with both predictors affine in the Gaussian globals.

    Parameters
    ----------
    pair : PairTerm
    geometries : tuple of PredictorGeometry
        Of ``eta_1``, ``eta_2`` and their sum.
    """

    form = "two affine predictors"

    def __init__(self, pair: PairTerm, geometries):
        self.pair = pair
        self.geometries = tuple(geometries)
        self.name = pair.name
        n = [predictor_chunkable(p, logp=False) for p in pair.parts]
        self.n_obs = n[0] if len(set(n)) == 1 and n[0] is not None else None
        if self.n_obs is not None and not subset_is_clean(
            pair.logp, tuple(pair.placeholders), self.n_obs
        ):
            self.n_obs = None

    def accumulate(self, q: QView, stats: TermStats, opts: EvalOptions, chunk=None) -> TermStats:
        pair, geoms = self.pair, self.geometries
        logp, placeholders = pair.logp, pair.placeholders
        shape = pair.parts[0].eta_shape
        weight = None
        if chunk is not None:
            restricted = [
                restrict_predictor(p, g, chunk, logp=False)
                for p, g in zip(pair.parts, geoms, strict=True)
            ]
            geoms = tuple(r.geometry for r in restricted)
            weight = restricted[0].entry_weight
            shape = restricted[0].term.eta_shape
            logp, placeholders = observation_subset(
                pair.logp, tuple(pair.placeholders), int(pair.parts[0].eta_shape[0]), chunk.index
            )
        designs = [g.prepare() for g in geoms]
        (m1, v1), (m2, v2), (_, vs) = [
            g.moments(q.means, q.covs, d) for g, d in zip(geoms, designs, strict=True)
        ]
        v1, v2 = pt.maximum(v1, 0.0), pt.maximum(v2, 0.0)
        c = 0.5 * (pt.maximum(vs, 0.0) - v1 - v2)

        def shaped(x):
            return x.reshape(shape) if shape else x[0]

        T, (a1, a2), (b11, b12, b22) = expected_pair_derivatives(
            logp, placeholders, [shaped(x) for x in (m1, v1, m2, v2, c)], PAIR_POINTS
        )
        if weight is not None:
            T = T * weight.reshape(T.shape)
        value = add_to(stats.value, pt.sum(T))
        grads, hessians, crosses = stats.grads, stats.hessians, stats.crosses
        if not opts.need_derivatives:
            return TermStats(value, grads, hessians, crosses, stats.phase_values)
        a1, a2, b11, b12, b22 = (x.reshape((-1,)) for x in (a1, a2, b11, b12, b22))
        if weight is not None:
            a1, a2, b11, b12, b22 = (x * weight for x in (a1, a2, b11, b12, b22))
        betas = (b11 - b12, b22 - b12, b12) if opts.need_hessian else (None, None, None)
        alphas = (a1, a2, pt.zeros_like(a1))
        head = opts.head if opts.need_hessian else None
        for geom, d, a, b in zip(geoms, designs, alphas, betas, strict=True):
            grads, hessians = geom.accumulate(a, b, grads, hessians, d)
            if head is not None:
                crosses = geom.accumulate_cross(b, head, crosses, d)
        return TermStats(value, grads, hessians, crosses, stats.phase_values)

    def bytes_per_observation(self, scans: bool = True) -> float:
        """Six graphs at ``PAIR_POINTS ** 2`` nodes per entry."""
        return 8.0 * (6 * PAIR_POINTS**2 + 32)
