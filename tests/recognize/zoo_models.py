"""A zoo of PyMC models written the way PyMC users write them.

Every builder returns a fresh ``pm.Model``; the data are small and generated
with ``np.random.default_rng(seed)`` so that recognition is fast and
deterministic. ``tests/recognize/test_zoo.py`` states what the recognizer must
make of each of them.
"""

from __future__ import annotations

import warnings

import numpy as np
import pymc as pm
import pytensor.tensor as pt

import pymc_mcssvi

N = 60  # observations in the small models
D = 3  # regression coefficients


def _data(seed=0, n=N, d=D):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    w = rng.normal(size=d)
    return rng, X, w


# ----------------------------------------------------------------------- GLMs
def logistic_matmul():
    rng, X, w_true = _data(1)
    y = rng.binomial(1, 1 / (1 + np.exp(-X @ w_true)))
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        pm.Bernoulli("y", logit_p=X @ w, observed=y)
    return m


def logistic_math_dot():
    rng, X, w_true = _data(2)
    y = rng.binomial(1, 1 / (1 + np.exp(-X @ w_true)))
    with pm.Model() as m:
        w = pm.Normal("w", mu=0.0, sigma=2.0, shape=D)
        p = pm.math.invlogit(pm.math.dot(X, w))
        pm.Bernoulli("y", p=p, observed=y)
    return m


def logistic_intercept():
    rng, X, w_true = _data(3)
    y = rng.binomial(1, 1 / (1 + np.exp(-(0.5 + X @ w_true))))
    with pm.Model() as m:
        b = pm.Normal("b", 0, 5)
        w = pm.Normal("w", 0, 1, shape=D)
        pm.Bernoulli("y", logit_p=b + X @ w, observed=y)
    return m


def logistic_pm_data():
    rng, X, w_true = _data(4)
    y = rng.binomial(1, 1 / (1 + np.exp(-X @ w_true)))
    with pm.Model() as m:
        X_data = pm.Data("X", X)
        y_data = pm.Data("y_obs", y)
        w = pm.Normal("w", 0, 1, shape=D)
        pm.Bernoulli("y", logit_p=pt.dot(X_data, w), observed=y_data, shape=X_data.shape[0])
    return m


def logistic_coords_dims():
    rng, X, w_true = _data(5)
    y = rng.binomial(1, 1 / (1 + np.exp(-X @ w_true)))
    coords = {"feature": ["age", "income", "score"], "obs_id": np.arange(N)}
    with pm.Model(coords=coords) as m:
        X_data = pm.Data("X", X, dims=("obs_id", "feature"))
        intercept = pm.Normal("intercept", 0, 2)
        beta = pm.Normal("beta", 0, 1, dims="feature")
        logit_p = pm.Deterministic("logit_p", intercept + X_data @ beta, dims="obs_id")
        pm.Bernoulli("y", logit_p=logit_p, observed=y, dims="obs_id")
    return m


def logistic_sum_product():
    rng, X, w_true = _data(6)
    y = rng.binomial(1, 1 / (1 + np.exp(-X @ w_true)))
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        pm.Bernoulli("y", logit_p=(X * w).sum(-1), observed=y)
    return m


def logistic_stacked_scalars():
    rng, X, w_true = _data(7)
    y = rng.binomial(1, 1 / (1 + np.exp(-X @ w_true)))
    with pm.Model() as m:
        b0 = pm.Normal("b0", 0, 1)
        b1 = pm.Normal("b1", 0, 1)
        b2 = pm.Normal("b2", 0, 1)
        beta = pt.stack([b0, b1, b2])
        pm.Bernoulli("y", logit_p=X @ beta, observed=y)
    return m


def probit():
    rng, X, w_true = _data(8)
    y = (X @ w_true + rng.normal(size=N) > 0).astype(int)
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        pm.Bernoulli("y", p=pm.math.invprobit(X @ w), observed=y)
    return m


def poisson_exp():
    rng, X, w_true = _data(9)
    y = rng.poisson(np.exp(0.3 * X @ w_true))
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        pm.Poisson("y", mu=pm.math.exp(X @ w), observed=y)
    return m


def negative_binomial():
    rng, X, w_true = _data(10)
    y = rng.negative_binomial(5, 5 / (5 + np.exp(0.3 * X @ w_true)))
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        alpha = pm.HalfNormal("alpha", 5)
        pm.NegativeBinomial("y", mu=pm.math.exp(X @ w), alpha=alpha, observed=y)
    return m


def gamma_regression():
    rng, X, w_true = _data(11)
    mu = np.exp(0.3 * X @ w_true)
    y = rng.gamma(4.0, mu / 4.0)
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        shape = pm.HalfNormal("shape", 5)
        pm.Gamma("y", alpha=shape, beta=shape / pm.math.exp(X @ w), observed=y)
    return m


def student_t():
    rng, X, w_true = _data(12)
    y = X @ w_true + rng.standard_t(4, size=N)
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        nu = pm.Gamma("nu", 2, 0.1)
        sigma = pm.HalfNormal("sigma", 1)
        pm.StudentT("y", nu=nu, mu=X @ w, sigma=sigma, observed=y)
    return m


def linear_regression():
    rng, X, w_true = _data(13)
    y = 1.0 + X @ w_true + 0.5 * rng.normal(size=N)
    with pm.Model() as m:
        intercept = pm.Normal("intercept", 0, 10)
        w = pm.Normal("w", 0, 1, shape=D)
        sigma = pm.HalfNormal("sigma", 1)
        pm.Normal("y", mu=intercept + X @ w, sigma=sigma, observed=y)
    return m


def binomial_trials():
    rng, X, w_true = _data(14)
    trials = rng.integers(5, 20, size=N)
    y = rng.binomial(trials, 1 / (1 + np.exp(-X @ w_true)))
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        pm.Binomial("y", n=trials, logit_p=X @ w, observed=y)
    return m


def ordered_logistic():
    rng, X, w_true = _data(15)
    eta = X @ w_true
    y = np.digitize(eta + rng.logistic(size=N), [-1.0, 1.0])
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        cutpoints = pm.Normal(
            "cutpoints",
            mu=[-1.0, 1.0],
            sigma=5.0,
            shape=2,
            transform=pm.distributions.transforms.ordered,
        )
        pm.OrderedLogistic("y", eta=X @ w, cutpoints=cutpoints, observed=y)
    return m


def poisson_offset():
    rng, X, w_true = _data(16)
    exposure = rng.uniform(1.0, 10.0, size=N)
    y = rng.poisson(exposure * np.exp(0.3 * X @ w_true))
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        log_rate = pm.math.log(exposure) + X @ w
        pm.Poisson("y", mu=pm.math.exp(log_rate), observed=y)
    return m


def deterministic_predictor():
    rng, X, w_true = _data(17)
    y = rng.binomial(1, 1 / (1 + np.exp(-X @ w_true)))
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        eta = pm.Deterministic("eta", X @ w)
        p = pm.Deterministic("p", pm.math.sigmoid(eta))
        pm.Bernoulli("y", p=p, observed=y)
    return m


def horseshoe():
    rng, X, w_true = _data(18, d=5)
    y = X @ w_true + rng.normal(size=N)
    with pm.Model() as m:
        tau = pm.HalfCauchy("tau", 1)
        lam = pm.HalfCauchy("lam", 1, shape=5)
        w = pm.Normal("w", 0, tau * lam, shape=5)
        sigma = pm.HalfNormal("sigma", 1)
        pm.Normal("y", X @ w, sigma, observed=y)
    return m


def two_likelihoods():
    """Two observed variables sharing the coefficients (a joint model)."""
    rng, X, w_true = _data(19)
    y1 = rng.binomial(1, 1 / (1 + np.exp(-X @ w_true)))
    y2 = X @ w_true + rng.normal(size=N)
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        pm.Bernoulli("y_bin", logit_p=X @ w, observed=y1)
        pm.Normal("y_cont", X @ w, 1.0, observed=y2)
    return m


# ------------------------------------------------------- Gaussian global shapes
def scalar_mean():
    rng = np.random.default_rng(20)
    y = 2.0 + rng.normal(size=N)
    with pm.Model() as m:
        mu = pm.Normal("mu", 0, 10)
        sigma = pm.HalfNormal("sigma", 2)
        pm.Normal("y", mu, sigma, observed=y)
    return m


def matrix_coefficients():
    """Poisson regression of C count columns: coefficients W with shape (D, C)."""
    rng, X, _ = _data(21)
    C = 4
    y = rng.poisson(1.0, size=(N, C))
    with pm.Model() as m:
        W = pm.Normal("W", 0, 1, shape=(D, C))
        pm.Poisson("y", mu=pm.math.exp(X @ W), observed=y)
    return m


def mvnormal_cov():
    rng, X, w_true = _data(22)
    y = rng.binomial(1, 1 / (1 + np.exp(-X @ w_true)))
    Sigma = 0.5 * np.eye(D) + 0.5
    with pm.Model() as m:
        w = pm.MvNormal("w", mu=np.zeros(D), cov=Sigma)
        pm.Bernoulli("y", logit_p=X @ w, observed=y)
    return m


def mvnormal_tau():
    rng, X, w_true = _data(23)
    y = X @ w_true + rng.normal(size=N)
    precision = np.linalg.inv(0.5 * np.eye(D) + 0.5)
    with pm.Model() as m:
        w = pm.MvNormal("w", mu=np.zeros(D), tau=precision)
        pm.Normal("y", X @ w, 1.0, observed=y)
    return m


def mvnormal_lkj():
    """Correlated random intercepts and slopes with an LKJ prior (chol= argument)."""
    rng = np.random.default_rng(24)
    G = 8
    g = rng.integers(0, G, N)
    x = rng.normal(size=N)
    y = rng.normal(size=N)
    with pm.Model() as m:
        chol, corr, stds = pm.LKJCholeskyCov(
            "chol", n=2, eta=2.0, sd_dist=pm.Exponential.dist(1.0, shape=2), compute_corr=True
        )
        ab = pm.MvNormal("ab", mu=np.zeros(2), chol=chol, shape=(G, 2))
        sigma = pm.HalfNormal("sigma", 1)
        pm.Normal("y", ab[g, 0] + ab[g, 1] * x, sigma, observed=y)
    return m


def several_gaussians():
    rng, X, w_true = _data(25)
    z = rng.normal(size=N)
    y = 1.0 + X @ w_true + 0.5 * z + rng.normal(size=N)
    with pm.Model() as m:
        alpha = pm.Normal("alpha", 0, 10)
        beta = pm.Normal("beta", 0, 1, shape=D)
        gamma = pm.MvNormal("gamma", mu=np.zeros(2), cov=np.eye(2))
        sigma = pm.HalfNormal("sigma", 1)
        mu = alpha + X @ beta + gamma[0] * z + gamma[1] * z**2
        pm.Normal("y", mu, sigma, observed=y)
    return m


# ----------------------------------------------------------------- hierarchical
def _groups(seed, G, n=N):
    rng = np.random.default_rng(seed)
    g = np.concatenate([np.arange(G), rng.integers(0, G, n - G)])
    return rng, g


def random_intercepts_noncentered():
    G = 6
    rng, g = _groups(30, G)
    y = rng.normal(size=N)
    with pm.Model() as m:
        mu = pm.Normal("mu", 0, 5)
        sd = pm.HalfNormal("sd", 1)
        z = pm.Normal("z", 0, 1, shape=G)
        a = pm.Deterministic("a", mu + sd * z)
        sigma = pm.HalfNormal("sigma", 1)
        pm.Normal("y", a[g], sigma, observed=y)
    return m


def random_intercepts_centered():
    G = 6
    rng, g = _groups(31, G)
    y = rng.poisson(2.0, size=N)
    with pm.Model() as m:
        mu_a = pm.Normal("mu_a", 0, 5)
        sd = pm.HalfNormal("sd", 1)
        a = pm.Normal("a", mu_a, sd, shape=G)
        pm.Poisson("y", pm.math.exp(a[g]), observed=y)
    return m


def random_slopes(G=5, n=N, seed=32):
    rng, g = _groups(seed, G, n)
    x = rng.normal(size=n)
    y = rng.normal(size=n)
    with pm.Model() as m:
        sd_a = pm.HalfNormal("sd_a", 1)
        sd_b = pm.HalfNormal("sd_b", 1)
        a = pm.Normal("a", 0, sd_a, shape=G)
        b = pm.Normal("b", 0, sd_b, shape=G)
        sigma = pm.HalfNormal("sigma", 1)
        pm.Normal("y", a[g] + b[g] * x, sigma, observed=y)
    return m


def random_slopes_large():
    """600 groups: the Gaussian dimension (1200) exceeds the full-covariance limit."""
    return random_slopes(G=600, n=1200, seed=33)


def random_slopes_large_with_intercept():
    G, n = 600, 1200
    rng, g = _groups(34, G, n)
    x = rng.normal(size=n)
    X = rng.normal(size=(n, 2))
    y = rng.binomial(1, 0.5, size=n)
    with pm.Model(coords={"group": np.arange(G)}) as m:
        beta = pm.Normal("beta", 0, 1, shape=2)
        sd = pm.HalfNormal("sd", 1, shape=2)
        a = pm.Normal("a", 0, sd[0], dims="group")
        b = pm.Normal("b", 0, sd[1], dims="group")
        pm.Bernoulli("y", logit_p=X @ beta + a[g] + b[g] * x, observed=y)
    return m


def random_slopes_noncentered_dims():
    """Non-centered intercepts and slopes declared with ``dims=``: the gathered rows of
    ``sd * z`` carry ``Shape(sd * z)``, a dependency on the scale through a shape."""
    G, n = 8, N
    rng, g = _groups(36, G, n)
    x = rng.normal(size=n)
    y = rng.poisson(1.0, size=n)
    with pm.Model(coords={"group": np.arange(G)}) as m:
        b0 = pm.Normal("b0", 0, 5)
        sd_a = pm.HalfNormal("sd_a", 1)
        sd_b = pm.HalfNormal("sd_b", 1)
        z_a = pm.Normal("z_a", 0, 1, dims="group")
        z_b = pm.Normal("z_b", 0, 1, dims="group")
        a, b = sd_a * z_a, sd_b * z_b
        pm.Poisson("y", pm.math.exp(b0 + a[g] + b[g] * x), observed=y)
    return m


def crossed_effects():
    rng = np.random.default_rng(35)
    n_subj, n_item = 8, 5
    subj = rng.integers(0, n_subj, N)
    item = rng.integers(0, n_item, N)
    y = rng.normal(size=N)
    with pm.Model() as m:
        mu = pm.Normal("mu", 0, 5)
        sd_s = pm.HalfNormal("sd_s", 1)
        sd_i = pm.HalfNormal("sd_i", 1)
        u = pm.Normal("u", 0, sd_s, shape=n_subj)
        v = pm.Normal("v", 0, sd_i, shape=n_item)
        sigma = pm.HalfNormal("sigma", 1)
        pm.Normal("y", mu + u[subj] + v[item], sigma, observed=y)
    return m


def nested_index():
    """Counties within states: county effects centered on their state's effect."""
    rng = np.random.default_rng(36)
    n_state, n_county = 3, 9
    state_of_county = np.arange(n_county) % n_state
    county = rng.integers(0, n_county, N)
    y = rng.normal(size=N)
    with pm.Model() as m:
        s = pm.Normal("s", 0, 2, shape=n_state)
        sd_c = pm.HalfNormal("sd_c", 1)
        c = pm.Normal("c", s[state_of_county], sd_c, shape=n_county)
        sigma = pm.HalfNormal("sigma", 1)
        pm.Normal("y", c[county], sigma, observed=y)
    return m


def nested_index_direct():
    """The same nesting written in the likelihood: ``s[state_of_county[county]] + c[county]``."""
    rng = np.random.default_rng(37)
    n_state, n_county = 3, 9
    state_of_county = np.arange(n_county) % n_state
    county = rng.integers(0, n_county, N)
    y = rng.poisson(3.0, size=N)
    with pm.Model() as m:
        s = pm.Normal("s", 0, 2, shape=n_state)
        sd_c = pm.HalfNormal("sd_c", 1)
        c = pm.Normal("c", 0, sd_c, shape=n_county)
        pm.Poisson("y", pm.math.exp(s[state_of_county[county]] + c[county]), observed=y)
    return m


def log_scale_normal():
    """A Normal latent that sets the scale of another: it becomes a hyperparameter."""
    G = 6
    rng, g = _groups(38, G)
    y = rng.normal(size=N)
    with pm.Model() as m:
        log_s = pm.Normal("log_s", 0, 1)
        a = pm.Normal("a", 0, pm.math.exp(log_s), shape=G)
        pm.Normal("y", a[g], 1.0, observed=y)
    return m


def nonlinear_mean_prior():
    G = 6
    rng, g = _groups(39, G)
    y = rng.normal(size=N)
    with pm.Model() as m:
        mu_a = pm.Normal("mu_a", 0, 1)
        a = pm.Normal("a", pm.math.exp(mu_a), 1.0, shape=G)
        pm.Normal("y", a[g], 1.0, observed=y)
    return m


def nonlinear_regression():
    rng = np.random.default_rng(40)
    t = np.linspace(0, 5, N)
    y = 3.0 * np.exp(-0.7 * t) + 0.1 * rng.normal(size=N)
    with pm.Model() as m:
        a = pm.Normal("a", 0, 5)
        b = pm.Normal("b", 0, 1)
        sigma = pm.HalfNormal("sigma", 1)
        pm.Normal("y", a * pm.math.exp(-b * t), sigma, observed=y)
    return m


# --------------------------------------------------------- matrix factorization
def _ratings(seed, n_users=12, n_items=10, n=N):
    rng = np.random.default_rng(seed)
    s = rng.integers(0, n_users, n)
    d = rng.integers(0, n_items, n)
    r = rng.normal(size=n)
    return s, d, r


def pmf_sum():
    s, d, r = _ratings(41)
    with pm.Model() as m:
        U = pm.Normal("U", 0, 1, shape=(12, 3))
        V = pm.Normal("V", 0, 1, shape=(10, 3))
        sigma = pm.HalfNormal("sigma", 1)
        pm.Normal("r", (U[s] * V[d]).sum(-1), sigma, observed=r)
    return m


def pmf_einsum():
    s, d, r = _ratings(42)
    with pm.Model() as m:
        U = pm.Normal("U", 0, 1, shape=(12, 3))
        V = pm.Normal("V", 0, 1, shape=(10, 3))
        pm.Normal("r", pt.einsum("nk,nk->n", U[s], V[d]), 0.5, observed=r)
    return m


def pmf_with_biases():
    s, d, r = _ratings(43)
    with pm.Model() as m:
        U = pm.Normal("U", 0, 1, shape=(12, 3))
        V = pm.Normal("V", 0, 1, shape=(10, 3))
        pm.Normal("r", pm.math.sum(U[s] * V[d], axis=1), 0.5, observed=r)
    return m


def pmf_dense_missing():
    """A matrix with missing entries, observed densely: PyMC imputes them."""
    rng = np.random.default_rng(44)
    Y = rng.normal(size=(12, 10))
    Y[rng.random(Y.shape) < 0.3] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pm.ImputationWarning)
        with pm.Model() as m:
            U = pm.Normal("U", 0, 1, shape=(12, 3))
            V = pm.Normal("V", 0, 1, shape=(10, 3))
            pm.Normal("Y", U @ V.T, 0.5, observed=Y)
    return m


# ------------------------------------------------------------- Rayleigh globals
def _gme_data(seed):
    rng, X, w_true = _data(seed)
    y = rng.poisson(np.log1p(np.exp(X @ w_true)))
    return X, y


def gme_rayleigh():
    """The paper's generalized mixed effects model with a Rayleigh noise scale."""
    X, y = _gme_data(50)
    with pm.Model() as m:
        w1 = pm.Normal("w1", 0, 1, shape=D)
        w2 = pymc_mcssvi.Rayleigh("w2", sigma=5.0)
        f = pm.Normal("f", X @ w1, pm.math.sqrt(w2), shape=N)
        pm.Poisson("y", pm.math.log1pexp(f), observed=y)
    return m


def gme_weibull2():
    X, y = _gme_data(51)
    with pm.Model() as m:
        w1 = pm.Normal("w1", 0, 1, shape=D)
        w2 = pm.Weibull("w2", alpha=2.0, beta=3.0)
        f = pm.Normal("f", X @ w1, pm.math.sqrt(w2), shape=N)
        pm.Poisson("y", pm.math.log1pexp(f), observed=y)
    return m


def gme_weibull15():
    X, y = _gme_data(52)
    with pm.Model() as m:
        w1 = pm.Normal("w1", 0, 1, shape=D)
        w2 = pm.Weibull("w2", alpha=1.5, beta=3.0)
        f = pm.Normal("f", X @ w1, pm.math.sqrt(w2), shape=N)
        pm.Poisson("y", pm.math.log1pexp(f), observed=y)
    return m


def rayleigh_regression_scale():
    """A Rayleigh global used directly as the noise scale of a regression."""
    rng, X, w_true = _data(53)
    y = X @ w_true + rng.normal(size=N)
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        s = pymc_mcssvi.Rayleigh("s", sigma=2.0)
        pm.Normal("y", X @ w, s, observed=y)
    return m


# ----------------------------------------------------------------------- locals
def gme_halfnormal_scale():
    """GME with a HalfNormal noise scale: f is a local, the scale a hyperparameter."""
    X, y = _gme_data(54)
    with pm.Model() as m:
        w1 = pm.Normal("w1", 0, 1, shape=D)
        tau = pm.HalfNormal("tau", 1)
        f = pm.Normal("f", X @ w1, tau, shape=N)
        pm.Poisson("y", pm.math.log1pexp(f), observed=y)
    return m


def olre_additive():
    """Observation-level random effect added to the linear predictor (overdispersed Poisson)."""
    rng, X, w_true = _data(55)
    y = rng.poisson(np.exp(0.3 * X @ w_true + 0.5 * rng.normal(size=N)))
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        sd = pm.HalfNormal("sd", 1)
        eps = pm.Normal("eps", 0, sd, shape=N)
        pm.Poisson("y", pm.math.exp(X @ w + eps), observed=y)
    return m


def olre_centered():
    """The same observation-level effect written centered on the linear predictor."""
    rng, X, w_true = _data(56)
    y = rng.poisson(np.exp(0.3 * X @ w_true + 0.5 * rng.normal(size=N)))
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        sd = pm.HalfNormal("sd", 1)
        eta = pm.Normal("eta", X @ w, sd, shape=N)
        pm.Poisson("y", pm.math.exp(eta), observed=y)
    return m


def zero_inflation_indicator():
    rng, X, w_true = _data(57)
    y = rng.poisson(np.exp(0.3 * X @ w_true)) * rng.binomial(1, 0.7, size=N)
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        z = pm.Bernoulli("z", 0.3, shape=N)
        pm.Poisson("y", z * pm.math.exp(X @ w), observed=y)
    return m


def mixture_regression_switch():
    rng, X, _ = _data(58)
    y = rng.normal(size=N)
    with pm.Model() as m:
        w0 = pm.Normal("w0", 0, 1, shape=D)
        w1 = pm.Normal("w1", 0, 1, shape=D)
        z = pm.Categorical("z", p=np.array([0.5, 0.5]), shape=N)
        mu = pm.math.switch(pt.eq(z, 1), X @ w1, X @ w0)
        pm.Normal("y", mu, 1.0, observed=y)
    return m


def mixture_means_stack():
    rng = np.random.default_rng(59)
    y = np.concatenate([rng.normal(-2, 1, N // 2), rng.normal(2, 1, N // 2)])
    with pm.Model() as m:
        mu0 = pm.Normal("mu0", -1, 5)
        mu1 = pm.Normal("mu1", 1, 5)
        z = pm.Categorical("z", p=np.array([0.4, 0.6]), shape=N)
        mu = pt.stack([mu0, mu1])[z]
        pm.Normal("y", mu, 1.0, observed=y)
    return m


def mixture_three_components():
    rng = np.random.default_rng(60)
    y = rng.normal(size=N)
    with pm.Model() as m:
        mus = pm.Normal("mus", np.array([-2.0, 0.0, 2.0]), 1.0, shape=3)
        z = pm.Categorical("z", p=np.ones(3) / 3, shape=N)
        pm.Normal("y", mus[z], 1.0, observed=y)
    return m


# -------------------------------------------------------------------- minibatch
def _mb_data(seed):
    rng, X, w_true = _data(seed, n=200)
    # float 0/1 labels: pm.Minibatch cannot slice int64 observed data (PyMC casts it to int32)
    y = rng.binomial(1, 1 / (1 + np.exp(-X @ w_true))).astype("float64")
    return X, y


def minibatch_total_size():
    X, y = _mb_data(70)
    X_mb, y_mb = pm.Minibatch(X, y, batch_size=50)
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        pm.Bernoulli("y", logit_p=X_mb @ w, observed=y_mb, total_size=len(y))
    return m


def minibatch_no_total_size():
    X, y = _mb_data(71)
    X_mb, y_mb = pm.Minibatch(X, y, batch_size=50)
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        pm.Bernoulli("y", logit_p=X_mb @ w, observed=y_mb)
    return m


def minibatch_glmm():
    """Random intercepts with the group index sliced by the same minibatch."""
    rng, g = _groups(74, 10, n=200)
    x = rng.normal(size=200)
    y = rng.normal(size=200)
    x_mb, g_mb, y_mb = pm.Minibatch(x, g, y, batch_size=40)
    with pm.Model() as m:
        beta = pm.Normal("beta", 0, 1)
        sd = pm.HalfNormal("sd", 1)
        a = pm.Normal("a", 0, sd, shape=10)
        pm.Normal("y", a[g_mb] + beta * x_mb, 1.0, observed=y_mb, total_size=200)
    return m


# ----------------------------------------------------------------- potentials
def potential_on_gaussians():
    rng, X, w_true = _data(72)
    y = rng.binomial(1, 1 / (1 + np.exp(-X @ w_true)))
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        pm.Bernoulli("y", logit_p=X @ w, observed=y)
        pm.Potential("sum_to_zero", pm.logp(pm.Normal.dist(0, 0.01), w.sum()))
    return m


def potential_on_hyper():
    rng, X, w_true = _data(73)
    y = X @ w_true + rng.normal(size=N)
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        sigma = pm.HalfNormal("sigma", 1)
        pm.Normal("y", X @ w, sigma, observed=y)
        pm.Potential("sigma_penalty", -(sigma**2))
    return m


# ----------------------------------------------------------- unsupported models
def gamma_poisson():
    y = np.random.default_rng(80).poisson(3.0, size=N)
    with pm.Model() as m:
        lam = pm.Gamma("lam", 2.0, 1.0)
        pm.Poisson("y", lam, observed=y)
    return m


def laplace_coefficients():
    rng, X, w_true = _data(81)
    y = X @ w_true + rng.normal(size=N)
    with pm.Model() as m:
        w = pm.Laplace("w", 0, 1, shape=D)
        pm.Normal("y", X @ w, 1.0, observed=y)
    return m


def predictions_in_model():
    """Predictions written into the model: free variables nothing reads."""
    rng, X, w_true = _data(83)
    y = rng.poisson(np.exp(0.3 * X @ w_true))
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        pm.Poisson("y", pm.math.exp(X @ w), observed=y)
        y_new = pm.Poisson("y_new", pm.math.exp(X[:4] @ w))
        pm.Normal("noisy_new", y_new, 1.0)
    return m


def missing_observed():
    rng, X, w_true = _data(82)
    y = X @ w_true + rng.normal(size=N)
    y[[3, 17]] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pm.ImputationWarning)  # PyMC announces the imputation
        with pm.Model() as m:
            w = pm.Normal("w", 0, 1, shape=D)
            pm.Normal("y", X @ w, 1.0, observed=y)
    return m


def nan_design_matrix():
    rng, X, w_true = _data(83)
    y = rng.binomial(1, 1 / (1 + np.exp(-X @ w_true)))
    X[5, 1] = np.nan
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        pm.Bernoulli("y", logit_p=X @ w, observed=y)
    return m


def multivariate_observed():
    rng = np.random.default_rng(85)
    Y = rng.normal(size=(N, 2))
    with pm.Model() as m:
        mu = pm.Normal("mu", 0, 1, shape=2)
        pm.MvNormal("Y", mu=mu, cov=np.eye(2), observed=Y)
    return m


def discrete_scalar_latent():
    rng, X, w_true = _data(86)
    y = rng.poisson(3.0, size=N)
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        k = pm.Poisson("k", 3.0)
        pm.Poisson("y", pm.math.exp(X @ w) + k, observed=y)
    return m


def bernoulli_wrong_size():
    rng, X, w_true = _data(87)
    y = rng.poisson(3.0, size=N)
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        z = pm.Bernoulli("z", 0.5, shape=N // 2)
        pm.Poisson("y", pm.math.exp(X @ w) * pt.concatenate([z, z]), observed=y)
    return m


def bernoulli_shared_by_two_observed():
    rng, X, w_true = _data(88)
    y1 = rng.poisson(3.0, size=N)
    y2 = rng.poisson(3.0, size=N)
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        z = pm.Bernoulli("z", 0.5, shape=N)
        pm.Poisson("y1", z * pm.math.exp(X @ w), observed=y1)
        pm.Poisson("y2", z * pm.math.exp(X @ w), observed=y2)
    return m


def cluster_assignment_per_group():
    """A Categorical of the wrong length: one assignment per group, read by many rows."""
    G = 6
    rng, g = _groups(89, G)
    y = rng.normal(size=N)
    with pm.Model() as m:
        mus = pm.Normal("mus", 0, 5, shape=2)
        z = pm.Categorical("z", p=np.array([0.5, 0.5]), shape=G)
        pm.Normal("y", mus[z[g]], 1.0, observed=y)
    return m


# ------------------------------------------------------------------ more GLMs
def zero_inflated_poisson():
    rng, X, w_true = _data(90)
    y = rng.poisson(np.exp(0.3 * X @ w_true)) * rng.binomial(1, 0.7, size=N)
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        psi = pm.Beta("psi", 2, 2)
        pm.ZeroInflatedPoisson("y", psi=psi, mu=pm.math.exp(X @ w), observed=y)
    return m


def beta_regression():
    rng, X, w_true = _data(91)
    y = rng.beta(2.0, 2.0, size=N)
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        kappa = pm.Gamma("kappa", 2.0, 0.1)
        pm.Beta("y", mu=pm.math.invlogit(X @ w), nu=kappa, observed=y)
    return m


def exponential_survival():
    rng, X, w_true = _data(92)
    t = rng.exponential(np.exp(0.3 * X @ w_true))
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        pm.Exponential("t", lam=pm.math.exp(-(X @ w)), observed=t)
    return m


def censored_regression():
    rng, X, w_true = _data(93)
    y = np.minimum(X @ w_true + rng.normal(size=N), 1.5)
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        pm.Censored("y", pm.Normal.dist(X @ w, 1.0), lower=None, upper=1.5, observed=y)
    return m


def truncated_regression():
    rng, X, w_true = _data(102)
    y = np.minimum(X @ w_true + rng.normal(size=N), 4.9)
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        pm.Truncated("y", pm.Normal.dist(X @ w, 1.0), upper=5.0, observed=y)
    return m


def multinomial_logistic():
    rng, X, _ = _data(94)
    y = rng.integers(0, 3, size=N)
    with pm.Model() as m:
        W = pm.Normal("W", 0, 1, shape=(D, 3))
        pm.Categorical("y", p=pm.math.softmax(X @ W, axis=-1), observed=y)
    return m


def heteroskedastic():
    rng, X, w_true = _data(95)
    y = X @ w_true + np.exp(0.2 * X[:, 0]) * rng.normal(size=N)
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        v = pm.Normal("v", 0, 1, shape=D)
        pm.Normal("y", X @ w, pm.math.exp(X @ v), observed=y)
    return m


def log_sigma_likelihood():
    rng, X, w_true = _data(96)
    y = X @ w_true + rng.normal(size=N)
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        log_sigma = pm.Normal("log_sigma", 0, 1)
        pm.Normal("y", X @ w, pm.math.exp(log_sigma), observed=y)
    return m


def random_walk_spline():
    rng = np.random.default_rng(97)
    K = 6
    B = rng.uniform(size=(N, K))
    y = rng.normal(size=N)
    with pm.Model() as m:
        sd = pm.HalfNormal("sd", 1)
        steps = pm.Normal("steps", 0, sd, shape=K)
        beta = pt.cumsum(steps)
        pm.Normal("y", B @ beta, 1.0, observed=y)
    return m


def mvnormal_hierarchical_mean():
    rng, X, w_true = _data(98)
    y = X @ w_true + rng.normal(size=N)
    with pm.Model() as m:
        m0 = pm.Normal("m0", 0, 1)
        w = pm.MvNormal("w", mu=m0 * np.ones(D), cov=np.eye(D))
        pm.Normal("y", X @ w, 1.0, observed=y)
    return m


def vector_matrix_product():
    rng, X, w_true = _data(99)
    y = rng.binomial(1, 1 / (1 + np.exp(-X @ w_true)))
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        pm.Bernoulli("y", logit_p=pm.math.dot(w, X.T), observed=y)
    return m


def normal_mixture_likelihood():
    rng, X, w_true = _data(100)
    y = X @ w_true + rng.normal(size=N)
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        mu = X @ w
        pm.NormalMixture(
            "y",
            w=np.array([0.9, 0.1]),
            mu=pt.stack([mu, mu], axis=-1),
            sigma=np.array([1.0, 5.0]),
            observed=y,
        )
    return m


def gaussian_latent_only():
    """A 'local' with no global at all: ``y ~ Normal(f, 1)``, ``f ~ Normal(0, 1)``."""
    y = np.random.default_rng(101).normal(size=N)
    with pm.Model() as m:
        f = pm.Normal("f", 0, 1, shape=N)
        pm.Normal("y", f, 1.0, observed=y)
    return m
