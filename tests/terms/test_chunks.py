"""Chunked statistics: a term reduced chunk by chunk gives the whole term's numbers.

Every form of term is fitted twice, once whole and once with ``chunk_size=7`` (so
that its observations, or the Monte Carlo path's draws, are reduced over several
chunks, the last one padded), and the two fits must agree to rounding: the same
iterations, bounds and q. The step of a chunked matrix factorization holds no array
as long as the observations times ``K^2`` outside the scan's body.
"""

from __future__ import annotations

import numpy as np
import pymc as pm
import pytest
from pytensor.scan.op import Scan

import pymc_mcssvi
from pymc_mcssvi.estimators.chunks import chunk_layout, observation_subset
from pymc_mcssvi.models import pmf


def _glmm(rng):
    g = np.repeat(np.arange(6), 10)
    x = rng.normal(size=g.size)
    y = rng.poisson(np.exp(0.3 + 0.5 * x + rng.normal(0, 0.6, 6)[g]))
    with pm.Model() as m:
        b = pm.Normal("b", 0, 2, shape=2)
        s = pm.HalfNormal("s", 1)
        z = pm.Normal("z", 0, 1, shape=6)
        pm.Poisson("y", pm.math.exp(b[0] + b[1] * x + s * z[g]), observed=y)
    return m


def _ordinal_factorization(rng):
    r, c = rng.integers(0, 12, 120), rng.integers(0, 9, 120)
    y = rng.integers(0, 4, 120)
    return pmf(r, c, y, 12, 9, 2, likelihood="ordinal", cutpoints=[-1.0, 0.0, 1.0])


def _two_predictors(rng):
    x = rng.normal(size=50)
    y = rng.normal(0.5 * x, np.exp(0.3 * x))
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1, shape=2)
        c = pm.Normal("c", 0, 1, shape=2)
        pm.Normal("y", b[0] + b[1] * x, pm.math.exp(c[0] + c[1] * x), observed=y)
    return m


def _decay(rng):
    t = np.linspace(0, 3, 30)
    y = 2.0 * np.exp(-0.7 * t) + rng.normal(0, 0.1, 30)
    with pm.Model() as m:
        a = pm.Normal("a", 1, 1)
        b = pm.Normal("b", 0.5, 0.5)
        pm.Normal("y", a * pm.math.exp(-b * t), 0.1, observed=y)
    return m


def _gaussian_local(rng):
    x = rng.normal(size=40)
    y = rng.poisson(np.exp(0.5 + 0.4 * x + rng.normal(0, 0.5, 40)))
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1, shape=2)
        f = pm.Normal("f", b[0] + b[1] * x, 0.5, shape=40)
        pm.Poisson("y", pm.math.exp(f), observed=y)
    return m


MODELS = {
    "affine+meanfield": (_glmm, {}),
    "affine+point": (_glmm, {"hyper": "point"}),
    "bilinear": (_ordinal_factorization, {}),
    "two predictors": (_two_predictors, {}),
    "monte carlo draws": (_decay, {"n_draws": 16}),
    "marginalized local": (_gaussian_local, {}),
}
#: The slow ones (a local's inner quadrature per chunk) run with ``make test-slow``.
SLOW = {"marginalized local"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in MODELS]
)
def test_chunked_fit_is_the_whole_fit(name):
    build, kw = MODELS[name]
    fits = []
    for chunk_size in (None, 7):
        model = build(np.random.default_rng(3))
        with model:
            inf = pymc_mcssvi.HMCSSVI(random_seed=1, chunk_size=chunk_size, **kw)
            plan = inf.kernel.chunk_plan()
            approx = inf.fit(n=6, progressbar=False)
        fits.append((plan, approx.hist, approx.mean.eval()))
    (whole_plan, h0, m0), (plan, h1, m1) = fits
    assert whole_plan == {} and plan, "the term should have been split"
    np.testing.assert_allclose(h1, h0, rtol=1e-10)
    np.testing.assert_allclose(m1, m0, rtol=1e-8, atol=1e-10)


def test_chunked_factorization_holds_no_per_observation_blocks():
    """Outside the scan's body no array of the step is as large as the observations
    times ``K^2``: the per-observation ``K x K`` products exist one chunk at a time."""
    rng = np.random.default_rng(0)
    n, K = 600, 4
    r, c = rng.integers(0, 30, n), rng.integers(0, 20, n)
    model = pmf(r, c, rng.integers(0, 2, n), 30, 20, K, likelihood="bernoulli")
    sizes = {}
    for chunk_size in (None, 50):
        with model:
            inf = pymc_mcssvi.HMCSSVI(random_seed=0, chunk_size=chunk_size)
            step = inf._step_function(backend="python")
            step.compile()
        nodes = step.maker.fgraph.apply_nodes
        outer = [
            np.prod([d or 1 for d in o.type.shape])
            for node in nodes
            for o in node.outputs
            if o.ndim and not isinstance(node.op, Scan)
        ]
        sizes[chunk_size] = (max(outer), any(isinstance(nd.op, Scan) for nd in nodes))
    assert sizes[None][0] >= n * K * K and not sizes[None][1]
    assert sizes[50][0] < n * K and sizes[50][1]


def test_chunk_layout_pads_the_last_chunk_at_zero_weight():
    index, weight = chunk_layout(7, 3)
    assert index.shape == weight.shape == (3, 3)
    assert index.ravel()[:7].tolist() == list(range(7)) and weight.sum() == 7
    assert np.all(weight.ravel()[7:] == 0)


def test_observation_subset_gathers_aligned_arrays_only():
    """Data along the observation axis are gathered, broadcast arrays are not, and a
    batch axis in front (a local's quadrature nodes) is skipped."""
    import pytensor
    import pytensor.tensor as pt

    n = 5
    f = pt.vector("f", shape=(n,))
    y = pt.constant(np.arange(n, dtype="float64"))
    nodes = pt.constant(np.linspace(-1, 1, 3)[:, None])  # (3, 1): broadcast along n
    logp = pt.sum(-((y - f[None, :] - nodes) ** 2), axis=0) * pt.constant(2.0)
    index = pt.constant(np.array([4, 1]))
    sub, ph = observation_subset(logp, f, n, index)
    got = pytensor.function([ph], sub)(np.array([0.5, -0.5]))
    full = pytensor.function([f], logp)(np.array([0.0, -0.5, 0.0, 0.0, 0.5]))
    np.testing.assert_allclose(got, full[[4, 1]])


def _data_glmm(rng, static: bool):
    """A random-intercept logistic regression on ``pm.Data`` (``shape=`` given or not)."""
    n = 400
    g = np.arange(n) % 8
    X = rng.normal(size=(n, 3))
    y = rng.binomial(1, 1 / (1 + np.exp(-(X @ [0.5, -1.0, 0.3] + rng.normal(0, 0.7, 8)[g]))))
    shape = (lambda a: {"shape": a.shape}) if static else (lambda a: {})
    with pm.Model() as m:
        Xd = pm.Data("X", X, **shape(X))
        gd = pm.Data("g", g, **shape(g))
        yd = pm.Data("y_obs", y, **shape(y))
        w = pm.Normal("w", 0, 1, shape=3)
        s = pm.HalfNormal("s", 1)
        z = pm.Normal("z", 0, 1, shape=8)
        pm.Bernoulli("y", logit_p=Xd @ w + s * z[gd], observed=yd)
    return m


def test_data_without_static_shapes_is_chunked_as_with_them():
    """``pm.Data`` without ``shape=`` (how most models give their data) has no static
    length, so the likelihood could not be split into chunks: its step held
    per-observation arrays of all its rows (a 1,000,000 x 20 logistic regression passed
    16 GB). Recognition now sees the data's current shapes: the chunk plan, and the fit,
    are those of the same model with ``shape=`` given; a later ``pm.set_data`` of another
    length is refused by name before a continued fit."""
    fits = []
    for static in (True, False):
        model = _data_glmm(np.random.default_rng(5), static)
        with model:
            inf = pymc_mcssvi.HMCSSVI(random_seed=1, chunk_size=64)
            plan = inf.kernel.chunk_plan()
            approx = inf.fit(n=5, progressbar=False)
        fits.append((plan, approx.hist, approx.mean.eval(), inf, model))
    (p0, h0, m0, _, _), (p1, h1, m1, inf, model) = fits
    assert p0 == p1 and p1, "the likelihood should be split into chunks of 64 rows"
    np.testing.assert_allclose(h1, h0, rtol=1e-12)
    np.testing.assert_allclose(m1, m0, rtol=1e-10, atol=1e-12)
    # the same length: the continued fit reads the new values
    with model:
        pm.set_data({"y_obs": 1 - model["y_obs"].get_value()})
        inf.fit(n=1, progressbar=False)
        pm.set_data({"X": np.zeros((10, 3)), "g": np.zeros(10, int), "y_obs": np.zeros(10, int)})
        with pytest.raises(ValueError, match=r"'(X|g|y_obs)' changed shape from \(400"):
            inf.fit(n=1, progressbar=False)


def test_minibatch_likelihood_is_not_chunked(monkeypatch):
    """pm.Minibatch draws its rows with a random generator that a chunk's scan cannot
    update: a likelihood over its rows is kept whole even when its intermediates pass
    the chunk budget (it failed to compile: "No update found for at least one RNG used
    in Scan Op", the default fit of a 2,000 x 2,000 batch), and an explicit chunk_size
    that would split the batch is refused with a message naming the batch."""
    import pymc_mcssvi.algorithms.kernel as kernel

    rng = np.random.default_rng(0)
    X = rng.normal(size=(2000, 5))
    y = (rng.random(2000) < 0.5).astype("float64")
    Xb, yb = pm.Minibatch(X, y, batch_size=400)
    with pm.Model():
        w = pm.Normal("w", 0, 1, shape=5)
        pm.Bernoulli("obs", logit_p=Xb @ w, observed=yb, total_size=2000)
        monkeypatch.setattr(kernel, "CHUNK_BYTES", 1000.0)  # every term past the budget
        inf = pymc_mcssvi.HMCSSVI(random_seed=0, polish=False)
        assert inf.kernel.chunk_plan() == {}
        approx = inf.fit(20, progressbar=False)
        assert np.all(np.isfinite(approx.mean.eval()))
        with pytest.raises(ValueError, match="chunk_size=100 splits a pm.Minibatch.*400 rows"):
            pymc_mcssvi.HMCSSVI(chunk_size=100).fit(2, progressbar=False)
