"""Marginalized locals: quadrature against SciPy, enumeration against PyMC's marginal distributions."""

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import pytest
from scipy import integrate, stats

import pymc_mcssvi
from pymc_mcssvi.recognize.marginalize import marginal_logp
from pymc_mcssvi.recognize.roles import assign_roles

Y = {"poisson_softplus": 3, "bernoulli": 1, "studentt": 1.3, "normal": 0.4}


def _model(kind, loc, scale):
    with pm.Model() as m:
        # the recognizer needs one Gaussian global; data of its own keep it from being
        # a predictive leaf (a variable nothing reads)
        g = pm.Normal("other_global", 0, 1)
        pm.Normal("g_data", g, 1.0, observed=0.0)
        f = pm.Normal("f", loc, scale, shape=3)
        y = np.full(3, Y[kind])
        if kind == "poisson_softplus":
            pm.Poisson("y", pm.math.log1pexp(f), observed=y.astype(int))
        elif kind == "bernoulli":
            pm.Bernoulli("y", logit_p=f, observed=y.astype(int))
        elif kind == "studentt":
            pm.StudentT("y", nu=4, mu=f, sigma=0.5, observed=y)
        else:
            pm.Normal("y", f, 0.7, observed=y)
    return m


def _reference(kind, loc, scale):
    def lik(f):
        if kind == "poisson_softplus":
            return stats.poisson(np.log1p(np.exp(f))).pmf(Y[kind])
        if kind == "bernoulli":
            return 1 / (1 + np.exp(-f))
        if kind == "studentt":
            return stats.t(4, loc=f, scale=0.5).pdf(Y[kind])
        return stats.norm(f, 0.7).pdf(Y[kind])

    val = integrate.quad(
        lambda f: stats.norm(loc, scale).pdf(f) * lik(f),
        loc - 14 * scale,
        loc + 14 * scale,
        epsabs=0,
        epsrel=1e-13,
        limit=400,
    )[0]
    return np.log(val)


CASES = [(k, 0.3, 0.5) for k in Y] + [(k, 1.5, 1.2) for k in Y if k != "studentt"]


@pytest.mark.parametrize(("kind", "loc", "scale"), CASES)
def test_quadrature_marginal_matches_numerical_integration(kind, loc, scale):
    """Smooth likelihoods: 1e-8. (A StudentT likelihood narrower than the local's
    spread has poles near the real axis; Gauss-Hermite then needs ~200 nodes.)"""
    m = _model(kind, loc, scale)
    (lc,) = assign_roles(m).locals
    got = marginal_logp(m, lc, n_inner=120).eval()
    np.testing.assert_allclose(got, _reference(kind, loc, scale), rtol=1e-8, atol=1e-10)


def test_normal_likelihood_marginal_is_closed_form():
    m = _model("normal", 0.3, 0.5)
    (lc,) = assign_roles(m).locals
    got = marginal_logp(m, lc).eval()
    np.testing.assert_allclose(
        got, stats.norm(0.3, np.sqrt(0.5**2 + 0.7**2)).logpdf(0.4), rtol=1e-14
    )


def test_jensen_bound_is_lower():
    m = _model("poisson_softplus", 0.3, 0.8)
    (lc,) = assign_roles(m).locals
    opt = marginal_logp(m, lc, bound="optimal", n_inner=40).eval()
    jen = marginal_logp(m, lc, bound="jensen", n_inner=40).eval()
    assert np.all(jen < opt)


def _bound_at(model, m0, S0):
    with model:
        inf = pymc_mcssvi.MCSSVI(hyper="point", cov="full")
    k, st = inf.kernel, inf.store.symbolic
    st.cand.means[0].set_value(m0)
    st.cand.factors[0].set_value(np.linalg.cholesky(np.linalg.inv(S0)))
    _, info = k.step(st)
    return float(pytensor.function([], info.candidate_bound)())


def test_zero_inflated_indicator_equals_pm_zero_inflated_poisson():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 2))
    y = rng.poisson(np.exp(X @ [0.5, -0.3])) * rng.binomial(1, 0.7, 40)
    with pm.Model() as explicit:
        w = pm.Normal("w", 0, 1, shape=2)
        z = pm.Bernoulli("z", 0.7, shape=40)
        pm.Poisson("y", z * pm.math.exp(X @ w) + 1e-300 * (1 - z), observed=y)
    with pm.Model() as marginal:
        w = pm.Normal("w", 0, 1, shape=2)
        pm.ZeroInflatedPoisson("y", psi=0.7, mu=pm.math.exp(X @ w), observed=y)
    m0 = np.array([[0.4, -0.2]])
    S0 = np.array([[[0.05, 0.01], [0.01, 0.04]]])
    np.testing.assert_allclose(_bound_at(explicit, m0, S0), _bound_at(marginal, m0, S0), rtol=1e-8)


def test_mixture_assignment_equals_pm_normal_mixture():
    rng = np.random.default_rng(1)
    x = rng.normal(size=50)
    y = 0.5 + 1.2 * x + rng.normal(0, 0.3, 50) * np.where(rng.random(50) < 0.8, 1, 4)
    with pm.Model() as explicit:
        b = pm.Normal("b", 0, 2, shape=2)
        z = pm.Categorical("z", p=[0.8, 0.2], shape=50)
        sd = pt.as_tensor([0.3, 1.2])[z]
        pm.Normal("y", b[0] + b[1] * x, sd, observed=y)
    with pm.Model() as marginal:
        b = pm.Normal("b", 0, 2, shape=2)
        mu = b[0] + b[1] * x
        pm.NormalMixture(
            "y", w=[0.8, 0.2], mu=pt.stack([mu, mu], axis=-1), sigma=[0.3, 1.2], observed=y
        )
    m0 = np.array([[0.4, 1.1]])
    S0 = np.array([[[0.01, 0.002], [0.002, 0.02]]])
    np.testing.assert_allclose(_bound_at(explicit, m0, S0), _bound_at(marginal, m0, S0), rtol=1e-8)


def test_local_outside_likelihood_support_is_a_named_error():
    with pm.Model() as m:
        w = pm.Normal("w", 1.0, 1.0)
        f = pm.Normal("f", w, 1.0, shape=5)
        pm.Poisson("y", mu=f, observed=np.ones(5, dtype=int))  # identity link: negative rates
    with pytest.raises(pymc_mcssvi.UnsupportedModelError, match="'f'.*support"):
        pymc_mcssvi.describe(m)


def test_rayleigh_scale_must_be_positive():
    X = np.random.default_rng(0).normal(size=(20, 2))
    with pm.Model():
        w1 = pm.Normal("w1", 0, 1, shape=2)
        w2 = pymc_mcssvi.Rayleigh("w2", sigma=-1.0)
        f = pm.Normal("f", X @ w1, pm.math.sqrt(w2), shape=20)
        pm.Poisson("y", pm.math.exp(f), observed=np.ones(20, dtype=int))
        with pytest.raises(pymc_mcssvi.UnsupportedModelError, match="'w2'.*positive"):
            pymc_mcssvi.MCSSVI()


@pytest.mark.slow
def test_gme_builder_and_optimal_beats_jensen():
    rng = np.random.default_rng(4)
    X = rng.normal(size=(150, 2))
    y = rng.poisson(np.log1p(np.exp(X @ [0.6, -0.5] + rng.normal(0, 0.8, 150))))
    m = pymc_mcssvi.models.gme(X, y, tau=1.0)
    with m:
        opt = pymc_mcssvi.HMCSSVI(bound="optimal").fit(progressbar=False)
        jen = pymc_mcssvi.HMCSSVI(bound="jensen").fit(progressbar=False)
    # Both report their own full bound; the optimal structured bound is the tighter one.
    assert -opt.hist[-1] > -jen.hist[-1]
    idata = opt.sample(200, random_seed=1)
    assert idata.posterior["f"].shape == (1, 200, 150)
    assert idata.posterior.attrs["marginal_locals"] == ["f"]


def test_mvnormal_local_over_all_rows_is_fitted_jointly_and_exactly():
    """A latent with one correlated entry per row (``pm.MvNormal`` over the rows) is not a
    conditionally independent local: it joins the Gaussian globals, and with a Gaussian
    likelihood the joint q is the exact posterior of (w, f)."""
    rng = np.random.default_rng(3)
    N, D, s = 30, 2, 0.5
    X = rng.normal(size=(N, D))
    idx = np.arange(N)
    Sigma = 0.5 * np.exp(-(np.subtract.outer(idx, idx) ** 2) / 10.0) + 1e-3 * np.eye(N)
    y = rng.normal(size=N)
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=D)
        f = pm.MvNormal("f", mu=X @ w, cov=Sigma)
        pm.Normal("y", f, s, observed=y)
    d = pymc_mcssvi.describe(m)
    assert {r["name"]: r["role"] for r in d.variables} == {
        "w": "gaussian global",
        "f": "gaussian global",
    }
    with m:
        approx = pymc_mcssvi.MCSSVI().fit(progressbar=False)
    Si = np.linalg.inv(Sigma)
    P = np.block([[np.eye(D) + X.T @ Si @ X, -X.T @ Si], [-Si @ X, Si + np.eye(N) / s**2]])
    cov = np.linalg.inv(P)
    mean = cov @ np.concatenate([np.zeros(D), y / s**2])
    order = np.concatenate(
        [np.arange(approx.ordering[v][1].start, approx.ordering[v][1].stop) for v in ("w", "f")]
    )
    np.testing.assert_allclose(np.asarray(approx.mean.eval())[order], mean, atol=1e-6)
    np.testing.assert_allclose(np.asarray(approx.cov.eval())[np.ix_(order, order)], cov, atol=1e-6)


def test_minibatch_scaling_multiplies_the_marginal_not_the_integrand():
    """``N / |M|`` scales ``log p(y_i | w)`` after the integral over the local.

    All rows are identical, so any minibatch of 10 of the 40 rows, scaled by 4,
    must give exactly the full data's marginal log likelihood.
    """
    N, b = 40, 10
    X = np.tile([[0.4, -1.0]], (N, 1))
    y = np.full(N, 3, dtype="int32")
    Xm, ym = pm.Minibatch(X, y, batch_size=b)
    values = {"w1": np.array([0.3, -0.2]), "w2_log__": np.log(1.7)}
    out = []
    for data, total in (((X, y), None), ((Xm, ym), N)):
        model = pymc_mcssvi.models.gme(*data, total_size=total)
        local = assign_roles(model).locals[0]
        lp = pt.sum(marginal_logp(model, local))
        inputs = [model.rvs_to_values[model[n]] for n in ("w1", "w2")]
        fn = pytensor.function(inputs, lp, on_unused_input="ignore")
        out.append(fn(values["w1"], values["w2_log__"]))
    assert pymc_mcssvi.describe(model).predictor("y") == "dense affine, through local 'f'"
    np.testing.assert_allclose(out[1], out[0], rtol=1e-12)


def test_local_posterior_moments_average_the_exact_conditionals():
    """Gaussian likelihood: given w, f_i | y_i is Gaussian in closed form; the
    local's reported mean and sd are its moments averaged over the same draws of w
    (law of total variance), whatever the batching over draws."""
    from pymc_mcssvi.posterior import locals as L

    rng = np.random.default_rng(7)
    N, s, sig = 40, 0.7, 0.5
    X = rng.normal(size=(N, 2))
    y = X @ [0.8, -0.4] + rng.normal(0, np.hypot(s, sig), N)
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=2)
        f = pm.Normal("f", X @ w, s, shape=N)
        pm.Normal("y", f, sig, observed=y)
        inf = pymc_mcssvi.HMCSSVI(random_seed=0)
        approx = inf.fit(progressbar=False)
    draws = approx.sample_dict_fn(200, random_seed=0)["w"]
    a = draws @ X.T  # (200, N)
    prec = 1 / s**2 + 1 / sig**2
    cond_mean = (a / s**2 + y / sig**2) / prec
    want_mean = cond_mean.mean(0)
    want_sd = np.sqrt(cond_mean.var(0) + 1 / prec)
    p = inf._local_params["f"]
    np.testing.assert_allclose(p["mean"].get_value(), want_mean, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(p["sd"].get_value(), want_sd, rtol=1e-7)
    batch = L.BATCH_ELEMENTS
    try:
        L.BATCH_ELEMENTS = 3 * 40 * N  # batches of 3 draws, the last one shorter
        with m:
            L.local_posteriors(m, approx, inf.tlm.locals, inf._local_params, inf._local_moments)
    finally:
        L.BATCH_ELEMENTS = batch
    np.testing.assert_allclose(p["mean"].get_value(), want_mean, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(p["sd"].get_value(), want_sd, rtol=1e-7)


@pytest.mark.parametrize(("y", "loc", "scale"), [(80, 0.0, 0.55), (200, -1.0, 1.0), (3, 1.0, 0.5)])
def test_adaptive_nodes_integrate_a_likelihood_much_narrower_than_the_local(y, loc, scale):
    """A count of 80 pins ``f`` to +-0.11 while the local's prior sd is 0.55: the
    default 12 nodes placed on the prior are off by 0.8-40 nats, the nodes centred on
    the integrand's mode (Laplace) agree with numerical integration to 1e-8 (relative)."""
    from scipy import special

    with pm.Model() as m:
        g = pm.Normal("other_global", 0, 1)
        pm.Normal("g_data", g, 1.0, observed=0.0)
        f = pm.Normal("f", loc, scale, shape=2)
        pm.Poisson("y", pm.math.exp(f), observed=np.full(2, y))
    (lc,) = assign_roles(m).locals
    got = marginal_logp(m, lc, n_inner=12).eval()

    def integrand(x):
        return np.exp(y * x - np.exp(x) - special.gammaln(y + 1) + stats.norm(loc, scale).logpdf(x))

    mode = np.log(y + 0.5)
    lo, hi = min(loc, mode) - 10 * scale, max(loc, mode) + 10 * scale
    exact = np.log(
        integrate.quad(integrand, lo, hi, points=[mode], epsabs=0, epsrel=1e-13, limit=500)[0]
    )
    # (PyTensor's log(80!) differs from SciPy's by 2e-7 to 2e-6, depending on the
    # backend: a relative 1e-8)
    np.testing.assert_allclose(got, exact, rtol=1e-8, atol=0)


def test_observation_level_effect_predictor_is_the_rest_of_the_sum():
    """``exp(b0 + b1 x + u[g] + e)`` with ``e`` a local: the marginal reads the globals
    through ``b0 + b1 x + u[g]`` only (a gather GLM per row, not Monte Carlo)."""
    rng = np.random.default_rng(2)
    g, x = rng.integers(0, 4, 30), rng.normal(size=30)
    with pm.Model() as m:
        b0 = pm.Normal("b0", 0, 2)
        b1 = pm.Normal("b1", 0, 1)
        u = pm.Normal("u", 0, pm.HalfNormal("s_g", 1), shape=4)
        e = pm.Normal("e", 0, pm.HalfNormal("s_e", 1), shape=30)
        pm.Poisson("y", pm.math.exp(b0 + b1 * x + u[g] + e), observed=rng.poisson(3, 30))
    assert pymc_mcssvi.describe(m).predictor("y") == "dense affine + gather, through local 'e'"


def test_monte_carlo_inner_integral_is_unbiased_in_the_likelihood_and_fits():
    """``inner="mc"`` (the paper's fresh draws from the local's prior): the average of
    ``p(y | f)`` over the draws estimates the integral (checked with 20,000 draws
    against 120 quadrature nodes), and a fit with it runs."""
    m = _model("poisson_softplus", 0.3, 0.5)
    (lc,) = assign_roles(m).locals
    mc = marginal_logp(m, lc, inner="mc", n_inner=20000).eval()
    np.testing.assert_allclose(mc, _reference("poisson_softplus", 0.3, 0.5), atol=0.02)
    rng = np.random.default_rng(5)
    X = rng.normal(size=(60, 2))
    with pymc_mcssvi.models.gme(X, rng.poisson(2, 60), tau=1.0):
        approx = pymc_mcssvi.HMCSSVI(inner="mc", n_inner=100, random_seed=1).fit(
            10, progressbar=False
        )
    assert np.all(np.isfinite(approx.hist))


def _noncentred_and_centred(kind, deterministic=False):
    """One local per observation, scaled by a hyperparameter (rat tumours, eight
    schools): ``mu + sigma * z`` with ``z ~ N(0, 1)``, and ``theta ~ N(mu, sigma)``."""
    rng = np.random.default_rng(3)
    n = rng.integers(10, 40, 12)
    y = rng.binomial(n, 0.3) if kind == "binomial" else rng.normal(1.0, 2.0, 12)
    se = np.linspace(0.5, 2.0, 12)

    def lik(eta):
        if kind == "binomial":
            pm.Binomial("y", n=n, p=pm.math.invlogit(eta), observed=y)
        else:
            pm.Normal("y", eta, se, observed=y)

    with pm.Model() as nc:
        mu = pm.Normal("mu", 0, 2)
        sigma = pm.HalfNormal("sigma", 1)
        z = pm.Normal("z", 0, 1, shape=12)
        eta = mu + sigma * z
        lik(pm.Deterministic("theta", eta) if deterministic else eta)
    with pm.Model() as c:
        mu = pm.Normal("mu", 0, 2)
        sigma = pm.HalfNormal("sigma", 1)
        lik(pm.Normal("theta", mu, sigma, shape=12))
    return nc, c


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "deterministic"), [("binomial", False), ("normal", True)])
def test_noncentred_local_is_integrated_as_the_centred_one(kind, deterministic):
    """``mu + sigma * z`` is the centred local ``theta ~ N(mu, sigma)`` (a change of
    variables): the marginal is the centred one at any point, to rounding, and reads
    the globals through one affine predictor. Before, every quadrature node carried
    ``mu`` and the term went to the general estimator (rat tumours: 12.7 s against
    7.9 s for the centred model, the same bound)."""
    nc, c = _noncentred_and_centred(kind, deterministic)
    marginals = []
    for m in (nc, c):
        (lc,) = assign_roles(m).locals
        lp = marginal_logp(m, lc)
        mu, sigma = m.rvs_to_values[m["mu"]], m.rvs_to_values[m["sigma"]]
        fn = pytensor.function([mu, sigma], lp)
        marginals.append([fn(a, np.log(s)) for a, s in [(-0.8, 0.3), (0.4, 1.7), (1.1, 0.05)]])
    np.testing.assert_allclose(marginals[0], marginals[1], rtol=1e-11, atol=1e-11)
    expected = "dense affine, through local 'z'"
    assert pymc_mcssvi.describe(nc).predictor("y") == expected
    with nc:
        q_nc = pymc_mcssvi.HMCSSVI(random_seed=1).fit(progressbar=False)
    with c:
        q_c = pymc_mcssvi.HMCSSVI(random_seed=1).fit(progressbar=False)
    np.testing.assert_allclose(q_nc.hist[-1], q_c.hist[-1], rtol=1e-9)


@pytest.mark.slow
def test_local_scaled_by_a_global_or_read_twice_is_not_recentred():
    """The change of variables needs the scale free of the Gaussian globals (``beta * z``
    with ``beta`` Gaussian is a product of two unknowns), ``z`` read through the one
    affine expression only, and no zero in a data scale (``x * z`` with ``x = 0`` on
    some rows would give those rows a local of sd 0); otherwise the term stays
    general (and exact)."""
    rng = np.random.default_rng(4)
    y = rng.poisson(3, 10)
    with pm.Model() as by_global:
        mu = pm.Normal("mu", 0, 2)
        beta = pm.Normal("beta", 0.5, 1)
        z = pm.Normal("z", 0, 1, shape=10)
        pm.Poisson("y", pm.math.exp(mu + beta * z), observed=y)
    with pm.Model() as twice:
        mu = pm.Normal("mu", 0, 2)
        sigma = pm.HalfNormal("sigma", 1)
        z = pm.Normal("z", 0, 1, shape=10)
        pm.NegativeBinomial(
            "y", mu=pm.math.exp(mu + sigma * z), alpha=pm.math.exp(z) + 1, observed=y
        )
    with pm.Model() as by_zeros:
        mu = pm.Normal("mu", 0, 2)
        z = pm.Normal("z", 0, 1, shape=10)
        pm.Poisson("y", pm.math.exp(mu + np.arange(10) % 3 * z), observed=y)
    with pm.Model() as by_scaled_zeros:  # a hyperparameter times data with zeros
        mu = pm.Normal("mu", 0, 2)
        sigma = pm.HalfNormal("sigma", 1)
        z = pm.Normal("z", 0, 1, shape=10)
        pm.Poisson("y", pm.math.exp(mu + sigma * (np.arange(10) % 2) * z), observed=y)
    for m in (by_global, twice, by_zeros, by_scaled_zeros):
        assert pymc_mcssvi.describe(m).predictor("y") == "general, through local 'z'"
        (lc,) = assign_roles(m).locals
        assert np.all(
            np.isfinite(marginal_logp(m, lc).eval({v: 0.1 for v in m.value_vars if v.name != "z"}))
        )
