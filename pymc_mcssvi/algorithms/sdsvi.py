"""S-DSVI: standard gradients on the mean and the upper Cholesky factor of the covariance.

The structured bound optimized without natural gradients (paper eq. DSVIupdate),
with ``S = C^T C``, ``C`` upper triangular::

    C  <- C + optimizer( triu( diag(1 / diag C) + C H ) )   (paper eq. LGM-dsvi-update-C)
    m  <- m + optimizer( g )                                (paper eq. LGM-dsvi-update-mean)

``H`` is the expected Hessian of the log joint, which includes ``-Sigma^{-1}``
of the prior, so ``C H`` is the paper's ``-C Sigma^{-1} + 2 C sum lambda_i h_i h_i^T``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytensor.tensor as pt

from pymc_mcssvi.algorithms.base import Algorithm
from pymc_mcssvi.families.gaussian import GaussianBlocks

__all__ = ["SDSVIStep", "factor_gradient"]


def factor_gradient(C, H):
    """Gradient of the bound with respect to the upper factor ``C`` (``S = C^T C``).

    Notes
    -----
    ``dE_q[l]/dS = H / 2`` (Price's theorem) gives ``dE/dC = C H``; the entropy
    ``sum log |C_kk|`` adds ``1 / C_kk`` on the diagonal. The lower triangle is
    masked so that ``C`` stays upper triangular.
    """
    k = C.type.shape[-1]
    upper = pt.constant(np.triu(np.ones((k, k))))
    diag = pt.diagonal(C, axis1=-2, axis2=-1)
    grad = C @ H + pt.eye(k) * (1.0 / diag)[..., None, :]
    return grad * upper


@dataclass(frozen=True)
class SDSVIStep(Algorithm):
    """Standard-gradient baseline on ``(m, C)``."""

    name = "sdsvi"
    parameterization = "covariance"

    def step(self, states, grads, hessians, rho, scale, t, opt_states):
        new_states, new_opt = [], []
        mo, fo = self.mean_optimizer, self.factor_optimizer
        for s, g, H, (ms, fs) in zip(states, grads, hessians, opt_states, strict=True):
            dm, ms = mo.update(g, ms, self._opt_scale(mo, rho, scale), t)
            dC, fs = fo.update(factor_gradient(s.factor, H), fs, self._opt_scale(fo, rho, scale), t)
            new_states.append(GaussianBlocks(s.mean + dm, s.factor + dC))
            new_opt.append((ms, fs))
        return new_states, new_opt
