r"""The explicit state of a fit: everything that changes between iterations.

A step is a pure function ``step(state, ...) -> (state, info)`` (see
:mod:`~pymc_mcssvi.algorithms.kernel`): :class:`KernelState` holds the accepted
q (``base``), the candidate the next iteration evaluates (``cand``), the
accepted state's derivatives (cached, so that a rejected candidate is retried
with a shorter step without re-evaluating the base), the step size, the
optimizers' states and the sub-states of the hyperparameters and Rayleigh
globals; :class:`StepInfo` is what one iteration reports.

States are trees of NamedTuples, tuples and arrays (``None`` for absent parts).
The same tree holds NumPy arrays (values), PyTensor shared variables (the storage
a compiled step updates in place, :class:`SharedState`) or symbolic expressions
(the step's graph): :func:`tree_map` walks any of them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pytensor
from pytensor.tensor.random.type import RandomType

__all__ = [
    "ArrowState",
    "GaussianHyperState",
    "KernelState",
    "PointHyperState",
    "QState",
    "RayleighState",
    "SharedState",
    "StepInfo",
    "tree_leaves",
    "tree_map",
]


class QState(NamedTuple):
    """q(w) per segment: means ``(R, K)`` and triangular factors ``(R, K, K)`` (the lower
    Cholesky factor of the precision, or the upper factor of the covariance for S-DSVI)."""

    means: tuple
    factors: tuple


class ArrowState(NamedTuple):
    """The arrow coupling of the head segment with the others
    (:mod:`~pymc_mcssvi.algorithms.arrow`): the accepted state's cross blocks ``X``
    (``None`` for the head), the view's ``G`` per segment and the Schur factor ``LS``."""

    X: tuple
    G: tuple
    LS: Any


class PointHyperState(NamedTuple):
    """Point hyperparameters: accepted and candidate ``h``, the accepted gradient and
    Hessian, and the first-order optimizer's state (empty for Newton steps)."""

    base: Any
    cand: Any
    grad: Any
    hess: Any
    base_opt: tuple
    cand_opt: tuple


class GaussianHyperState(NamedTuple):
    """Mean-field q(h): accepted and candidate means ``(1, n_h)`` and precision factors
    ``(1, n_h, n_h)``, the accepted gradient and Hessian, and the linear-response view
    (the precision factor of q(h) with q(w) eliminated, ``dm_w / dh`` per segment;
    ``None`` and ``()`` when the step is not coupled)."""

    base_mean: Any
    base_factor: Any
    cand_mean: Any
    cand_factor: Any
    grad: Any
    hess: Any
    lr_factor: Any
    lr_responses: tuple


class RayleighState(NamedTuple):
    """q of each Rayleigh global (scales ``sigma_q``), accepted and candidate, the
    accepted gradients, each global's own step-size factor and the first-order
    optimizers' states (S-DSVI)."""

    base: tuple
    cand: tuple
    grad: tuple
    rho_factor: tuple
    base_opt: tuple
    cand_opt: tuple


class KernelState(NamedTuple):
    """Everything a fit changes between iterations.

    Attributes
    ----------
    base, cand : QState
        The accepted q and the candidate evaluated next.
    grads, hessians : tuple
        ``g`` ``(R, K)`` and ``H`` ``(R, K, K)`` per segment at ``base``.
    bound : scalar
        The accepted state's bound (``-inf`` before the first accepted step).
    phase_bounds : (n_phases,)
        The accepted value of each phase (matrix factorizations move their factors
        in turn, each judged by its phase's value).
    phase : int
        The phase of the candidate.
    scale : scalar
        The step-size multiplier the schedule adapts.
    t : scalar
        Accepted steps.
    base_opt, cand_opt : tuple
        First-order optimizers' states per segment (H-MC-SSVI's mean, S-DSVI).
    crosses : tuple
        With the hyperparameters' step coupled: ``E[d g_s / d h]`` per segment, then
        ``E[d H_s / d h]`` (``None`` where a segment does not depend on ``h``).
    arrow : ArrowState or None
    hyper : PointHyperState, GaussianHyperState or None
    rayleigh : RayleighState or None
    """

    base: QState
    cand: QState
    grads: tuple
    hessians: tuple
    bound: Any
    phase_bounds: Any
    phase: Any
    scale: Any
    t: Any
    base_opt: tuple
    cand_opt: tuple
    crosses: tuple
    arrow: ArrowState | None
    hyper: PointHyperState | GaussianHyperState | None
    rayleigh: RayleighState | None


class StepInfo(NamedTuple):
    """What one iteration reports.

    Attributes
    ----------
    bound : scalar
        The accepted state's bound after the iteration.
    candidate_bound : scalar
        The candidate's bound (``-inf`` or NaN where it was not finite).
    accepted : int8
        Whether the candidate was accepted.
    rho : scalar
        The step size of the next candidate.
    """

    bound: Any
    candidate_bound: Any
    accepted: Any
    rho: Any


def _is_node(x) -> bool:
    return isinstance(x, tuple | list)


def tree_map(fn, tree, *rest):
    """``fn`` applied to the leaves of ``tree`` (and the matching leaves of ``rest``);
    NamedTuples, tuples and lists keep their structure, ``None`` stays ``None``.

    Examples
    --------
    >>> tree_map(lambda a, b: a + b, QState((1, 2), (3,)), QState((10, 20), (30,)))
    QState(means=(11, 22), factors=(33,))
    >>> tree_map(lambda a: a, (None, [1]))
    (None, [1])
    """
    if tree is None:
        return None
    if _is_node(tree):
        parts = [tree_map(fn, *children) for children in zip(tree, *rest, strict=True)]
        if isinstance(tree, list):
            return parts
        if hasattr(tree, "_fields"):
            return type(tree)(*parts)
        return tuple(parts)
    return fn(tree, *rest)


def tree_leaves(tree) -> list:
    """The leaves of a state tree in order (``None`` parts left out).

    Examples
    --------
    >>> tree_leaves(QState((1, None), (2,)))
    [1, 2]
    """
    if tree is None:
        return []
    if _is_node(tree):
        return [leaf for child in tree for leaf in tree_leaves(child)]
    return [tree]


def _shared(value, name):
    value = np.asarray(value)
    if value.dtype.kind == "f":
        value = value.astype("float64")
    return pytensor.shared(value, name=name, shape=value.shape)


def _names(tree, prefix="state"):
    """A tree of names mirroring ``tree``: field names and positions joined by dots."""
    if tree is None:
        return None
    if _is_node(tree):
        fields = getattr(tree, "_fields", None)
        keys = fields if fields is not None else [str(i) for i in range(len(tree))]
        parts = [_names(child, f"{prefix}.{key}") for key, child in zip(keys, tree, strict=True)]
        if isinstance(tree, list):
            return parts
        if fields is not None:
            return type(tree)(*parts)
        return tuple(parts)
    return prefix


class SharedState:
    """Shared variables holding a state tree: the storage a compiled step updates.

    ``symbolic`` is the tree of shared variables (the step's inputs), :meth:`get`
    and :meth:`set` move values in and out, and :meth:`updates` pairs each shared
    variable with its new value for ``pytensor.function(updates=...)``. Shapes are
    static: a state keeps its shapes for the whole fit.

    Examples
    --------
    >>> import pytensor
    >>> store = SharedState(QState((np.zeros(2),), (np.ones((1, 1)),)))
    >>> new = tree_map(lambda v: v + 1.0, store.symbolic)
    >>> fn = pytensor.function([], [], updates=store.updates(new))
    >>> _ = fn()
    >>> store.get().means[0].tolist()
    [1.0, 1.0]
    """

    def __init__(self, values, name: str = "state"):
        self.symbolic = tree_map(_shared, values, _names(values, name))

    def get(self, borrow: bool = False):
        """The current values (copies unless ``borrow``)."""
        return tree_map(lambda s: s.get_value(borrow=borrow), self.symbolic)

    def set(self, values) -> None:
        """Store ``values`` (a tree of the same structure)."""

        def put(shared, value):
            value = np.asarray(value, dtype=shared.dtype)
            if value.shape != shared.type.shape:
                raise ValueError(
                    f"{shared.name}: value of shape {value.shape}, state has {shared.type.shape}"
                )
            shared.set_value(value)

        tree_map(put, self.symbolic, values)

    def updates(self, new) -> dict:
        """``{shared variable: new value}`` for every leaf of the tree."""
        out = {}
        tree_map(lambda s, v: out.__setitem__(s, v), self.symbolic, new)
        return out

    def to_host(self) -> None:
        """Leave NumPy arrays in the shared variables (a JAX function stores its own)."""
        for s in tree_leaves(self.symbolic):
            if not isinstance(s.type, RandomType):
                s.set_value(np.array(s.get_value(borrow=True)), borrow=True)
