r"""Bilinear predictors ``f_n = u_{s_n}^T v_{d_n}``: matrix factorization (paper section 3.5).

Under ``q(U, V) = prod_i q(u_i) prod_j q(v_j)`` the expectation over one factor's
row given a point of the other's is one-dimensional; the points are sigma points
or fixed draws (:mod:`~pymc_mcssvi.estimators.bilinear`). The factors move in turn
(two phases), each judged by its own side's estimate of the bound, so the term's
:class:`~pymc_mcssvi.terms.base.TermStats` carries one value per phase. Chunks are
chunks of runs of one row's observations (full batch, one bilinear term; of the
observations when terms are added to the product).
"""

from __future__ import annotations

from pymc_mcssvi.estimators.bilinear import BilinearEstimator
from pymc_mcssvi.recognize.graph import evaluate_static
from pymc_mcssvi.terms.base import EvalOptions, QView, Term, TermStats, add_to

__all__ = ["BilinearTerms"]


class BilinearTerms(Term):
    """The bilinear terms of a model (see the module docstring)."""

    form = "bilinear"

    def __init__(self, estimator: BilinearEstimator):
        self.estimator = estimator
        self.name = ", ".join(t.name for t, _, _ in estimator.items)
        self.n_obs = None
        items = estimator.items
        if estimator.n_runs is not None:  # chunks of runs of one row's observations
            self.n_obs = estimator.n_runs
        elif len(items) == 1 and estimator.row_subsample is None:
            ((term, _, _),) = items
            shape = term.left_rows.type.shape
            if shape and shape[0] is not None:
                self.n_obs = int(shape[0])
            else:
                try:
                    self.n_obs = int(evaluate_static([term.left_rows.shape[0]])[0])
                except Exception:  # rows that change (pm.Minibatch): not chunked
                    self.n_obs = None

    def accumulate(self, q: QView, stats: TermStats, opts: EvalOptions, chunk=None) -> TermStats:
        T_v, T_u, g, H = self.estimator.expectations(
            q.states,
            q.covs,
            opts.need_hessian,
            opts.phase,
            step=opts.step,
            by_node=opts.by_node,
            chunk=chunk,
        )
        grads, hessians = list(stats.grads), list(stats.hessians)
        if opts.need_derivatives:
            grads = [add_to(a, b) for a, b in zip(grads, g, strict=True)]
            hessians = [add_to(a, b) for a, b in zip(hessians, H, strict=True)]
        phases = stats.phase_values or (None, None)
        phase_values = (add_to(phases[0], T_v), add_to(phases[1], T_u))
        return TermStats(stats.value, grads, hessians, stats.crosses, phase_values)

    def bytes_per_observation(self, scans: bool = True) -> float:
        """Per observation and side: the gathered ``K x K`` covariance and the ``K x K``
        Hessian contribution, the points and their products (``a x K`` each), and the
        quadrature at the points; times the observations of a run when chunks are runs
        of one row's observations."""
        est = self.estimator
        K = max(est.tlm.segments[su].k for _, su, _ in est.items)
        points = 2 * K if est.n_draws == "sigma" else est.n_draws
        return (
            est.run_length
            * 8.0
            * (4 * K * K + 8 * points * K + 2 * points * est.n_points * 6 + 8 * points)
        )
