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
from pymc_mcssvi.families.gaussian import GaussianBlocks, _lower_inverse, bmm, bmv

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

    def _points(self, K, salt):
        """Standard points ``E`` (``a x K``) shared by all observations, and whether they are sigma points."""
        if self.n_draws == "sigma":
            half = np.sqrt(K) * np.eye(K)
        else:
            rng = np.random.default_rng(self.seed + 104729 * salt + K)
            half = rng.standard_normal((self.n_draws // 2, K))
        return np.concatenate([half, -half])

    def _square_root(self, state: GaussianBlocks):
        """``A`` with ``A A^T = S`` per row (``L^{-T}`` or ``C^T``)."""
        if self.parameterization == "precision":
            return pt.matrix_transpose(_lower_inverse(state.factor))
        return pt.matrix_transpose(state.factor)

    def phase_segments(self, nseg):
        """Segments moved in each phase: phase 0 the right factors (V), phase 1 the left (U).

        Each phase's value estimator draws the factor that does not move, so the
        value is the exact objective whose gradients the moving factor uses.
        """
        left = {su for _, su, _ in self.items}
        right = {sv for _, _, sv in self.items}
        return [set(range(nseg)) - left, set(range(nseg)) - right]

    def _derivatives(self, E, mean, A, alpha, beta, need_hessian):
        """Per-observation ``g`` and ``H`` of the moving factor from the points' derivatives.

        With points ``x_a = m + A e_a`` (``m``, ``A`` of the drawn factor's row) and
        expected derivatives ``alpha_a``, ``beta_a`` (``a x n``)::

            g_n = mean_a alpha_a x_a = abar m + A (E^T alpha / a)
            H_n = mean_a beta_a x_a x_a^T
                = bbar m m^T + m w^T + w m^T + A (E^T diag(beta) E / a) A^T,
                  w = A (E^T beta / a)

        so nothing of size ``n x a x K x K`` is formed. For sigma points
        ``E^T diag(beta) E`` is diagonal.
        """
        a = E.shape[0]
        Ec = pt.constant(E)
        g = pt.mean(alpha, axis=0)[:, None] * mean + bmv(A, pt.dot(alpha.T, Ec) / a)
        if not need_hessian:
            return g, None
        w = bmv(A, pt.dot(beta.T, Ec) / a)
        H = pt.mean(beta, axis=0)[:, None, None] * (mean[:, :, None] * mean[:, None, :])
        H = H + mean[:, :, None] * w[:, None, :] + w[:, :, None] * mean[:, None, :]
        K = E.shape[1]
        if self.n_draws == "sigma":
            gamma = (beta[:K] + beta[K:]).T * (float(K) / a)  # (n, K): E^T diag(beta) E / a
            H = H + bmm(A * gamma[:, None, :], pt.matrix_transpose(A))
        else:
            outer = np.einsum("ak,al->akl", E, E).reshape(a, K * K) / a
            G = pt.dot(beta.T, pt.constant(outer)).reshape((-1, K, K))
            H = H + bmm(bmm(A, G), pt.matrix_transpose(A))
        return g, H

    def expectations(self, states, covs, need_hessian=True):
        """``(T_v, T_u, grads, hessians)``.

        ``T_v`` (points of U, exact in V) is the value consistent with the
        gradients of the V rows, ``T_u`` the one for the U rows.

        Notes
        -----
        Per observation ``n`` (rows ``s`` of U and ``d`` of V), with square roots
        ``A_u A_u^T = S_u``, ``A_v A_v^T = S_v`` and ``M = A_v^T A_u``, a point
        ``u = m_u + A_u e`` gives ``f | u ~ N(m_v^T m_u + e^T A_u^T m_v,
        ||A_v^T m_u + M e||^2)`` and symmetrically ``v = m_v + A_v e`` gives
        ``N(m_u^T m_v + e^T A_v^T m_u, ||A_u^T m_v + M^T e||^2)``: one ``K x K``
        product per observation serves both sides, and the largest
        intermediates are ``n x K x K`` (memory ``O(n K^2)``, not ``O(n a K^2)``).
        """
        nseg = len(states)
        grads, hessians = [None] * nseg, [None] * nseg
        total_v = pt.constant(0.0)
        total_u = pt.constant(0.0)
        for k, (term, su, sv) in enumerate(self.items):
            Ru, K = states[su].mean.type.shape
            Rv = states[sv].mean.type.shape[0]
            s, d = term.left_rows, term.right_rows
            mu, mv = states[su].mean[s], states[sv].mean[d]  # (n, K)
            Au, Av = self._square_root(states[su])[s], self._square_root(states[sv])[d]
            M = bmm(pt.matrix_transpose(Av), Au)  # (n, K, K)
            p = bmv(pt.matrix_transpose(Av), mu)  # A_v^T m_u
            q = bmv(pt.matrix_transpose(Au), mv)  # A_u^T m_v
            c = pt.sum(mu * mv, axis=-1)
            E_u, E_v = self._points(K, 2 * k), self._points(K, 2 * k + 1)
            # Points of U (update of the V rows) and of V (update of the U rows).
            mean_v = c[None, :] + pt.dot(pt.constant(E_u), q.T)  # (a, n)
            ME = pt.tensordot(M, pt.constant(E_u), axes=[[2], [1]])  # (n, K, a)
            var_v = pt.sum(pt.square(p[:, :, None] + ME), axis=1).T
            mean_u = c[None, :] + pt.dot(pt.constant(E_v), p.T)
            MtE = pt.tensordot(M, pt.constant(E_v), axes=[[1], [1]])  # (n, K, a)
            var_u = pt.sum(pt.square(q[:, :, None] + MtE), axis=1).T
            T_v, a_v, b_v = expected_derivatives(
                term.logp, term.placeholder, mean_v, var_v, n_points=self.n_points
            )
            T_u, a_u, b_u = expected_derivatives(
                term.logp, term.placeholder, mean_u, var_u, n_points=self.n_points
            )
            total_v = total_v + pt.mean(pt.sum(T_v, axis=-1))
            total_u = total_u + pt.mean(pt.sum(T_u, axis=-1))
            for seg, rows, E, m_draw, A_draw, al, be, R in (
                (sv, d, E_u, mu, Au, a_v, b_v, Rv),
                (su, s, E_v, mv, Av, a_u, b_u, Ru),
            ):
                g_obs, H_obs = self._derivatives(E, m_draw, A_draw, al, be, need_hessian)
                g = pt.inc_subtensor(pt.zeros((R, K))[rows], g_obs)
                grads[seg] = g if grads[seg] is None else grads[seg] + g
                if need_hessian:
                    H = pt.inc_subtensor(pt.zeros((R, K, K))[rows], H_obs)
                    hessians[seg] = H if hessians[seg] is None else hessians[seg] + H
        return total_v, total_u, grads, hessians
