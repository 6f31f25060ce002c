r"""Predictor-space estimators of ``g = E_q[grad l]`` and ``H = E_q[hess l]``.

For a term ``sum_i l_i(eta_i)`` with ``eta_i = o_i + a_i^T w`` (ARCHITECTURE.md §3)

.. math::

    \eta_i \sim \mathcal N(o_i + a_i^T m,\; a_i^T S a_i),\qquad
    g = \sum_i \alpha_i a_i,\qquad H = \sum_i \beta_i a_i a_i^T,

with the one-dimensional expectations ``alpha``, ``beta`` of
:mod:`pymc_mcssvi.estimators.quadrature`. q factorizes over segments, so only the
diagonal blocks of ``H`` that q keeps are ever formed:

* *dense path* (a full segment, or a block/diag segment reached only through
  dense designs): the rows ``a_i`` restricted to the segment are assembled into
  an ``n x D_s`` matrix ``A`` and ``H = A^T diag(beta) A`` is one BLAS product;
* *sparse path* (gathers into block/diag segments: random effects, PMF rows):
  each row touches ``k`` coordinates; ``g`` and the ``K x K`` blocks of ``H`` are
  segment sums (``inc_subtensor``) of ``n k^2`` products, and the predictor
  variances gather entries of the covariance blocks. No ``n x D`` Jacobian is
  formed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Constant
from pytensor.graph.traversal import graph_inputs

from pymc_mcssvi.recognize.affine import LinearTerm
from pymc_mcssvi.recognize.graph import shape64
from pymc_mcssvi.recognize.ir import PredictorTerm, Segment

__all__ = ["PredictorGeometry", "SegmentPieces"]

#: Full segments up to this size take gathers through a dense one-hot design.
DENSE_GATHER_MAX = 2048


@dataclass
class SegmentPieces:
    """The parts of one predictor term that read one segment."""

    segment: int
    dense: list[tuple[np.ndarray, object]] = field(
        default_factory=list
    )  # (segment coords, vals (n|1, k))
    sparse: list[tuple[object, object, object]] = field(default_factory=list)  # (rows, cols, vals)
    dense_path: bool = True
    mixed: bool = False


class PredictorGeometry:
    """Everything about one predictor term that does not change between iterations.

    Parameters
    ----------
    term : PredictorTerm
        With terms already flattened to ``(rows, k)``.
    segments : list of Segment
    seg_of : dict
        Gaussian global id to segment index.
    n_rows : TensorVariable
        Number of predictor entries (``prod(eta_shape)``).
    """

    def __init__(
        self, term: PredictorTerm, segments: list[Segment], seg_of: dict[int, int], n_rows
    ):
        self.term = term
        self.segments = segments
        self.seg_of = seg_of
        self.n_rows = n_rows
        pieces: dict[int, SegmentPieces] = {}
        for t in term.terms:
            s = seg_of[t.source]
            seg = segments[s]
            p = pieces.setdefault(s, SegmentPieces(s))
            cols_const = _constant_cols(t)
            if t.is_dense and cols_const is not None:
                coords = seg.row_of[t.source][cols_const] * seg.k + seg.col_of[t.source][cols_const]
                p.dense.append((coords, t.vals))
            else:
                rows = pt.constant(seg.row_of[t.source])[t.cols]
                cols = pt.constant(seg.col_of[t.source])[t.cols]
                p.sparse.append((rows, cols, t.vals))
        for p in pieces.values():
            seg = segments[p.segment]
            if p.sparse and seg.kind == "full" and _mixed_is_cheaper(p, seg):
                p.dense_path, p.mixed = False, True
                continue
            if p.sparse and not (seg.kind == "full" and seg.dim <= DENSE_GATHER_MAX):
                p.dense_path = False
                # Dense designs into a sparse-path segment become gathers with k = D.
                for coords, vals in p.dense:
                    r = pt.constant(coords // seg.k)[None, :]
                    c = pt.constant(coords % seg.k)[None, :]
                    p.sparse.append((r, c, vals))
                p.dense = []
        self.pieces = list(pieces.values())

    # ----------------------------------------------------------------- assembly
    def design(self, p: SegmentPieces):
        """Dense ``n x D_s`` design of the term restricted to segment ``p``.

        Notes
        -----
        Dense pieces with contiguous columns are placed by slicing; gathers are
        one-hot encoded by comparison with ``arange(D_s)`` (an elementwise
        ``n x k x D_s`` product, much faster than a scatter into the design).
        """
        seg = self.segments[p.segment]
        n = self.n_rows
        if len(p.dense) == 1 and not p.sparse:
            coords, vals = p.dense[0]
            if np.array_equal(coords, np.arange(seg.dim)):
                return _rows_vals(vals, n, len(coords))
        A = pt.zeros((n, seg.dim))
        for coords, vals in p.dense:
            v = _rows_vals(vals, n, len(coords))
            if np.array_equal(coords, np.arange(coords[0], coords[0] + len(coords))):
                A = pt.inc_subtensor(A[:, coords[0] : coords[0] + len(coords)], v)
            else:
                A = pt.inc_subtensor(A[:, coords], v)
        for rows, cols, vals in p.sparse:
            idx = rows * seg.k + cols
            idx = pt.broadcast_to(idx, (n, _last_width(idx)))
            v = _rows_vals(vals, n, _last_width(idx))
            onehot = pt.eq(idx[:, :, None], pt.arange(seg.dim)[None, None, :])
            A = A + pt.sum(onehot * v[:, :, None], axis=1)
        return A

    def prepare(self):
        """Per-iteration dense designs (computed once, shared by moments, g and H)."""
        out = {}
        for p in self.pieces:
            if p.dense_path:
                out[id(p)] = self.design(p)
            elif p.mixed:
                out[id(p)] = self._mixed_parts(p)
        return out

    def _mixed_parts(self, p: SegmentPieces):
        """``(coords, X_d, cols, vals)`` of a full segment read through gathers.

        The row ``a_i`` of the design is ``X_d[i]`` placed at ``coords`` plus
        ``vals[i]`` placed at ``cols[i]``: a few dense columns (fixed effects)
        and a few gathered ones (random effects), never the ``n x D`` one-hot.
        """
        n = self.n_rows
        if p.dense:
            coords = np.concatenate([c for c, _ in p.dense]).astype("int64")
            Xd = pt.concatenate([_rows_vals(v, n, len(c)) for c, v in p.dense], axis=1)
        else:
            coords, Xd = np.zeros(0, dtype="int64"), None
        _, cols, vals = _concat_sparse(p.sparse, n)
        return coords, Xd, cols, vals

    # ------------------------------------------------------------------ moments
    def moments(self, means, covs, designs):
        """Mean and variance of the predictor under q (flattened rows).

        Parameters
        ----------
        means : list of (R, K) tensors, one per segment
        covs : list of (R, K, K) covariance blocks, one per segment
        designs : dict from :meth:`prepare`
        """
        n = self.n_rows
        offset = self.term.offset
        mu = (
            pt.zeros((n,))
            if offset is None
            else pt.broadcast_to(offset, shape64(self.term.eta_shape)).reshape((n,))
        )
        var = pt.zeros((n,))
        for p in self.pieces:
            seg = self.segments[p.segment]
            m, S = means[p.segment], covs[p.segment]
            if p.dense_path:
                A = designs[id(p)]
                mu = mu + A @ m.reshape((seg.dim,))
                var = var + _dense_quadratic(A, S, seg)
            elif p.mixed:
                dmu, dvar = _mixed_moments(designs[id(p)], m.reshape((seg.dim,)), S[0])
                mu, var = mu + dmu, var + dvar
            else:
                for rows, cols, vals in p.sparse:
                    v = 1.0 if vals is None else vals
                    mu = mu + pt.sum(v * m[rows, cols], axis=-1)
                rows, cols, vals = _concat_sparse(p.sparse, n)
                same = pt.eq(rows[:, :, None], rows[:, None, :])
                Sg = S[rows[:, :, None], cols[:, :, None], cols[:, None, :]]
                vv = vals[:, :, None] * vals[:, None, :]
                var = var + pt.sum(pt.switch(same, vv * Sg, 0.0), axis=(1, 2))
        return mu, var

    # -------------------------------------------------------------- derivatives
    def accumulate(self, alpha, beta, grads, hessians, designs):
        """Add ``sum_i alpha_i a_i`` and ``sum_i beta_i a_i a_i^T`` per segment.

        ``grads`` / ``hessians`` are lists (one entry per segment) of tensors or
        ``None``; the updated lists are returned. ``beta=None`` skips ``H``.
        """
        n = self.n_rows
        grads, hessians = list(grads), list(hessians)
        for p in self.pieces:
            seg = self.segments[p.segment]
            R, K = seg.rows, seg.k
            if p.dense_path:
                A = designs[id(p)]
                g = (alpha @ A).reshape((R, K))
                H = None if beta is None else _dense_hessian(A, beta, seg)
            elif p.mixed:
                g, H = _mixed_derivatives(designs[id(p)], alpha, beta, seg.dim)
                g = g.reshape((R, K))
                H = None if H is None else H[None]
            else:
                rows, cols, vals = _concat_sparse(p.sparse, n)
                g = pt.zeros((R, K))
                g = pt.inc_subtensor(g[rows, cols], vals * alpha[:, None])
                H = None
                if beta is not None:
                    same = pt.eq(rows[:, :, None], rows[:, None, :])
                    w = pt.switch(
                        same, beta[:, None, None] * vals[:, :, None] * vals[:, None, :], 0.0
                    )
                    r3 = pt.broadcast_to(rows[:, :, None], w.shape)
                    H = pt.zeros((R, K, K))
                    H = pt.inc_subtensor(H[r3, cols[:, :, None], cols[:, None, :]], w)
            grads[p.segment] = g if grads[p.segment] is None else grads[p.segment] + g
            if H is not None:
                hessians[p.segment] = H if hessians[p.segment] is None else hessians[p.segment] + H
        return grads, hessians

    def column_norms(self, norms, designs):
        """Add ``sum_i a_i^2`` (elementwise: the squared column norms of the design) per
        segment, as ``(R, K)`` tensors in the list ``norms`` (``None`` entries start
        at 0); the updated list is returned. The diagonal of ``accumulate``'s ``H``
        with ``beta = 1``, without forming ``H``."""
        n = self.n_rows
        norms = list(norms)
        for p in self.pieces:
            seg = self.segments[p.segment]
            if p.dense_path:
                c = pt.sum(pt.square(designs[id(p)]), axis=0).reshape((seg.rows, seg.k))
            elif p.mixed:
                coords, Xd, cols, vals = designs[id(p)]
                c = pt.zeros((seg.dim,))
                c = pt.inc_subtensor(c[cols], pt.square(vals))
                if Xd is not None:
                    c = pt.inc_subtensor(c[coords], pt.sum(pt.square(Xd), axis=0))
                c = c.reshape((seg.rows, seg.k))
            else:
                rows, cols, vals = _concat_sparse(p.sparse, n)
                c = pt.zeros((seg.rows, seg.k))
                c = pt.inc_subtensor(c[rows, cols], pt.square(vals))
            norms[p.segment] = c if norms[p.segment] is None else norms[p.segment] + c
        return norms

    def accumulate_cross(self, beta, head, crosses, designs):
        """Add ``sum_i beta_i a_{i,s} a_{i,head}^T`` for every segment ``s`` but ``head``.

        These are the cross blocks ``(R_s, K_s, p)`` of the expected Hessian
        between segment ``s`` and the head segment (the full block of the fixed
        effects) that the block-diagonal ``H`` leaves out
        (:mod:`pymc_mcssvi.algorithms.arrow`). Segments the term does not read
        together with the head are left unchanged; ``crosses`` is updated and
        returned.
        """
        heads = [p for p in self.pieces if p.segment == head]
        if not heads or beta is None:
            return crosses
        (hp,) = heads
        crosses = list(crosses)
        n = self.n_rows
        Ahb = None

        def head_design():  # (n, p), scaled by beta
            nonlocal Ahb
            if Ahb is None:
                Ah = designs[id(hp)] if hp.dense_path else self.design(hp)
                Ahb = Ah * beta[:, None]
            return Ahb

        for p in self.pieces:
            if p.segment == head:
                continue
            seg = self.segments[p.segment]
            R, K, d = seg.rows, seg.k, self.segments[head].dim
            if p.dense_path:
                X = (designs[id(p)].T @ head_design()).reshape((R, K, d))
            elif p.mixed:  # a second full segment: not an arrow
                continue
            else:
                rows, cols, vals = _concat_sparse(p.sparse, n)
                X = pt.zeros((R, K, d))
                if hp.mixed:  # the head's few entries per row, not its n x p one-hot
                    X = _mixed_cross(X, rows, cols, vals * beta[:, None], designs[id(hp)])
                else:
                    X = pt.inc_subtensor(
                        X[rows, cols], vals[:, :, None] * head_design()[:, None, :]
                    )
            s = p.segment
            crosses[s] = X if crosses[s] is None else crosses[s] + X
        return crosses


def _constant_cols(t: LinearTerm):
    """Numeric column indices of a dense term, or None if they are data dependent."""
    try:
        if not all(isinstance(v, Constant) for v in graph_inputs([t.cols])):
            return None
        return np.asarray(t.cols.eval(mode="FAST_COMPILE")).reshape(-1).astype("int64")
    except Exception:
        return None


def _rows_vals(vals, n, k):
    one = pt.ones((), dtype="float64")
    v = one if vals is None else vals
    return pt.broadcast_to(v, (n, k)).astype("float64")


def _last_width(*xs):
    """Largest last-axis length of ``xs``: a Python int when all are static, else symbolic.

    A symbolic length in ``broadcast_to`` makes PyTensor constant-fold the shape
    graph on every call (about 10 ms each; 0.3 s of a Contraception GLMM's
    set-up, whose step and profile build dozens).

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> _last_width(pt.matrix(shape=(None, 3)), pt.matrix(shape=(1, 2)))
    3
    >>> isinstance(_last_width(pt.matrix(shape=(None, 3)), pt.matrix()), int)
    False
    """
    static = [x.type.shape[-1] for x in xs]
    if all(s is not None for s in static):
        return max(static)
    k = xs[0].shape[-1]
    for x in xs[1:]:
        k = pt.maximum(k, x.shape[-1])
    return k


def _concat_sparse(sparse, n):
    rows, cols, vals = [], [], []
    for r, c, v in sparse:
        k = _last_width(r, c) if v is None else _last_width(r, c, v)
        rows.append(pt.broadcast_to(r, (n, k)))
        cols.append(pt.broadcast_to(c, (n, k)))
        vals.append(_rows_vals(v, n, k))
    if len(rows) == 1:
        return rows[0], cols[0], vals[0]
    return pt.concatenate(rows, axis=1), pt.concatenate(cols, axis=1), pt.concatenate(vals, axis=1)


def _dense_quadratic(A, S, seg: Segment):
    """``diag(A S A^T)`` for a design ``A`` (n x D_s) and block covariance ``S``."""
    if seg.kind == "full":
        return pt.sum((A @ S[0]) * A, axis=1)
    if seg.k == 1:
        return pt.square(A) @ S[:, 0, 0]
    A3 = A.reshape((A.shape[0], seg.rows, seg.k))
    AS = (A3[:, :, None, :] @ S[None])[:, :, 0, :]
    return pt.sum(AS * A3, axis=(1, 2))


def _dense_hessian(A, beta, seg: Segment):
    """Diagonal blocks of ``A^T diag(beta) A`` kept by the segment's structure."""
    if seg.kind == "full":
        # A^T (beta * A): scaling the C-ordered design keeps the product one BLAS gemm
        # (scaling A^T instead makes PyTensor build a strided copy first).
        return (A.T @ (A * beta[:, None]))[None]
    if seg.k == 1:
        return (beta @ pt.square(A))[:, None, None]
    A3 = A.reshape((A.shape[0], seg.rows, seg.k))
    Ab = A3 * beta[:, None, None]
    return pt.einsum("nrk,nrl->rkl", Ab, A3)


# ------------------------------------------------------------------ mixed path
def _static_width(x) -> int:
    """Static size of the last axis, or a guess of 2 when it is symbolic."""
    if x is None:
        return 1
    k = x.type.shape[-1] if x.type.ndim else 1
    return int(k) if k is not None else 2


def _mixed_is_cheaper(p: SegmentPieces, seg: Segment) -> bool:
    """Whether the gather-aware path beats the one-hot design for a full segment.

    Per row the one-hot path costs about ``3 D^2`` flops (moments, g and H
    through BLAS); the mixed path ``3 d^2`` for the dense columns plus scatter
    and gather work of order ``d p + p^2`` (weighted: indexed memory access is
    slower than BLAS).
    """
    d = sum(len(c) for c, _ in p.dense)
    k = sum(
        max(_static_width(r), _static_width(c), _static_width(v) if v is not None else 1)
        for r, c, v in p.sparse
    )
    return 3 * seg.dim**2 > 3 * d * d + 16 * (d * k + k * k) + 64


def _mixed_moments(parts, m, S):
    """Mean and variance of ``a_i^T w`` for the rows of a mixed design (see :meth:`_mixed_parts`)."""
    coords, Xd, cols, vals = parts
    mu = pt.sum(vals * m[cols], axis=-1)
    Scc = S[cols[:, :, None], cols[:, None, :]]
    var = pt.sum(Scc * vals[:, :, None] * vals[:, None, :], axis=(1, 2))
    if Xd is not None:
        mu = mu + Xd @ m[coords]
        Sd = S[coords]  # (d, D)
        Sdd = Sd[:, coords]
        var = var + pt.sum((Xd @ Sdd) * Xd, axis=1)
        # cross term 2 x_i^T S[coords, cols_i] v_i: a (d, n, p) gather, no n x D product
        W = pt.sum(Sd[:, cols] * vals[None], axis=2)  # (d, n)
        var = var + 2.0 * pt.sum(W.T * Xd, axis=1)
    return mu, var


def _mixed_cross(X, rows, cols, bv, parts):
    """``X[r, c, :] += bv_i a_{i,head}`` for each row's gathered entries ``(r, c)`` of a
    block segment, with the head's row ``a_{i,head}`` given as a mixed design (see
    :meth:`PredictorGeometry._mixed_parts`): ``n k (d + p)`` scattered products.
    Through the head's one-hot design they were ``n k D`` (a logistic GLMM with 20,000
    rows and a 67-dimension head: 0.6 of its 1.0 s per uncompiled iteration)."""
    coords, Xd, hcols, hvals = parts
    r, c = rows[:, :, None], cols[:, :, None]
    X = pt.inc_subtensor(X[r, c, hcols[:, None, :]], bv[:, :, None] * hvals[:, None, :])
    if Xd is not None:
        at = pt.constant(coords)[None, None, :]
        X = pt.inc_subtensor(X[r, c, at], bv[:, :, None] * Xd[:, None, :])
    return X


def _mixed_derivatives(parts, alpha, beta, D):
    """``sum_i alpha_i a_i`` and ``sum_i beta_i a_i a_i^T`` for a mixed design."""
    coords, Xd, cols, vals = parts
    g = pt.zeros((D,))
    g = pt.inc_subtensor(g[cols], vals * alpha[:, None])
    if Xd is not None:
        g = pt.inc_subtensor(g[coords], alpha @ Xd)
    if beta is None:
        return g, None
    bv = vals * beta[:, None]
    H = pt.zeros((D, D))
    H = pt.inc_subtensor(H[cols[:, :, None], cols[:, None, :]], bv[:, :, None] * vals[:, None, :])
    if Xd is not None:
        c = pt.constant(coords)
        H = pt.inc_subtensor(H[c[:, None], c[None, :]], Xd.T @ (Xd * beta[:, None]))
        M = pt.zeros((D, len(coords)))
        M = pt.inc_subtensor(M[cols], bv[:, :, None] * Xd[:, None, :])
        H = pt.inc_subtensor(H[:, c], M)
        H = pt.inc_subtensor(H[c, :], M.T)
    return g, H
