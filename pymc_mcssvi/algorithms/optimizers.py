"""First-order optimizers for the standard-gradient parts of H-MC-SSVI and S-DSVI.

Each optimizer is a pair of pure functions over symbolic tensors, in the style of
the step functions: ``init(param) -> state`` and
``update(grad, state, lr, t) -> (delta, new_state)``; the caller adds ``delta``
(an *ascent* direction: the bound is maximized).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytensor.tensor as pt

__all__ = ["Optimizer", "make_optimizer"]


@dataclass(frozen=True)
class Optimizer:
    """A first-order ascent rule.

    Parameters
    ----------
    kind : {"adagrad", "adam", "sgd"}
        ``"adagrad"`` is the paper's choice (global learning rate 1.0).
    lr : float
        Learning rate; multiplied by the step kernel's adaptive scale.
    beta1, beta2, eps : float
        Adam moments and the denominator floor.

    Examples
    --------
    >>> opt = Optimizer("sgd", lr=0.5)
    >>> delta, _ = opt.update(pt.as_tensor([2.0]), opt.init(np.zeros(1)), 1.0, 1)
    >>> delta.eval().tolist()
    [1.0]
    """

    kind: str = "adagrad"
    lr: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self):
        if self.kind not in ("adagrad", "adam", "sgd"):
            raise ValueError(f"optimizer must be 'adagrad', 'adam' or 'sgd', got {self.kind!r}")
        if self.lr <= 0:
            raise ValueError(f"learning rate must be positive, got {self.lr}")

    def init(self, value: np.ndarray) -> tuple[np.ndarray, ...]:
        """Numeric initial state for a parameter shaped like ``value``."""
        z = np.zeros_like(np.asarray(value, dtype="float64"))
        if self.kind == "adagrad":
            return (z,)
        if self.kind == "adam":
            return (z, z.copy())
        return ()

    def restart(self, state):
        """State after a rejected step: Adam's momentum is dropped so that the next
        step follows the (rescaled) gradient, an ascent direction for small steps."""
        if self.kind == "adam":
            m, v = state
            return (pt.zeros_like(m), v)
        return state

    def update(self, grad, state, scale, t):
        """Ascent step ``delta`` and the new optimizer state.

        ``t`` is the (1-based) number of accepted steps, used by Adam's bias
        correction.
        """
        lr = self.lr * scale
        if self.kind == "sgd":
            return lr * grad, ()
        if self.kind == "adagrad":
            (acc,) = state
            acc = acc + pt.square(grad)
            return lr * grad / (pt.sqrt(acc) + self.eps), (acc,)
        m, v = state
        m = self.beta1 * m + (1 - self.beta1) * grad
        v = self.beta2 * v + (1 - self.beta2) * pt.square(grad)
        t = pt.maximum(pt.as_tensor(t).astype("float64"), 1.0)
        mhat = m / (1 - self.beta1**t)
        vhat = v / (1 - self.beta2**t)
        return lr * mhat / (pt.sqrt(vhat) + self.eps), (m, v)


def make_optimizer(spec, default_lr: float) -> Optimizer:
    """Resolve an optimizer argument: a name, a ``(name, lr)`` pair or an :class:`Optimizer`."""
    if isinstance(spec, Optimizer):
        return spec
    if isinstance(spec, tuple):
        name, lr = spec
        return Optimizer(name, lr=float(lr))
    return Optimizer(spec, lr=default_lr)
