r"""``g`` and ``H`` for bilinear predictors ``f_n = u_{s_n}^T v_{d_n}`` (paper section 3.5, PMF).

With ``q(U, V) = prod_i q(u_i) prod_j q(v_j)`` (one full ``K x K`` block per row),
the expectation over ``v_j`` given ``u_i`` is one-dimensional:
``f | u ~ N(u^T m_{v_j}, u^T S_{v_j} u)``. Following the paper (eqs.
pmf_expec_start - PMF-SVI-update-V), the expectation over ``u_i`` uses
``k1`` points from ``q(u_i)`` and the expectation over ``f`` given each point is
computed by Gauss-Hermite quadrature (the paper's ``k2`` samples). By default the
points are fixed random antithetic draws (the paper's ``k1`` Monte Carlo
samples, 4 by default); ``draws="sigma"`` uses the ``2K`` sigma points
``m + A (+-sqrt(K) e_k)`` (``A A^T = S``), which reproduce the first two moments
of ``u`` exactly, so that for a Gaussian likelihood the covariance step with
``rho = 1`` is exactly the closed-form update of Lim & Teh (2007):

.. math::

    g_{v_j} = \sum_{n: d_n = j} \frac{1}{k_1}\sum_a \alpha_n(u^a)\, u^a, \qquad
    H_{v_j} = \sum_{n: d_n = j} \frac{1}{k_1}\sum_a \beta_n(u^a)\, u^a (u^a)^T ,

accumulated with segment sums over the rows (never a dense Jacobian), and
symmetrically for ``u_i`` with points of ``v``. The points are fixed, so the
estimate is a deterministic function of q (backtracking stays valid).
"""

from __future__ import annotations

import numpy as np
import pytensor.tensor as pt

from pymc_mcssvi.estimators.quadrature import expected_derivatives
from pymc_mcssvi.exceptions import UnsupportedModelError
from pymc_mcssvi.families.gaussian import GaussianBlocks, _lower_inverse

__all__ = ["BilinearEstimator"]


class BilinearEstimator:
    """Expectations of the bilinear terms of a :class:`TwoLevelModel`.

    Parameters
    ----------
    tlm : TwoLevelModel
    seg_of : dict
        Gaussian global id to segment index.
    parameterization : {"precision", "covariance"}
    n_draws : int or "sigma"
        Random antithetic draws of the other factor per observation (the
        paper's ``k1``; default 4), or ``"sigma"`` for the ``2K`` sigma points
        (exact first two moments: the conjugate update is then exact, at
        ``K / 2`` times the cost).
    n_points : int
        Gauss-Hermite nodes for the expectation over the product.
    seed : int
    """

    def __init__(self, tlm, seg_of, parameterization, n_draws=4, n_points=8, seed=0):
        self.tlm = tlm
        self.parameterization = parameterization
        self.n_points = n_points
        self.n_draws = n_draws if n_draws == "sigma" else int(n_draws) + int(n_draws) % 2
        self.seed = seed
        self.items = []
        for term in tlm.bilinear_terms:
            segs = []
            for gid in (term.left, term.right):
                s = seg_of[gid]
                seg = tlm.segments[s]
                g = tlm.gaussians[gid]
                if seg.kind != "block" or seg.members != [gid] or seg.k != g.shape[1]:
                    raise UnsupportedModelError(
                        g.name,
                        "a factor of a matrix factorization needs one K x K covariance block per row",
                        f"leave cov= at its default for {g.name!r} or pass cov={{{g.name!r}: 'block'}}",
                    )
                segs.append(s)
            self.items.append((term, segs[0], segs[1]))

    @property
    def active(self) -> bool:
        return bool(self.items)

    def _eps(self, K, salt):
        """Standard points ``(k1, 1, K)`` shared by all observations."""
        if self.n_draws == "sigma":
            half = np.sqrt(K) * np.eye(K)[:, None, :]
        else:
            rng = np.random.default_rng(self.seed + 104729 * salt + K)
            half = rng.standard_normal((self.n_draws // 2, 1, K))
        return pt.constant(np.concatenate([half, -half]))

    def _square_root(self, state: GaussianBlocks):
        """``A`` with ``A A^T = S`` per row (``L^{-T}`` or ``C^T``)."""
        if self.parameterization == "precision":
            return pt.matrix_transpose(_lower_inverse(state.factor))
        return pt.matrix_transpose(state.factor)

    def _side(self, term, draw_state, draw_rows, other_mean, other_cov, other_rows, salt):
        """Expectations for the factor indexed by ``other_rows``, drawing the other factor.

        Returns the draws as ``(n, a, K)`` and ``T, alpha, beta`` as ``(a, n)``.

        Notes
        -----
        Per-observation products are written as broadcasts and sums (one
        vectorized expression) instead of ``n`` small matrix products; the
        largest intermediate is ``n x a x K x K``.
        """
        A = self._square_root(draw_state)[draw_rows]  # (n, K, K)
        eps = self._eps(int(draw_state.mean.type.shape[-1]), salt)[:, 0, :]  # (a, K)
        u = draw_state.mean[draw_rows][:, None, :] + pt.sum(
            A[:, None, :, :] * eps[None, :, None, :], axis=-1
        )
        mv = other_mean[other_rows]  # (n, K)
        Sv = other_cov[other_rows]  # (n, K, K)
        mean = pt.sum(u * mv[:, None, :], axis=-1).T  # (a, n)
        var = pt.sum(u[..., :, None] * Sv[:, None, :, :] * u[..., None, :], axis=(-2, -1)).T
        T, alpha, beta = expected_derivatives(
            term.logp, term.placeholder, mean, pt.maximum(var, 0.0), n_points=self.n_points
        )
        return u, T, alpha, beta

    def phase_segments(self, nseg):
        """Segments moved in each phase: phase 0 the right factors (V), phase 1 the left (U).

        Each phase's value estimator draws the factor that does not move, so the
        value is the exact objective whose gradients the moving factor uses.
        """
        left = {su for _, su, _ in self.items}
        right = {sv for _, _, sv in self.items}
        return [set(range(nseg)) - left, set(range(nseg)) - right]

    def expectations(self, states, covs, need_hessian=True):
        """``(T_v, T_u, grads, hessians)``.

        ``T_v`` (draws of U, exact in V) is the value consistent with the
        gradients of the V rows, ``T_u`` the one for the U rows.
        """
        nseg = len(states)
        grads, hessians = [None] * nseg, [None] * nseg
        total_v = pt.constant(0.0)
        total_u = pt.constant(0.0)
        for k, (term, su, sv) in enumerate(self.items):
            Ru, Kdim = states[su].mean.type.shape
            Rv = states[sv].mean.type.shape[0]
            # Update of V rows: draws of U.
            u, T_v, a_v, b_v = self._side(
                term, states[su], term.left_rows, states[sv].mean, covs[sv], term.right_rows, 2 * k
            )
            # Update of U rows: draws of V.
            v, T_u, a_u, b_u = self._side(
                term,
                states[sv],
                term.right_rows,
                states[su].mean,
                covs[su],
                term.left_rows,
                2 * k + 1,
            )
            total_v = total_v + pt.mean(pt.sum(T_v, axis=-1))
            total_u = total_u + pt.mean(pt.sum(T_u, axis=-1))
            for seg, rows, draws, a, b, R in (
                (sv, term.right_rows, u, a_v, b_v, Rv),
                (su, term.left_rows, v, a_u, b_u, Ru),
            ):
                n_pts = pt.cast(draws.shape[1], "float64")
                g_obs = pt.sum(a.T[:, :, None] * draws, axis=1) / n_pts  # (n, K)
                g = pt.zeros((R, Kdim))
                g = pt.inc_subtensor(g[rows], g_obs)
                grads[seg] = g if grads[seg] is None else grads[seg] + g
                if need_hessian:
                    # sum_a beta_a u_a u_a^T per observation
                    H_obs = (
                        pt.sum(
                            (draws * b.T[:, :, None])[..., :, None] * draws[..., None, :], axis=1
                        )
                        / n_pts
                    )
                    H = pt.zeros((R, Kdim, Kdim))
                    H = pt.inc_subtensor(H[rows], H_obs)
                    hessians[seg] = H if hessians[seg] is None else hessians[seg] + H
        return total_v, total_u, grads, hessians
