"""Bad models and bad data fail loudly, with the variable named and a remedy."""

import numpy as np
import pymc as pm
import pytensor.tensor as pt
import pytest

import pymc_mcssvi
from pymc_mcssvi import DivergenceError, UnsupportedModelError


def test_no_gaussian_global():
    with pm.Model():
        lam = pm.Gamma("lam", 2, 1)
        pm.Poisson("y", lam, observed=[1, 2, 3])
        with pytest.raises(UnsupportedModelError, match="'lam'.*no Gaussian"):
            pm.fit(method="hmcssvi")


def test_transformed_normal_is_named_when_no_gaussian_global_is_left():
    """Ordered mixture means (``transform=ordered``) are hyperparameters; with nothing
    else Gaussian the error named only "Normal priors", which they already had."""
    y = np.r_[np.random.default_rng(0).normal(-2, 1, 40), np.random.default_rng(1).normal(2, 1, 40)]
    with pm.Model():
        mu = pm.Normal("mu", 0, 5, shape=2, transform=pm.distributions.transforms.ordered)
        w = pm.Dirichlet("w", np.ones(2))
        pm.NormalMixture("y", w=w, mu=mu, sigma=1.0, observed=y)
        with pytest.raises(UnsupportedModelError, match="'mu' is a pm.Normal with a `transform=`"):
            pm.fit(method="hmcssvi")


@pytest.mark.parametrize("kind", ["student_t_init", "garch"])
def test_latent_time_series_is_a_named_error(kind):
    """A latent time series that is not Gaussian given its parameters (a random walk
    from a StudentT start, a GARCH(1,1) path) would be left to the mean-field
    hyperparameters (a random walk that way: posterior sds 0.07-0.2 of NUTS's); the
    error names it and says how to rewrite it. Gaussian random walks and AR
    processes with Normal initial values are Gaussian globals
    (``test_latent_time_series_is_exact_in_one_step``)."""
    y = np.cumsum(np.random.default_rng(0).normal(0, 0.1, 30))
    with pm.Model():
        b0 = pm.Normal("b0", 0, 5)
        if kind == "student_t_init":
            x = pm.GaussianRandomWalk(
                "x", sigma=0.1, init_dist=pm.StudentT.dist(nu=3, mu=0, sigma=1), shape=30
            )
            how = "cumsum"
        else:
            x = pm.GARCH11("x", omega=0.1, alpha_1=0.2, beta_1=0.5, initial_vol=0.1, shape=30)
            how = "cumsum"
        pm.Normal("y", b0 + x, 0.5, observed=y)
        with pytest.raises(UnsupportedModelError, match=f"'x'.*latent time series.*{how}"):
            pm.fit(method="hmcssvi", progressbar=False)


def test_nan_in_predictor_data():
    X = np.ones((3, 2))
    X[1, 0] = np.nan
    with pm.Model():
        w = pm.Normal("w", 0, 1, shape=2)
        pm.Normal("y", pm.math.dot(X, w), 1.0, observed=np.zeros(3))
        with pytest.raises(UnsupportedModelError, match="'y'.*data.*NaN"):
            pm.fit(method="mcssvi")


def test_infinite_observed_data():
    with pm.Model():
        w = pm.Normal("w", 0, 1)
        pm.Normal("y", w, 1.0, observed=np.array([0.0, np.inf]))
        with pytest.raises(UnsupportedModelError, match="'y'.*observed data.*infinite"):
            pm.fit(method="mcssvi")


def test_no_free_variables():
    """A model without free variables was reported as a variable named '(none)' with the
    advice to use ADVI, which fails on it too."""
    with pm.Model():
        pm.Normal("y", 0, 1, observed=np.zeros(5))
        with pytest.raises(UnsupportedModelError, match="'y'.*no free random variables"):
            pm.fit(method="hmcssvi")


def test_empty_observed_data():
    """A likelihood with no rows (a filter that removed every row) failed inside PyTensor
    (``Alloc static input type and target shape are incompatible``)."""
    with pm.Model():
        w = pm.Normal("w", 0, 1, shape=2)
        pm.Bernoulli("y", logit_p=np.zeros((0, 2)) @ w, observed=np.zeros(0))
        with pytest.raises(UnsupportedModelError, match="'y'.*observed data are empty"):
            pm.fit(method="hmcssvi")


def test_discrete_free_variable():
    with pm.Model():
        k = pm.Poisson("k", 3.0)
        w = pm.Normal("w", 0, 1)
        pm.Normal("y", w * k, 1.0, observed=[1.0, 2.0])
        with pytest.raises(UnsupportedModelError, match="'k'.*discrete"):
            pm.fit(method="mcssvi")


@pytest.mark.parametrize("n", [0, -3, 2.5])
def test_bad_iteration_count(n):
    with pm.Model():
        w = pm.Normal("w", 0, 1)
        pm.Normal("y", w, 1.0, observed=[0.1, 0.2])
        with pytest.raises(ValueError, match="n must be a positive integer"):
            pm.fit(n=n, method="mcssvi", progressbar=False)


def test_unknown_fit_argument():
    with pm.Model():
        w = pm.Normal("w", 0, 1)
        pm.Normal("y", w, 1.0, observed=[0.1, 0.2])
        with pytest.raises(TypeError, match="obj_n_mc"):
            pm.fit(n=3, method="mcssvi", obj_n_mc=10, progressbar=False)


def test_bound_not_finite_at_start_raises_divergence():
    """Identity-link Poisson: the rate is negative at the starting q, log p = -inf / NaN."""
    X = np.abs(np.random.default_rng(0).normal(size=(20, 2)))
    with pm.Model():
        w = pm.Normal("w", -5, 1, shape=2)
        pm.Poisson("y", mu=X @ w, observed=np.ones(20, dtype=int))
        with pytest.raises(DivergenceError, match="not finite at the starting point") as err:
            pm.fit(method="mcssvi", progressbar=False)
    assert err.value.approx is not None


def test_divergence_keeps_last_good_state():
    """The bound becomes non-finite mid-fit and no step size recovers it: the fit raises
    DivergenceError, whose approximation holds the last accepted state.

    A continuous likelihood that is undefined beyond some point does not do this:
    backtracking approaches the boundary and keeps accepting shorter steps (an
    identity-link Poisson with the data pulling its rate below 0 converged, or
    stalled, without an error). Here a callback sets one predictor to NaN after
    some accepted iterations (a pipeline that updates ``pm.Data`` while fitting):
    every later candidate is NaN whatever its step size. The fit is continued
    from a first call because ``hist`` records the iterations of completed calls.
    """
    rng = np.random.default_rng(1)
    x = rng.normal(size=60)
    y = rng.poisson(np.exp(0.5 + 0.8 * x))
    bad = x.copy()
    bad[7] = np.nan
    at_break = {}

    def break_data(approx, losses, i):
        if i == 6:  # the second iteration of the second call
            at_break["losses"] = np.array(losses)
            at_break["mean"] = approx.mean.eval()
            at_break["std"] = approx.std.eval()
            pm.set_data({"x": bad})

    with pm.Model():
        xd = pm.Data("x", x)
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Poisson("y", pm.math.exp(b[0] + b[1] * xd), observed=y)
        inference = pymc_mcssvi.MCSSVI()
        first = inference.fit(n=4, progressbar=False).hist.copy()
        with pytest.raises(DivergenceError, match="diverged at iteration") as err:
            inference.fit(n=200, callbacks=[break_data], progressbar=False)
    assert np.all(np.isfinite(first)) and first[-1] < first[0]
    # the second call accepted steps before the data were broken ...
    losses = at_break["losses"]
    assert len(losses) == 2 and np.all(np.isfinite(losses)) and losses[-1] <= first[-1]
    # ... and diverged after them, keeping that state
    assert err.value.iteration > 6
    approx = err.value.approx
    assert approx is inference.approx
    assert len(approx.hist) >= 1 and np.all(np.isfinite(approx.hist))
    np.testing.assert_array_equal(approx.hist[:4], first)
    mean, std = approx.mean.eval(), approx.std.eval()
    assert np.all(np.isfinite(mean)) and np.all(np.isfinite(std))
    np.testing.assert_array_equal(mean, at_break["mean"])
    np.testing.assert_array_equal(std, at_break["std"])
    assert f"ELBO {-losses[-1]:,.6g}" in str(err.value)


def test_bad_cov_and_schedule_arguments():
    with pm.Model():
        w = pm.Normal("w", 0, 1, shape=2)
        pm.Normal("y", w.sum(), 1.0, observed=[0.1])
        with pytest.raises(UnsupportedModelError, match="'v'"):
            pymc_mcssvi.MCSSVI(cov={"v": "diag"})
        with pytest.raises(ValueError, match="cov must be one of"):
            pymc_mcssvi.MCSSVI(cov="dense")
        with pytest.raises(ValueError, match="schedule must be one of"):
            pymc_mcssvi.MCSSVI(schedule="cosine")
        with pytest.raises(ValueError, match="start_sigma"):
            pymc_mcssvi.MCSSVI(start_sigma=-1)


def test_minibatch_without_total_size_warns():
    X = np.random.default_rng(0).normal(size=(100, 2))
    y = X[:, 0]
    Xm, ym = pm.Minibatch(X, y, batch_size=10)
    with pm.Model():
        w = pm.Normal("w", 0, 1, shape=2)
        pm.Normal("y", Xm @ w, 1.0, observed=ym)
        with pytest.warns(UserWarning, match="'y'.*total_size"):
            pymc_mcssvi.MCSSVI()


def test_matrix_factorization_with_other_terms_names_the_general_path():
    """Row biases *added* to the product are the bilinear estimator's (``bilinear +
    affine``, row_subsample allowed); a product *scaled* by another variable is not a
    function of the product alone, so the term is fitted by Monte Carlo + autodiff;
    describe says so and row_subsample (which needs the product) is refused with the
    reason."""
    rng = np.random.default_rng(0)
    R, C, K, n = 8, 6, 2, 60
    r, c = rng.integers(0, R, n), rng.integers(0, C, n)
    for scaled in (False, True):
        with pm.Model() as m:
            a = pm.Normal("a", 0, 1, shape=R)
            U = pm.Normal("U", 0, 1, shape=(R, K))
            V = pm.Normal("V", 0, 1, shape=(C, K))
            prod = (U[r] * V[c]).sum(-1)
            eta = a[r] * prod if scaled else a[r] + prod
            pm.Bernoulli("y", logit_p=eta, observed=rng.integers(0, 2, n))
        if not scaled:
            assert pymc_mcssvi.describe(m).predictor("y") == "bilinear + affine"
            with m:
                pymc_mcssvi.HMCSSVI(row_subsample=3)
            continue
        assert pymc_mcssvi.describe(m).predictor("y") == "general (bilinear + other terms)"
        with m, pytest.raises(ValueError, match=r"predictor of 'y' adds other terms"):
            pymc_mcssvi.HMCSSVI(row_subsample=3)


def test_scan_over_gaussian_globals_in_a_general_likelihood_warns():
    """An AR(1) trend written with ``pytensor.scan`` goes to the Monte Carlo + autodiff
    path, whose batched derivatives of the scan loop in Python (minutes for 120
    dimensions): said at recognition, with the rewrite."""
    import pytensor
    import pytensor.tensor as pt

    with pm.Model() as model:
        rho = pm.Normal("rho", 0.8, 0.2)
        eps = pm.Normal("eps", 0, 1, shape=6)
        f = pytensor.scan(
            lambda e, prev, r: r * prev + e,
            sequences=[eps],
            outputs_info=[pt.zeros(())],
            non_sequences=[rho],
            return_updates=False,
        )
        pm.Normal("y", f, 0.3, observed=np.linspace(0, 1, 6))
    with pytest.warns(UserWarning, match="'y' runs a pytensor.scan.*pt.cumsum"):
        pymc_mcssvi.describe(model)


def test_observed_outside_the_support_is_named_at_the_start():
    """A negative Poisson count: the start's DivergenceError named neither the variable
    nor the entry."""
    x = np.linspace(-1, 1, 20)
    with pm.Model():
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Poisson("counts", pm.math.exp(b[0] + b[1] * x), observed=np.r_[np.ones(19), -1])
        with pytest.raises(DivergenceError, match=r"'counts'.*-inf.*entries 19 \(-1\)"):
            pm.fit(method="hmcssvi", random_seed=1, progressbar=False)


def test_empty_gaussian_global_and_zero_draws():
    """A Gaussian global of shape 0 failed inside the estimator (IndexError); sample(0)
    inside NumPy. Both are ValueErrors that say so."""
    x = np.linspace(-1, 1, 30)
    with pm.Model():
        b = pm.Normal("b", 0, 2, shape=2)
        e = pm.Normal("e", 0, 1, shape=0)
        pm.Normal("y", b[0] + b[1] * x + e.sum(), 1.0, observed=x)
        with pytest.raises(UnsupportedModelError, match="'e'.*no entries"):
            pm.fit(method="hmcssvi", progressbar=False)
    with pm.Model():
        b = pm.Normal("b", 0, 2, shape=2)
        pm.Normal("y", b[0] + b[1] * x, 1.0, observed=x)
        approx = pm.fit(method="hmcssvi", progressbar=False)
    with pytest.raises(ValueError, match="draws must be a positive integer"):
        approx.sample(0)


def test_likelihood_without_second_derivatives_is_named():
    """pm.Rice's log density uses the Bessel ratio I1e, which PyTensor cannot
    differentiate: PyTensor's MethodNotDefined surfaced from inside the bound."""
    rng = np.random.default_rng(49)
    x = rng.normal(size=40)
    y = np.abs(rng.normal(np.exp(1.0 + 0.3 * x), 1.0))
    with pm.Model():
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Rice("y", nu=pm.math.exp(b[0] + b[1] * x), sigma=1.0, observed=y)
        with pytest.raises(UnsupportedModelError, match="'y'.*cannot differentiate"):
            pm.fit(method="hmcssvi", progressbar=False)


def test_marginal_gp_without_latents_is_told_how_to_write_it():
    """``pm.gp.Marginal`` integrates the GP out: no Gaussian global is left for the
    structured q. The error says how to write the model (a latent GP) instead of
    asking for Normal priors on regression coefficients it does not have."""
    rng = np.random.default_rng(43)
    X = np.sort(rng.uniform(0, 10, 30))[:, None]
    y = np.sin(X[:, 0]) + rng.normal(0, 0.3, 30)
    with pm.Model():
        ls, eta = pm.Gamma("ls", 4, 2), pm.HalfNormal("eta", 1.5)
        gp = pm.gp.Marginal(cov_func=eta**2 * pm.gp.cov.ExpQuad(1, ls))
        gp.marginal_likelihood("y", X=X, y=y, sigma=pm.HalfNormal("sigma", 1))
        with pytest.raises(UnsupportedModelError, match=r"'y' is an MvNormal.*pm\.gp\.Latent"):
            pm.fit(method="hmcssvi", progressbar=False)


def test_sparse_marginal_gp_is_told_to_put_the_inducing_values_in_the_model():
    """``pm.gp.MarginalApprox`` (FITC, VFE) writes its likelihood as a Potential with the
    GP integrated out: the error names it and says how to write the inducing-point GP
    the plugin fits, instead of asking for Normal regression coefficients."""
    rng = np.random.default_rng(45)
    X = np.sort(rng.uniform(0, 10, 40))[:, None]
    y = np.sin(X[:, 0]) + rng.normal(0, 0.3, 40)
    with pm.Model():
        ls, eta = pm.Gamma("ls", 4, 2), pm.HalfNormal("eta", 2)
        gp = pm.gp.MarginalApprox(cov_func=eta**2 * pm.gp.cov.ExpQuad(1, ls), approx="FITC")
        gp.marginal_likelihood("y", X=X, Xu=X[::5], y=y, sigma=pm.HalfNormal("sigma", 1))
        with pytest.raises(
            UnsupportedModelError, match=r"'marginalapprox_loglik_y' is a sparse GP.*gp\.Latent"
        ):
            pm.fit(method="hmcssvi", progressbar=False)


def test_start_values_of_the_wrong_shape_or_outside_the_support_are_refused():
    """``start=`` with another shape was cut silently to the variable's length (or
    raised a raw IndexError); a negative scale became a NaN mean of q."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 3))
    y = (X @ [1.0, -0.5, 0.2] + rng.logistic(size=60) > 0).astype(int)
    with pm.Model(coords={"feat": ["a", "b", "c"]}):
        b0 = pm.Normal("b0", 0, 2)
        w = pm.Normal("w", 0, 1, dims="feat")
        s = pm.HalfNormal("s", 1)
        pm.Bernoulli("y", logit_p=b0 + s * (X @ w), observed=y)
        for bad in (np.arange(10.0), np.ones(2)):
            with pytest.raises(ValueError, match=r"start value for 'w' has shape"):
                pm.fit(method="hmcssvi", start={"w": bad}, progressbar=False)
        with pytest.raises(ValueError, match=r"start value for 's' is outside its support"):
            pm.fit(method="hmcssvi", n=1, start={"s": -1.0}, progressbar=False)


def test_data_set_after_a_fit_is_checked_when_the_fit_goes_on():
    """``pm.set_data`` with NaN predictors or an out-of-range group index, then
    ``refine``: the checks of a first fit apply (NaN raised a raw broadcast error or
    gave an infinite bound; the index a raw PyTensor IndexError)."""
    rng = np.random.default_rng(0)
    N, G = 80, 5
    X, g = rng.normal(size=(N, 2)), rng.integers(0, G, N)
    y = X @ [1.0, -0.5] + rng.normal(0, 0.7, G)[g] + rng.normal(0, 0.5, N)
    with pm.Model():
        x, gd = pm.Data("x", X), pm.Data("g", g)
        w = pm.Normal("w", 0, 1, shape=2)
        a = pm.Normal("a", 0, pm.HalfNormal("sa", 1), shape=G)
        pm.Normal("y", x @ w + a[gd], 0.5, observed=y)
        inference = pymc_mcssvi.HMCSSVI()
        inference.fit(progressbar=False)
        bad = X.copy()
        bad[3, 1] = np.nan
        pm.set_data({"x": bad})
        with pytest.raises(UnsupportedModelError, match=r"data 'x' .* contains NaN"):
            inference.refine(5, progressbar=False)
        bad_g = g.copy()
        bad_g[0] = 50
        pm.set_data({"x": X, "g": bad_g})
        with pytest.raises(UnsupportedModelError, match=r"outside \[0, 5\)"):
            inference.refine(5, progressbar=False)
        pm.set_data({"g": g})
        assert np.isfinite(inference.refine(2, progressbar=False).hist[-1])


def test_beta_binomial_hierarchy_is_told_to_use_logit_normal_effects():
    """The rat-tumour model of PyMC's gallery (``theta_j ~ Beta``, binomial counts) has no
    Gaussian global; the error points to the logit-normal form the plugin fits."""
    with pm.Model():
        mu, kappa = pm.Beta("mu", 1, 1), pm.Gamma("kappa", 2, 0.1)
        theta = pm.Beta("theta", mu * kappa, (1 - mu) * kappa, shape=5)
        pm.Binomial("y", n=20, p=theta, observed=[1, 3, 2, 5, 4])
        with pytest.raises(UnsupportedModelError, match=r"invlogit of Normal effects"):
            pm.fit(method="hmcssvi", progressbar=False)


def test_predictors_set_to_a_new_length_without_the_observed_data_are_named():
    """``pm.set_data`` of the predictors alone (the observed data left at the old length)
    failed in the first iteration with NumPy's broadcasting error."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=60), rng.normal(size=60)
    with pm.Model():
        xd, yd = pm.Data("x", x), pm.Data("y_obs", y)
        b = pm.Normal("b", 0, 1)
        pm.Normal("y", b * xd, 1.0, observed=yd)
        pm.set_data({"x": x[:50]})
        with pytest.raises(UnsupportedModelError, match=r"'y'.*\(60,\).*\(50,\).*set_data"):
            pm.fit(method="hmcssvi", progressbar=False)
        pm.set_data({"x": x[:50], "y_obs": y[:50]})
        pm.fit(n=2, method="hmcssvi", progressbar=False)


def test_thousands_of_hyperparameter_coordinates():
    """Two topics over 602 words (a correlated topic model's Dirichlet topics, 1,202
    coordinates): a mean-field q(h) over them is refused with the remedy; as point
    estimates they take Adam steps (no 1202 x 1202 Hessian is kept), with a warning,
    and the bound improves."""
    from pymc_mcssvi.pymc.fit_warnings import MAX_MEANFIELD_HYPERS

    rng = np.random.default_rng(0)
    D, V, K = 4, 602, 2
    assert K * (V - 1) > MAX_MEANFIELD_HYPERS
    topics = rng.dirichlet(np.full(V, 0.5), size=K)
    counts = np.stack([rng.multinomial(300, rng.dirichlet([1.0, 1.0]) @ topics) for _ in range(D)])
    with pm.Model():
        beta = pm.Dirichlet("beta", a=np.full(V, 0.5), shape=(K, V))
        eta = pm.Normal("eta", 0.0, 1.0, shape=(D, K))
        pm.Multinomial("w", n=300, p=pm.math.softmax(eta, axis=-1) @ beta, observed=counts)
        with pytest.raises(UnsupportedModelError, match="'beta'.*hyper='point'"):
            pm.fit(method="hmcssvi", n=1, progressbar=False)
        with pytest.warns(UserWarning, match="Adam steps"):
            inference = pymc_mcssvi.HMCSSVI(hyper="point")
        assert inference.store.get().hyper.hess.shape == (0, 0)
        approx = inference.fit(n=4, progressbar=False)
    assert np.all(np.isfinite(approx.hist)) and approx.hist[-1] < approx.hist[0]


def test_a_potential_indexing_past_the_vocabulary_is_named():
    """A topic model's nonzero-count ``pm.Potential`` with a word index beyond the
    vocabulary raised PyTensor's bare ``IndexError`` from inside recognition."""
    rng = np.random.default_rng(0)
    D, V = 6, 5
    counts = rng.poisson(2, (D, V))
    d, v = np.nonzero(counts)
    v[0] = V + 3
    with pm.Model():
        eta = pm.Normal("eta", 0, 1, shape=(D, 1))
        theta = pm.math.softmax(pt.concatenate([eta, pt.zeros((D, 1))], axis=1), axis=-1)
        beta = pm.Dirichlet("beta", np.full(V, 0.5), shape=(2, V))
        p = (theta[d] * beta[:, v].T).sum(-1)
        pm.Potential("w", (counts[d, np.minimum(v, V - 1)] * pt.log(p)).sum())
        with pytest.raises(UnsupportedModelError, match=r"'w'.*Potential.*IndexError.*index 8"):
            pm.fit(n=2, method="hmcssvi", progressbar=False)


@pytest.mark.parametrize("n", [5, 20])
def test_a_fit_whose_bound_was_never_finite_raises_when_n_runs_out(n):
    """A negative Poisson count with an explicit ``n``: the fit used to end after ``n``
    iterations and return the start as its approximation, with an infinite -ELBO in
    ``hist`` and no error, because the start's narrowing and jittering had not run
    out. Now the same error as without ``n`` names the variable and the entry."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=40)
    y = rng.poisson(np.exp(0.3 * x))
    y[7] = -1
    with pm.Model():
        b = pm.Normal("b", 0, 1)
        pm.Poisson("y", pm.math.exp(b * x), observed=y)
        with pytest.raises(DivergenceError, match=rf"after {n} iterations.*'y'.*entries 7 \(-1\)"):
            pm.fit(n=n, method="hmcssvi", progressbar=False)


@pytest.mark.parametrize("as_data", [False, True])
def test_infinite_covariate_is_named(as_data):
    """An inf in a covariate gave a DivergenceError that blamed the observed variable's
    support, with NumPy's "invalid value encountered in matmul" warnings leaking."""
    import warnings

    rng = np.random.default_rng(0)
    X = rng.normal(size=(100, 3))
    y = (X @ [1.0, -1.0, 0.5] + rng.logistic(size=100) > 0).astype(int)
    X[5, 1] = np.inf
    with pm.Model():
        Xd = pm.Data("X", X) if as_data else X
        b = pm.Normal("b", 0, 1, shape=3)
        pm.Bernoulli("y", logit_p=Xd @ b, observed=y)
        where = "data 'X'" if as_data else r"a data array of shape \(100, 3\)"
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            with pytest.raises(UnsupportedModelError, match=rf"'y': {where}.*inf.*\(5, 1\)"):
                pm.fit(method="hmcssvi", progressbar=False)


def test_shapes_that_do_not_fit_are_named_not_a_numpy_traceback():
    """``pm.Data`` X with 3 columns times a 4-vector raised a 35-line NumPy traceback
    ("could not broadcast input array") from inside the fit's first step; the data's static
    shapes (recognition's twins) now name it while the model is recognized."""
    rng = np.random.default_rng(0)
    with pm.Model():
        X = pm.Data("X", rng.normal(size=(100, 3)))
        b = pm.Normal("b", 0, 1, shape=4)
        pm.Normal("y", X @ b, 1.0, observed=rng.normal(size=100))
        with pytest.raises(
            UnsupportedModelError, match=r"'y': its log density cannot be (built or )?evalu"
        ):
            pm.fit(method="hmcssvi", progressbar=False)


def _fit_warnings(model, **kwargs):
    import warnings

    with model, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        approx = pm.fit(method="hmcssvi", diagnose=False, progressbar=False, **kwargs)
    return approx, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_complete_separation_with_flat_priors_warns_of_an_improper_posterior():
    """Separated classes with ``pm.Flat`` coefficients: there is no posterior, and the fit
    converged to finite means and sds without a word (-ELBO settled at the bound of a
    q that keeps widening along the separating direction)."""
    x = np.random.default_rng(0).normal(size=100)
    with pm.Model() as model:
        b0, b1 = pm.Flat("b0"), pm.Flat("b1")
        pm.Bernoulli("y", logit_p=b0 + b1 * x, observed=(x > 0).astype(int))
    approx, caught = _fit_warnings(model)
    assert np.all(np.isfinite(approx.mean.eval()))
    improper = [m for m in caught if "improper" in m]
    assert len(improper) == 1 and "'b1'" in improper[0] and "proper priors" in improper[0]


@pytest.mark.parametrize("kind", ["collinear", "halfflat_one_group"])
def test_other_improper_posteriors_warn(kind):
    """Collinear columns under Flat priors (the log density is constant along their
    null direction) and a HalfFlat group scale with one group (the marginal likelihood
    falls like 1 / scale)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=80)
    y = 1 + 0.5 * x + rng.normal(0, 0.7, 80)
    with pm.Model() as model:
        b0 = pm.Normal("b0", 0, 5)
        if kind == "collinear":
            w = pm.Flat("w", shape=2)
            pm.Normal("y", b0 + np.column_stack([x, 2 * x]) @ w, 0.7, observed=y)
            culprit = "'w'"
        else:
            a = pm.Normal("a", 0, pm.HalfFlat("sa"), shape=1)
            pm.Normal("y", b0 + a[np.zeros(80, dtype=int)] + 0.5 * x, 0.7, observed=y)
            culprit = "'sa'"
    _, caught = _fit_warnings(model, n=60)
    assert any("improper" in m and culprit in m for m in caught), caught


@pytest.mark.parametrize("kind", ["logistic", "gaussian_halfflat", "glmm"])
def test_proper_posteriors_with_flat_priors_do_not_warn(kind):
    """Overlapping classes, a Gaussian regression with a Flat intercept and a HalfFlat
    residual scale, a logistic GLMM with a Flat intercept: proper posteriors, no
    warning."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=100)
    g = rng.integers(0, 5, 100)
    with pm.Model() as model:
        b0 = pm.Flat("b0")
        if kind == "logistic":
            b1 = pm.Flat("b1")
            y = (x + rng.logistic(size=100) > 0).astype(int)
            pm.Bernoulli("y", logit_p=b0 + b1 * x, observed=y)
        elif kind == "gaussian_halfflat":
            b1 = pm.Normal("b1", 0, 1)
            pm.Normal("y", b0 + b1 * x, pm.HalfFlat("s"), observed=1 + x + rng.normal(size=100))
        else:
            a = pm.Normal("a", 0, pm.HalfNormal("sa", 1), shape=5)
            y = (x + rng.normal(0, 0.8, 5)[g] + rng.logistic(size=100) > 0).astype(int)
            pm.Bernoulli("y", logit_p=b0 + a[g] + x, observed=y)
    approx, caught = _fit_warnings(model)
    assert approx.converged
    assert not [m for m in caught if "improper" in m]


@pytest.mark.parametrize("written", ["product", "switch"])
def test_zero_inflation_with_a_bernoulli_local_fits_as_zero_inflated_poisson(written):
    """``pm.Poisson("y", exp(b) * (1 - z))`` with ``z ~ Bernoulli(0.3)`` per observation
    (and the same with ``pm.math.switch``): at ``z = 1`` the rate is 0 whatever ``b``,
    and its derivatives through ``exp(b) * 0`` were NaN, so the fit stopped at its
    start with a DivergenceError ("not finite at the starting point (ELBO -509.8)").
    Enumerated, it is the zero-inflated Poisson: the same q as pm.ZeroInflatedPoisson."""
    import pytensor.tensor as pt

    rng = np.random.default_rng(0)
    N = 100
    y = rng.poisson(2.0, N) * (rng.random(N) > 0.3)
    with pm.Model():
        b = pm.Normal("b", 0, 1)
        pm.ZeroInflatedPoisson("y", 0.7, pm.math.exp(b), observed=y)
        zip_fit = pm.fit(method="hmcssvi", diagnose=False, progressbar=False)
    with pm.Model() as model:
        b = pm.Normal("b", 0, 1)
        z = pm.Bernoulli("z", 0.3, shape=N)
        if written == "product":
            mu = pm.math.exp(b) * (1 - z)
        else:
            mu = pm.math.switch(pt.eq(z, 1), 0.0, pm.math.exp(b))
        pm.Poisson("y", mu, observed=y)
        approx = pm.fit(method="hmcssvi", diagnose=False, progressbar=False)
    assert pymc_mcssvi.describe(model).role("z").startswith("local")
    assert approx.converged
    mean, std = approx.mean_data["b"].values, approx.std_data["b"].values
    np.testing.assert_allclose(mean, zip_fit.mean_data["b"].values, rtol=1e-6)
    np.testing.assert_allclose(std, zip_fit.std_data["b"].values, rtol=1e-6)


@pytest.mark.parametrize("fault", ["rows", "inf_y", "inf_x"])
def test_minibatch_arrays_that_do_not_fit_are_named(fault):
    """pm.Minibatch arrays of different lengths failed in the first iteration with
    PyTensor's AssertionError; an infinite value in the full arrays was fitted silently
    (the batches that held it gave rejected steps)."""
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(60, 2)), rng.normal(size=60)
    if fault == "rows":
        X = X[:-1]
    elif fault == "inf_y":
        y[7] = np.inf
    else:
        X[3, 1] = -np.inf
    Xm, ym = pm.Minibatch(X, y, batch_size=20)
    with pm.Model():
        w = pm.Normal("w", 0, 1, shape=2)
        pm.Normal("y", Xm @ w, 0.5, observed=ym, total_size=60)
        match = {
            "rows": r"'y'.*pm.Minibatch have different numbers of rows \(59, 60\)",
            "inf_y": r"'y'.*observed data .*pm.Minibatch.* NaN or infinite",
            "inf_x": r"'y'.*through pm.Minibatch holds -inf \(at index \(3, 1\)\)",
        }[fault]
        with pytest.raises(UnsupportedModelError, match=match):
            pm.fit(method="hmcssvi", progressbar=False)


def test_group_codes_cast_from_fractional_floats_are_named():
    """``a[pt.cast(g, "int64")]`` with ``g`` a NumPy float array: PyMC folds the cast of
    the constant before the index check sees it, so 2.5 became group 2 silently."""
    import pytensor.tensor as pt

    rng = np.random.default_rng(0)
    g = rng.integers(0, 4, 40).astype(float)
    g[3] = 2.5
    with pm.Model():
        a = pm.Normal("a", 0, 1, shape=4)
        pm.Normal("y", a[pt.cast(g, "int64")], 1.0, observed=rng.normal(size=40))
        with pytest.raises(UnsupportedModelError, match=r"'y'.*not whole numbers \(e.g. 2.5\)"):
            pm.fit(method="hmcssvi", progressbar=False)


def test_multinomial_data_of_the_wrong_length_is_named():
    """The trials of a Multinomial one row short: PyMC's log density could not be built
    and PyTensor's "Incompatible Elemwise input shapes" came from inside recognition."""
    rng = np.random.default_rng(0)
    counts = rng.multinomial(30, [0.2, 0.3, 0.5], size=20)
    with pm.Model():
        eta = pm.Normal("eta", 0, 1, shape=(20, 3))
        pm.Multinomial(
            "counts", n=counts.sum(1)[:-1], p=pm.math.softmax(eta, axis=-1), observed=counts
        )
        with pytest.raises(UnsupportedModelError, match=r"'counts'.*cannot be built"):
            pm.fit(method="hmcssvi", progressbar=False)


@pytest.mark.parametrize(
    "option, value",
    [
        ("bound", "elbo"),
        ("inner", "laplace"),
        ("estimator", "exact"),
        ("n_points", 0),
        ("n_draws", 2.5),
        ("chunk_size", -10),
        ("bilinear_draws", 0),
        ("schedule", -0.5),
        ("rho0", "big"),
        ("tau", -3.0),
        ("linear_response", "no"),
        ("mean_optimizer", "lbfgs"),
        ("random_seed", "seed"),
        ("start", {"nope": 1.0}),
        ("backend", "cuda"),
        ("blas_threads", 0),
        ("n_starts", 0),
        ("callbacks", [5]),
        ("n", True),
    ],
)
def test_bad_options_are_refused_by_name(option, value):
    """Each of these failed deep inside the fit with an error that named nothing
    (NumPy's "deg must be a positive integer", a ZeroDivisionError, PyTensor's mode
    table) or was ignored (``bound="elbo"``, ``n_draws=0``, ``linear_response="no"``)."""
    with pm.Model():
        w = pm.Normal("w", 0, 1)
        pm.Normal("y", w, 1.0, observed=[0.1, 0.2])
        name = "nope" if option == "start" else option
        with pytest.raises((ValueError, TypeError), match=rf"^{name}|'{name}'"):
            pm.fit(method="hmcssvi", progressbar=False, **{option: value})


def test_start_error_says_whether_the_bound_or_its_derivatives_are_not_finite():
    """A finite ELBO with non-finite derivatives was reported as "not finite at the
    starting point (ELBO -509.8)", which contradicted itself."""
    from pymc_mcssvi.pymc.fit_loop import start_not_finite

    with pm.Model() as m:
        pm.Normal("y", pm.Normal("mu"), 1.0, observed=[0.0])
    finite = str(start_not_finite(m, -509.8, None, 3))
    assert "derivatives are not finite" in finite and "the ELBO is, -509.8" in finite
    assert "ELBO is not finite" in str(start_not_finite(m, -np.inf, None, 3))
