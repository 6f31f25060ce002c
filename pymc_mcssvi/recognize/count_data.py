"""Checks of count and category data (topic models' documents) before a fit.

A document-term matrix with a negative or fractional count, a ``Multinomial`` whose
``n`` disagrees with the rows' sums, or a word index beyond the vocabulary make the
log density ``-inf`` (or fail inside PyTensor). The fit then stopped with a
divergence message or PyTensor's ``DisconnectedInputError``, neither of which named
the cause. These checks name the variable, the rows and what to change.
"""

from __future__ import annotations

import numpy as np
from pytensor.graph.fg import MissingInputError
from pytensor.tensor.random.basic import CategoricalRV, MultinomialRV

from pymc_mcssvi.exceptions import UnsupportedModelError
from pymc_mcssvi.recognize.graph import evaluate_static

__all__ = ["check_count_data"]


def check_count_data(model, obs) -> None:
    """Raise :class:`~pymc_mcssvi.UnsupportedModelError` for count or category data
    outside the likelihood's support.

    ``pm.Multinomial``: counts must be non-negative whole numbers, every row must have
    at least one count (a document with no tokens), and ``n`` must equal the rows'
    sums. ``pm.Categorical``: values must be whole numbers in ``[0, categories)`` (a
    word index within the vocabulary). Data that cannot be evaluated before the fit
    (``pm.Minibatch``) are left to the fit.

    Examples
    --------
    >>> import numpy as np, pymc as pm
    >>> with pm.Model() as m:
    ...     w = pm.Multinomial("w", n=[3, 2], p=[0.5, 0.5], observed=[[1, 2], [2, 1]])
    >>> check_count_data(m, w)
    Traceback (most recent call last):
    ...
    pymc_mcssvi.exceptions.UnsupportedModelError: Variable 'w': its n (2 at row 1) ...
    """
    op = obs.owner.op if obs.owner is not None else None
    if not isinstance(op, (MultinomialRV, CategoricalRV)):
        return
    value = model.rvs_to_values.get(obs)
    params = op.dist_params(obs.owner)
    try:
        if isinstance(op, MultinomialRV):
            y, n = evaluate_static([value, params[0]])
        else:
            y, k = evaluate_static([value, params[0].shape[-1]])
    except (MissingInputError, ValueError, TypeError):
        return
    y = np.asarray(y, dtype="float64")
    whole = np.isfinite(y) & (y == np.round(y))
    if isinstance(op, CategoricalRV):
        bad = ~whole | (y < 0) | (y >= int(k))
        if bad.any():
            raise UnsupportedModelError(
                obs.name,
                f"its observed value {_first(y, bad)} is not a category index in "
                f"0..{int(k) - 1} ({int(bad.sum())} such entries)",
                "map the data to indices 0..categories-1 (a word index beyond the vocabulary: "
                "build the vocabulary from all documents, or drop unseen words)",
            )
        return
    bad = ~whole | (y < 0)
    if bad.any():
        raise UnsupportedModelError(
            obs.name,
            f"its counts must be non-negative whole numbers; {_first(y, bad)} is not "
            f"({int(bad.sum())} such entries)",
            "check the document-term (count) matrix",
        )
    totals = y.sum(axis=-1)
    empty = np.flatnonzero((totals == 0).reshape(-1))
    if empty.size:
        raise UnsupportedModelError(
            obs.name,
            f"{empty.size} row(s) have no counts (rows {_rows(empty)}): documents with zero "
            "tokens carry no information about the topics and make the per-document blocks "
            "their priors",
            "drop those rows (e.g. counts[counts.sum(1) > 0]) and their entries in n",
        )
    n = np.broadcast_to(np.asarray(n, dtype="float64"), totals.shape)
    off = np.flatnonzero((n != totals).reshape(-1))
    if off.size:
        i = off[0]
        raise UnsupportedModelError(
            obs.name,
            f"its n ({n.reshape(-1)[i]:g} at row {i}) is not the sum of the row's counts "
            f"({totals.reshape(-1)[i]:g}); {off.size} row(s) disagree (rows {_rows(off)})",
            "pass n=counts.sum(-1) (PyMC casts fractional counts to whole numbers, so the "
            "rows' sums can change)",
        )


def _first(y, bad) -> str:
    """The first flagged entry of ``y`` and its position, e.g. ``-1 at (2, 3)``."""
    first = np.argwhere(bad)[0]
    return f"{y[tuple(first)]:g} at {tuple(int(i) for i in first)}"


def _rows(idx, most=5) -> str:
    shown = ", ".join(str(int(i)) for i in idx[:most])
    return shown + (", ..." if idx.size > most else "")
