r"""Gaussian globals whose rows a general (Monte Carlo + autodiff) term never couples.

A general term's Hessian is needed only in q(w)'s blocks. When the term never
couples two rows of a set of matrices with the same number of rows (a
correlated topic model's documents ``softmax(eta[d]) @ beta``, per-group
effects inside a non-affine likelihood), its Hessian restricted to them is
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

__all__ = ["PROBE_SCALE", "SEPARABLE_TOL", "separable_rows"]

#: Size of the random point's offset from the start and of the probes' perturbations.
PROBE_SCALE = 0.3
#: Largest change of an unperturbed row's gradient, relative to the largest change,
#: still read as no coupling (rounding).
SEPARABLE_TOL = 1e-10


def separable_rows(gaussians, general_terms, model, point, seed: int = 0) -> tuple[int, ...]:
    """Ids of the Gaussian globals whose rows the general terms never couple.

    Candidates are the matrices (two or more dimensions) with the same number of
    rows ``R > 1``, largest total size first; the first candidate set that
    passes the probes is returned (one set: its colored products are exact only
    when no other set is colored), else ``()``.

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
    candidates: dict[int, list[int]] = {}
    for i, g in enumerate(gaussians):
        if len(g.shape) >= 2 and g.shape[0] > 1:
            candidates.setdefault(int(g.shape[0]), []).append(i)
    if not general_terms or not candidates:
        return ()
    offsets = np.cumsum([0] + [g.size for g in gaussians])
    dim = int(offsets[-1])
    w = pt.vector("w_probe", shape=(dim,), dtype="float64")
    repl = {
        g.value: w[o : o + g.size].reshape(g.shape).astype(g.value.dtype)
        for g, o in zip(gaussians, offsets, strict=False)
    }
    value_vars = set(model.value_vars) - set(repl)
    total = pt.sum([pt.sum(t.logp) for t in general_terms])
    for v in graph_inputs([total]):
        if v in value_vars:
            repl[v] = pt.constant(np.asarray(point[v.name], dtype=v.dtype))
    total = graph_replace(total, repl, strict=False)
    grad_fn = pytensor.function([w], pt.grad(total, w), on_unused_input="ignore")

    rng = np.random.default_rng(seed)
    start = np.concatenate(
        [np.asarray(point[g.value.name], dtype="float64").ravel() for g in gaussians]
    )
    w0 = start + PROBE_SCALE * rng.standard_normal(dim)
    g0 = grad_fn(w0)
    if not np.all(np.isfinite(g0)):
        return ()
    by_size = sorted(candidates.items(), key=lambda kv: -sum(gaussians[i].size for i in kv[1]))
    for R, members in by_size:
        # (R, n) flat positions of each row's coordinates, over the members
        rows = np.concatenate(
            [offsets[i] + np.arange(gaussians[i].size).reshape(R, -1) for i in members],
            axis=1,
        )
        if _rows_uncoupled(grad_fn, w0, g0, rows, rng):
            return tuple(members)
    return ()


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
