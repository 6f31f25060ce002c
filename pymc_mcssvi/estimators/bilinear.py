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

Per-row subsampling (the paper's scheme for dense rows, ``row_subsample=B``):
in every iteration each row ``j`` of the factor being updated uses at most
``B`` of its ``|O_j|`` observations (a window of ``B`` consecutive ones of the
row's observations in an order shuffled once, at a random offset that moves on
by ``B`` at each step of the factor), weighted by ``|O_j| / |M_j|``; every
observation is used with probability ``|M_j| / |O_j|``, so the sums above (and
the bound) are unbiased estimates, and each is used once every
``|O_j| / |M_j|`` steps.
"""

from __future__ import annotations

import numpy as np
import pytensor.tensor as pt
from pytensor.conditional import ifelse
from pytensor.graph.basic import Constant
from pytensor.graph.fg import MissingInputError
from pytensor.graph.replace import clone_replace
from pytensor.graph.traversal import io_toposort

from pymc_mcssvi.estimators.chunks import restrict_predictor
from pymc_mcssvi.estimators.quadrature import expected_derivatives
from pymc_mcssvi.exceptions import UnsupportedModelError
from pymc_mcssvi.families.gaussian import GaussianBlocks, _lower_inverse, bmm, bmv
from pymc_mcssvi.recognize.graph import depends_on_any, evaluate_static, holds_row_positions

__all__ = ["BilinearEstimator"]


def _row_positions(v, n, m):
    """``arange(m)`` shaped like ``v`` if the constant ``v`` is ``arange(n)`` along axis 0, else ``None``."""
    if not isinstance(v, Constant) or v.type.shape[0] != n or not holds_row_positions(v.data):
        return None
    data = np.asarray(v.data)
    pos = pt.arange(m).reshape((m,) + (1,) * (data.ndim - 1))
    return pt.broadcast_to(pos, (m, *data.shape[1:])).astype(v.dtype)


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
    row_subsample : int, optional
        At most this many observations per row of the factor being updated, a
        window that moves on through the row's observations at each step of the
        factor (module docstring). ``None`` uses every observation.
    affine_geometries : list, optional
        Per bilinear term, the :class:`~pymc_mcssvi.estimators.predictor.PredictorGeometry`
        of the terms added to its product (:attr:`BilinearTerm.affine`), or
        ``None``. Under the factorized q those terms are a Gaussian independent
        of both factors: their mean and variance add to those of ``f`` given a
        point of the drawn factor, and their globals' ``g`` and ``H`` come from
        the same expected derivatives, averaged over the points.
    """

    def __init__(
        self,
        tlm,
        seg_of,
        parameterization,
        n_draws=4,
        n_points=8,
        seed=0,
        row_subsample=None,
        affine_geometries=None,
    ):
        self.tlm = tlm
        self.affine_geometries = (
            list(affine_geometries)
            if affine_geometries is not None
            else [None] * len(tlm.bilinear_terms)
        )
        self.row_subsample = None if row_subsample is None else int(row_subsample)
        if self.row_subsample is not None and self.row_subsample < 1:
            raise ValueError(f"row_subsample must be a positive integer, got {row_subsample!r}")
        self._n_rngs = 0
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
                k = g.shape[0] if gid in term.transposed else g.shape[1]
                if seg.kind != "block" or seg.members != [gid] or seg.k != k:
                    raise UnsupportedModelError(
                        g.name,
                        "a factor of a matrix factorization needs one K x K covariance block per row",
                        f"leave cov= at its default for {g.name!r} or pass cov={{{g.name!r}: 'block'}}",
                    )
                segs.append(s)
            self.items.append((term, segs[0], segs[1]))
        self.layouts = [self._layouts(term) for term, _, _ in self.items]

    def _layouts(self, term):
        """Observations grouped by row, per side: ``(order, counts, starts)`` for U and V rows.

        Within a row the observations are in a random order (fixed at set-up;
        :meth:`_subsample` takes windows of it).
        """
        if self.row_subsample is None:
            return None
        try:
            rows = evaluate_static([term.left_rows, term.right_rows])
        except MissingInputError:
            raise UnsupportedModelError(
                term.name,
                "row_subsample needs fixed row and column indices (they change between iterations here)",
                "use either pm.Minibatch or row_subsample, not both",
            ) from None
        out = []
        rng = np.random.default_rng(self.seed + 15485863)
        for idx, gid in zip(rows, (term.left, term.right), strict=True):
            idx = np.asarray(idx, dtype="int64")
            R = self.tlm.gaussians[gid].shape[0]
            counts = np.bincount(idx, minlength=R)
            order = np.lexsort((rng.random(idx.size), idx))
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
            out.append((order, counts, starts))
        return out

    def mean_row_weight(self) -> float:
        """Mean of ``|O_j| / |M_j|`` over the rows with observations (the largest over
        factors and terms), clipped to ``[1, 100]``; 1 without subsampling."""
        if self.row_subsample is None:
            return 1.0
        worst = 1.0
        for layout in self.layouts:
            for _, counts, _ in layout:
                c = counts[counts > 0]
                if c.size:
                    worst = max(worst, float(np.mean(c / np.minimum(c, self.row_subsample))))
        return float(min(worst, 100.0))

    def _subsample(self, layout, step=None):
        """Observation ids ``(R * B,)`` and weights ``|O_j| / |M_j|`` (0 for padding).

        Row ``j``'s subset is a window of ``B`` consecutive observations (cyclically)
        of its fixed random order. With ``step`` (the number of earlier
        evaluations of this side, symbolic) the window starts at ``o_j + step * B``
        for a random offset ``o_j`` drawn once: consecutive windows are adjacent,
        so every ``ceil(|O_j| / B)`` steps use each observation once (systematic
        sampling without replacement, as an epoch of shuffled minibatches does).
        Each window on its own is still at a uniformly random start, so each
        observation is in it with probability ``B / |O_j|`` and the weighted sums
        are unbiased. The natural step averages the estimates of recent
        iterations, and adjacent windows make that average's noise smaller than
        independent ones do (InstEval binary, B = 5: ADVI's final held-out NLL
        reached after about 95 iterations instead of 120, and 0.6165 instead of
        0.6176 after 200).
        Without ``step`` (evaluations outside the step) the start is a fresh
        uniform draw. Either way a draw costs one number per row (sorting
        ``rows x max |O_j|`` random keys per iteration, an earlier way, took
        about a tenth of an InstEval step: lecturers have up to 633 ratings).
        """
        order, counts, starts = layout
        B = min(self.row_subsample, int(max(counts.max(), 1)))
        n = np.maximum(counts, 1)[:, None]
        # One generator or offset per draw: two draws from one generator would give
        # both the same numbers (PyMC's compile seeds each and updates it per call).
        self._n_rngs += 1
        if step is not None:
            rng = np.random.default_rng(self.seed + 7919 * self._n_rngs)
            offset = np.floor(rng.random(n.shape) * n).astype("int64")
            first = pt.constant(offset) + pt.cast(step, "int64") * B
        else:
            rng = pt.random.shared_rng(
                seed=self.seed + 7919 * self._n_rngs, name="row_subsample_rng"
            )
            u = pt.random.uniform(size=(len(counts),), rng=rng)
            first = pt.cast(pt.floor(u[:, None] * pt.constant(n.astype("float64"))), "int64")
        pos = (first + pt.constant(np.arange(B)[None, :])) % pt.constant(n)
        valid = np.arange(B)[None, :] < counts[:, None]
        obs = pt.constant(order)[pt.minimum(pt.constant(starts[:, None]) + pos, len(order) - 1)]
        w = np.where(counts > 0, counts / np.maximum(np.minimum(counts, B), 1), 0.0)
        weight = pt.constant(np.where(valid, w[:, None], 0.0))
        return obs.reshape((-1,)), weight.reshape((-1,))

    @staticmethod
    def _observation_subset(term, obs):
        """``(logp, placeholder)`` of the term restricted to observations ``obs``.

        The log density is elementwise in the product, so every array of
        leading length ``n`` that enters the computation from the product
        onwards (the data, trials, offsets, constant-shape masks such as
        ``Alloc(False, n)``) is gathered with ``obs``; a constant that holds the
        positions ``0, ..., n - 1`` themselves (the row index of a
        ``take_along_axis``, folded from ``arange(n)``) becomes the subset's
        positions instead.
        """
        n = int(evaluate_static([term.left_rows.shape[0]])[0])
        ph = pt.vector(f"{term.placeholder.name}_subset", dtype=term.placeholder.dtype)
        repl = {term.placeholder: ph}
        dependent = {term.placeholder}
        for node in io_toposort([term.placeholder], [term.logp]):
            if not any(i in dependent for i in node.inputs):
                continue
            dependent.update(node.outputs)
            for v in node.inputs:
                if v in dependent or v in repl or v.ndim == 0:
                    continue
                if v.type.shape[0] == n:
                    repl[v] = _row_positions(v, n, obs.shape[0])
                    if repl[v] is None:
                        repl[v] = v[obs]
        # Rebuilt node by node: the static length n gives way to the subset's.
        return clone_replace(term.logp, replace=repl, rebuild_strict=False), ph

    def depends_on(self, variables) -> bool:
        """Whether any bilinear term's log density involves ``variables``."""
        return any(depends_on_any(term.logp, variables) for term, _, _ in self.items)

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

    def _square_root_t(self, state: GaussianBlocks):
        """``A^T`` for ``A A^T = S`` per row (``L^{-1}`` or ``C``): the products below
        contract the last axes of these, the form a batched dot is fastest in."""
        if self.parameterization == "precision":
            return _lower_inverse(state.factor)
        return state.factor

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

    def _side(
        self,
        term,
        E,
        draw,
        exact,
        draw_rows,
        exact_rows,
        M=None,
        obs=None,
        weight=None,
        affine=None,
        by_node=False,
        affine_at_obs=False,
    ):
        """``(T, g_obs, H_obs, rows, alpha, beta)`` for the factor ``exact``, with points of
        the factor ``draw``.

        ``draw`` and ``exact`` are ``(mean, A^T)`` of all rows; ``M = A_x^T A_d`` per
        observation may be passed in (shared with the other side). ``obs`` and
        ``weight`` restrict the observations (row subsampling). ``affine`` is the
        mean and variance, per observation, of terms added to the product;
        ``alpha`` and ``beta`` are then the expected derivatives per observation
        (averaged over the points, weighted, restricted to ``obs``), else None.
        """
        (md, Atd), (mx, Atx) = draw, exact
        logp, ph = term.logp, term.placeholder
        if obs is not None:
            draw_rows, exact_rows = draw_rows[obs], exact_rows[obs]
            logp, ph = self._observation_subset(term, obs)
        md, Atd, mx, Atx = md[draw_rows], Atd[draw_rows], mx[exact_rows], Atx[exact_rows]
        if M is None:
            M = bmm(Atx, pt.matrix_transpose(Atd))  # A_x^T A_d
        Ec = pt.constant(E)
        mean = pt.sum(md * mx, axis=-1)[None, :] + pt.dot(Ec, bmv(Atd, mx).T)  # (a, n)
        p = bmv(Atx, md)
        if self.n_draws == "sigma":
            # E = [c I; -c I], c = sqrt(K): ||p +- c M_k||^2 = |p|^2 +- 2 c (M^T p)_k + c^2 |M_k|^2
            c = float(np.sqrt(E.shape[1]))
            pp = pt.sum(pt.square(p), axis=-1)[:, None]
            cross = 2.0 * c * pt.sum(M * p[:, :, None], axis=1)
            cols = (c * c) * pt.sum(pt.square(M), axis=1)
            var = pt.concatenate([pp + cross + cols, pp - cross + cols], axis=1).T
        else:
            ME = pt.tensordot(M, Ec, axes=[[2], [1]])  # (n, K, a)
            var = pt.sum(pt.square(p[:, :, None] + ME), axis=1).T
        Ad = pt.matrix_transpose(Atd)
        if affine is not None:
            ma, va = affine if (obs is None or affine_at_obs) else (affine[0][obs], affine[1][obs])
            mean, var = mean + ma[None, :], var + va[None, :]
        T, alpha, beta = expected_derivatives(
            logp, ph, mean, var, n_points=self.n_points, by_node=by_node
        )
        if weight is not None:
            T, alpha = T * weight, alpha * weight
            beta = None if beta is None else beta * weight
        g_obs, H_obs = self._derivatives(E, md, Ad, alpha, beta, beta is not None)
        a_obs = b_obs = None
        if affine is not None:
            a_obs = pt.mean(alpha, axis=0)
            b_obs = None if beta is None else pt.mean(beta, axis=0)
        return pt.mean(pt.sum(T, axis=-1)), g_obs, H_obs, exact_rows, a_obs, b_obs

    def expectations(
        self, states, covs, need_hessian=True, phase=None, step=None, by_node=False, chunk=None
    ):
        """``(T_v, T_u, grads, hessians)``.

        ``T_v`` (points of U, exact in V) is the value consistent with the
        gradients of the V rows, ``T_u`` the one for the U rows.

        ``phase`` (a symbolic integer, optional) asks for one side only: phase
        0 the V side, phase 1 the U side (:meth:`phase_segments`). The other
        side is not computed (a lazy ``ifelse``): its factor's ``g`` and ``H``
        are zeros and both values are the computed side's. A stochastic
        (non-monotone) kernel moves one factor per step and needs nothing of
        the other, so each iteration does half the work.

        ``step`` (a symbolic integer, with ``row_subsample``) counts the earlier
        evaluations of each side: the rows' windows advance by ``B`` observations
        per step (:meth:`_subsample`). Without it each window starts at random.

        ``chunk`` (a :class:`~pymc_mcssvi.terms.base.Chunk` of observations, one
        bilinear term, no row subsampling) restricts both sides to those observations,
        weighted: their part of every sum.

        Notes
        -----
        Per observation ``n`` (rows ``s`` of U and ``d`` of V), with square roots
        ``A_u A_u^T = S_u``, ``A_v A_v^T = S_v`` and ``M = A_v^T A_u``, a point
        ``u = m_u + A_u e`` gives ``f | u ~ N(m_v^T m_u + e^T A_u^T m_v,
        ||A_v^T m_u + M e||^2)`` and symmetrically ``v = m_v + A_v e`` gives
        ``N(m_u^T m_v + e^T A_v^T m_u, ||A_u^T m_v + M^T e||^2)``: without
        subsampling one ``K x K`` product per observation serves both sides, and
        the largest intermediates are ``n x K x K`` (memory ``O(n K^2)``, not
        ``O(n a K^2)``).
        """
        nseg = len(states)
        grads, hessians = [None] * nseg, [None] * nseg
        totals = [pt.constant(0.0), pt.constant(0.0)]
        # per side: g and H of the globals in terms added to a product (both sides
        # estimate them; a phase uses its own side's, a full step their average)
        extra = [([None] * nseg, [None] * nseg), ([None] * nseg, [None] * nseg)]
        means = [st.mean for st in states]
        items = zip(self.items, self.layouts, self.affine_geometries, strict=True)
        for k, ((term, su, sv), layout, geom) in enumerate(items):
            K = states[su].mean.type.shape[1]
            s, d = term.left_rows, term.right_rows
            U = (states[su].mean, self._square_root_t(states[su]))
            V = (states[sv].mean, self._square_root_t(states[sv]))
            E_u, E_v = self._points(K, 2 * k), self._points(K, 2 * k + 1)
            affine = designs = None
            if geom is not None and chunk is not None:
                geom = restrict_predictor(term.affine, geom, chunk, logp=False).geometry
            if geom is not None:
                designs = geom.prepare()
                ma, va = geom.moments(means, covs, designs)
                affine = (ma, pt.maximum(va, 0.0))
            if chunk is not None:
                if layout is not None or len(self.items) > 1:
                    raise ValueError("chunks of a matrix factorization need one term, full batch")
                obs, w = chunk.index, chunk.weight
                M = bmm(V[1][d[obs]], pt.matrix_transpose(U[1][s[obs]]))  # A_v^T A_u
                subsets = [(None, None), (None, None)]
                kw = {"obs": obs, "weight": w, "affine": affine, "by_node": by_node}
                sides = [
                    self._side(term, E_u, U, V, s, d, M=M, affine_at_obs=True, **kw),
                    self._side(
                        term, E_v, V, U, d, s, M=pt.matrix_transpose(M), affine_at_obs=True, **kw
                    ),
                ]
            elif layout is None:
                M = bmm(V[1][d], pt.matrix_transpose(U[1][s]))  # A_v^T A_u
                subsets = [(None, None), (None, None)]
                sides = [
                    self._side(term, E_u, U, V, s, d, M=M, affine=affine, by_node=by_node),
                    self._side(
                        term,
                        E_v,
                        V,
                        U,
                        d,
                        s,
                        M=pt.matrix_transpose(M),
                        affine=affine,
                        by_node=by_node,
                    ),
                ]
            else:
                subsets = [self._subsample(layout[1], step), self._subsample(layout[0], step)]
                (obs_v, w_v), (obs_u, w_u) = subsets
                sides = [
                    self._side(
                        term, E_u, U, V, s, d, obs=obs_v, weight=w_v, affine=affine, by_node=by_node
                    ),
                    self._side(
                        term, E_v, V, U, d, s, obs=obs_u, weight=w_u, affine=affine, by_node=by_node
                    ),
                ]
            for i, (seg, side) in enumerate(zip((sv, su), sides, strict=True)):
                T, g_obs, H_obs, rows, a_obs, b_obs = side
                totals[i] = totals[i] + T
                R, Kdim = states[seg].mean.type.shape
                g = pt.inc_subtensor(pt.zeros((R, Kdim))[rows], g_obs)
                grads[seg] = g if grads[seg] is None else grads[seg] + g
                if need_hessian:
                    H = pt.inc_subtensor(pt.zeros((R, Kdim, Kdim))[rows], H_obs)
                    hessians[seg] = H if hessians[seg] is None else hessians[seg] + H
                if geom is None:
                    continue
                obs = subsets[i][0]
                if obs is not None:  # back to all observations (0 where not drawn)
                    n = affine[0].shape[0]
                    a_obs = pt.inc_subtensor(pt.zeros((n,))[obs], a_obs)
                    if b_obs is not None:
                        b_obs = pt.inc_subtensor(pt.zeros((n,))[obs], b_obs)
                extra[i] = geom.accumulate(
                    a_obs, b_obs if need_hessian else None, *extra[i], designs
                )
        if phase is None:
            for s in range(nseg):
                for out, i in ((grads, 0), (hessians, 1)):
                    parts = [extra[0][i][s], extra[1][i][s]]
                    if parts[0] is not None:
                        half = 0.5 * (parts[0] + parts[1])
                        out[s] = half if out[s] is None else out[s] + half
            return totals[0], totals[1], grads, hessians
        return self._one_side(phase, states, totals, grads, hessians, extra)

    def _one_side(self, phase, states, totals, grads, hessians, extra):
        """Only phase ``phase``'s side: ``ifelse`` on the phase, zeros for the other factor;
        the globals of terms added to a product take that side's ``extra`` (g, H)."""
        moved = self.phase_segments(len(states))
        for s in range(len(states)):  # a segment in added terms only
            if grads[s] is None and extra[0][0][s] is not None:
                grads[s] = pt.zeros_like(extra[0][0][s])
                if extra[0][1][s] is not None:
                    hessians[s] = pt.zeros_like(extra[0][1][s])
        segs = [s for s in range(len(states)) if grads[s] is not None]
        outs = [[totals[i]] for i in range(2)]
        for i in range(2):
            for s in segs:
                arrays = [grads[s]] + ([hessians[s]] if hessians[s] is not None else [])
                added = [extra[i][0][s], extra[i][1][s]][: len(arrays)]
                arrays = [a if e is None else a + e for a, e in zip(arrays, added, strict=True)]
                outs[i] += [
                    a if s in moved[i] else pt.zeros(a.type.shape, dtype=a.dtype) for a in arrays
                ]
        picked = iter(ifelse(pt.eq(phase, 0), outs[0], outs[1], name="bilinear_side"))
        T = next(picked)
        for s in segs:
            grads[s] = next(picked)
            if hessians[s] is not None:
                hessians[s] = next(picked)
        return T, T, grads, hessians
