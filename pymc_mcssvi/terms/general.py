r"""Log densities of the Gaussian globals handled by Monte Carlo and automatic differentiation.

Every term that is neither affine, two-predictor nor bilinear in the globals
(``a * exp(-b t)``, a multivariate likelihood, a ``pm.Potential``) is averaged over
draws ``w = m + A eps`` of q: ``g = E_q[grad l]``, ``H = E_q[hess l]`` (Bonnet's and
Price's theorems), with the Hessian from colored Hessian-vector products
(:mod:`~pymc_mcssvi.estimators.general`). All general terms share the draws, so they
form one :class:`MonteCarloTerm`; its chunks are chunks of the (fixed) draws.
"""

from __future__ import annotations

from pymc_mcssvi.estimators.general import GeneralEstimator
from pymc_mcssvi.terms.base import EvalOptions, QView, Term, TermStats, add_to

__all__ = ["MonteCarloTerm"]


class MonteCarloTerm(Term):
    """The general terms of a model, averaged over draws of q (see the module docstring)."""

    form = "general (Monte Carlo + autodiff)"
    # a Potential, a mixture or a product of globals need not be log-concave
    indefinite = True

    def __init__(self, estimator: GeneralEstimator):
        self.estimator = estimator
        self.name = ", ".join(t.name for t in estimator.tlm.general_terms)
        # chunks index the draws, which must be the same at every evaluation
        self.n_obs = estimator.n_draws if estimator.fixed else None

    def accumulate(self, q: QView, stats: TermStats, opts: EvalOptions, chunk=None) -> TermStats:
        T, g, H = self.estimator.expectations(
            q.states,
            q.parameterization,
            opts.need_hessian,
            draws=chunk,
            by_color=opts.scans,
            scan_mode=opts.scan_mode,
            window=opts.step if self.estimator.windows is not None else None,
        )
        value = add_to(stats.value, T)
        grads, hessians = list(stats.grads), list(stats.hessians)
        if opts.need_derivatives:
            grads = [add_to(a, b) for a, b in zip(grads, g, strict=True)]
            hessians = [add_to(a, b) for a, b in zip(hessians, H, strict=True)]
        return TermStats(value, grads, hessians, stats.crosses, stats.phase_values)

    def bytes_per_observation(self, scans: bool = True) -> float:
        return self.estimator.bytes_per_draw(by_color=scans)
