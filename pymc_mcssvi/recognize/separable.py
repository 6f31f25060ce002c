r"""Gaussian globals whose rows a general (Monte Carlo + autodiff) term never couples.

A general term's Hessian is needed only in q(w)'s blocks. When the term never
couples two rows of a set of globals with the same number of rows (a
correlated topic model's documents ``softmax(eta[d]) @ beta``, per-group
effects ``a[g]`` inside a non-affine likelihood), its Hessian restricted to them is
block diagonal by row, and every row's block comes from one Hessian-vector
product per column with "colored" directions (coordinate ``k`` of every row at
once) instead of one per coordinate
(:class:`~pymc_mcssvi.estimators.general.GeneralEstimator`).

Whether a term couples rows is decided numerically, where it cannot be fooled
by the way the graph is written: at a random point near the start, the rows
are perturbed in ``ceil(log2 R)`` groups, group ``b`` the rows whose index has
bit ``b`` set. Any two rows differ in some bit, so a coupling between them
changes the gradient of a row outside the perturbed group in at least one
probe. A separable graph computes each row's gradient from that row's inputs
and leaves the other rows' gradients unchanged (up to :data:`SEPARABLE_TOL`,
for graphs that shift every row by a global maximum).
"""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.graph.replace import graph_replace
from pytensor.graph.traversal import graph_inputs

__all__ = [
    "PROBE_SCALE",
    "SEPARABLE_TOL",
    "flat_offsets",
    "hessian_colors",
    "read_flat",
    "separable_rows",
]

#: Size of the random point's offset from the start and of the probes' perturbations.
PROBE_SCALE = 0.3
#: Largest change of an unperturbed row's gradient, relative to the largest change,
#: still read as no coupling (rounding).
SEPARABLE_TOL = 1e-10


def separable_rows(gaussians, general_terms, model, point, seed: int = 0) -> tuple[int, ...]:
    """Ids of the Gaussian globals whose rows the general terms never couple.

    Candidates are the globals with the same number of rows ``R > 1`` (a vector's
    rows are its entries: group effects ``a[g]`` inside a non-affine likelihood),
    each member probed alone, then the members that pass together (else the
    largest of them); the largest passing set over the numbers of rows is
    returned (one set: its colored products are exact only when no other set is
    colored), else ``()``.

    Parameters
    ----------
    gaussians : list of GaussianGlobal
    general_terms : list of GeneralTerm
    model : pm.Model
    point : dict
        Values of the model's value variables by name (the start).
    seed : int
        Seed of the probe point and perturbations.

    Examples
    --------
    >>> import numpy as np, pymc as pm
    >>> from pymc_mcssvi.recognize import recognize
    >>> with pm.Model() as m:
    ...     mu = pm.Normal("mu", 0, 1, shape=3)
    ...     eta = pm.Normal("eta", mu, 1, shape=(30, 3))
    ...     _ = pm.Potential("lik", pm.math.logsumexp(eta, axis=-1).sum())
    >>> recognize(m).general_rows  # eta, the second Gaussian global
    (1,)
    """
    if not general_terms:
        return ()
    total = pt.sum([pt.sum(t.logp) for t in general_terms])
    used = set(graph_inputs([total]))
    candidates: dict[int, list[int]] = {}
    for i, g in enumerate(gaussians):
        if len(g.shape) >= 1 and g.shape[0] > 1 and g.value in used:
            candidates.setdefault(int(g.shape[0]), []).append(i)
    if not candidates:
        return ()
    offsets = flat_offsets(gaussians)
    dim = int(offsets[-1])
    w = pt.vector("w_probe", shape=(dim,), dtype="float64")
    others = set(model.value_vars) - {g.value for g in gaussians}
    fixed = {v: pt.constant(np.asarray(point[v.name], dtype=v.dtype)) for v in used & others}
    total = read_flat(total, w, gaussians, fixed)
    grad_fn = pytensor.function([w], pt.grad(total, w), on_unused_input="ignore")

    rng = np.random.default_rng(seed)
    start = np.concatenate(
        [np.asarray(point[g.value.name], dtype="float64").ravel() for g in gaussians]
    )
    w0 = start + PROBE_SCALE * rng.standard_normal(dim)
    g0 = grad_fn(w0)
    if not np.all(np.isfinite(g0)):
        return ()

    def rows_of(members, R):  # (R, n) flat positions of each row's coordinates
        return np.concatenate(
            [offsets[i] + np.arange(gaussians[i].size).reshape(R, -1) for i in members], axis=1
        )

    def passes(members, R):
        return _rows_uncoupled(grad_fn, w0, g0, rows_of(members, R), rng)

    # per number of rows: the members that pass alone, then together (else the largest
    # of them alone); the largest passing set over all numbers of rows
    best: tuple[int, ...] = ()
    for R, members in candidates.items():
        alone = [i for i in members if passes([i], R)]
        if len(alone) > 1 and not passes(alone, R):
            alone = [max(alone, key=lambda i: gaussians[i].size)]
        if sum(gaussians[i].size for i in alone) > sum(gaussians[i].size for i in best):
            best = tuple(alone)
    return best


def _rows_uncoupled(grad_fn, w0, g0, rows, rng) -> bool:
    R = rows.shape[0]
    for bit in range(int(np.ceil(np.log2(R)))):
        moved = (np.arange(R) >> bit) & 1 == 1
        w1 = w0.copy()
        w1[rows[moved].ravel()] += PROBE_SCALE * rng.standard_normal(rows[moved].size)
        change = np.abs(grad_fn(w1) - g0)
        if not np.all(np.isfinite(change)):
            return False
        if np.any(change[rows[~moved].ravel()] > SEPARABLE_TOL * change.max()):
            return False
    return True


def flat_offsets(gaussians) -> np.ndarray:
    """Start of each Gaussian global in the flat vector of all of them, then its length."""
    return np.cumsum([0] + [g.size for g in gaussians])


def read_flat(total, w, gaussians, fixed=None):
    """``total`` with the Gaussian globals' value variables read, in order, from the
    flat vector ``w`` (and the replacements ``fixed`` of other inputs)."""
    repl = {
        g.value: w[o : o + g.size].reshape(g.shape).astype(g.value.dtype)
        for g, o in zip(gaussians, flat_offsets(gaussians), strict=False)
    }
    return graph_replace(total, {**repl, **(fixed or {})}, strict=False)


def hessian_colors(gaussians, rows, read=None, diagonal=()) -> np.ndarray:
    """Per flat coordinate ``(color, row)``: the Hessian-vector product (color) whose
    direction holds that coordinate, and its row in a row-separable global (``-1``
    for the others, which have a color of their own). ``rows`` are the ids of the
    row-separable globals (:func:`separable_rows`); the number of colors is the
    number of products the Hessian takes. ``read`` (ids of the globals the terms
    read; default all) gives the others color ``-1``: their Hessian is zero, no
    product is needed. ``diagonal`` (ids of globals whose q is diagonal and whose Hessian
    diagonal comes from the gradients alone, Stein's identity) get color ``-1``:
    no product.

    Examples
    --------
    >>> from types import SimpleNamespace as G
    >>> gs = [G(size=4, shape=(2, 2)), G(size=3, shape=(3,))]
    >>> hessian_colors(gs, rows=(0,))[:, 0].tolist()
    [0, 1, 0, 1, 2, 3, 4]
    >>> hessian_colors(gs, rows=(0,), read={0})[:, 0].tolist()
    [0, 1, 0, 1, -1, -1, -1]
    >>> hessian_colors(gs, rows=(0,), diagonal=(1,))[:, 0].tolist()
    [0, 1, 0, 1, -1, -1, -1]
    """
    offsets = flat_offsets(gaussians)
    color_of = np.zeros((int(offsets[-1]), 2), dtype="int64")
    n = 0
    for i, g in enumerate(gaussians):
        pos = offsets[i] + np.arange(g.size)
        if (read is not None and i not in read) or i in diagonal:
            color_of[pos] = -1
            continue
        if i in rows:
            R = g.shape[0]
            per_row = pos.reshape(R, -1)  # coordinate k of every row: one color
            color_of[per_row, 0] = n + np.arange(per_row.shape[1])[None, :]
            color_of[per_row, 1] = np.arange(R)[:, None]
            n += per_row.shape[1]
        else:
            color_of[pos] = np.column_stack([n + np.arange(g.size), np.full(g.size, -1)])
            n += g.size
    return color_of
