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

__all__ = ["AUTO_DRAWS", "AUTO_DRAW_NODES", "RUN_MAX", "SIGMA_POINT_BUDGET", "BilinearEstimator"]

#: ``n_draws="auto"``: sigma points while an iteration evaluates at most this many
#: (observations x ``2K`` points, summed over the terms); above it, :data:`AUTO_DRAWS`
#: draws per row. Sigma points are exact in the second moments and fit InstEval better
#: at equal time (binary, 44,650 ratings, K = 10: held-out NLL 0.643 after 47 s
#: against 0.658 with 4 draws); at 800,000 ratings and K = 20 they cost 25 s an
#: iteration, and 4 draws per row (3-4 s) reach a held-out NLL of 0.292 in 10
#: iterations (docs/benchmarks.md, matrix factorization at scale).
SIGMA_POINT_BUDGET = 4_000_000
#: Draws per row of the drawn factor when ``"auto"`` leaves sigma points.
AUTO_DRAWS = 4
#: Gauss-Hermite nodes per draw when ``"auto"`` takes draws (at most ``n_points``): the
#: draws' own error is far above 6 nodes' (InstEval binary, 4 draws, 30 iterations:
#: -ELBO 33,704.8 with 6 nodes against 33,702.9 with 12, held-out NLL 0.6504 against
#: 0.6507, at half the time per iteration).
AUTO_DRAW_NODES = 6

#: Most observations per run of one row (:meth:`BilinearEstimator._pieces`): a run's
#: Hessian is one ``K x (L a)`` by ``(L a) x K`` product.
RUN_MAX = 32


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
    n_draws : int, "sigma" or "auto"
        Fixed antithetic draws of the other factor, per row of it (the paper's
        ``k1``; :meth:`_points`), or ``"sigma"`` for the ``2K`` sigma points (exact
        first two moments: the conjugate update is then exact, at ``K / 2`` times the
        cost), or ``"auto"``: sigma points up to :data:`SIGMA_POINT_BUDGET`
        evaluations an iteration, else :data:`AUTO_DRAWS` draws with at most
        :data:`AUTO_DRAW_NODES` nodes each.
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
        work = self._sigma_work(tlm)
        if n_draws == "auto":
            n_draws = "sigma" if work <= SIGMA_POINT_BUDGET else AUTO_DRAWS
            if n_draws != "sigma":
                self.n_points = min(int(n_points), AUTO_DRAW_NODES)
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
        self.pieces = self._pieces()

    def _sigma_work(self, tlm) -> float:
        """Evaluations of one iteration at sigma points: per term, both sides'
        observations (at most ``row_subsample`` per row) times ``2K``. Sets
        :attr:`n_observations`."""
        work = 0.0
        #: Observations of the bilinear terms (``None`` when their indices change).
        self.n_observations = 0
        for term in tlm.bilinear_terms:
            K = tlm.gaussians[term.left].shape[0 if term.left in term.transposed else 1]
            try:
                left, right = evaluate_static([term.left_rows, term.right_rows])
            except Exception:  # indices that change (pm.Minibatch): the batch's length
                n = term.left_rows.type.shape[0] or 0
                work += 2 * n * 2 * K
                self.n_observations = None
                continue
            if self.n_observations is not None:
                self.n_observations += int(np.asarray(left).size)
            for idx in (np.asarray(left).ravel(), np.asarray(right).ravel()):
                used = idx.size
                if self.row_subsample is not None:
                    used = np.minimum(np.bincount(idx), self.row_subsample).sum()
                work += float(used) * 2 * K
        return work

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

    def _pieces(self):
        """Each side's observations in runs of ``L`` of one row, or ``None``.

        For one bilinear term in full batch with fixed indices and nothing added to
        its product: per side (V's rows, then U's), ``(obs, weight, rows)`` with
        ``obs`` ``(P, L)`` the observation ids of ``P`` runs (a row's observations
        in order, cut into runs of ``L``, the last one padded with weight 0),
        ``weight`` ``(P, L)`` and ``rows`` ``(P,)`` the run's row. Both sides are
        padded to the same ``P`` with empty runs, so that a chunk (of runs) indexes
        both. ``L`` is the largest power of two at most half the smaller side's mean
        row count, between 1 and :data:`RUN_MAX`, so that padding adds at most about a
        third.
        """
        if len(self.items) != 1 or self.row_subsample is not None:
            return None
        if self.affine_geometries[0] is not None:
            return None
        term, su, sv = self.items[0]
        try:
            left, right = evaluate_static([term.left_rows, term.right_rows])
        except Exception:  # rows that change (pm.Minibatch)
            return None
        left, right = np.asarray(left, "int64"), np.asarray(right, "int64")
        if left.ndim != 1 or left.size < 2 or right.shape != left.shape:
            return None  # (indices of different lengths are named later, at the step)
        sizes = (self.tlm.segments[sv].rows, self.tlm.segments[su].rows)
        all_counts = [
            np.bincount(idx, minlength=R) for idx, R in zip((right, left), sizes, strict=True)
        ]
        mean = min(left.size / max(1, np.count_nonzero(c)) for c in all_counts)
        L = int(min(RUN_MAX, 2 ** max(0, int(np.floor(np.log2(max(1.0, mean / 2)))))))
        sides = []
        for idx, R, counts in zip((right, left), sizes, all_counts, strict=True):
            order = np.argsort(idx, kind="stable")
            runs = -(-counts // L)  # ceil
            run_row = np.repeat(np.arange(R), runs)
            first_run = np.concatenate([[0], np.cumsum(runs)[:-1]])
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
            rows = idx[order]
            pos = np.arange(idx.size) - starts[rows]  # position within the row
            slot = (first_run[rows] + pos // L) * L + pos % L
            obs = np.full(run_row.size * L, -1, dtype="int64")
            obs[slot] = order
            weight = (obs >= 0).astype("float64")
            # padding repeats the run's first observation (finite), weight 0
            first = np.repeat(obs.reshape(-1, L)[:, :1], L, axis=1).reshape(-1)
            obs = np.where(obs >= 0, obs, first)
            sides.append([obs.reshape(-1, L), weight.reshape(-1, L), run_row])
        P = max(side[2].size for side in sides)
        for side in sides:
            extra = P - side[2].size
            if extra:
                side[0] = np.concatenate([side[0], np.repeat(side[0][:1], extra, axis=0)])
                side[1] = np.concatenate([side[1], np.zeros((extra, L))])
                side[2] = np.concatenate([side[2], np.zeros(extra, dtype="int64")])
        return [tuple(side) for side in sides]

    @property
    def n_runs(self):
        """Runs per side of :meth:`_pieces` (the chunks' unit), or ``None``."""
        return None if self.pieces is None else int(self.pieces[0][2].size)

    @property
    def run_length(self) -> int:
        """Observations per run (1 without runs)."""
        return 1 if self.pieces is None else int(self.pieces[0][0].shape[1])

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

    def _window(self, layout) -> int:
        """Observations per row of a row-subsampled side (:meth:`_subsample`)."""
        counts = layout[1]
        return min(self.row_subsample, int(max(counts.max(), 1)))

    def _run_sides(self, term, sides_args, chunk, by_node):
        """Both sides over :meth:`_pieces`' runs (restricted to ``chunk``'s runs):
        ``_side`` outputs with each run's row."""
        sides = []
        for (obs, wt, runs), args in zip(self.pieces, sides_args, strict=True):
            obs, wt, runs = pt.constant(obs), pt.constant(wt), pt.constant(runs)
            if chunk is not None:
                obs, runs = obs[chunk.index], runs[chunk.index]
                wt = wt[chunk.index] * chunk.weight[:, None]
            side = self._side(
                term,
                *args,
                obs=obs.reshape((-1,)),
                weight=wt.reshape((-1,)),
                by_node=by_node,
                group=self.run_length,
            )
            sides.append((*side[:3], runs, *side[4:]))
        return sides

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
        B = self._window(layout)
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

    def _points(self, K, salt, R):
        """Standard points ``E``: ``(a, K)`` sigma points shared by all rows, or with
        ``n_draws`` draws ``(R, a, K)``, fixed and independent from row to row.

        A row's draws are ``+- sqrt(K) q_k`` for ``a / 2`` columns ``q_k`` of a random
        orthogonal matrix of its own: a random subset of rotated sigma points, so that
        their second moment is ``I`` on average over rows (exactly ``I`` when
        ``a = 2K``) and their mean is exactly 0. Independent rows matter: a factor's
        ``g`` and ``H`` sum over many rows of the other factor, and their draws' errors
        average out there; points shared by all rows (an earlier form) gave every
        row the same error (InstEval binary: held-out NLL 0.749 with 4 shared draws,
        against 0.643 with sigma points).
        """
        if self.n_draws == "sigma":
            half = np.sqrt(K) * np.eye(K)
            return np.concatenate([half, -half])
        b = self.n_draws // 2
        rng = np.random.default_rng(self.seed + 104729 * salt + K)
        Q, Rm = np.linalg.qr(rng.standard_normal((R, K, K)))
        Q = Q * np.sign(np.diagonal(Rm, axis1=-2, axis2=-1))[:, None, :]  # Haar
        reps = -(-b // K)  # more draws than K: further independent rotations
        if reps > 1:
            extra = [np.linalg.qr(rng.standard_normal((R, K, K)))[0] for _ in range(reps - 1)]
            Q = np.concatenate([Q, *extra], axis=-1)
        half = np.sqrt(K) * np.swapaxes(Q[:, :, :b], -1, -2)  # (R, b, K)
        return np.concatenate([half, -half], axis=1)

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

    def _row_points(self, E, draw):
        """Points ``x_a = m + A e_a`` of every row of the drawn factor, ``(R, a, K)``
        (``draw`` is ``(mean, A^T)``): ``a K^2`` per row, once, not per observation."""
        mean, At = draw
        return mean[:, None, :] + bmm(pt.constant(E), At)

    def _side(
        self,
        term,
        E,
        draw,
        exact,
        draw_rows,
        exact_rows,
        obs=None,
        weight=None,
        affine=None,
        by_node=False,
        affine_at_obs=False,
        group=None,
    ):
        """``(T, g_obs, H_obs, rows, alpha, beta)`` for the factor ``exact``, with points of
        the factor ``draw``.

        ``draw`` is ``(mean, A^T)`` of all rows of the drawn factor, ``exact`` is
        ``(mean, S)`` (its covariance blocks) of the factor the derivatives are for.
        ``obs`` and ``weight`` restrict the observations (row subsampling, chunks).
        ``affine`` is the mean and variance, per observation, of terms added to the
        product; ``alpha`` and ``beta`` are then the expected derivatives per
        observation (averaged over the points, weighted, restricted to ``obs``),
        else None.

        Per observation ``n`` with points ``x_a`` of its drawn row and the exact row's
        ``m``, ``S``: ``f | x_a ~ N(x_a^T m, x_a^T S x_a)``, and with the expected
        derivatives ``alpha_a``, ``beta_a`` of the log density at those moments::

            g_n = mean_a alpha_a x_a,        H_n = mean_a beta_a x_a x_a^T

        ``O(a K^2)`` flops and ``O(a K + K^2)`` memory per observation (the points
        are formed per row of the drawn factor, not per observation).

        ``group``: the observations (after ``obs``) come in runs of ``group`` of the
        same exact row (:meth:`_pieces`, row subsampling's windows), and ``g_obs``,
        ``H_obs`` are summed per run: ``H`` of a run is one ``K x (group a)`` by
        ``(group a) x K`` product, and a run's sums are added into its row instead of
        every observation's (a scatter of ``K x K`` blocks per observation is what
        limited a compiled step: 31 us an observation at ``K = 20``).
        """
        logp, ph = term.logp, term.placeholder
        if obs is not None:
            draw_rows, exact_rows = draw_rows[obs], exact_rows[obs]
            logp, ph = self._observation_subset(term, obs)
        a, K = E.shape[-2:]
        sigma = self.n_draws == "sigma"
        if group is None:
            mx, Sx = exact[0][exact_rows], exact[1][exact_rows]  # per observation
        else:  # one exact row per run (padding repeats the run's first observation)
            first = exact_rows.reshape((-1, group))[:, 0]
            mx, Sx = exact[0][first], exact[1][first]
        if sigma:
            md, At = draw[0][draw_rows], draw[1][draw_rows]  # (n, K), (n, K, K)
            mean, var = _sigma_moments(md, At, mx, Sx, group)
        else:
            X = self._row_points(E, draw)[draw_rows]  # (n, a, K)
            if group is not None:
                X = X.reshape((-1, group * a, K))
            mean = pt.sum(X * mx[:, None, :], axis=-1)
            var = pt.sum(bmm(X, Sx) * X, axis=-1)
            if group is not None:
                mean, var = mean.reshape((-1, a)), var.reshape((-1, a))
            mean, var = mean.T, var.T  # (a, n)
        if affine is not None:
            ma, va = affine if (obs is None or affine_at_obs) else (affine[0][obs], affine[1][obs])
            mean, var = mean + ma[None, :], var + va[None, :]
        T, alpha, beta = expected_derivatives(
            logp, ph, mean, var, n_points=self.n_points, by_node=by_node
        )
        if weight is not None:
            T, alpha = T * weight, alpha * weight
            beta = None if beta is None else beta * weight
        if sigma:
            g_obs, H_obs = _sigma_derivatives(md, At, alpha, beta, group)
        else:
            g_obs, H_obs = _point_derivatives(X, alpha, beta, group)
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
        Per observation ``n`` (rows ``s`` of U and ``d`` of V), a point
        ``u_a = m_u + A_u e_a`` (``A_u A_u^T = S_u``, formed once per row of U) gives
        ``f | u_a ~ N(u_a^T m_v, u_a^T S_v u_a)``, and symmetrically for points of
        V: ``O(a K^2)`` flops per observation and side (:meth:`_side`), and the
        largest intermediates are ``n x K x K`` (the gathered ``S`` and the
        per-observation ``H``; chunks bound ``n``). An earlier form went through
        ``M = A_v^T A_u`` and ``A (E^T diag(beta) E) A^T`` per observation,
        ``O(K^3)``: 6x the flops at ``K = 20``, ``a = 4``.
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
            # drawn: (mean, A^T) of every row; exact: (mean, covariance blocks)
            U = (states[su].mean, self._square_root_t(states[su]))
            V = (states[sv].mean, self._square_root_t(states[sv]))
            Ux, Vx = (states[su].mean, covs[su]), (states[sv].mean, covs[sv])
            E_u = self._points(K, 2 * k, states[su].mean.type.shape[0])
            E_v = self._points(K, 2 * k + 1, states[sv].mean.type.shape[0])
            affine = designs = None
            if geom is not None and chunk is not None:
                geom = restrict_predictor(term.affine, geom, chunk, logp=False).geometry
            if geom is not None:
                designs = geom.prepare()
                ma, va = geom.moments(means, covs, designs)
                affine = (ma, pt.maximum(va, 0.0))
            sides_args = ((E_u, U, Vx, s, d), (E_v, V, Ux, d, s))  # V's side, then U's
            subsets = [(None, None), (None, None)]
            if self.pieces is not None:
                sides = self._run_sides(term, sides_args, chunk, by_node)
            elif layout is not None:
                subsets = [self._subsample(layout[1], step), self._subsample(layout[0], step)]
                sides = []
                for args, (obs, w), lay in zip(
                    sides_args, subsets, (layout[1], layout[0]), strict=True
                ):
                    B = self._window(lay)
                    side = self._side(
                        term, *args, obs=obs, weight=w, affine=affine, by_node=by_node, group=B
                    )
                    sides.append((*side[:3], pt.arange(lay[1].size), *side[4:]))
            else:
                if chunk is not None and len(self.items) > 1:
                    raise ValueError("chunks of a matrix factorization need one term, full batch")
                kw = {"affine": affine, "by_node": by_node}
                if chunk is not None:
                    kw.update(obs=chunk.index, weight=chunk.weight, affine_at_obs=True)
                sides = [self._side(term, *args, **kw) for args in sides_args]
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


def _point_derivatives(X, alpha, beta, group):
    """``g`` and ``H`` per observation (or per run of ``group``) from points ``X``
    (``(n, a, K)``, or ``(runs, group * a, K)``) and their expected derivatives
    ``alpha``, ``beta`` ``(a, n)``: ``mean_a alpha_a x_a`` and
    ``mean_a beta_a x_a x_a^T`` (one ``K x (group a)`` product per run)."""
    a = alpha.shape[0]
    al = (alpha.T / a).reshape(X.shape[:2])
    g = pt.sum(al[:, :, None] * X, axis=1)
    if beta is None:
        return g, None
    Xb = X * ((beta.T / a).reshape(X.shape[:2]))[:, :, None]
    return g, bmm(pt.matrix_transpose(Xb), X)


def _sigma_moments(md, At, mx, Sx, group):
    """Moments of ``f = x^T v`` at the ``2K`` sigma points ``x = m_d +- c A_d e_k``
    (``c = sqrt(K)``; ``At`` is ``A_d^T`` per observation) with ``v ~ N(mx, Sx)``:
    ``(mean, var)``, each ``(2K, n)``.

    ``mean_k = m_d . mx +- c (A_d^T mx)_k``, ``var_k = m_d^T Sx m_d +- 2 c (A_d^T Sx
    m_d)_k + c^2 (A_d^T Sx A_d)_kk``: one ``A_d^T Sx`` product per observation (with
    runs, one ``(group K) x K`` by ``K x K`` product per run: ``Sx`` is the run's).
    """
    K = md.type.shape[-1]
    c = float(np.sqrt(K))
    if group is None:
        q = bmv(Sx, md)  # Sx m_d
        ZT = bmm(At, Sx)  # A_d^T Sx
        Amx = bmv(At, mx)
        Aq = bmv(At, q)
        mm = pt.sum(md * mx, axis=-1)
    else:
        runs = Sx.shape[0]
        mdr = md.reshape((runs, group, K))
        q = bmm(mdr, Sx)  # (runs, group, K): rows m_d^T Sx
        Atr = At.reshape((runs, group * K, K))
        ZT = bmm(Atr, Sx).reshape((-1, K, K))
        Amx = bmv(Atr, mx).reshape((-1, K))
        q = q.reshape((-1, K))
        Aq = bmv(At, q)
        mm = pt.sum(mdr * mx[:, None, :], axis=-1).reshape((-1,))
    qq = pt.sum(md * q, axis=-1)
    diag = pt.sum(At * ZT, axis=-1)  # (A_d^T Sx A_d)_kk
    mean = pt.concatenate([mm[:, None] + c * Amx, mm[:, None] - c * Amx], axis=1).T
    base = qq[:, None] + (c * c) * diag
    var = pt.concatenate([base + 2.0 * c * Aq, base - 2.0 * c * Aq], axis=1).T
    return mean, var


def _sigma_derivatives(md, At, alpha, beta, group):
    """``g`` and ``H`` per observation (or per run of ``group``) at the ``2K`` sigma
    points ``m_d +- c A_d e_k``::

        g = abar m + A u,     u = c (alpha_+ - alpha_-) / a
        H = bbar m m^T + m w^T + w m^T + A diag(gamma) A^T,
            w = A c (beta_+ - beta_-) / a,  gamma = c^2 (beta_+ + beta_-) / a

    With runs the sums over a run are products with the run's stacked ``m`` (``group
    x K``) and ``A^T`` (``(group K) x K``): ``O(K^3)`` per observation, as one
    product per run.
    """
    K = md.type.shape[-1]
    a = 2 * K
    c = float(np.sqrt(K))
    abar = pt.mean(alpha, axis=0)  # (n,)
    u = (c / a) * (alpha[:K] - alpha[K:]).T  # (n, K)
    if group is None:
        g = abar[:, None] * md + pt.sum(At * u[:, :, None], axis=1)
    else:
        runs = -1
        Atr = At.reshape((runs, group * K, K))
        g = pt.sum((abar[:, None] * md).reshape((runs, group, K)), axis=1) + pt.sum(
            Atr * u.reshape((runs, group * K))[:, :, None], axis=1
        )
    if beta is None:
        return g, None
    bbar = pt.mean(beta, axis=0)
    w = pt.sum(At * ((c / a) * (beta[:K] - beta[K:]).T)[:, :, None], axis=1)  # A (.)
    gamma = ((c * c) / a) * (beta[:K] + beta[K:]).T  # (n, K)
    if group is None:
        H = bbar[:, None, None] * (md[:, :, None] * md[:, None, :])
        H = H + md[:, :, None] * w[:, None, :] + w[:, :, None] * md[:, None, :]
        return g, H + bmm(pt.matrix_transpose(At * gamma[:, :, None]), At)
    mdr = md.reshape((runs, group, K))
    wr = w.reshape((runs, group, K))
    H = bmm(pt.matrix_transpose(mdr * bbar.reshape((runs, group))[:, :, None]), mdr)
    MW = bmm(pt.matrix_transpose(mdr), wr)
    H = H + MW + pt.matrix_transpose(MW)
    Atg = Atr * gamma.reshape((runs, group * K))[:, :, None]
    return g, H + bmm(pt.matrix_transpose(Atg), Atr)
