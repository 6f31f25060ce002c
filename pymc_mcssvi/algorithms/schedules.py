r"""Step-size schedules for the natural-gradient and standard-gradient updates.

Every schedule is ``rho_t = base(t) * scale`` where ``t`` counts accepted steps
and ``scale`` is a multiplier the step kernel adapts:

``"adaptive"``
    ``base = 1``; ``scale`` starts at ``rho0`` (default 1: the fixed-point
    update), grows by ``grow`` after an accepted step (capped at ``rho_max``) and
    is halved whenever the candidate's bound is lower than the current one (or
    not finite). The bound is exact and cheap in predictor space, so this is a
    backtracking line search without extra evaluations. For full-batch fits.
``"inverse"``
    The paper's ``rho_t = rho0 / t``.
``"power"``
    Robbins-Monro ``rho_t = rho0 * (t + tau)^(-kappa)``, ``0.5 < kappa <= 1``.
    For minibatches, where bounds of different batches cannot be compared.
``"constant"``
    ``rho_t = rho0``.

For the decreasing schedules ``scale`` only shrinks when a step produces a
non-finite bound or an indefinite precision, and recovers by ``grow`` after.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytensor.tensor as pt

__all__ = ["Schedule", "make_schedule"]

_KINDS = ("adaptive", "inverse", "power", "constant")


@dataclass(frozen=True)
class Schedule:
    """A step-size schedule (see the module docstring).

    Examples
    --------
    >>> s = Schedule("power", rho0=1.0, tau=1.0, kappa=0.7)
    >>> float(s.base(pt.constant(3.0)).eval())  # (3 + 1) ** -0.7
    0.378929141627...
    """

    kind: str = "adaptive"
    rho0: float = 1.0
    tau: float = 1.0
    kappa: float = 0.7
    grow: float = 1.5
    shrink: float = 0.5
    rho_max: float = 1.0

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"schedule must be one of {_KINDS}, got {self.kind!r}")
        if self.rho0 <= 0:
            raise ValueError(f"rho0 must be positive, got {self.rho0}")
        if self.kind == "power" and not (0.0 < self.kappa <= 1.0):
            raise ValueError(f"kappa must be in (0, 1], got {self.kappa}")

    @property
    def monotone(self) -> bool:
        """Whether a decrease of the bound rejects a step."""
        return self.kind == "adaptive"

    def base(self, t):
        """The deterministic part of the schedule at accepted-step count ``t >= 1``."""
        t = pt.maximum(pt.as_tensor(t).astype("float64"), 1.0)
        if self.kind == "adaptive":
            return pt.constant(1.0)
        if self.kind == "inverse":
            return self.rho0 / t
        if self.kind == "power":
            return self.rho0 * (t + self.tau) ** (-self.kappa)
        return pt.constant(self.rho0)

    def initial_scale(self) -> float:
        return self.rho0 if self.kind == "adaptive" else 1.0

    def next_scale(self, scale, accepted):
        """Scale after a step was accepted or rejected."""
        cap = self.rho_max if self.kind == "adaptive" else 1.0
        return pt.switch(accepted, pt.minimum(scale * self.grow, cap), scale * self.shrink)


def make_schedule(schedule, *, minibatch: bool, **overrides) -> Schedule:
    """Resolve the ``schedule=`` argument of the inference classes.

    ``"auto"`` is ``"adaptive"`` for full-batch fits and ``"power"`` for
    minibatch fits. A float gives a constant step size.
    """
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, int | float):
        return Schedule("constant", rho0=float(schedule), **overrides)
    if schedule in (None, "auto"):
        schedule = "power" if minibatch else "adaptive"
    return Schedule(schedule, **overrides)
