"""Common interface of the three structured-VI algorithms.

An algorithm is a pure step rule on the Gaussian q of each segment::

    step(states, grads, hessians, rho, scale, t, opt_states) -> (states, opt_states)

given the expected gradient ``g`` and Hessian ``H`` of the log joint at
``states`` (see :mod:`pymc_mcssvi.bounds.structured`). Acceptance, step-size
control and hyperparameters live in :mod:`pymc_mcssvi.algorithms.kernel`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pymc_mcssvi.algorithms.optimizers import Optimizer

__all__ = ["Algorithm"]


@dataclass(frozen=True)
class Algorithm:
    """Base class: subclasses set :attr:`name`, :attr:`parameterization` and :meth:`step`."""

    name = "base"
    parameterization = "precision"
    mean_optimizer: Optimizer | None = field(default=None)
    factor_optimizer: Optimizer | None = field(default=None)

    @property
    def newton_mean(self) -> bool:
        """Whether the mean step is ``m + rho P_new^{-1} g`` with ``P_new`` the new precision.

        Such steps can be coupled with the hyperparameters' step into one joint
        Newton step (:meth:`~pymc_mcssvi.algorithms.hyperparameters.MeanFieldHyperparameters.updates`).
        """
        return False

    def init_opt_state(self, means, factors):
        """Numeric optimizer state per segment: ``(mean_state, factor_state)``."""
        out = []
        for m, f in zip(means, factors, strict=True):
            ms = self.mean_optimizer.init(m) if self.mean_optimizer else ()
            fs = self.factor_optimizer.init(f) if self.factor_optimizer else ()
            out.append((ms, fs))
        return out

    def restart_opt_state(self, opt_states):
        """Optimizer states to step from after a rejected candidate."""
        out = []
        for ms, fs in opt_states:
            ms = self.mean_optimizer.restart(ms) if self.mean_optimizer else ms
            fs = self.factor_optimizer.restart(fs) if self.factor_optimizer else fs
            out.append((ms, fs))
        return out

    def step(
        self, states, grads, hessians, rho, scale, t, opt_states
    ):  # pragma: no cover - abstract
        raise NotImplementedError

    @staticmethod
    def _opt_scale(opt: Optimizer, rho, scale):
        # Plain gradient steps follow the schedule; adaptive optimizers only take its backoff.
        return rho if opt.kind == "sgd" else scale
