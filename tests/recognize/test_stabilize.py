"""Stable forms of ordered likelihoods: same values as PyMC's, finite where PyMC's round to log(0)."""

from decimal import Decimal, getcontext

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import pytest

from pymc_mcssvi.recognize.graph import remove_checks
from pymc_mcssvi.recognize.stabilize import stable_logp

CUT = np.array([-1.0, 0.0, 1.5])
Y = np.array([0, 1, 2, 3, 0, 3, 2])


def _graphs(dist):
    f = pt.vector("f")
    raw = remove_checks(pm.logp(dist.dist(eta=f, cutpoints=CUT), Y))
    lp = stable_logp(raw)
    d1 = pytensor.grad(lp.sum(), f)
    d2 = pytensor.grad(d1.sum(), f)
    fn = pytensor.function([f], [raw, lp, d1, d2])
    return fn


def _ordered_logistic_reference(f):
    """log P(y | f) from the definition, in 50-digit decimal arithmetic."""
    getcontext().prec = 50
    c = [None, *(Decimal(float(x)) for x in CUT), None]

    def sigmoid(x):
        return Decimal(1) if x is None else Decimal(1) / (1 + (-x).exp())

    out = []
    for yi, fi in zip(Y, f, strict=True):
        hi = Decimal(1) if c[yi + 1] is None else sigmoid(c[yi + 1] - Decimal(float(fi)))
        lo = Decimal(0) if c[yi] is None else sigmoid(c[yi] - Decimal(float(fi)))
        out.append(float((hi - lo).ln()))
    return np.array(out)


@pytest.mark.parametrize("dist", [pm.OrderedLogistic, pm.OrderedProbit])
def test_matches_pymc_where_pymc_is_finite(dist):
    fn = _graphs(dist)
    f = np.random.default_rng(0).normal(scale=2.0, size=Y.size)
    raw, lp, d1, _ = fn(f)
    np.testing.assert_allclose(lp, raw, rtol=1e-12, atol=1e-14)
    h = 1e-6
    fd = (fn(f + h)[1] - fn(f - h)[1]) / (2 * h)
    np.testing.assert_allclose(d1, fd, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("dist", [pm.OrderedLogistic, pm.OrderedProbit])
def test_finite_far_out(dist):
    """Quadrature nodes of a wide predictor reach |f| of tens to hundreds."""
    fn = _graphs(dist)
    f = np.array([-60.0, 40.0, 300.0, -50.0, 37.0, 800.0, -900.0])
    raw, lp, d1, d2 = fn(f)
    assert not np.all(np.isfinite(raw))  # PyMC's own form underflows here
    assert np.all(np.isfinite(lp)) and np.all(np.isfinite(d1)) and np.all(np.isfinite(d2))
    assert np.all(d2 <= 0)  # log-concave in f


def test_ordered_logistic_far_out_is_exact():
    fn = _graphs(pm.OrderedLogistic)
    f = np.array([-60.0, 40.0, 30.0, -35.0, 37.0, 30.0, -20.0])
    # atol: the outer levels carry log1mexp(-50) = -2e-22 (stabilize.py).
    np.testing.assert_allclose(fn(f)[1], _ordered_logistic_reference(f), rtol=1e-12, atol=1e-21)


def _depends_on(v, x):
    from pytensor.graph.traversal import ancestors

    return x in ancestors([v])


@pytest.mark.parametrize("static_length", [False, True])
@pytest.mark.parametrize("cut_kind", ["constant", "learned", "per_observation"])
def test_ordered_logistic_gathers_cutpoints_before_the_predictor(cut_kind, static_length):
    """The rewritten density is elementwise in f: nothing n x levels depends on f.

    Learned cutpoints (a symbolic vector) and per-observation cutpoints (a matrix)
    give PyMC's values and the same gradients in f and in the cutpoints. With a
    static length (as in a model), canonicalization pushes the index into both
    terms of the difference; that form is rewritten too.
    """
    from pytensor.graph.traversal import io_toposort

    f = pt.tensor("f", shape=(Y.size if static_length else None,))
    c = pt.vector("c") if cut_kind == "learned" else pt.matrix("c")
    if cut_kind == "constant":
        cut, inputs, value = CUT, [f], {}
    elif cut_kind == "learned":
        cut, inputs, value = c, [f, c], {c: CUT}
    else:
        cut, inputs = c, [f, c]
        value = {c: CUT + np.linspace(-0.3, 0.3, Y.size)[:, None]}
    raw = remove_checks(pm.logp(pm.OrderedLogistic.dist(eta=f, cutpoints=cut), Y))
    lp = stable_logp(raw)
    compiled = pytensor.function(inputs, lp).maker.fgraph
    for node in io_toposort(compiled.inputs, compiled.outputs):
        for out in node.outputs:
            if _depends_on(out, compiled.inputs[0]):
                assert out.ndim <= 1, node
    wrt = inputs
    fn = pytensor.function(
        inputs, [raw, lp, *pytensor.grad(raw.sum(), wrt), *pytensor.grad(lp.sum(), wrt)]
    )
    fv = np.random.default_rng(1).normal(scale=2.0, size=Y.size)
    out = fn(fv, *value.values())
    np.testing.assert_allclose(out[1], out[0], rtol=1e-12, atol=1e-14)
    k = len(wrt)
    for g_raw, g_lp in zip(out[2 : 2 + k], out[2 + k :], strict=True):
        np.testing.assert_allclose(g_lp, g_raw, rtol=1e-8, atol=1e-10)


def _cloglog_reference(x):
    """log(1 - exp(-exp(x))) in 500-digit decimal arithmetic (series for tiny exp(x))."""
    getcontext().prec = 500
    out = []
    for xi in x:
        t = Decimal(float(xi)).exp()
        if t < Decimal("1e-100"):
            out.append(float(t.ln() + (1 - t / 2 + t * t / 6).ln()))
        else:
            out.append(float((1 - (-t).exp()).ln()))
    return np.array(out)


@pytest.mark.parametrize("link", ["cloglog", "loglog"])
def test_complementary_log_log_links(link):
    """``p = 1 - exp(-exp(f))`` and ``p = exp(-exp(-f))`` as users write them: the values
    match a 50-digit reference, the first derivative finite differences, and both
    derivatives stay finite where PyTensor's own form gives 0/0 or inf/inf."""
    f = pt.vector("f")
    p = 1 - pm.math.exp(-pm.math.exp(f)) if link == "cloglog" else pm.math.exp(-pm.math.exp(-f))
    y = np.array([1, 0] * 6)
    raw = remove_checks(pm.logp(pm.Bernoulli.dist(p=p), y))
    lp = stable_logp(raw)
    d1 = pytensor.grad(lp.sum(), f)
    d2 = pytensor.grad(d1.sum(), f)
    fn = pytensor.function([f], [lp, d1, d2])
    naive = pytensor.function([f], pytensor.grad(pytensor.grad(raw.sum(), f).sum(), f))
    # in terms of s (the argument of the cloglog form): exp(s) stays finite, s reaches -900
    s = np.array([-900.0, -900.0, -40.0, -40.0, -3.0, -3.0, 0.5, 0.5, 5.0, 5.0, 40.0, 40.0])
    x = s if link == "cloglog" else -s
    val, g, h = fn(x)
    assert np.isfinite(g).all() and np.isfinite(h).all()
    assert not np.isfinite(naive(x)).all()  # the case this guards against
    # the value: y = 1 is log p, y = 0 is log(1 - p); in terms of the cloglog form
    ref_hit = _cloglog_reference(s)  # log P(event with prob 1 - exp(-exp(s)))
    ref = np.where((y == 1) == (link == "cloglog"), ref_hit, -np.exp(s))
    np.testing.assert_allclose(val, ref, rtol=1e-12, atol=1e-300)
    mid = np.abs(x) < 50
    h_ = 1e-6
    fd = (fn(x + h_)[0] - fn(x - h_)[0]) / (2 * h_)
    np.testing.assert_allclose(g[mid], fd[mid], rtol=1e-6, atol=1e-9)


def _censored(kind, f):
    """(censored log density graph of predictor ``f``, censoring points, closed form)."""
    c = np.array([0.5, 2.0, 3.0, 0.5, 2.0, 3.0])
    if kind == "exponential_right":
        dist = pm.Censored.dist(pm.Exponential.dist(lam=pm.math.exp(f)), lower=None, upper=c)
        return dist, c, lambda x: -c * np.exp(x)  # log survival, exactly
    if kind == "weibull_right":
        dist = pm.Censored.dist(
            pm.Weibull.dist(alpha=1.5, beta=pm.math.exp(f)), lower=None, upper=c
        )
        return dist, c, lambda x: -((c * np.exp(-x)) ** 1.5)
    dist = pm.Censored.dist(pm.Exponential.dist(lam=pm.math.exp(f)), lower=c, upper=None)

    def log_cdf(x):  # log(1 - exp(-c e^x)) in 50-digit arithmetic
        getcontext().prec = 50
        out = []
        for ci, xi in zip(c, x, strict=True):
            t = Decimal(float(ci)) * Decimal(float(xi)).exp()
            out.append(float((1 - (-t).exp()).ln()))
        return np.array(out)

    return dist, c, log_cdf


@pytest.mark.parametrize("kind", ["exponential_right", "weibull_right", "exponential_left"])
def test_censored_survival_times(kind):
    """Censored exponential and Weibull observations (``pm.Censored``): PyMC writes the log
    survival as ``log1mexp(log1mexp(u))`` and the log cdf as ``log1mexp(-c exp(f))``; both
    round to log(0) (or 0/0 derivatives) at quadrature nodes far out. The stable forms match
    the closed form and have finite derivatives from f = -700 to 700 (Weibull: from -300,
    below which the log survival ``-(c e^{-f})^{1.5}`` itself overflows)."""
    f = pt.vector("f")
    dist, c, reference = _censored(kind, f)
    raw = remove_checks(pm.logp(dist, c))  # every observation at its censoring point
    lp = stable_logp(raw)
    d1 = pytensor.grad(lp.sum(), f)
    d2 = pytensor.grad(d1.sum(), f)
    fn = pytensor.function([f], [lp, d1, d2])
    rg = pytensor.grad(raw.sum(), f)
    naive = pytensor.function([f], [raw, rg, pytensor.grad(rg.sum(), f)])
    far = np.array([-300.0 if kind == "weibull_right" else -700.0, -40.0, -3.0, 0.5, 30.0, 700.0])
    val, g, h = fn(far)
    assert np.isfinite(g).all() and np.isfinite(h).all()
    assert not all(np.isfinite(v).all() for v in naive(far))  # what this guards against
    mid = np.abs(far) < 50
    x = far[mid]
    np.testing.assert_allclose(val[mid], reference(far)[mid], rtol=1e-10)
    h_ = 1e-6
    fd = (fn(far + h_)[0] - fn(far - h_)[0]) / (2 * h_)
    np.testing.assert_allclose(g[mid], fd[mid], rtol=1e-6, atol=1e-9)
    assert x.size == 4


def _log_erfc_reference(x):
    """log(erfc(x)) in 60-digit arithmetic: the continued fraction for x > 3, else the series."""
    getcontext().prec = 60
    out = []
    for xi in x:
        z = Decimal(float(xi))
        if z > 3:
            # erfc(z) = exp(-z^2) / sqrt(pi) * 1 / (z + 1/2 / (z + 1 / (z + 3/2 / (z + ...))))
            frac = z
            for k in range(400, 0, -1):
                frac = z + Decimal(k) / 2 / frac
            pi = Decimal("3.14159265358979323846264338327950288419716939937510582097494")
            out.append(float(-z * z - (pi.sqrt() * frac).ln()))
        else:
            from scipy.special import erfc

            out.append(float(np.log(erfc(float(xi)))))
    return np.array(out)


@pytest.mark.parametrize("fixed_alpha", [False, True])
def test_skew_normal_derivatives_finite_far_out(fixed_alpha):
    """``pm.SkewNormal``'s ``log(1 + erf(alpha z / sqrt 2))``: value as a 60-digit
    reference, first derivatives (in the predictor and in ``alpha``) as finite
    differences, both derivatives finite where ``erfc`` underflows; also at
    ``alpha = 0`` (the point-mode start), where PyTensor's own asymptotic branch
    has ``0 * inf`` derivatives."""
    f, alpha = pt.vector("f"), pt.scalar("alpha")
    y = np.zeros(7)
    a = 3.0 if fixed_alpha else alpha
    raw = remove_checks(pm.logp(pm.SkewNormal.dist(mu=f, sigma=1.0, alpha=a), y))
    lp = stable_logp(raw)
    d1 = pytensor.grad(lp.sum(), f)
    d2 = pytensor.grad(d1.sum(), f)
    outs = [lp, d1, d2]
    if not fixed_alpha:
        da = pytensor.grad(lp.sum(), alpha)
        outs += [da, pytensor.grad(da, alpha)]
    fn = pytensor.function([f, alpha], outs, on_unused_input="ignore")
    x = np.array([-60.0, -8.0, 0.0, 3.0, 8.0, 12.0, 60.0])
    vals = fn(x, 3.0)
    assert all(np.isfinite(v).all() for v in vals)
    # log 2 + log N(0 | f, 1) + log Phi(-3 f) with log Phi(t) = log(erfc(-t / sqrt 2) / 2)
    # (PyMC divides by pt.sqrt(2), which PyTensor evaluates in float32)
    sqrt2 = float(np.sqrt(np.float32(2)))
    ref = -0.5 * np.log(2 * np.pi) - 0.5 * x**2 + _log_erfc_reference(3.0 * x / sqrt2)
    np.testing.assert_allclose(vals[0], ref, rtol=1e-10)
    h = 1e-6
    fd = (fn(x + h, 3.0)[0] - fn(x - h, 3.0)[0]) / (2 * h)
    np.testing.assert_allclose(vals[1], fd, rtol=1e-6, atol=1e-6)
    if not fixed_alpha:
        fda = (fn(x, 3.0 + h)[0].sum() - fn(x, 3.0 - h)[0].sum()) / (2 * h)
        np.testing.assert_allclose(vals[3], fda, rtol=1e-6)
        assert all(np.isfinite(v).all() for v in fn(x, 0.0))


def test_masks_stay_elementwise_when_batched():
    """The comparisons' gradient stop is elementwise: batched over quadrature nodes (by the
    plugin's own batching rules) it is no ``Blockwise`` (a Python loop over the batch on
    the Python backend)."""
    from pytensor.graph.traversal import applys_between
    from pytensor.tensor.blockwise import Blockwise

    from pymc_mcssvi.estimators.quadrature import derivative_graphs
    from pymc_mcssvi.recognize.vectorize import vectorize_graph

    f = pt.vector("f")
    lp = stable_logp(remove_checks(pm.logp(pm.Poisson.dist(pm.math.exp(f)), np.array([0, 3]))))
    batched = vectorize_graph(list(derivative_graphs(lp, f)), {f: pt.matrix("F")})
    nodes = applys_between([], batched)
    assert not any(isinstance(n.op, Blockwise) for n in nodes)
