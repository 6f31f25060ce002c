r"""Monte Carlo + autodiff estimator of ``g`` and ``H`` for non-affine log densities.

For a log density :math:`\ell(w)` that does not factor through an affine predictor
(e.g. ``mu = a * exp(-b * t)``), Bonnet's and Price's theorems give

.. math::

    g = E_q[\nabla \ell(w)],\qquad H = E_q[\nabla^2 \ell(w)],

estimated with reparameterized draws ``w = m + A eps``. The gradient and the
Hessian of the sum are symbolic (PyTensor autodiff), vectorized over the draws.

Draws are either fresh each iteration (unbiased, the paper's estimator) or
*fixed* for the whole fit (a sample-average approximation: the bound becomes a
deterministic function of q, so the adaptive step size can compare values).
Fixed draws are antithetic pairs, which makes odd moments exact.
"""

from __future__ import annotations

import numpy as np
import pytensor.tensor as pt
from pytensor.gradient import jacobian
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
        hess = jacobian(grad, w, vectorize=True)
        self._w = w
        self._graphs = (total, grad, 0.5 * (hess + hess.T))

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
        H = pt.mean(vals[2], axis=0)
        hess = [H[idx[:, :, None], idx[:, None, :]] for idx in self.maps]
        return T, grads, hess
