"""A general term's sum over observations, evaluated part by part (issue 48).

A topic model's ``pm.Potential`` over its nonzero counts is one scalar, but a sum over
the rows of its index and count leaves. :class:`ObservationParts` evaluates it on
slices of those rows in turn, so that a draw holds one part's ``(rows, K)`` arrays.
The gradient of a sum is the sum of the parts' gradients: the split must give the
whole term's value, gradients and Stein Hessians, and a fit the same -ELBO trace.
Forms where a split would change the numbers must be left whole.
"""

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import pytest

import pymc_mcssvi
from pymc_mcssvi.estimators import parts
from pymc_mcssvi.estimators.general import GeneralEstimator
from pymc_mcssvi.families.gaussian import GaussianBlocks
from pymc_mcssvi.recognize.model import recognize
from pymc_mcssvi.terms.base import Chunk


def _potential_ctm(D=40, V=40, K=25, n=120, seed=0):
    """A CTM with learned topics over the nonzero counts (``benchmarks/ctm_synthetic.py``'s
    spelling), with more than :data:`parts.MIN_ROWS` nonzero pairs; at ``K = 25`` the
    documents' blocks (24 logits) and the topic logits' diagonal come from Stein's
    identity, the form that is split."""
    rng = np.random.default_rng(seed)
    beta = rng.dirichlet(np.full(V, 0.3), size=K)
    eta = rng.normal(0, 1, (D, K - 1))
    theta = np.exp(np.c_[eta, np.zeros(D)])
    theta /= theta.sum(1, keepdims=True)
    counts = np.stack([rng.multinomial(n, theta[d] @ beta) for d in range(D)])
    d, v = np.nonzero(counts)
    assert d.size >= parts.MIN_ROWS
    with pm.Model() as m:
        mu = pm.Normal("mu", 0, 1, shape=K - 1)
        eta = pm.Normal("eta", mu, 1, shape=(D, K - 1))
        logit_beta = pm.Normal("logit_beta", 0, 1, shape=(K, V))
        theta = pm.math.softmax(pt.concatenate([eta, pt.zeros((D, 1))], axis=1), axis=-1)
        beta = pm.math.softmax(logit_beta, axis=-1)
        p = (theta[d] * beta[:, v].T).sum(-1)
        pm.Potential("w", (counts[d, v] * pt.log(p)).sum())
    return m


def _states(tlm, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for seg in tlm.segments:
        mean = rng.normal(0, 0.5, (seg.rows, seg.k))
        factor = np.tril(rng.normal(0, 0.1, (seg.rows, seg.k, seg.k))) + 1.5 * np.eye(seg.k)
        out.append(GaussianBlocks(pt.constant(mean), pt.constant(factor)))
    return out


def _split_into(monkeypatch, n_parts):
    """Make :meth:`ObservationParts.build` choose about ``n_parts`` parts."""
    real = parts.ObservationParts.build.__func__

    def build(cls, total, w, bytes_per_draw):
        monkeypatch.setattr(parts, "PART_BYTES", bytes_per_draw / n_parts * 1.001)
        return real(cls, total, w, bytes_per_draw)

    monkeypatch.setattr(parts.ObservationParts, "build", classmethod(build))


def _evaluate(est, states, chunk=None):
    T, g, H = est.expectations(states, "precision", draws=chunk)
    outs = [T] + [x for x in g + H if x is not None]
    return pytensor.function([], outs)()


def test_parts_give_the_whole_terms_value_gradients_and_hessians(monkeypatch):
    tlm = recognize(_potential_ctm())
    whole = GeneralEstimator(tlm)
    assert whole.parts is None  # a small term stays whole by default
    _split_into(monkeypatch, 3)
    split = GeneralEstimator(tlm)
    assert split.parts is not None and split.parts.n_parts == 3
    assert split.parts.n_parts * split.parts.part_rows > split.parts.n_rows  # padded
    states = _states(tlm)
    for a, b in zip(_evaluate(whole, states), _evaluate(split, states), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-10)
    # a chunk of the draws: the parts of its weighted share
    chunk = Chunk(pt.constant(np.arange(10, 30)), pt.constant(np.full(20, 1.0)))
    for a, b in zip(_evaluate(whole, states, chunk), _evaluate(split, states, chunk), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-10)


def test_a_fit_with_parts_follows_the_whole_terms_trace(monkeypatch):
    def trace():
        with _potential_ctm():
            approx = pymc_mcssvi.HMCSSVI(random_seed=1).fit(n=4, progressbar=False)
        return np.asarray(approx.hist)

    whole = trace()
    _split_into(monkeypatch, 3)
    np.testing.assert_allclose(trace(), whole, rtol=1e-9)


def test_globals_the_terms_do_not_read_take_no_products():
    # mu only enters eta's prior: the Potential's Hessian has no entry of it
    tlm = recognize(_potential_ctm())
    est = GeneralEstimator(tlm)
    mu = [g.name for g in tlm.gaussians].index("mu")
    seg = next(s for s, seg in enumerate(tlm.segments) if mu in seg.members)
    assert not est._products  # eta's blocks and the topic logits' diagonal: Stein
    T, g, H = est.expectations(_states(tlm), "precision")
    assert g[seg] is None and H[seg] is None


def _leaves(n=2000):
    d = pt.constant(np.arange(n) % 7, name="d")
    c = pt.constant(np.linspace(1.0, 2.0, n), name="c")
    return d, c


@pytest.mark.parametrize(
    "form, split",
    [
        (lambda x, w, d, c: (c * pt.log(x[d])).sum(), True),
        (lambda x, w, d, c: -(c[:, None] * w[d].T.T).sum(-1).sum() * 2.0, True),
        (lambda x, w, d, c: (c * pt.log(x[d])).sum() + 5.0, False),  # added once per part
        (lambda x, w, d, c: (c * pt.log(x[d])).sum() + x.sum(), False),  # added once
        (lambda x, w, d, c: pt.log(pt.exp(c * x[d]).sum()), False),  # log of the sum
        (lambda x, w, d, c: pt.max(c * x[d]), False),  # not a sum
        (lambda x, w, d, c: pt.cumsum(c * x[d])[-1], False),  # mixes observations
    ],
)
def test_only_sums_over_the_observations_are_split(form, split):
    x = pt.vector("x", shape=(7,))
    w = pt.matrix("w", shape=(7, 3))
    d, c = _leaves()
    total = form(pt.exp(x), w, d, c)
    assert (parts.observation_axes(total, [d, c]) is not None) is split


# ------------------------------------------------------------------ row windows


def _run(outs):
    """Values of ``outs`` (``None`` kept)."""
    vals = iter(pytensor.function([], [x for x in outs if x is not None])())
    return [None if x is None else next(vals) for x in outs]


def _window(est, states, window=None):
    kw = {} if window is None else {"window": pt.constant(window)}
    T, g, H = est.expectations(states, "precision", **kw)
    return _run([T, *g, *H])


def test_row_windows_add_up_to_the_whole_term():
    # row_batch: window j holds the observations of rows lo[j]:hi[j] of the documents'
    # logits. Its value and the other globals' derivatives are scaled by the number of
    # windows; unscaled, the windows add up to the whole term's value, gradients and Stein
    # Hessians, and the batched rows outside a window get nothing from it
    tlm = recognize(_potential_ctm())
    est = GeneralEstimator(tlm, row_batch=7)
    win, batched, nseg = est.windows, est.batched, len(tlm.segments)
    assert win.n_windows == 6 and list(win.hi - win.lo) == [7] * 5 + [5]
    assert [tlm.gaussians[g].name for g in tlm.segments[batched].members] == ["eta"]
    states = _states(tlm)
    expected = _window(GeneralEstimator(tlm), states)
    total = [0.0 if x is not None else None for x in expected]
    for j in range(win.n_windows):
        outs = _window(est, states, j)
        scale = win.n_windows  # each window as often: their average is the whole
        outside = np.ones(tlm.segments[batched].rows, dtype=bool)
        outside[win.lo[j] : win.hi[j]] = False
        for x in (outs[1 + batched], outs[1 + nseg + batched]):
            assert np.all(x[outside] == 0.0) and np.any(x[~outside] != 0.0)
        for k, x in enumerate(outs):
            if x is not None:
                own = k in (1 + batched, 1 + nseg + batched)
                total[k] = total[k] + (x if own else x / scale)
    for a, b in zip(expected, total, strict=True):
        if a is None:
            assert b is None
        else:
            np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-8)
