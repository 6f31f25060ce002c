"""Per-variable choices recorded on a model's variables by a model builder.

A builder such as :func:`~pymc_mcssvi.models.sparse_gp` writes an ordinary PyMC
model; what the model's graph cannot say, which bound a local enters with and
whether an observed variable is scored by its predictive density, it records on
the variable's ``tag``. Other samplers ignore the tags: under ``pm.sample`` the
model is the plain model.

Examples
--------
>>> import pymc as pm
>>> with pm.Model():
...     f = pm.Normal("f", 0, 1, shape=3)
>>> bound_of(mark_bound(f, "jensen"), default="optimal")
'jensen'
"""

from __future__ import annotations

__all__ = [
    "BOUNDS",
    "bound_of",
    "builder_of",
    "mark_bound",
    "mark_builder",
    "predictive",
    "scored_predictive",
]

#: Bounds a local may be marked with (``pm.fit``'s ``bound`` option, per local).
BOUNDS = ("optimal", "jensen")


def mark_bound(rv, bound: str):
    """Record that the local ``rv`` enters the bound as ``bound`` (see ``BOUNDS``);
    returns ``rv``."""
    if bound not in BOUNDS:
        raise ValueError(f"bound must be one of {BOUNDS}, got {bound!r}")
    rv.tag.mcssvi_bound = bound
    return rv


def bound_of(rv, default: str) -> str:
    """The bound recorded on the local ``rv``, else ``default``."""
    return getattr(rv.tag, "mcssvi_bound", default)


def predictive(rv):
    r"""Record that the observed ``rv`` is scored by its predictive density,
    :math:`\sum_i \log E_q[p(y_i \mid \cdot)]` instead of the bound's
    :math:`\sum_i E_q[\log p(y_i \mid \cdot)]` (the paper's sparse-GP variant V2, not
    a lower bound); returns ``rv``."""
    rv.tag.mcssvi_predictive = True
    return rv


def scored_predictive(rv) -> bool:
    """Whether :func:`predictive` marked ``rv``."""
    return bool(getattr(rv.tag, "mcssvi_predictive", False))


def mark_builder(rv, label: str):
    """Record which builder (and bound) wrote the observed ``rv``, e.g.
    ``"sparse_gp:titsias"``: recognition then skips its notes on hand-written
    spellings of the same model; returns ``rv``."""
    rv.tag.mcssvi_builder = label
    return rv


def builder_of(rv) -> str | None:
    """The label :func:`mark_builder` recorded on ``rv``, or ``None``."""
    return getattr(rv.tag, "mcssvi_builder", None)
