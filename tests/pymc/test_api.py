"""The PyMC-facing API: pm.fit registration, Approximation views, sampling, callbacks, seeds."""

import numpy as np
import pymc as pm
import pytest
from pymc.variational.callbacks import CheckParametersConvergence

import pymc_mcssvi
from pymc_mcssvi import HMCSSVI, MCSSVI, SDSVI, StructuredApproximation


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(5)
    X = rng.normal(size=(150, 2))
    y = rng.normal(0.5 + X @ np.array([1.0, -0.5]), 0.8)
    return X, y


def linreg(X, y, coords=True):
    with pm.Model(
        coords={"feature": ["x1", "x2"], "obs": np.arange(len(y))} if coords else None
    ) as model:
        Xd = pm.Data("X", X, dims=("obs", "feature") if coords else None)
        b0 = pm.Normal("b0", 0, 5)
        w = pm.Normal("w", 0, 1, dims="feature" if coords else None, shape=None if coords else 2)
        sigma = pm.HalfNormal("sigma", 2)
        mu = pm.Deterministic("mu", b0 + Xd @ w, dims="obs" if coords else None)
        pm.Normal("y", mu, sigma, observed=y, dims="obs" if coords else None)
    return model


@pytest.mark.parametrize("method", ["mcssvi", "hmcssvi", "sdsvi", "MCSSVI"])
def test_pm_fit_accepts_method_names(data, method):
    with linreg(*data):
        approx = pm.fit(method=method, progressbar=False, n=5)
    assert isinstance(approx, StructuredApproximation)
    assert len(approx.hist) == 5


@pytest.mark.parametrize("cls", [MCSSVI, HMCSSVI, SDSVI])
def test_pm_fit_accepts_instances(data, cls):
    with linreg(*data):
        approx = pm.fit(method=cls(), progressbar=False)
    assert approx.converged is True
    assert 3 < approx.n_iter < 1000


def test_other_methods_still_work(data):
    with linreg(*data):
        approx = pm.fit(n=50, method="advi", progressbar=False)
    assert len(approx.hist) == 50


def test_default_stops_at_convergence_and_hist_is_negative_elbo(data):
    with linreg(*data):
        approx = pm.fit(method="hmcssvi", progressbar=False)
    assert approx.converged and approx.n_iter < 300
    assert approx.hist.shape == (approx.n_iter,)
    assert np.all(
        np.diff(approx.hist) <= 1e-6 * np.abs(approx.hist[1:])
    )  # monotone: full batch, adaptive


def test_sample_returns_constrained_draws_with_dims(data):
    with linreg(*data) as model:
        approx = pm.fit(
            method="mcssvi", progressbar=False, random_seed=1, inf_kwargs={"hyper": "point"}
        )
        idata = approx.sample(300, random_seed=2)
        ppc = pm.sample_posterior_predictive(idata, progressbar=False, random_seed=3)
    post = idata.posterior
    assert post["w"].dims == ("chain", "draw", "feature")
    assert list(post["feature"].values) == ["x1", "x2"]
    assert post["mu"].dims == ("chain", "draw", "obs")
    assert (post["sigma"] > 0).all()
    np.testing.assert_allclose(post["sigma"].std(), 0.0, atol=1e-12)  # point estimate
    assert "sigma" in post.attrs["point_estimates"]
    assert ppc.posterior_predictive["y"].shape == (1, 300, len(data[1]))
    # Draws agree with the approximation's own views.
    np.testing.assert_allclose(post["w"].mean(("chain", "draw")), approx.mean_data["w"], atol=0.05)
    assert set(model.named_vars) >= {"w", "b0", "sigma"}


def test_meanfield_hyperparameters_are_sampled(data):
    with linreg(*data):
        approx = pm.fit(method="hmcssvi", progressbar=False, random_seed=1)
        idata = approx.sample(500, random_seed=2)
    sigma = idata.posterior["sigma"]
    assert float(sigma.std()) > 0.01
    assert "point_estimates" not in idata.posterior.attrs
    assert approx.std_data["sigma_log__"] > 0


def test_mean_std_cov_views(data):
    with linreg(*data):
        approx = pm.fit(method="mcssvi", progressbar=False, inf_kwargs={"hyper": "point"})
    mean, std, cov = approx.mean.eval(), approx.std.eval(), approx.cov.eval()
    order = approx.ordering
    assert set(order) == {"b0", "w", "sigma_log__"}
    np.testing.assert_allclose(np.sqrt(np.diag(cov)), std, rtol=1e-10)
    s = order["sigma_log__"][1]
    assert std[s] == 0.0
    np.testing.assert_allclose(np.exp(mean[s]), approx.sample(10).posterior["sigma"].values[0, 0])


def test_sample_node_and_callbacks(data):
    calls = []

    def cb(approx, losses, i):
        calls.append(i)
        if i == 7:
            raise StopIteration("enough")

    with linreg(*data, coords=False) as model:
        approx = pm.fit(
            method="hmcssvi", progressbar=False, callbacks=[cb, CheckParametersConvergence()]
        )
        w = model["w"]
        draws = approx.sample_node(w, size=500).eval()
    assert calls == list(range(1, 8))
    assert approx.n_iter == 7
    assert draws.shape == (500, 2)


def test_check_parameters_convergence_with_its_defaults_stops_the_fit(data):
    """PyMC's ``CheckParametersConvergence()`` (``diff="relative"``) compares the flattened
    ``approx.params``: the factors' structural zeros counted as a relative change of 1
    and the fit ran all ``n`` iterations although q had stopped moving."""
    with linreg(*data):
        approx = pm.fit(
            n=1000,
            tol=None,  # PyMC's callback alone stops the fit
            method="hmcssvi",
            progressbar=False,
            callbacks=[CheckParametersConvergence(every=50)],
        )
    assert approx.n_iter == 100
    flat = np.concatenate([p.get_value().ravel() for p in approx.params])
    assert np.all(flat != 0.0)
    # S-DSVI's factors are upper triangular (S = C^T C): their params are the upper
    # triangles, which hold the covariance (the lower ones, read before, were zeros)
    with linreg(*data):
        approx = pm.fit(n=20, method="sdsvi", progressbar=False)
    flat = np.concatenate([p.get_value().ravel() for p in approx.params])
    assert np.all(flat != 0.0)


def test_same_seed_is_bit_identical(data):
    X, y = data
    Xm, ym = pm.Minibatch(X, y, batch_size=32)
    out = []
    for _ in range(2):
        with pm.Model():
            w = pm.Normal("w", 0, 1, shape=2)
            pm.Normal("y", Xm @ w, 0.8, observed=ym, total_size=len(y))
            approx = pm.fit(
                n=30,
                method="hmcssvi",
                random_seed=123,
                progressbar=False,
                inf_kwargs={"estimator": "mc"},
            )
            out.append(
                (
                    approx.hist.copy(),
                    approx.mean.eval(),
                    approx.sample(5, random_seed=1).posterior["w"].values,
                )
            )
    for a, b in zip(out[0], out[1], strict=True):
        np.testing.assert_array_equal(a, b)
    with pm.Model():
        w = pm.Normal("w", 0, 1, shape=2)
        pm.Normal("y", Xm @ w, 0.8, observed=ym, total_size=len(y))
        other = pm.fit(n=30, method="hmcssvi", random_seed=124, progressbar=False)
    assert not np.array_equal(other.hist, out[0][0])


def test_start_values_are_used(data):
    with linreg(*data, coords=False):
        inf = MCSSVI(start={"w": np.array([3.0, -3.0]), "sigma": 2.0})
    np.testing.assert_allclose(inf.approx.mean_data["w"], [3.0, -3.0])
    np.testing.assert_allclose(inf.approx.mean_data["sigma_log__"], np.log(2.0))


def test_refine_continues(data):
    with linreg(*data):
        inf = HMCSSVI()
        inf.fit(n=3, progressbar=False)
        approx = inf.refine(4, progressbar=False)
    assert len(approx.hist) == 7


def test_start_sigma_by_variable_name(data):
    """``start_sigma`` as ``pm.ADVI`` takes it, a dict by variable name (RV or value
    variable), sets the initial sds of those variables' q; a name that is not a free
    variable or an array of the wrong shape is a ValueError naming it."""
    with linreg(*data):
        inf = HMCSSVI(start_sigma={"w": [0.1, 0.2], "sigma_log__": 0.05})
        P = np.linalg.inv(inf.approx.groups[0].cov.eval())
        order = inf.approx.groups[0].ordering
        sd_w = 1 / np.sqrt(np.diag(P)[order["w"][1]])
        np.testing.assert_allclose(sd_w, [0.1, 0.2])
        L_h = inf.store.symbolic.hyper.base_factor.get_value()[0]
        np.testing.assert_allclose(1 / np.diag(L_h), [0.05])
        with pytest.raises(ValueError, match="'nope' is not a free variable"):
            HMCSSVI(start_sigma={"nope": 1.0})
        with pytest.raises(ValueError, match=r"start_sigma\['w'\] has shape \(3,\)"):
            HMCSSVI(start_sigma={"w": [1.0, 2.0, 3.0]})
        approx = pm.fit(method="hmcssvi", start_sigma={"b0": 0.5}, progressbar=False)
    assert np.isfinite(approx.hist[-1])


def test_continuing_after_set_data_fits_the_new_data():
    """``pm.set_data`` between two ``fit`` calls of one inference object (as with
    ``pm.ADVI``): the second call fits the new data. Every step used to be judged against
    the stored bound of the old data and rejected, q stayed put and a DivergenceError
    followed. Relabelled groups: the effects' means come back permuted, the bound equal."""
    rng = np.random.default_rng(0)
    n, G = 200, 10
    g = rng.integers(0, G, n)
    x = rng.normal(size=n)
    y = rng.poisson(np.exp(0.2 + 0.4 * x + rng.normal(0, 0.5, G)[g]))
    with pm.Model() as model:
        gd = pm.Data("g", g)
        b = pm.Normal("b", 0, 2, shape=2)
        u = pm.Normal("u", 0, 1, shape=G)
        pm.Poisson("y", pm.math.exp(b[0] + b[1] * x + u[gd]), observed=y)
        inf = HMCSSVI(random_seed=1)
    inf.fit(progressbar=False)
    u_old, elbo_old = inf.approx.mean_data["u"].values.copy(), inf.hist[-1]
    perm = np.roll(np.arange(G), 3)
    with model:
        pm.set_data({"g": perm[g]})
    inf.fit(n=30, progressbar=False)
    u_new = inf.approx.mean_data["u"].values
    np.testing.assert_allclose(u_new[perm], u_old, atol=1e-4)
    assert abs(inf.hist[-1] - elbo_old) < 1e-6 * abs(elbo_old)


def _glmm_and_gme():
    rng = np.random.default_rng(0)
    g = rng.integers(0, 8, 120)
    x = rng.normal(size=120)
    with pm.Model() as glmm:
        b = pm.Normal("b", 0, 2, shape=2)
        s = pm.HalfNormal("s", 1.0)
        a = pm.Normal("a", 0, s, shape=8)
        pm.Bernoulli("y", logit_p=b[0] + b[1] * x + a[g], observed=rng.integers(0, 2, 120))
    X = rng.standard_normal((60, 3))
    y = rng.poisson(np.log1p(np.exp(X @ np.array([0.5, -0.3, 0.2]))))
    import pymc_mcssvi

    return {"glmm": glmm, "gme": pymc_mcssvi.models.gme(X, y, prior_sd=1.0, tau=5.0)}


@pytest.mark.slow
@pytest.mark.parametrize("which", ["glmm", "gme"])
def test_fitted_approximation_pickles(which):
    """A fitted approximation round-trips through cloudpickle (as PyMC's own do), with
    its per-draw re-fitted globals (GLMM) or local posteriors (GME), and samples the
    same draws for the same seed afterwards."""
    cloudpickle = pytest.importorskip("cloudpickle")
    model = _glmm_and_gme()[which]
    with model:
        approx = HMCSSVI(random_seed=0).fit(max_iter=40, progressbar=False)
    assert approx.conditional_factories, "the approximation should re-fit or add something"
    before = approx.sample(30, random_seed=5).posterior
    loaded = cloudpickle.loads(cloudpickle.dumps(approx))
    after = loaded.sample(30, random_seed=5).posterior
    assert set(after.data_vars) == set(before.data_vars)
    for name in before.data_vars:
        np.testing.assert_allclose(after[name].values, before[name].values, rtol=1e-10)
    np.testing.assert_array_equal(loaded.hist, approx.hist)


def test_inference_options_pass_through_pm_fit():
    """``pm.fit(method="hmcssvi", hyper="point")``, as the collapsed-scale warning suggests,
    raised ``TypeError: HMCSSVI.fit() got unexpected arguments: hyper``."""
    rng = np.random.default_rng(0)
    g = rng.integers(0, 5, 100)
    y = rng.normal(0.3, 0.5, 5)[g] + rng.normal(size=100)
    with pm.Model():
        sd = pm.HalfNormal("sd", 1)
        a = pm.Normal("a", 0, sd, shape=5)
        pm.Normal("y", a[g], 1.0, observed=y)
        approx = pm.fit(method="hmcssvi", hyper="point", progressbar=False)
        assert approx.point_estimates == ["sd"]
        with pytest.raises(TypeError, match="both directly and in inf_kwargs"):
            pm.fit(method="hmcssvi", hyper="point", inf_kwargs={"hyper": "meanfield"})


def test_sample_after_set_dim_keeps_the_fitted_coordinates():
    """``model.set_dim`` to more groups (for predictions) after the fit: ``approx.sample()``
    is the posterior of the fitted model, labelled with the fitted coordinates (xarray
    raised "conflicting sizes for dimension 'grp'"; so does pm.ADVI's); the model keeps
    its new coordinates."""
    rng = np.random.default_rng(34)
    g = rng.integers(0, 6, 120)
    y = rng.normal(0, 0.7, 6)[g] + rng.normal(0, 0.5, 120)
    with pm.Model(coords={"grp": [f"g{i}" for i in range(6)]}) as model:
        gd = pm.Data("gd", g)
        a = pm.Normal("a", 0, 1, dims="grp")
        pm.Normal("y", a[gd], pm.HalfNormal("s", 1), observed=y, shape=gd.shape)
        approx = pm.fit(method="hmcssvi", progressbar=False)
        model.set_dim("grp", 9, coord_values=[f"g{i}" for i in range(9)])
    post = approx.sample(5, random_seed=1).posterior
    assert post["a"].shape == (1, 5, 6)
    assert list(post["grp"].values) == [f"g{i}" for i in range(6)]
    assert len(model.coords["grp"]) == 9


def test_sample_after_set_data_with_new_coords_is_the_fitted_posterior():
    """``pm.set_data`` with new data and new coordinates for predictions: ``approx.sample()``
    is the posterior of the fitted data, its data groups the fitted data under the fitted
    labels (the new data under the old labels raised xarray's "conflicting sizes for
    dimension 'obs'"), and the predictions are for the new data."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(100, 2))
    y = X @ [1.0, -0.5] + rng.normal(size=100)
    with pm.Model(coords={"obs": np.arange(100), "feat": ["a", "b"]}) as model:
        x = pm.Data("x", X, dims=("obs", "feat"))
        yd = pm.Data("y_obs", y, dims="obs")
        w = pm.Normal("w", 0, 1, dims="feat")
        mu = pm.Deterministic("mu", x @ w, dims="obs")
        pm.Normal("y", mu, 1.0, observed=yd, dims="obs")
        approx = pm.fit(method="hmcssvi", progressbar=False)
        pm.set_data({"x": X[:5], "y_obs": np.zeros(5)}, coords={"obs": np.arange(100, 105)})
    idata = approx.sample(20, random_seed=1)
    assert idata["posterior"]["mu"].shape == (1, 20, 100)
    assert idata["observed_data"]["y"].shape == (100,)
    np.testing.assert_array_equal(idata["posterior"]["obs"].values, np.arange(100))
    with model:
        pred = pm.sample_posterior_predictive(idata, predictions=True, progressbar=False)
    assert pred["predictions"]["y"].shape == (1, 20, 5)
    np.testing.assert_array_equal(pred["predictions"]["obs"].values, np.arange(100, 105))


def test_model_with_data_frozen_into_constants_fits_as_the_original():
    """``freeze_dims_and_data`` (PyMC's transform for faster sampling) turns ``pm.Data``
    into constants; the fit failed at its end copying them ("'TensorConstant' object has
    no attribute 'get_value'"). It now gives the original model's fit."""
    from pymc.model.transform.optimization import freeze_dims_and_data

    rng = np.random.default_rng(0)
    x = rng.normal(size=50)
    y = (rng.random(50) < 1 / (1 + np.exp(-0.5 - x))).astype(int)
    with pm.Model(coords={"obs": range(50)}) as model:
        xd = pm.Data("x", x, dims="obs")
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Bernoulli("y", logit_p=b[0] + b[1] * xd, observed=y, dims="obs")
    means = []
    for m in (model, freeze_dims_and_data(model)):
        with m:
            approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
        means.append(approx.sample(50, random_seed=2).posterior["b"].values)
    np.testing.assert_allclose(means[1], means[0], rtol=1e-8, atol=1e-10)


def test_describe_gives_the_size_of_every_observed_variable():
    with pm.Model() as model:
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Normal("y", b[0] + b[1], 1.0, observed=0.3)  # a scalar observation
        pm.Normal("Y", b[0] + b[1] * np.ones((5, 2)), 1.0, observed=np.ones((5, 2)))
    sizes = {r["name"]: r["size"] for r in pymc_mcssvi.describe(model).observed}
    assert sizes == {"y": "1", "Y": "5x2"}


def test_unknown_method_names_list_the_plugins_methods_too():
    """A misspelt method (PyMC's KeyError listed only PyMC's four methods) or the class
    instead of an instance gets an error naming what pm.fit takes."""
    with pm.Model():
        w = pm.Normal("w", 0, 1)
        pm.Normal("y", w, 1, observed=[0.1, 0.2])
        for typo in ("hmcssvi ", "hmc-ssvi"):
            with pytest.raises(KeyError, match=r"did you mean 'hmcssvi'\?.*'sdsvi'.*'advi'"):
                pm.fit(method=typo, progressbar=False)
        with pytest.raises(TypeError, match=r"is a class: pass an instance"):
            pm.fit(method=HMCSSVI, progressbar=False)
        assert pm.fit(n=5, method="ADVI", progressbar=False).hist.size == 5


def test_n_is_a_cap_and_tol_none_runs_exactly_n():
    """``pm.fit(n=30000, method="hmcssvi")`` (the ADVI habit) ran all 30,000 iterations
    (60 s) on a logistic regression that converges in 8. ``n`` is now the most
    iterations; a fit stopped by it without converging warns; ``tol=None`` runs
    exactly ``n``."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(300, 3))
    y = (X @ [1.0, -1.0, 0.5] + rng.logistic(size=300) > 0).astype(int)
    with pm.Model():
        w = pm.Normal("w", 0, 1, shape=3)
        pm.Bernoulli("y", logit_p=X @ w, observed=y)
        approx = pm.fit(n=30000, method="hmcssvi", progressbar=False)
        assert approx.converged is True and approx.n_iter < 50
        with pytest.warns(UserWarning, match="stopped at n=3 iterations without converging"):
            short = pm.fit(n=3, method="hmcssvi", progressbar=False)
        assert short.converged is False and short.n_iter == 3
        exact = pm.fit(n=40, method="hmcssvi", tol=None, progressbar=False)
        assert exact.converged is None and exact.n_iter == 40
        with pytest.raises(ValueError, match="pass n as well"):
            pm.fit(method="hmcssvi", tol=None, progressbar=False)
        with pytest.raises(ValueError, match="tol must be a positive number"):
            pm.fit(method="hmcssvi", tol=-1.0, progressbar=False)
