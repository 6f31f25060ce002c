"""MC-SSVI: natural-gradient steps on both natural parameters (paper eq. generalSVIupdate).

For the Gaussian q of each segment::

    P     <- (1 - rho) P     + rho (-H)            (paper eq. LGM-SVI-update-V)
    P m   <- (1 - rho) P m   + rho (g - H m)       (paper eq. LGM-SVI-update-mean)

with ``g, H`` the expected gradient and Hessian of the log joint, so that the
prior's natural parameters enter through ``-H`` and ``g - H m``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pymc_mcssvi.algorithms.base import Algorithm
from pymc_mcssvi.families.gaussian import natural_step

__all__ = ["MCSSVIStep"]


@dataclass(frozen=True)
class MCSSVIStep(Algorithm):
    """Natural-gradient step for mean and precision.

    Examples
    --------
    >>> MCSSVIStep().parameterization
    'precision'
    """

    name = "mcssvi"
    parameterization = "precision"

    @property
    def newton_mean(self) -> bool:
        return True

    def step(self, states, grads, hessians, rho, scale, t, opt_states):
        new = [natural_step(s, g, H, rho) for s, g, H in zip(states, grads, hessians, strict=True)]
        return new, opt_states
