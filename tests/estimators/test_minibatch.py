"""Minibatch estimates (scaled by N/|M| through ``total_size``) are unbiased."""

import numpy as np
import pymc as pm
import pytest
from pymc.pytensorf import compile as pm_compile

import pymc_mcssvi
from pymc_mcssvi.families.gaussian import GaussianBlocks


def _estimator(model, m, L):
    with model:
        inf = pymc_mcssvi.MCSSVI()
    st = inf.store.symbolic
    st.cand.means[0].set_value(m)
    st.cand.factors[0].set_value(L)
    ev = inf.bound.evaluate([GaussianBlocks(st.cand.means[0], st.cand.factors[0])])
    with model:
        return pm_compile([], [ev.expected_loglik, ev.grads[0], ev.hessians[0]], random_seed=1)


@pytest.mark.slow
def test_minibatch_g_H_and_bound_are_unbiased():
    rng = np.random.default_rng(7)
    N, D, B = 400, 3, 40
    X = rng.normal(size=(N, D))
    y = rng.binomial(1, 1 / (1 + np.exp(-X @ np.array([1.0, -1.0, 0.5])))).astype("int32")
    Xm, ym = pm.Minibatch(X, y, batch_size=B)
    with pm.Model() as mb:
        w = pm.Normal("w", 0, 1, shape=D)
        pm.Bernoulli("y", logit_p=Xm @ w, observed=ym, total_size=N)
    with pm.Model() as full:
        w = pm.Normal("w", 0, 1, shape=D)
        pm.Bernoulli("y", logit_p=X @ w, observed=y)
    m = np.array([[0.5, -0.5, 0.2]])
    L = np.linalg.cholesky(np.linalg.inv(np.diag([0.1, 0.2, 0.1]) + 0.02))[None]
    T_full, g_full, H_full = _estimator(full, m, L)()
    f = _estimator(mb, m, L)
    draws = [f() for _ in range(3000)]
    for k, want in enumerate([T_full, g_full, H_full]):
        vals = np.array([d[k] for d in draws])
        mean = vals.mean(0)
        se = vals.std(0) / np.sqrt(len(vals)) + 1e-12
        assert np.all(np.abs(mean - want) < 5 * se), (k, mean, want, se)
        assert not np.allclose(vals[0], vals[1])  # really random batches


@pytest.mark.slow
def test_minibatch_fit_ends_near_the_full_batch_fit():
    """Batches of 200 of 4,000 rows (a logistic regression): the last iterate of the
    natural-gradient steps carries their noise, and the default stopping rule (bound
    averages of two windows) ended after about 140 iterations with means 0.6 full-batch
    sds (root mean square) off, up to 1.2. q is now the polynomial-decay average of the
    iterates, and the fit stops when that average has stopped moving too."""
    import pymc as pm

    rng = np.random.default_rng(0)
    N = 4000
    X = rng.normal(size=(N, 3))
    y = rng.binomial(1, 1 / (1 + np.exp(-X @ np.array([1.0, -1.0, 0.5])))).astype("float64")
    with pm.Model():
        w = pm.Normal("w", 0, 1, shape=3)
        pm.Bernoulli("y", logit_p=X @ w, observed=y)
        full = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    ref_m, ref_s = full.mean.eval(), full.std.eval()
    z = []
    for seed in (1, 2, 3):
        Xm, ym = pm.Minibatch(X, y, batch_size=200)
        with pm.Model():
            w = pm.Normal("w", 0, 1, shape=3)
            pm.Bernoulli("y", logit_p=Xm @ w, observed=ym, total_size=N)
            approx = pm.fit(method="hmcssvi", random_seed=seed, progressbar=False)
        assert approx.converged
        z.append((approx.mean.eval() - ref_m) / ref_s)
        np.testing.assert_allclose(approx.std.eval(), ref_s, rtol=0.1)
    rms = float(np.sqrt(np.mean(np.square(z))))
    assert rms < 0.35, np.round(z, 2)
