"""H-MC-SSVI: natural-gradient step for the precision, standard gradient for the mean.

The paper's hybrid (section 3, "Our second contribution"): the precision follows
the MC-SSVI fixed-point step (eq. LGM-SVI-update-V), the mean follows the
standard-gradient step of S-DSVI (eq. LGM-dsvi-update-mean)::

    P  <- (1 - rho) P + rho (-H)
    m  <- m + optimizer(g)          g = E_q[grad log p(y, w)]

The paper uses Adagrad with learning rate 1.0 for the mean. On correlated
designs a first-order mean step needs O(condition number) iterations; the
default here preconditions the mean gradient with the covariance of q, which
makes the full-batch step coincide with MC-SSVI's (see docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from pymc_mcssvi.algorithms.base import Algorithm
from pymc_mcssvi.families.gaussian import GaussianBlocks, cho_solve_blocks, natural_step

__all__ = ["HMCSSVIStep"]


@dataclass(frozen=True)
class HMCSSVIStep(Algorithm):
    """Natural step for the precision; a separate gradient step for the mean.

    ``mean_optimizer=None`` (the default of :class:`~pymc_mcssvi.HMCSSVI`) takes
    the gradient step preconditioned by the new covariance,
    ``m <- m + rho S_new g``, the natural gradient for the mean. With an
    :class:`~pymc_mcssvi.algorithms.optimizers.Optimizer` (the paper: Adagrad,
    learning rate 1.0) the mean follows that first-order rule on ``g`` itself.
    """

    name = "hmcssvi"
    parameterization = "precision"

    @property
    def newton_mean(self) -> bool:
        return self.mean_optimizer is None

    def step(self, states, grads, hessians, rho, scale, t, opt_states):
        new_states, new_opt = [], []
        opt = self.mean_optimizer
        for s, g, H, (ms, fs) in zip(states, grads, hessians, opt_states, strict=True):
            prec = natural_step(s, g, H, rho, mean_update=False)
            if opt is None:
                delta = rho * cho_solve_blocks(prec.factor, g)
            else:
                delta, ms = opt.update(g, ms, self._opt_scale(opt, rho, scale), t)
            new_states.append(GaussianBlocks(s.mean + delta, prec.factor))
            new_opt.append((ms, fs))
        return new_states, new_opt
