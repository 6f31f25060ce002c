r"""Monte Carlo + autodiff estimator of ``g`` and ``H`` for non-affine log densities.

For a log density :math:`\ell(w)` that does not factor through an affine predictor
(e.g. ``mu = a * exp(-b * t)``), Bonnet's and Price's theorems give

.. math::

    g = E_q[\nabla \ell(w)],\qquad H = E_q[\nabla^2 \ell(w)],

estimated with reparameterized draws ``w = m + A eps``. The gradient and the
Hessian of the sum are symbolic (PyTensor autodiff), vectorized over the draws.
Only q's blocks of ``H`` are needed: the Hessian is formed from Hessian-vector
products, one per coordinate, except for the matrices whose rows the terms never
couple (:func:`~pymc_mcssvi.recognize.separable.separable_rows`), which take one
product per column ("colored" directions: coordinate ``k`` of every row at once).

When every global enters the terms through integer gathers (``theta[person]``,
``exp(log_a)[item]`` once the gathers are moved down to the leaves) and each
observation's log density depends on its own gathered entries only (an item
response model), the Hessian is a sum of one small ``J x J`` matrix per
observation (``J`` gathered inputs): :class:`PerObservation` forms those from
second derivatives with respect to the ``J`` inputs and adds them into q's blocks,
instead of one Hessian-vector product per coordinate of the globals whose rows
are coupled. Same draws, same numbers.

Draws are either fresh each iteration (unbiased, the paper's estimator) or
*fixed* for the whole fit (a sample-average approximation: the bound becomes a
deterministic function of q, so the adaptive step size can compare values).
Fixed draws are antithetic pairs, which makes odd moments exact.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.graph.basic import Constant
from pytensor.graph.replace import graph_replace
from pytensor.graph.traversal import graph_inputs, io_toposort

from pymc_mcssvi.estimators.parts import ObservationParts, RowWindows
from pymc_mcssvi.exceptions import UnsupportedModelError
from pymc_mcssvi.families.gaussian import covariance, sample
from pymc_mcssvi.recognize.graph import (
    depends_on_any,
    evaluate_static,
    gather_index,
    is_separable,
    lift_gathers,
)
from pymc_mcssvi.recognize.model import general_reads
from pymc_mcssvi.recognize.separable import flat_offsets, hessian_colors, read_flat
from pymc_mcssvi.recognize.stabilize import stable_logp
from pymc_mcssvi.recognize.vectorize import shapes_at_fixed, vectorize_graph

__all__ = ["GeneralEstimator", "flat_indices"]


def flat_indices(tlm):
    """Offsets of each Gaussian global in the flat vector and, per segment, the
    ``(R, K)`` array of flat positions."""
    starts = flat_offsets(tlm.gaussians)
    offsets, off = [int(o) for o in starts[:-1]], int(starts[-1])
    maps = []
    for seg in tlm.segments:
        idx = np.full((seg.rows, seg.k), -1, dtype="int64")
        for gid in seg.members:
            j = np.arange(tlm.gaussians[gid].size)
            idx[seg.row_of[gid], seg.col_of[gid]] = offsets[gid] + j
        assert (idx >= 0).all()
        maps.append(idx)
    return offsets, off, maps


def moment_matched(half):
    """Draws ``(n, R, K)`` whose second moment per row is exactly the identity.

    With their negatives (antithetic pairs) the fixed draws then have the standard
    normal's mean and covariance exactly, so expectations of quadratic functions are
    exact: 32 plain pairs in 26 dimensions gave a group scale 0.6 NUTS sds too high
    on a hierarchical decay curve. Rows with fewer draws than coordinates are left as
    drawn.

    Examples
    --------
    >>> import numpy as np
    >>> e = moment_matched(np.random.default_rng(0).standard_normal((40, 3, 5)))
    >>> bool(np.allclose(np.einsum("nrk,nrl->rkl", e, e) / 40, np.eye(5)))
    True
    """
    n, _, k = half.shape
    if n <= k:
        return half
    second = np.einsum("nrk,nrl->rkl", half, half) / n
    L = np.linalg.cholesky(second)
    # e L^-T per row: second moment L^-1 S L^-T = I
    return np.einsum("rkl,nrl->nrk", np.linalg.inv(L), half)


class GeneralEstimator:
    """Expectations of the general (non-affine) terms of a :class:`TwoLevelModel`.

    Parameters
    ----------
    tlm : TwoLevelModel
    n_draws : int
        Number of draws (rounded up to an even number when ``fixed``).
    fixed : bool
        Use the same antithetic draws every iteration.
    seed : int
        Seed of the fixed draws.
    row_batch : int, optional
        Evaluate the terms on the observations of ``row_batch`` rows of a per-row
        global at a time (:class:`~pymc_mcssvi.estimators.parts.RowWindows`, see
        :attr:`windows`); the other globals' derivatives are scaled to all rows.
    """

    def __init__(self, tlm, n_draws: int = 64, fixed: bool = True, seed: int = 0, row_batch=None):
        self.tlm = tlm
        self.offsets, self.dim, self.maps = flat_indices(tlm)
        #: with ``row_batch``: the windows of the rows and the segment they batch
        self.windows, self.batched = None, None
        #: ids of the Gaussian globals the general terms read
        read = self.reads = general_reads(tlm)
        batched = _batchable(tlm, read) if row_batch is not None else []
        # With row_batch every Hessian block or diagonal of the globals the terms read
        # comes from the window's gradients (Stein's identity). Globals in full
        # segments still take products, of the whole terms (all rows, not scaled).
        self._diagonal = tuple(tlm.general_diagonal)
        self._blocks_stein = tuple(tlm.general_stein_blocks)
        if row_batch is not None:
            members = lambda kind: {  # noqa: E731
                g for seg in tlm.segments if seg.kind == kind for g in seg.members if g in read
            }
            self._diagonal = tuple(sorted(set(self._diagonal) | members("diag")))
            self._blocks_stein = tuple(sorted(set(self._blocks_stein) | members("block")))
        # Stein's blocks need more draws than block coordinates (per antithetic half)
        k_stein = max((seg.k for seg in tlm.segments if self._stein_block_segment(seg)), default=0)
        n_draws = max(int(n_draws), 2 * (k_stein + 1))
        self.n_draws = int(n_draws) + (int(n_draws) % 2 if fixed else 0)
        self.fixed = fixed
        self.seed = seed
        self._fixed_eps = {}
        #: the terms' sum over observations part by part (every Hessian entry from
        #: Stein's identity, so only the value and gradient are needed), or None
        self.parts = None
        self.active = bool(tlm.general_terms)
        if not self.active:
            return
        w = pt.vector("w_flat", shape=(self.dim,))
        # stable forms before autodiff: the derivative of log(1 - sigmoid(x)) is 0 / 0
        # where sigmoid(x) rounds to 1
        total = pt.sum([pt.sum(stable_logp(t.logp)) for t in tlm.general_terms])
        total = read_flat(total, w, tlm.gaussians)
        grad = pt.grad(total, w)
        # one Hessian-vector product per color: coordinate k of every row of the
        # row-separable globals at once, and one per coordinate of the others
        no_products = tuple(self._diagonal) + self._blocks_stein
        self._color_of = hessian_colors(tlm.gaussians, tlm.general_rows, read, no_products)
        n_colors = max(int(self._color_of[:, 0].max()) + 1, 1)
        colored = np.flatnonzero(self._color_of[:, 0] >= 0)
        colors = pt.set_subtensor(
            pt.zeros((n_colors, self.dim))[self._color_of[colored, 0], colored], 1.0
        )
        c = pt.vector("color", shape=(self.dim,))
        hvp = pt.grad(pt.sum(grad * c), w)
        # sizes read from tensors at fixed w and c: batched over draws and colors they
        # would become a batch of sizes (the split positions of a join's gradient, a
        # topic model's [eta, 0]), which JAX cannot trace and numba runs in object mode
        total, grad, hvp = shapes_at_fixed([w, c], [total, grad, hvp])
        if colored.size:
            hess = vectorize_graph(hvp, {c: colors})  # (C, dim)
        else:  # every Hessian entry comes from the gradients (Stein's identity)
            hess = pt.zeros((1, self.dim))
        self._w = w
        self._graphs = (total, grad, hess)
        #: the products one color at a time (a scan over the colors: a chunked step
        #: holds one product's intermediates, not every color's)
        self._hvp, self._color, self._colors = hvp, c, colors
        self._products = bool(colored.size)
        self.per_observation = None
        if row_batch is None:  # (per observation: all of them at once)
            self.per_observation = PerObservation.build(tlm, self.offsets, self.maps)
        per_obs = self.per_observation
        if per_obs is not None and per_obs.cost >= n_colors * per_obs.n_obs:
            self.per_observation = None  # the colored products are cheaper
        if row_batch is not None:
            self._row_windows(total, w, batched, row_batch)
        elif not colored.size and self.per_observation is None:
            # the value's and the gradient's intermediates of one draw
            self.parts = ObservationParts.build(total, w, 16.0 * self._dependent_elements())

    def _row_windows(self, total, w, batched, row_batch):
        """Set :attr:`windows` and :attr:`batched` for ``row_batch`` rows a step, or
        raise :class:`~pymc_mcssvi.exceptions.UnsupportedModelError` saying why not."""
        if not batched:
            read = self.reads
            shared = [
                self.tlm.gaussians[g].name
                for seg in self.tlm.segments
                if seg.kind == "full"
                for g in seg.members
                if g in read and len(self.tlm.gaussians[g].shape) >= 1
            ]
            hint = (
                f"; {', '.join(map(repr, shared))} share one full covariance: give the "
                f"per-row one blocks of its own, e.g. cov={{{shared[0]!r}: 'block'}}"
                if shared
                else ""
            )
            raise ValueError(
                "row_batch moves a window of the rows of a per-row global (one block of q "
                "per row, such as a topic model's document logits) at each step, and the "
                f"Monte Carlo terms of this model read no such global{hint}; or drop "
                "row_batch"
            )
        elements = 16.0 * self._dependent_elements()
        reasons = []
        for s in batched:
            seg = self.tlm.segments[s]
            (gid,) = seg.members
            g = self.tlm.gaussians[gid]
            positions = (self.offsets[gid] + np.arange(g.size)).reshape((g.shape[0], -1))
            windows, reason = RowWindows.build(
                total, w, elements, positions, row_batch, check=self._window_gradient
            )
            if windows is None:
                reasons.append(f"{g.name!r}: {reason}")
                continue
            rows = np.asarray(seg.row_of[gid]).reshape((g.shape[0], -1))
            masks = np.zeros((windows.n_windows, seg.rows), dtype=bool)
            for j, (lo, hi) in enumerate(zip(windows.lo, windows.hi, strict=True)):
                masks[j, rows[lo:hi].ravel()] = True
            self.windows, self.batched, self._window_masks = windows, s, masks
            return
        first = self.tlm.gaussians[self.tlm.segments[batched[0]].members[0]].name
        raise UnsupportedModelError(
            first,
            "row_batch cannot split the Monte Carlo terms' observations by its rows ("
            + "; ".join(reasons)
            + ")",
            "drop row_batch",
        )

    def _window_gradient(self, parts, window):
        """The gradient of ``parts``' window ``window`` with respect to the flat globals at
        a random point (one draw), to check which rows a window's observations read."""
        W = pt.matrix("w_check", shape=(1, self.dim))
        _, grad = parts.values(vectorize_graph, W, window=pt.constant(window))
        fn = pytensor.function([W], grad[0], mode="FAST_COMPILE")
        rng = np.random.default_rng(0)
        return fn(0.1 * rng.standard_normal((1, self.dim)))

    def window_rows(self, window):
        """``(rows,)`` booleans of the batched segment: the rows window ``window`` moves."""
        return pt.constant(self._window_masks)[window]

    def _eps(self, seg):
        shape = (self.n_draws, seg.rows, seg.k)
        if not self.fixed:
            return pt.random.normal(size=shape)
        key = (seg.rows, seg.k)
        if key not in self._fixed_eps:
            rng = np.random.default_rng(self.seed + 7919 * seg.rows + seg.k)
            half = moment_matched(rng.standard_normal((self.n_draws // 2, seg.rows, seg.k)))
            # a shared variable, not a constant: an argument of the compiled step, which
            # JAX does not embed in (and XLA does not fold through) its program
            self._fixed_eps[key] = pytensor.shared(
                np.concatenate([half, -half]), name=f"fixed_eps_{seg.rows}x{seg.k}"
            )
        return self._fixed_eps[key]

    def expectations(
        self,
        states,
        parameterization,
        need_hessian=True,
        draws=None,
        by_color=False,
        scan_mode=None,
        window=None,
    ):
        """``(T, grads, hessians)`` with per-segment ``(R, K)`` / ``(R, K, K)`` blocks.

        With :attr:`windows` (``row_batch``), ``window`` (a symbolic integer, taken
        modulo the number of windows) selects the rows whose observations are
        evaluated.

        ``draws`` (a :class:`~pymc_mcssvi.terms.base.Chunk` of draw positions, fixed
        draws only) restricts the averages to those draws, weighted: their part of the
        averages over all draws. ``by_color`` takes the Hessian-vector products one
        color at a time (a scan compiled with ``scan_mode``).
        """
        if not self.active:
            return pt.constant(0.0), [None] * len(states), [None] * len(states)
        n = self.n_draws if draws is None else draws.index.shape[0]
        W = pt.zeros((n, self.dim))
        stein = {}  # diagonal segment -> (draws' deviations from the mean, variances)
        stein_rows = {}  # block segment -> (draws' deviations, covariance blocks)
        for s, (seg, st, idx) in enumerate(zip(self.tlm.segments, states, self.maps, strict=True)):
            eps = self._eps(seg)
            if draws is not None:
                eps = eps[draws.index]
            sampled = sample(st, parameterization, eps)
            W = pt.set_subtensor(W[:, idx.reshape(-1)], sampled.reshape((n, seg.dim)))
            if self._is_stein(seg):
                var = covariance(st, parameterization)[:, 0, 0]
                stein[s] = ((sampled - st.mean[None]).reshape((n, seg.dim)), var)
            elif self._stein_block_segment(seg):
                stein_rows[s] = (sampled - st.mean[None], covariance(st, parameterization))
        average = _average if draws is None else _weighted_average(draws.weight, self.n_draws)
        if need_hessian and self.per_observation is not None:
            return self.per_observation.expectations(W, self.maps, average)
        graphs = self._graphs if (need_hessian and not by_color) else self._graphs[:2]
        if self.windows is not None:
            if window is None:
                raise ValueError("a row_batch estimator evaluates one window at a time")
            window = window % self.windows.n_windows
            vals = [*self.windows.parts.values(vectorize_graph, W, scan_mode, window)]
            vals += vectorize_graph(list(graphs[2:]), {self._w: W})
        elif self.parts is not None:
            vals = [*self.parts.values(vectorize_graph, W, scan_mode)]
            vals += vectorize_graph(list(graphs[2:]), {self._w: W})
        else:
            vals = vectorize_graph(list(graphs), {self._w: W})
        T = average(vals[0])
        g = average(vals[1])
        # segments the terms do not read: no gradient, no Hessian
        read = [bool(set(seg.members) & self.reads) for seg in self.tlm.segments]
        grads = [g[idx] if r else None for idx, r in zip(self.maps, read, strict=True)]
        # a window's terms, scaled to all rows for every segment but the batched one
        # (whose rows outside the window do not move)
        scale = None if self.windows is None else self.windows.scale
        scaled = lambda x, s: x if (scale is None or x is None or s == self.batched) else scale * x  # noqa: E731
        if scale is not None:
            T = scale * T
            grads = [scaled(x, s) for s, x in enumerate(grads)]
        if not need_hessian:
            return T, grads, [None] * len(states)
        if by_color:
            HV = self._products_by_color(W, average, scan_mode)
        else:
            HV = average(vals[2])
        hess = []
        for s, idx in enumerate(self.maps):
            if not read[s]:
                hess.append(None)
                continue
            if s in stein_rows:
                hess.append(scaled(_stein_blocks(vals[1][:, idx], *stein_rows[s], average), s))
                continue
            if s in stein:
                # Stein's identity: E[g(w) (w - m)] = H S for the diagonal S, entry by entry
                dev, var = stein[s]
                diag = average(vals[1][:, idx.reshape(-1)] * dev) / var
                hess.append(scaled(diag[:, None, None], s))
                continue
            blocks = _blocks(HV, idx, self._color_of)
            # (products: of the whole terms, all rows, never scaled)
            hess.append(0.5 * (blocks + blocks.dimshuffle(0, 2, 1)))
        return T, grads, hess

    def _is_stein(self, seg) -> bool:
        """Whether the segment's Hessian diagonal comes from the gradients."""
        return seg.kind == "diag" and seg.members[0] in self._diagonal

    def _stein_block_segment(self, seg) -> bool:
        """Whether the segment's per-row Hessian blocks come from the gradients."""
        return seg.kind == "block" and set(seg.members) <= set(self._blocks_stein)

    def _products_by_color(self, W, average, mode=None):
        """The Hessian-vector products of every color, averaged over the draws ``W``,
        computed one color at a time by a scan (``(C, dim)``)."""

        if not self._products:
            return pt.zeros((1, self.dim))

        def product(color):
            return average(vectorize_graph(self._hvp, {self._w: W, self._color: color}))

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The `mode` argument of `scan`", FutureWarning)
            return pytensor.scan(product, sequences=[self._colors], return_updates=False, mode=mode)

    def bytes_per_draw(self, by_color: bool = True) -> float:
        """Rough bytes of one draw's intermediates in a chunked step: the static sizes
        of the nodes of the terms' log density that depend on the globals, for the
        value, the gradient and the colored Hessian-vector products (one at a time
        with ``by_color``), or for one part's value and gradient (:attr:`parts`)."""
        elements = self._dependent_elements()
        if self.parts is not None:  # one part's value and gradient at a time
            return 8.0 * elements * 2 / self.parts.n_parts
        # the value and the gradient, and one color's product at a time (a scan) or
        # every color's at once
        n_colors = 1 if by_color else int(self._color_of[:, 0].max()) + 1
        return 8.0 * elements * (2 + n_colors)

    def _dependent_elements(self) -> float:
        """Entries of the nodes of the terms' log density that depend on the globals."""
        total, _, _ = self._graphs
        dependent = {self._w}
        elements = 0.0
        for node in io_toposort([self._w], [total]):
            if not any(i in dependent for i in node.inputs):
                continue
            dependent.update(node.outputs)
            for out in node.outputs:
                shape = out.type.shape
                elements += float(np.prod([1 if d is None else d for d in shape], dtype=float))
        return elements


def _batchable(tlm, read) -> list[int]:
    """Segments that can be moved a window of rows at a time (``row_batch``): one
    per-row global each (a block per row, or a diagonal), read by the general terms
    (``read``: their ids), largest first."""
    out = []
    for s, seg in enumerate(tlm.segments):
        if len(seg.members) != 1 or seg.kind not in ("block", "diag"):
            continue
        (gid,) = seg.members
        g = tlm.gaussians[gid]
        if gid in read and len(g.shape) >= 1 and int(g.shape[0]) > 1:
            out.append(s)
    return sorted(out, key=lambda s: -tlm.segments[s].dim)


def _average(x):
    """The mean over the leading (draws) axis."""
    return pt.mean(x, axis=0)


def _weighted_average(weight, n_total):
    """Some draws' part of the mean over ``n_total`` draws, weighted."""

    def average(x):
        w = weight.reshape((-1,) + (1,) * (x.ndim - 1))
        return pt.sum(w * x, axis=0) / n_total

    return average


def _stein_blocks(grads, dev, cov, average):
    """Per-row Hessian blocks from the gradients by Stein's identity,
    ``E[g (w - m)^T] = H Sigma``: ``(R, K, K)`` from the draws' gradients and deviations
    from the mean (``(n, R, K)`` each) and q's covariance blocks ``Sigma`` (``(R, K, K)``),
    symmetrized. The draws' outer products are summed by one batched product per row
    (``(R, K, n) @ (R, n, K)``): no ``(n, R, K, K)`` array. Exact when the log density is
    quadratic and the draws' second moments are exact (fixed moment-matched draws).

    ``average`` weighs the draws (all of them, or a chunk's part of the average): it is
    applied to a one-hot stand-in to read each draw's weight.
    """
    n = grads.shape[0]
    weight = average(pt.eye(n))  # (n,): each draw's weight in the average
    g = (grads * weight[:, None, None]).dimshuffle(1, 2, 0)  # (R, K, n)
    outer = pt.matmul(g, dev.dimshuffle(1, 0, 2))  # (R, K, K): E[g dev^T]
    # H = E[g dev^T] Sigma^-1 = (Sigma^-1 E[dev g^T])^T, Sigma symmetric
    H = pt.linalg.solve(cov, outer.dimshuffle(0, 2, 1), assume_a="pos", b_ndim=2)
    H = H.dimshuffle(0, 2, 1)
    return 0.5 * (H + H.dimshuffle(0, 2, 1))


def _blocks(HV, idx, color_of):
    """A segment's blocks ``H[idx[r, j], idx[r, k]]``, ``(R, K, K)``, from the colored
    products ``HV`` (``(C, dim)``).

    A coordinate with its own color has its column of ``H`` in that color's product
    (read at the other coordinate's position; by symmetry also its row). Two
    coordinates of the row-separable globals: in the same row, the second one's
    color at the first one's position; in different rows ``H`` is 0. The index
    arrays broadcast over ``(R, K, 1)`` and ``(R, 1, K)``.
    """
    color, row = color_of[idx, 0], color_of[idx, 1]
    if np.any(color < 0):  # globals the terms do not read (or Stein's): zero there
        uncolored = (color < 0)[:, :, None] | (color < 0)[:, None, :]
        own = color_of.copy()
        own[own[:, 0] < 0, 0] = 0
        blocks = _blocks(HV, idx, own)
        return pt.switch(pt.constant(uncolored), 0.0, blocks)
    by_b = HV[color[:, None, :], idx[:, :, None]]  # HV[c(b), a]
    if np.all(row < 0):  # every coordinate has its own color: the dense blocks
        return by_b
    ra, rb = pt.constant(row[:, :, None]), pt.constant(row[:, None, :])
    if np.all(row >= 0):  # all row-separable: zero between rows
        return pt.switch(pt.eq(ra, rb), by_b, 0.0)
    by_a = HV[color[:, :, None], idx[:, None, :]]  # HV[c(a), b]
    use_b = (rb < 0) | ((ra >= 0) & pt.eq(ra, rb))
    return pt.switch(use_b, by_b, pt.switch(ra < 0, by_a, 0.0))


class PerObservation:
    """The general terms as functions of per-observation gathered inputs.

    Each term's log density, with its gathers moved down to the leaves
    (:func:`~pymc_mcssvi.recognize.graph.lift_gathers`), reads every Gaussian
    global only as ``x[idx]`` (``x`` a vector), and entry ``n`` depends on entry
    ``n`` of each such input only. Each input is replaced by a placeholder vector;
    its entries are flat coordinates of the globals (``positions``). With the
    draws ``W`` of all coordinates, the inputs are ``W[:, positions]``; the
    gradient adds each input's derivative at its coordinates and the Hessian adds
    each pair's mixed second derivative into q's blocks where both coordinates lie
    in the same block row.

    Use :meth:`build`, which returns None when a term does not have that form.
    """

    def __init__(self, placeholders, positions, term_of, total, maps):
        self.placeholders, self.positions, self.total = placeholders, positions, total
        n = len(placeholders)
        self.pairs = [(j, k) for j in range(n) for k in range(j, n) if term_of[j] == term_of[k]]
        self.grads = pt.grad(total, placeholders)
        # entrywise: the derivative of sum_n g_j[n] along input k is d2 l_n / dp_j dp_k
        self.second = [
            pt.grad(pt.sum(self.grads[j]), placeholders[k], disconnected_inputs="ignore")
            for j, k in self.pairs
        ]
        #: observations of all the terms (the length of each term's inputs)
        self.n_obs = sum(positions[term_of.index(t)].size for t in sorted(set(term_of)))
        self.cost = sum(p.size for p in positions) + sum(positions[j].size for j, _ in self.pairs)
        self._scatter = self._block_scatter(maps)

    @classmethod
    def build(cls, tlm, offsets, maps):
        values = {g.value: (i, g) for i, g in enumerate(tlm.gaussians)}
        total, holders, positions, term_of = 0.0, [], [], []
        for t, term in enumerate(tlm.general_terms):
            logp = lift_gathers(term.logp, through_affine=True)
            repl = {}
            try:
                for node in io_toposort(list(graph_inputs([logp])), [logp]):
                    for v in node.inputs:
                        if v not in values:
                            continue
                        gid, g = values[v]
                        idx = gather_index(node)
                        if idx is None or len(g.shape) != 1 or node.inputs[0] is not v:
                            return None
                        if not all(isinstance(i, Constant) for i in graph_inputs([idx])):
                            # pm.Data (set_data) or pm.Minibatch indices change: the
                            # positions below are fixed
                            return None
                        out = node.outputs[0]
                        if out in repl:
                            continue
                        (idx_val,) = evaluate_static([idx])
                        idx_val = np.asarray(idx_val, dtype="int64") % g.shape[0]
                        ph = pt.vector(f"{g.name}_gathered", shape=(idx_val.size,))
                        repl[out] = ph
                        holders.append(ph)
                        positions.append(offsets[gid] + idx_val)
                        term_of.append(t)
            except Exception:
                return None
            if not repl:
                return None
            flat = graph_replace(logp, repl, strict=False)
            if depends_on_any(flat, values):
                return None
            if not all(is_separable(flat, ph) for ph in repl.values()):
                return None
            total = total + pt.sum(stable_logp(flat))
        return cls(holders, positions, term_of, total, maps)

    def _block_scatter(self, maps):
        """Per segment ``(target, source)``: flat positions in its ``(R * K * K)``
        blocks and the positions in the concatenated second derivatives."""
        dim = sum(m.size for m in maps)
        seg = np.full(dim, -1)
        row = np.zeros(dim, dtype="int64")
        col = np.zeros(dim, dtype="int64")
        for s, idx in enumerate(maps):
            R, K = idx.shape
            seg[idx] = s
            row[idx] = np.arange(R)[:, None]
            col[idx] = np.arange(K)[None, :]
        starts = np.cumsum([0] + [self.positions[j].size for j, _ in self.pairs])
        out = []
        for s, idx in enumerate(maps):
            K = idx.shape[1]
            targets, sources = [], []
            for p, (j, k) in enumerate(self.pairs):
                a, b = self.positions[j], self.positions[k]
                same = (seg[a] == s) & (seg[b] == s) & (row[a] == row[b])
                n = np.flatnonzero(same)
                base = row[a[n]] * K * K
                targets.append(base + col[a[n]] * K + col[b[n]])
                sources.append(starts[p] + n)
                if j != k:
                    targets.append(base + col[b[n]] * K + col[a[n]])
                    sources.append(starts[p] + n)
            out.append((np.concatenate(targets), np.concatenate(sources)))
        return out

    def expectations(self, W, maps, average=None):
        """``(T, grads, hessians)`` as :meth:`GeneralEstimator.expectations`, for the
        draws ``W`` (``(S, dim)``) of all the coordinates (``average``: over them, by
        default their mean)."""
        average = _average if average is None else average
        repl = {ph: W[:, pos] for ph, pos in zip(self.placeholders, self.positions, strict=True)}
        vals = vectorize_graph([self.total, *self.grads, *self.second], repl)
        n = len(self.grads)
        T = average(vals[0])
        g = pt.zeros((W.shape[1],))
        for pos, gj in zip(self.positions, vals[1 : 1 + n], strict=True):
            g = pt.inc_subtensor(g[pos], average(gj))
        d2 = pt.concatenate([average(v) for v in vals[1 + n :]])
        hess = []
        for idx, (target, source) in zip(maps, self._scatter, strict=True):
            R, K = idx.shape
            blocks = pt.zeros((R * K * K,))
            if target.size:
                blocks = pt.inc_subtensor(blocks[target], d2[source])
            hess.append(blocks.reshape((R, K, K)))
        return T, [g[idx] for idx in maps], hess
