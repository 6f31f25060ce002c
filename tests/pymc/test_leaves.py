"""Predictive leaves: free variables nothing reads (predictions written into the
model, PyMC's imputed missing observations), drawn from their prior given each
draw of the other variables."""

import warnings

import numpy as np
import pymc as pm
import pytensor.tensor as pt
import pytest
from scipy.special import expit

import pymc_mcssvi
from pymc_mcssvi.recognize.dense_product import flatten_dense_product

S = 0.7  # known noise sd: the posterior of w is Gaussian in closed form
TAU = 2.0


def _data(seed=0, n=40, d=3):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    y = X @ np.array([0.8, -0.5, 0.3]) + S * rng.normal(size=n)
    return X, y, rng.normal(size=(4, d))


def _exact(X, y):
    """Posterior mean and covariance of w under N(0, TAU^2 I) and N(X w, S^2)."""
    cov = np.linalg.inv(X.T @ X / S**2 + np.eye(X.shape[1]) / TAU**2)
    return cov @ X.T @ y / S**2, cov


def _flat(post, name):
    v = post[name].values
    return v.reshape(-1, *v.shape[2:])


def test_a_gaussian_prediction_is_drawn_given_the_same_draw_of_the_globals():
    X, y, Xn = _data()
    with pm.Model() as m:
        w = pm.Normal("w", 0, TAU, shape=3)
        pm.Normal("y", X @ w, S, observed=y)
        pm.Normal("y_new", Xn @ w, S)
        approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    assert pymc_mcssvi.describe(m, show=False).role("y_new") == "predictive leaf"
    post = approx.sample(4000, random_seed=2).posterior
    assert post.attrs["predictive_leaves"] == ["y_new"]
    w_draws, y_new = _flat(post, "w"), _flat(post, "y_new")
    mean, cov = _exact(X, y)
    pred_mean, pred_var = Xn @ mean, np.diag(Xn @ cov @ Xn.T) + S**2
    se = np.sqrt(pred_var / len(y_new))
    np.testing.assert_array_less(np.abs(y_new.mean(0) - pred_mean), 4 * se)
    np.testing.assert_allclose(y_new.var(0), pred_var, rtol=0.1)
    # the noise around each draw's own predictor: N(0, S^2), independent of that draw
    resid = (y_new - w_draws @ Xn.T) / S
    np.testing.assert_allclose(resid.std(0), 1.0, rtol=0.06)
    corr = np.corrcoef(resid[:, 0], (w_draws @ Xn.T)[:, 0])[0, 1]
    assert abs(corr) < 0.08
    # the flat views carry the leaf's marginal moments
    sl = approx.ordering["y_new"][1]
    np.testing.assert_allclose(approx.mean.eval()[sl], pred_mean, atol=0.25)
    # the same seed gives the same draws, also after a pickle round trip
    again = approx.sample(50, random_seed=2).posterior
    np.testing.assert_array_equal(_flat(again, "y_new"), y_new[:50])
    cloudpickle = pytest.importorskip("cloudpickle")
    loaded = cloudpickle.loads(cloudpickle.dumps(approx))
    np.testing.assert_array_equal(
        _flat(loaded.sample(50, random_seed=2).posterior, "y_new"), y_new[:50]
    )


def test_imputed_observations_fit_as_without_them_and_are_drawn_from_the_predictive():
    X, y, _ = _data(1)
    missing = [2, 11, 30]
    y_nan = y.copy()
    y_nan[missing] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pm.ImputationWarning)
        with pm.Model() as m:
            w = pm.Normal("w", 0, TAU, shape=3)
            pm.Normal("y", X @ w, S, observed=y_nan)
    with m:
        approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    keep = np.setdiff1d(np.arange(len(y)), missing)
    mean, cov = _exact(X[keep], y[keep])
    sl = approx.ordering["w"][1]
    np.testing.assert_allclose(approx.mean.eval()[sl], mean, atol=1e-6)
    np.testing.assert_allclose(approx.cov.eval()[sl, sl], cov, atol=1e-6)
    post = approx.sample(4000, random_seed=3).posterior
    assert post.attrs["predictive_leaves"] == ["y_unobserved"]
    imputed = _flat(post, "y_unobserved")
    pred_mean = X[missing] @ mean
    pred_var = np.diag(X[missing] @ cov @ X[missing].T) + S**2
    np.testing.assert_array_less(
        np.abs(imputed.mean(0) - pred_mean), 4 * np.sqrt(pred_var / len(imputed))
    )
    np.testing.assert_allclose(imputed.var(0), pred_var, rtol=0.1)
    # PyMC's Deterministic joining both parts: the data where observed
    joined = _flat(post, "y")
    np.testing.assert_array_equal(joined[:, keep], np.broadcast_to(y[keep], joined[:, keep].shape))


def test_discrete_and_transformed_leaves_and_a_leaf_of_a_leaf():
    rng = np.random.default_rng(4)
    X = rng.normal(size=(200, 2))
    yb = rng.binomial(1, expit(X @ [1.0, -1.0]))
    Xn = X[:3]
    with pm.Model():
        w = pm.Normal("w", 0, 2, shape=2)
        pm.Bernoulli("y", logit_p=X @ w, observed=yb)
        pm.Bernoulli("b_new", logit_p=Xn @ w)
        g_new = pm.Gamma("g_new", alpha=2.0, beta=pt.exp(-(Xn @ w)))  # log-transformed
        pm.Normal("n_new", g_new, 1.0)  # reads a leaf only: also a leaf
        approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    post = approx.sample(4000, random_seed=5).posterior
    assert sorted(post.attrs["predictive_leaves"]) == ["b_new", "g_new", "n_new"]
    w_draws = _flat(post, "w")
    eta = w_draws @ Xn.T
    b_new = _flat(post, "b_new")
    assert b_new.dtype.kind == "i" and set(np.unique(b_new)) <= {0, 1}
    p = expit(eta).mean(0)
    np.testing.assert_array_less(np.abs(b_new.mean(0) - p), 4 * np.sqrt(p * (1 - p) / 4000))
    g_new, n_new = _flat(post, "g_new"), _flat(post, "n_new")
    assert (g_new > 0).all()
    # Gamma(2, rate exp(-eta)): g / exp(eta) ~ Gamma(2, 1) at each draw
    np.testing.assert_allclose((g_new / np.exp(eta)).mean(0), 2.0, rtol=0.06)
    np.testing.assert_allclose((n_new - g_new).std(0), 1.0, rtol=0.06)
    np.testing.assert_allclose((n_new - g_new).mean(0), 0.0, atol=0.1)


def test_unused_priors_are_drawn_with_a_draws_axis():
    """A leaf that reads no other variable (an unused prior, scalar or vector, and a
    leaf of it) is drawn independently at each draw, not once (it raised)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=100)
    with pm.Model():
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Poisson("y", pm.math.exp(b[0] + b[1] * x), observed=rng.poisson(np.exp(0.5 + 0.3 * x)))
        pm.HalfNormal("s0", 1.0)
        s2 = pm.HalfNormal("s2", 2.0, shape=2)
        pm.Normal("n_new", s2, 0.1)
        approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    post = approx.sample(4000, random_seed=2).posterior
    s0, s2, n_new = _flat(post, "s0"), _flat(post, "s2"), _flat(post, "n_new")
    assert s0.shape == (4000,) and s2.shape == (4000, 2) and n_new.shape == (4000, 2)
    for draws, scale in [(s0[:, None], 1.0), (s2, 2.0)]:
        mean, sd = scale * np.sqrt(2 / np.pi), scale * np.sqrt(1 - 2 / np.pi)
        np.testing.assert_array_less(np.abs(draws.mean(0) - mean), 4 * sd / np.sqrt(4000))
        np.testing.assert_allclose(draws.std(0), sd, rtol=0.05)
    np.testing.assert_allclose((n_new - s2).std(0), 0.1, rtol=0.06)
    assert abs(np.corrcoef(s2[:, 0], s2[:, 1])[0, 1]) < 0.06


def test_a_variable_read_by_a_potential_is_not_a_leaf():
    X, y, _ = _data()
    with pm.Model() as m:
        w = pm.Normal("w", 0, TAU, shape=3)
        pm.Normal("y", X @ w, S, observed=y)
        c = pm.Normal("c", 0, 1)
        pm.Potential("pull", -0.5 * (c - w[0]) ** 2)
        d = pm.Normal("d", 0, 1)
    desc = pymc_mcssvi.describe(m, show=False)
    assert desc.role("c") == "gaussian global"
    assert desc.role("d") == "predictive leaf"
    del d


@pytest.mark.parametrize("bias", [False, True])
def test_a_masked_dense_product_flattens_to_its_observed_entries(bias):
    rng = np.random.default_rng(6)
    Y = rng.normal(size=(5, 4))
    Y[rng.random(Y.shape) < 0.4] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pm.ImputationWarning)
        with pm.Model() as m:
            U = pm.Normal("U", 0, 1, shape=(5, 2))
            V = pm.Normal("V", 0, 1, shape=(4, 2))
            mu = pm.Normal("mu", 0, 1, shape=4) if bias else 0.0
            pm.Normal("Y", U @ V.T + mu, 0.5, observed=Y)
    obs = m["Y_observed"]
    logp = m.logp(vars=[obs], sum=False)[0]
    values = {m.rvs_to_values[v]: rng.normal(size=v.type.shape) for v in (m["U"], m["V"])}
    if bias:
        values[m.rvs_to_values[m["mu"]]] = rng.normal(size=4)
    shapes = {v: val.shape for v, val in values.items() if v.name in ("U", "V")}
    flat = flatten_dense_product(logp, shapes)
    assert flat is not None
    ins = {k: v for k, v in values.items()}
    np.testing.assert_allclose(
        flat.eval(ins, on_unused_input="ignore"), logp.eval(ins, on_unused_input="ignore")
    )
    # the product itself is gone: read at the observed entries only
    assert flat.type.shape == (int((~np.isnan(Y)).sum()),)
