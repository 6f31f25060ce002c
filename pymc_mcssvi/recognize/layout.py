"""Covariance structure of the Gaussian q: how globals are grouped into segments.

q over the Gaussian globals factorizes over *segments*; each segment is
``rows`` independent Gaussian blocks of size ``k`` (paper: one full covariance
per column of U and V in PMF, per document in CTM). ``"full"`` keeps all
correlations of its members, ``"block"`` keeps the correlations within each
leading index (row), ``"diag"`` keeps none.
"""

from __future__ import annotations

import numpy as np

from pymc_mcssvi.exceptions import UnsupportedModelError
from pymc_mcssvi.recognize.ir import GaussianGlobal, Segment

__all__ = [
    "ARROW_FULL_DIM",
    "ARROW_MAX_HEAD",
    "MAX_CROSSED_FULL_DIM",
    "MAX_FULL_DIM",
    "arrow_head",
    "build_segments",
    "resolve_structure",
]

#: Largest total dimension for which the automatic layout keeps one full covariance.
MAX_FULL_DIM = 1000
#: The same when observations read two large effect vectors at different rows
#: (crossed or nested grouping factors). The block-arrow q keeps the couplings of
#: the blocks with the fixed effects, not those between two factors' blocks, so
#: its natural step is block-Jacobi between the factors: a crossed Poisson GLMM
#: with 900 subjects x 200 items (1102 dims) took 3873 iterations (102 s) with it,
#: 39 (26 s) with one full covariance.
MAX_CROSSED_FULL_DIM = 2000
#: Effect vectors up to this size always join the full head of the layout.
SMALL_GLOBAL = 64
#: The limit instead of :data:`MAX_FULL_DIM` when the larger effect vectors are read
#: only through gathers of one grouping factor (random intercepts and slopes) and the
#: rest fits the arrow's head: the posterior precision given the hyperparameters is then
#: itself block-arrow, which the arrow q keeps exactly at a cost linear in the groups
#: (:mod:`~pymc_mcssvi.algorithms.arrow`). A logistic GLMM with random intercepts and
#: slopes, 300 groups (604 dimensions): 48.7 s with one full covariance, 4.5 s with the
#: arrow, the same posterior (means within 0.02 sd, sds 0.996-1.026x); 150 groups
#: 11.4 s against 3.4 s. Below it a full covariance costs about the same.
ARROW_FULL_DIM = 256


def resolve_structure(
    gaussians: list[GaussianGlobal],
    cov: str | dict | None,
    joint_blocks: list[list[int]] | None = None,
    row_blocks: set[int] | None = None,
    crossed: bool = False,
    arrow: bool = False,
) -> dict[int, str]:
    """Choose ``"full"``, ``"block"`` or ``"diag"`` for every Gaussian global.

    Parameters
    ----------
    gaussians : list of GaussianGlobal
    cov : {"auto", "full", "block", "diag"} or dict, optional
        One structure for all globals, or a mapping from global name to
        structure (unlisted globals get the automatic choice).
    joint_blocks : list of list of int, optional
        Groups of globals that the recognizer found indexed by the same
        grouping factor; the automatic choice puts them in one block segment.
    row_blocks : set of int, optional
        Globals read through a bilinear predictor (matrix factorization): the
        automatic choice is one block per row (the paper's factorized q).
    crossed : bool
        Whether an observation reads two large effect vectors at different rows;
        the automatic choice then keeps one full covariance up to
        :data:`MAX_CROSSED_FULL_DIM` dimensions instead of :data:`MAX_FULL_DIM`.
    arrow : bool
        Whether the arrow q represents the posterior's structure (effects of one
        grouping factor, a small head): the automatic choice then keeps one full
        covariance up to :data:`ARROW_FULL_DIM` dimensions only.

    Returns
    -------
    dict
        Global id to structure.
    """
    valid = {"auto", "full", "block", "diag"}
    names = {g.name: i for i, g in enumerate(gaussians)}
    per_var = {}
    if isinstance(cov, dict):
        for name, kind in cov.items():
            if name not in names:
                raise UnsupportedModelError(
                    name,
                    f"`cov` names {name!r}, which is not a Gaussian global of the model",
                    f"use one of {sorted(names)}",
                )
            if kind not in valid:
                raise ValueError(f"cov must be one of {sorted(valid)} for {name!r}, got {kind!r}")
            per_var[names[name]] = kind
        default = "auto"
    else:
        default = "auto" if cov is None else cov
    for kind in [default, *per_var.values()]:
        if kind not in valid:
            raise ValueError(f"cov must be one of {sorted(valid)} or a dict of them, got {kind!r}")

    def factor_rows(i):  # a factor of a matrix factorization: one block per row
        return bool(row_blocks) and i in row_blocks and len(gaussians[i].shape) >= 2

    # the factors' blocks are not part of the one full covariance the limit is about: the
    # biases and intercept of ``mu + a[u] + b[i] + (U[u] * V[i]).sum(-1)`` keep theirs
    total = sum(g.size for i, g in enumerate(gaussians) if not factor_rows(i))
    limit = MAX_CROSSED_FULL_DIM if crossed else ARROW_FULL_DIM if arrow else MAX_FULL_DIM
    out = {}
    for i, g in enumerate(gaussians):
        kind = per_var.get(i, default)
        if kind == "auto" and factor_rows(i):
            kind = "block"
        if kind == "auto" and total > limit and _in_joint(i, joint_blocks):
            kind = "block"
        if kind == "auto":
            if total <= limit or g.size <= SMALL_GLOBAL:
                kind = "full"
            elif len(g.shape) >= 2:
                kind = "block"
            else:
                kind = "diag"
        if kind == "block" and len(g.shape) < 2:
            # A vector has one entry per row: its row blocks are 1 x 1.
            kind = "diag" if not _in_joint(i, joint_blocks) else "block"
        out[i] = kind
    return out


def _in_joint(i, joint_blocks):
    return bool(joint_blocks) and any(i in grp and len(grp) > 1 for grp in joint_blocks)


def build_segments(
    gaussians: list[GaussianGlobal],
    structure: dict[int, str],
    joint_blocks: list[list[int]] | None = None,
    by_column: set[int] | None = None,
) -> list[Segment]:
    """Group globals into segments according to ``structure``.

    All ``"full"`` globals share one segment (their cross-covariances are kept);
    each ``"diag"`` global gets a diagonal segment; ``"block"`` globals that are
    listed together in ``joint_blocks`` (same leading length) share one block
    segment whose rows hold all their effects for one group, and other block
    globals get their own: one block per row, or per column for the matrices in
    ``by_column`` (a factor stored ``(K, rows)``).
    """
    by_column = by_column or set()
    segments: list[Segment] = []
    full = [i for i in range(len(gaussians)) if structure[i] == "full"]
    if full:
        seg = Segment("full", 1, sum(gaussians[i].size for i in full), full)
        off = 0
        for i in full:
            n = gaussians[i].size
            seg.row_of[i] = np.zeros(n, dtype="int64")
            seg.col_of[i] = off + np.arange(n, dtype="int64")
            off += n
        segments.append(seg)
    done = set(full)
    for grp in joint_blocks or []:
        members = [i for i in grp if structure[i] == "block" and i not in done]
        if len(members) < 2:
            continue
        rows = {gaussians[i].shape[0] for i in members}
        if len(rows) != 1:
            continue
        (r,) = rows
        ks = [gaussians[i].size // r for i in members]
        seg = Segment("block", r, sum(ks), members)
        off = 0
        for i, k in zip(members, ks, strict=True):
            j = np.arange(gaussians[i].size, dtype="int64")
            seg.row_of[i] = j // k
            seg.col_of[i] = off + j % k
            off += k
        segments.append(seg)
        done.update(members)
    for i, g in enumerate(gaussians):
        if i in done:
            continue
        j = np.arange(g.size, dtype="int64")
        if structure[i] == "diag":
            seg = Segment("diag", g.size, 1, [i])
            seg.row_of[i] = j
            seg.col_of[i] = np.zeros_like(j)
        elif i in by_column and len(g.shape) == 2:
            k, r = g.shape
            seg = Segment("block", r, k, [i])
            seg.row_of[i] = j % r
            seg.col_of[i] = j // r
        else:
            r = g.shape[0] if g.shape else 1
            k = g.size // max(r, 1)
            seg = Segment("block", r, k, [i])
            seg.row_of[i] = j // k
            seg.col_of[i] = j % k
        segments.append(seg)
    return segments


#: Largest head (full segment) for which the arrow coupling is used.
ARROW_MAX_HEAD = 256


def arrow_head(tlm) -> int | None:
    """Segment index of the arrow's head in a recognized model, or ``None``.

    The head is the one full segment (the fixed effects) when some predictor
    term reads it together with a block or diagonal segment (random effects of
    many groups). Matrix factorizations (their own phases) and heads above
    :data:`ARROW_MAX_HEAD` dimensions are left block diagonal.
    """
    full = [s for s, seg in enumerate(tlm.segments) if seg.kind == "full"]
    if len(full) != 1 or tlm.bilinear_terms or tlm.segments[full[0]].dim > ARROW_MAX_HEAD:
        return None
    (head,) = full
    return head if arrow_body(tlm, head) else None


def arrow_body(tlm, head) -> list[int]:
    """The segments the arrow couples with ``head``: those that some predictor term
    (or a two-predictor term's sum) reads together with it, the only terms with cross
    blocks (:meth:`~pymc_mcssvi.estimators.predictor.PredictorGeometry.accumulate_cross`).
    The others keep no ``(R, K, p)`` cross state (a topic model's 500,000 topic logits
    against a 49-dimensional head: 196 MB per array)."""
    if head is None:
        return []
    seg_of = {gid: s for s, seg in enumerate(tlm.segments) for gid in seg.members}
    body = set()
    for term in tlm.predictor_terms + [p.parts[2] for p in tlm.pair_terms]:
        segs = {seg_of[t.source] for t in term.terms}
        if head in segs:
            body |= segs - {head}
    return sorted(body)
