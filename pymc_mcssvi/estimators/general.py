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

Draws are either fresh each iteration (unbiased, the paper's estimator) or
*fixed* for the whole fit (a sample-average approximation: the bound becomes a
deterministic function of q, so the adaptive step size can compare values).
Fixed draws are antithetic pairs, which makes odd moments exact.
"""

from __future__ import annotations

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.replace import graph_replace, vectorize_graph

from pymc_mcssvi.families.gaussian import sample

__all__ = ["GeneralEstimator", "flat_indices"]


def flat_indices(tlm):
    """Offsets of each Gaussian global in the flat vector and, per segment, the
    ``(R, K)`` array of flat positions."""
    offsets, off = [], 0
    for g in tlm.gaussians:
        offsets.append(off)
        off += g.size
    maps = []
    for seg in tlm.segments:
        idx = np.full((seg.rows, seg.k), -1, dtype="int64")
        for gid in seg.members:
            j = np.arange(tlm.gaussians[gid].size)
            idx[seg.row_of[gid], seg.col_of[gid]] = offsets[gid] + j
        assert (idx >= 0).all()
        maps.append(idx)
    return offsets, off, maps


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
    """

    def __init__(self, tlm, n_draws: int = 64, fixed: bool = True, seed: int = 0):
        self.tlm = tlm
        self.offsets, self.dim, self.maps = flat_indices(tlm)
        self.n_draws = int(n_draws) + (int(n_draws) % 2 if fixed else 0)
        self.fixed = fixed
        self.seed = seed
        self.active = bool(tlm.general_terms)
        if not self.active:
            return
        w = pt.vector("w_flat", shape=(self.dim,))
        repl = {
            g.value: w[o : o + g.size].reshape(g.shape)
            for g, o in zip(tlm.gaussians, self.offsets, strict=True)
        }
        total = pt.sum([pt.sum(t.logp) for t in tlm.general_terms])
        total = graph_replace(total, repl, strict=False)
        grad = pt.grad(total, w)
        # one Hessian-vector product per color: coordinate k of every row of the
        # row-separable globals at once, and one per coordinate of the others
        colors, self._color_of = _colors(tlm, self.offsets, self.dim)
        c = pt.vector("color", shape=(self.dim,))
        hvp = pt.grad(pt.sum(grad * c), w)
        hess = vectorize_graph(hvp, {c: pt.constant(colors)})  # (C, dim)
        self._w = w
        self._graphs = (total, grad, hess)

    def _eps(self, seg):
        shape = (self.n_draws, seg.rows, seg.k)
        if not self.fixed:
            return pt.random.normal(size=shape)
        rng = np.random.default_rng(self.seed + 7919 * seg.rows + seg.k)
        half = rng.standard_normal((self.n_draws // 2, seg.rows, seg.k))
        return pt.constant(np.concatenate([half, -half]))

    def expectations(self, states, parameterization, need_hessian=True):
        """``(T, grads, hessians)`` with per-segment ``(R, K)`` / ``(R, K, K)`` blocks."""
        if not self.active:
            return pt.constant(0.0), [None] * len(states), [None] * len(states)
        W = pt.zeros((self.n_draws, self.dim))
        for seg, st, idx in zip(self.tlm.segments, states, self.maps, strict=True):
            draws = sample(st, parameterization, self._eps(seg))
            W = pt.set_subtensor(W[:, idx.reshape(-1)], draws.reshape((self.n_draws, seg.dim)))
        graphs = self._graphs if need_hessian else self._graphs[:2]
        vals = vectorize_graph(list(graphs), {self._w: W})
        T = pt.mean(vals[0])
        g = pt.mean(vals[1], axis=0)
        grads = [g[idx] for idx in self.maps]
        if not need_hessian:
            return T, grads, [None] * len(states)
        HV = pt.mean(vals[2], axis=0)
        hess = []
        for idx in self.maps:
            ci, pi, known = _block_entries(idx, self._color_of)
            blocks = pt.switch(known, HV[ci, pi], 0.0)
            hess.append(0.5 * (blocks + blocks.dimshuffle(0, 2, 1)))
        return T, grads, hess


def _colors(tlm, offsets, dim):
    """The directions of the Hessian-vector products, ``(C, dim)``, and per flat
    coordinate ``(color, row)``: the color whose product holds that coordinate's
    column, and the row of a row-separable global (``-1`` for the others)."""
    color_of = np.zeros((dim, 2), dtype="int64")
    colors = []
    for i, g in enumerate(tlm.gaussians):
        pos = offsets[i] + np.arange(g.size)
        if i in tlm.general_rows:
            R = g.shape[0]
            per_row = pos.reshape(R, -1)
            for k in range(per_row.shape[1]):
                v = np.zeros(dim)
                v[per_row[:, k]] = 1.0
                color_of[per_row[:, k]] = [len(colors), -1]
                colors.append(v)
            color_of[pos, 1] = np.repeat(np.arange(R), per_row.shape[1])
        else:
            for p in pos:
                v = np.zeros(dim)
                v[p] = 1.0
                color_of[p] = [len(colors), -1]
                colors.append(v)
    return np.stack(colors), color_of


def _block_entries(idx, color_of):
    """Where each entry ``H[idx[r, j], idx[r, k]]`` of a segment's blocks is in the
    colored products ``HV``: ``(color, position, known)`` arrays of shape ``(R, K, K)``.

    A coordinate of a global that is not row-separable has its own color, whose
    product is its column of ``H`` (the row of either coordinate by symmetry). Two
    coordinates of the row-separable globals: in the same row, the product of the
    second one's color at the first one's position; in different rows ``H`` is 0.
    """
    a = idx[:, :, None] * np.ones_like(idx)[:, None, :]  # H[a, b]
    b = idx[:, None, :] * np.ones_like(idx)[:, :, None]
    row_a, row_b = color_of[a, 1], color_of[b, 1]
    own_b = row_b < 0
    ci = np.where(own_b, color_of[b, 0], np.where(row_a < 0, color_of[a, 0], color_of[b, 0]))
    pi = np.where(own_b, a, np.where(row_a < 0, b, a))
    known = own_b | (row_a < 0) | (row_a == row_b)
    return ci, pi, known
