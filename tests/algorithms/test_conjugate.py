"""Algorithms against closed forms: the conjugate Gaussian linear model.

With a Gaussian likelihood and an affine predictor, one MC-SSVI step with
rho = 1 lands exactly on the posterior (the fixed-point update is exact).
"""

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import pytest
from scipy import stats

import pymc_mcssvi
from pymc_mcssvi.algorithms.sdsvi import factor_gradient
from pymc_mcssvi.families.gaussian import GaussianBlocks


@pytest.fixture(scope="module")
def conjugate():
    rng = np.random.default_rng(3)
    n, d = 120, 4
    X = rng.normal(size=(n, d))
    g = rng.integers(0, 3, n)
    sigma = 0.6
    y = X @ rng.normal(size=d) + rng.normal(0, sigma, n)
    with pm.Model() as model:
        b0 = pm.Normal("b0", 1.0, 2.0)
        w = pm.Normal("w", 0.0, 1.5, shape=d)
        a = pm.Normal("a", 0.0, 0.5, shape=3)
        pm.Normal("y", b0 + X @ w + a[g], sigma, observed=y)
    # Exact posterior of (b0, w, a).
    A = np.column_stack([np.ones(n), X, np.eye(3)[g]])
    prior_mean = np.r_[1.0, np.zeros(d), np.zeros(3)]
    prior_prec = np.diag(np.r_[1 / 4.0, np.full(d, 1 / 2.25), np.full(3, 1 / 0.25)])
    P = prior_prec + A.T @ A / sigma**2
    m = np.linalg.solve(P, prior_prec @ prior_mean + A.T @ y / sigma**2)
    logml = stats.multivariate_normal(
        A @ prior_mean, A @ np.linalg.inv(prior_prec) @ A.T + sigma**2 * np.eye(n)
    ).logpdf(y)
    return model, m, P, logml


@pytest.mark.parametrize("cls", [pymc_mcssvi.MCSSVI, pymc_mcssvi.HMCSSVI])
def test_one_step_rho_one_is_exact_posterior(conjugate, cls):
    model, m, P, logml = conjugate
    with model:
        inf = cls(schedule=1.0, start_sigma=3.0)
        inf.fit(n=2, progressbar=False)  # iteration 1 evaluates q0, iteration 2 accepts the step
    st = inf.store.symbolic
    mean = st.cand.means[0].get_value() if st.t.get_value() < 2 else st.base.means[0].get_value()
    L = (
        st.cand.factors[0].get_value() if st.t.get_value() < 2 else st.base.factors[0].get_value()
    )[0]
    np.testing.assert_allclose(mean[0], m, rtol=0, atol=1e-8)
    np.testing.assert_allclose(L @ L.T, P, rtol=1e-8, atol=1e-10 * np.abs(P).max())
    # And the bound at the posterior is the log marginal likelihood.
    np.testing.assert_allclose(-inf.hist[-1], logml, rtol=1e-9)


def test_flat_intercept_is_a_gaussian_global_with_zero_prior_precision():
    """``pm.Flat`` (log density 0) is a Gaussian global with no prior term: one step
    with rho = 1 lands on the exact posterior, whose precision has no prior part in
    that coordinate. It was a hyperparameter (a mean-field q apart from the other
    coefficients: a group scale 0.28 NUTS sd low, the intercept's sd 0.90x)."""
    rng = np.random.default_rng(4)
    n, d = 80, 3
    X = rng.normal(size=(n, d))
    sigma = 0.7
    y = 2.0 + X @ rng.normal(size=d) + rng.normal(0, sigma, n)
    with pm.Model() as model:
        b0 = pm.Flat("b0")
        w = pm.Normal("w", 0.0, 1.5, shape=d)
        pm.Normal("y", b0 + X @ w, sigma, observed=y)
    assert pymc_mcssvi.describe(model).role("b0") == "gaussian global"
    A = np.column_stack([np.ones(n), X])
    prior_prec = np.diag(np.r_[0.0, np.full(d, 1 / 2.25)])
    P = prior_prec + A.T @ A / sigma**2
    m = np.linalg.solve(P, A.T @ y / sigma**2)
    with model:
        inf = pymc_mcssvi.MCSSVI(schedule=1.0, start_sigma=3.0)
        inf.fit(n=2, progressbar=False)
    st = inf.store.symbolic
    L = st.base.factors[0].get_value()[0]
    np.testing.assert_allclose(st.base.means[0].get_value()[0], m, rtol=0, atol=1e-8)
    np.testing.assert_allclose(L @ L.T, P, rtol=1e-8, atol=1e-10 * np.abs(P).max())


def test_bound_at_posterior_is_log_marginal_likelihood(conjugate):
    model, m, P, logml = conjugate
    with model:
        inf = pymc_mcssvi.MCSSVI()
    st = inf.store.symbolic
    st.cand.means[0].set_value(m[None])
    st.cand.factors[0].set_value(np.linalg.cholesky(P)[None])
    ev = inf.bound.evaluate(
        [GaussianBlocks(st.cand.means[0], st.cand.factors[0])], need_derivatives=False
    )
    np.testing.assert_allclose(pytensor.function([], ev.value)(), logml, rtol=1e-9)


def test_sdsvi_factor_gradient_matches_finite_differences(rng):
    """d/dC [E_q l + entropy] = triu(C H + diag(1/diag C)) for a quadratic l."""
    K = 3
    Hm = -np.eye(K) * 2 + 0.3
    C0 = np.triu(rng.normal(size=(K, K))) + 2 * np.eye(K)

    def objective(C):
        S = C.T @ C
        return 0.5 * np.trace(Hm @ S) + np.sum(np.log(np.abs(np.diag(C))))

    got = factor_gradient(pt.as_tensor(C0[None]), pt.as_tensor(Hm[None])).eval()[0]
    h = 1e-6
    for i in range(K):
        for j in range(i, K):
            Cp, Cm = C0.copy(), C0.copy()
            Cp[i, j] += h
            Cm[i, j] -= h
            np.testing.assert_allclose(
                got[i, j], (objective(Cp) - objective(Cm)) / (2 * h), rtol=1e-6
            )
    assert np.all(np.tril(got, -1) == 0)


@pytest.mark.parametrize("cls", [pymc_mcssvi.MCSSVI, pymc_mcssvi.HMCSSVI, pymc_mcssvi.SDSVI])
def test_all_algorithms_reach_the_exact_posterior(conjugate, cls):
    model, m, P, logml = conjugate
    with model:
        # S-DSVI's standard-gradient steps: exactly 3000 (its stopping rule stops sooner)
        sdsvi = cls is pymc_mcssvi.SDSVI
        approx = cls().fit(
            n=3000 if sdsvi else None, tol=None if sdsvi else "auto", progressbar=False
        )
    S = np.linalg.inv(P)
    np.testing.assert_allclose(approx.mean.eval(), m, atol=1e-3 * np.sqrt(np.diag(S)).max() * 10)
    np.testing.assert_allclose(approx.std.eval(), np.sqrt(np.diag(S)), rtol=1e-2)
    np.testing.assert_allclose(-approx.hist[-1], logml, rtol=1e-5)


def test_multivariate_normal_outcome_is_exact_in_one_step():
    """An MvNormal outcome (read as whitened residuals ``L^-1 (y - mu)``, an affine
    predictor with a Gaussian likelihood; it was Monte Carlo + autodiff, also exact for
    a quadratic with antithetic draws) lands on the closed-form posterior of its mean
    and regression coefficients in one step with rho = 1."""
    rng = np.random.default_rng(31)
    n, x = 40, np.linspace(-1, 1, 40)
    Sigma = np.array([[1.0, 0.6], [0.6, 0.8]])
    Y = np.column_stack([0.5 + x, -0.3 * x]) + rng.multivariate_normal(np.zeros(2), Sigma, n)
    with pm.Model():
        a = pm.Normal("a", 0.0, 2.0, shape=2)
        b = pm.Normal("b", 0.0, 1.0, shape=2)
        pm.MvNormal("Y", a + x[:, None] * b, cov=Sigma, observed=Y)
        inf = pymc_mcssvi.MCSSVI(schedule=1.0, start_sigma=3.0)
        inf.fit(n=2, progressbar=False)
    assert inf.tlm.observed["Y"] == "dense affine (MvNormal, whitened)"
    # exact posterior of (a, b): y_i = [I, x_i I] (a, b) + noise
    Si = np.linalg.inv(Sigma)
    P = np.diag(np.r_[np.full(2, 1 / 4.0), np.ones(2)])
    h = np.zeros(4)
    for i in range(n):
        A = np.hstack([np.eye(2), x[i] * np.eye(2)])
        P = P + A.T @ Si @ A
        h = h + A.T @ Si @ Y[i]
    st = inf.store.symbolic
    mean = st.base.means[0].get_value()[0]
    L = st.base.factors[0].get_value()[0]
    np.testing.assert_allclose(mean, np.linalg.solve(P, h), atol=1e-8)
    np.testing.assert_allclose(L @ L.T, P, rtol=1e-8, atol=1e-10 * np.abs(P).max())


def test_sparse_gp_projection_is_exact_in_one_step():
    """A sparse GP with Gaussian noise (the paper's sparse GP experiment, fixed kernel):
    ``f = K_fu @ solve(K_uu, u)`` with ``u ~ MvNormal(0, K_uu)`` is affine in ``u``, so
    one natural step with rho = 1 lands on the closed-form posterior of ``u``."""
    rng = np.random.default_rng(32)
    n, m, noise = 60, 7, 0.3
    x = np.sort(rng.uniform(0, 5, n))[:, None]
    xu = np.linspace(0, 5, m)[:, None]
    y = np.sin(2 * x[:, 0]) + rng.normal(0, noise, n)
    cov = 1.2**2 * pm.gp.cov.Matern52(1, ls=0.8)
    kuu = cov(xu).eval() + 1e-6 * np.eye(m)
    kfu = cov(x, xu).eval()
    with pm.Model():
        u = pm.MvNormal("u", 0.0, cov=kuu)
        f = pt.as_tensor(kfu) @ pt.linalg.solve(pt.as_tensor(kuu), u, assume_a="pos")
        pm.Normal("y", f, noise, observed=y)
        inf = pymc_mcssvi.MCSSVI(schedule=1.0, start_sigma=3.0)
        inf.fit(n=2, progressbar=False)
    assert inf.tlm.observed["y"] == "dense affine"
    A = kfu @ np.linalg.inv(kuu)
    P = np.linalg.inv(kuu) + A.T @ A / noise**2
    st = inf.store.symbolic
    mean = st.base.means[0].get_value()[0]
    L = st.base.factors[0].get_value()[0]
    np.testing.assert_allclose(L @ L.T, P, rtol=1e-7)
    np.testing.assert_allclose(mean, np.linalg.solve(P, A.T @ y / noise**2), rtol=1e-6, atol=1e-6)


def _grid_adjacency(rows, cols):
    n = rows * cols
    W = np.zeros((n, n), dtype=int)
    for r in range(rows):
        for c in range(cols):
            i = r * cols + c
            if c + 1 < cols:
                W[i, i + 1] = W[i + 1, i] = 1
            if r + 1 < rows:
                W[i, i + cols] = W[i + cols, i] = 1
    return W


@pytest.mark.parametrize("prior", ["icar", "car"])
def test_spatial_effect_with_gaussian_noise_is_exact_in_one_step(prior):
    """``pm.ICAR`` (edges' differences plus PyMC's soft sum-to-zero term) and ``pm.CAR``
    (precision ``tau (D - alpha W)``) are Gaussian globals: with a Gaussian likelihood
    one natural step with rho = 1 lands on the closed-form posterior, and the bound
    there is the log normalizer of PyMC's log density (so the prior's constants,
    which move with ``sigma``, ``alpha`` and ``tau`` when those are learned, are
    PyMC's)."""
    rng = np.random.default_rng(33)
    W = _grid_adjacency(4, 5)
    n, noise = len(W), 0.4
    y = rng.normal(0, 1, n)
    with pm.Model() as model:
        if prior == "icar":
            phi = pm.ICAR("phi", W=W, sigma=0.7)
            i, j = np.nonzero(np.tril(W))
            B = np.zeros((len(i), n))
            B[np.arange(len(i)), i], B[np.arange(len(i)), j] = 1.0, -1.0
            P0 = B.T @ B / 0.7**2 + np.ones((n, n)) / (0.001 * n) ** 2
        else:
            phi = pm.CAR("phi", mu=np.zeros(n), W=W, alpha=0.8, tau=2.0)
            P0 = 2.0 * (np.diag(W.sum(0)) - 0.8 * W)
        pm.Normal("y", phi, noise, observed=y)
        # the adaptive schedule's first step has rho = 1 (a constant schedule's trust
        # region would shorten the step from the start, shrunk by the soft constraint)
        inf = pymc_mcssvi.MCSSVI()
        approx = inf.fit(n=2, progressbar=False)
    assert inf.tlm.gaussians[0].prior == prior
    P = P0 + np.eye(n) / noise**2
    m = np.linalg.solve(P, y / noise**2)
    st = inf.store.symbolic
    L = st.base.factors[0].get_value()[0]
    np.testing.assert_allclose(st.base.means[0].get_value()[0], m, atol=1e-8)
    np.testing.assert_allclose(L @ L.T, P, rtol=1e-8, atol=1e-10 * np.abs(P).max())
    logp = model.compile_logp()({"phi": m})
    log_normalizer = logp + 0.5 * n * np.log(2 * np.pi) - 0.5 * np.linalg.slogdet(P)[1]
    np.testing.assert_allclose(-approx.hist[-1], log_normalizer, rtol=1e-9)


@pytest.mark.parametrize("kind", ["random_walk", "ar2_constant"])
def test_latent_time_series_is_exact_in_one_step(kind):
    """A ``pm.GaussianRandomWalk`` or ``pm.AR`` latent (Normal initial values) is a
    Gaussian global whose prior is read as whitened residuals, affine in the path: with
    fixed parameters, an intercept and a Gaussian likelihood the posterior of
    ``(b0, x)`` is Gaussian, and one step with rho = 1 lands on it. Both series are
    batched (two paths) to check PyMC's axis order (walks time-first, AR time-last)."""
    rng = np.random.default_rng(33)
    T, s, noise = 15, 0.3, 0.5
    y = np.cumsum(rng.normal(0, s, (2, T)), axis=1) + rng.normal(0, noise, (2, T))
    rho, c = np.array([0.6, 0.25]), 0.2
    with pm.Model():
        b0 = pm.Normal("b0", 0.0, 2.0)
        if kind == "random_walk":
            x = pm.GaussianRandomWalk(
                "x", mu=0.1, sigma=s, init_dist=pm.Normal.dist(0.5, 1.5), shape=(2, T)
            )
        else:
            x = pm.AR(
                "x", rho=np.r_[c, rho], sigma=s, constant=True,
                init_dist=pm.Normal.dist(0.5, 1.5), shape=(2, T),
            )  # fmt: skip
        pm.Normal("y", b0 + x, noise, observed=y)
        inf = pymc_mcssvi.MCSSVI(schedule=1.0, start_sigma=3.0)
        inf.fit(n=2, progressbar=False)
    assert [g.prior for g in inf.tlm.gaussians] == [
        "normal",
        "randomwalk" if kind == "random_walk" else "ar",
    ]
    # exact: the prior residuals are D x - e (per path), the likelihood y = b0 + x + noise
    n = 2 * T
    D, e = np.zeros((n, n)), np.zeros(n)
    for p in range(2):
        o = p * T
        order = 1 if kind == "random_walk" else 2
        for t in range(T):
            if t < order:
                D[o + t, o + t], e[o + t] = 1 / 1.5, 0.5 / 1.5
            elif kind == "random_walk":
                D[o + t, [o + t, o + t - 1]] = np.array([1.0, -1.0]) / s
                e[o + t] = 0.1 / s
            else:
                D[o + t, [o + t, o + t - 1, o + t - 2]] = np.array([1.0, -rho[0], -rho[1]]) / s
                e[o + t] = c / s
    P = np.zeros((n + 1, n + 1))
    P[0, 0] = 1 / 4.0
    P[1:, 1:] = D.T @ D
    h = np.r_[0.0, D.T @ e]
    A = np.hstack([np.ones((n, 1)), np.eye(n)])
    P, h = P + A.T @ A / noise**2, h + A.T @ y.reshape(-1) / noise**2
    st = inf.store.symbolic
    mean, L = st.base.means[0].get_value()[0], st.base.factors[0].get_value()[0]
    np.testing.assert_allclose(mean, np.linalg.solve(P, h), atol=1e-8)
    np.testing.assert_allclose(L @ L.T, P, rtol=1e-8, atol=1e-10 * np.abs(P).max())
