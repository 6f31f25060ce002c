"""The matrix-factorization builder, its offline loaders and bad input."""

import numpy as np
import pymc as pm
import pytensor.tensor as pt
import pytest
from pymc.pytensorf import compile

import pymc_mcssvi
from pymc_mcssvi.bounds.structured import StructuredBound
from pymc_mcssvi.families.gaussian import GaussianBlocks
from pymc_mcssvi.models import load_insteval, load_reuters_counts, pmf

R, C, K = 6, 5, 2


def _entries(rng, n=30):
    return rng.integers(0, R, n), rng.integers(0, C, n), rng.integers(0, 2, n)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (dict(rows=np.array([0, 1, R])), "rows must lie in [0, 6)"),
        (dict(cols=np.array([0, -1, 2])), "cols must lie in [0, 5)"),
        (dict(rows=np.array([0.0, 1.0, 2.0])), "rows must be integer indices"),
        (dict(rank=C + 1), "rank must be between 1 and min(n_rows, n_cols) = 5"),
        (dict(likelihood="ordinal", y=np.array([0, 1, 7]), n_levels=5), "ordinal ratings"),
        (dict(likelihood="cauchy"), "likelihood must be one of"),
    ],
    ids=["row-too-large", "negative-col", "float-rows", "rank", "ordinal-level", "likelihood"],
)
def test_builder_rejects_bad_input(change, fragment):
    args = dict(
        rows=np.array([0, 1, 2]),
        cols=np.array([0, 1, 2]),
        y=np.array([0, 1, 1]),
        n_rows=R,
        n_cols=C,
        rank=K,
    )
    args.update(change)
    with pytest.raises(ValueError, match=None) as err:
        pmf(**args)
    assert fragment in str(err.value)


def test_hand_written_factorization_with_an_index_out_of_range_is_a_named_error(rng):
    s, d, y = _entries(rng)
    s[-1] = R
    with pm.Model() as m:
        U = pm.Normal("U", 0, 1, shape=(R, K))
        V = pm.Normal("V", 0, 1, shape=(C, K))
        pm.Bernoulli("y", logit_p=(U[s] * V[d]).sum(-1), observed=y)
    with pytest.raises(pymc_mcssvi.UnsupportedModelError, match="outside \\[0, 6\\)") as err:
        pymc_mcssvi.describe(m)
    assert err.value.variable == "y" and "'U'" in str(err.value)


def _bound_value(model, means, factors):
    tlm = pymc_mcssvi.describe(model).tlm
    ev = StructuredBound(tlm, bilinear_draws="sigma").evaluate(
        [
            GaussianBlocks(pt.constant(m), pt.constant(f))
            for m, f in zip(means, factors, strict=True)
        ]
    )
    return float(compile([], ev.phase_values[0])())


def test_duplicated_entries_are_independent_observations(rng):
    """A (row, column) pair given twice contributes its expected log likelihood twice."""
    s, d, y = _entries(rng)
    means = [rng.normal(size=(R, K)), rng.normal(size=(C, K))]
    factors = [np.repeat(np.eye(K)[None] * 2.0, n, 0) for n in (R, C)]
    without = pmf(s[1:], d[1:], y[1:], R, C, K)
    once = pmf(s, d, y, R, C, K)
    twice = pmf(np.r_[s, s[0]], np.r_[d, d[0]], np.r_[y, y[0]], R, C, K)
    v0, v1, v2 = (_bound_value(m, means, factors) for m in (without, once, twice))
    np.testing.assert_allclose(v2 - v1, v1 - v0, rtol=1e-10)
    assert v1 != v0


@pytest.mark.parametrize(
    ("likelihood", "extra"),
    [
        ("bernoulli", {}),
        ("poisson", {}),
        ("poisson_softplus", {}),
        ("ordinal", {"cutpoints": [-1.0, 0.0, 1.0]}),
        ("ordinal", {}),
        ("ordered_probit", {"cutpoints": [-1.0, 0.0, 1.0]}),
        ("normal", {}),
    ],
)
def test_every_likelihood_is_a_bilinear_term(likelihood, extra, rng):
    s, d, _ = _entries(rng)
    y = rng.integers(0, 4, s.size)
    model = pmf(s, d, y, R, C, K, likelihood=likelihood, **extra)
    desc = pymc_mcssvi.describe(model)
    assert desc.predictor("y") == "bilinear"
    assert desc.structure("U") == f"block {R} x ({K} x {K})"
    learned = likelihood in ("ordinal", "ordered_probit") and not extra
    assert ("cutpoints" in model.named_vars) == learned


def test_learned_prior_scales_are_hyperparameters(rng):
    s, d, y = _entries(rng)
    desc = pymc_mcssvi.describe(pmf(s, d, y, R, C, K, prior_sd=None))
    roles = {r["name"]: r["role"] for r in desc.variables}
    assert roles["sigma_U"] == roles["sigma_V"] == "hyperparameter"


def test_learned_prior_scales_with_row_subsampling_fit(rng):
    """The phase switch of the subsampled step, batched over q(h)'s sigma points, stays
    an ``ifelse`` (a ``Blockwise`` of it failed on the Python backend: ``TypeError:
    'NoneType' object is not subscriptable``)."""
    s, d, y = _entries(rng)
    with pmf(s, d, y, R, C, K, prior_sd=None):
        # the factors' learned scales have no linear response: said, not silent
        with pytest.warns(UserWarning, match="'sigma_U', 'sigma_V'.*too small and too narrow"):
            approx = pm.fit(
                n=12,
                method="hmcssvi",
                random_seed=1,
                progressbar=False,
                row_subsample=3,
            )
    assert np.isfinite(approx.hist).all()


def test_offline_loaders():
    ins = load_insteval("binary")
    r, c, y = ins["train"]
    rt, _, yt = ins["test"]
    assert (ins["n_rows"], ins["n_cols"]) == (2972, 1128)
    assert set(np.unique(y)) == {0, 1} and abs(len(yt) / (len(y) + len(yt)) - 0.2) < 1e-3
    assert (
        len(load_insteval("ordinal")["train"][0]) + len(load_insteval("ordinal")["test"][0])
        == 73421
    )
    reu = load_reuters_counts()
    assert reu["n_rows"] == 395 and reu["n_cols"] == 2000
    assert reu["train"][2].min() >= 1  # nonzero counts only


DENSE_SPELLINGS = {
    "dot": lambda U, V: pm.math.dot(U, V.T),
    "matmul": lambda U, V: U @ V.T,
    "broadcast-sum": lambda U, V: (U[:, None, :] * V[None, :, :]).sum(-1),
    "einsum": lambda U, V: pt.einsum("rk,ck->rc", U, V),
}


@pytest.mark.slow
@pytest.mark.parametrize("spelling", sorted(DENSE_SPELLINGS))
def test_dense_product_of_a_fully_observed_matrix_is_the_factorization(spelling, rng):
    """``U @ V.T + row + col`` over an (R, C) observed matrix (probabilistic PCA's
    spelling) fits exactly as the gathered factorization of its entries: the same
    bound at every iteration. It was Monte Carlo + autodiff over all coordinates."""
    y = rng.integers(0, 2, (R, C))
    s, d = np.repeat(np.arange(R), C), np.tile(np.arange(C), R)

    def model(dense):
        with pm.Model() as m:
            U = pm.Normal("U", 0, 1, shape=(R, K))
            V = pm.Normal("V", 0, 1, shape=(C, K))
            row = pm.Normal("row", 0, 1, shape=R)
            col = pm.Normal("col", 0, 1, shape=C)
            if dense:
                eta = DENSE_SPELLINGS[spelling](U, V) + row[:, None] + col
                pm.Bernoulli("y", logit_p=eta, observed=y)
            else:
                eta = (U[s] * V[d]).sum(-1) + row[s] + col[d]
                pm.Bernoulli("y", logit_p=eta, observed=y.ravel())
        return m

    dense, gathered = model(True), model(False)
    assert pymc_mcssvi.describe(dense).predictor("y") == "bilinear + affine"
    hists = []
    for m in (dense, gathered):
        with m:
            approx = pm.fit(n=6, method="hmcssvi", random_seed=3, progressbar=False)
        hists.append(np.asarray(approx.hist))
    np.testing.assert_allclose(hists[0], hists[1], rtol=1e-9)


def test_dense_product_inside_a_softmax_stays_general(rng):
    """A product read across its columns (a softmax over them) is not entrywise."""
    y = rng.integers(0, C, R)
    with pm.Model() as m:
        U = pm.Normal("U", 0, 1, shape=(R, K))
        V = pm.Normal("V", 0, 1, shape=(C, K))
        pm.Categorical("y", p=pm.math.softmax(U @ V.T, axis=-1), observed=y)
    assert pymc_mcssvi.describe(m).predictor("y").startswith("general")


def _factor_models(rng):
    """The same Gaussian factorization of an (R, C) matrix with its column factor
    stored (C, K) and read by a gather, and stored (K, C) in the dense ``U @ F``
    spelling of PyMC's factor-analysis example."""
    y = rng.normal(size=(R, C))
    s, d = np.repeat(np.arange(R), C), np.tile(np.arange(C), R)
    with pm.Model() as gathered:
        U = pm.Normal("U", 0, 1, shape=(R, K))
        V = pm.Normal("V", 0, 1, shape=(C, K))
        pm.Normal("y", mu=(U[s] * V[d]).sum(-1), sigma=0.7, observed=y.ravel())
    with pm.Model() as dense:
        U = pm.Normal("U", 0, 1, shape=(R, K))
        F = pm.Normal("F", 0, 1, shape=(K, C))
        pm.Normal("y", mu=U @ F, sigma=0.7, observed=y)
    return gathered, dense


def test_factor_stored_by_columns_has_one_block_per_column(rng):
    gathered, dense = _factor_models(rng)
    desc = pymc_mcssvi.describe(dense)
    assert desc.predictor("y") == "bilinear"
    assert desc.structure("F") == f"block {C} x ({K} x {K})"
    # the same q (F's block for column c is V's block for row c): the same bound
    means = [rng.normal(size=(R, K)), rng.normal(size=(C, K))]
    factors = [
        np.linalg.cholesky(np.eye(K) + 0.3 * np.ones((K, K)))[None] * rng.uniform(0.5, 2, (n, 1, 1))
        for n in (R, C)
    ]
    np.testing.assert_allclose(
        _bound_value(dense, means, factors), _bound_value(gathered, means, factors), rtol=1e-12
    )


def test_factor_stored_by_columns_reads_back_in_its_own_shape(rng):
    """The draws of ``F`` (K, C) are q's column blocks put back in place: U @ F matches
    the gathered model's U @ V.T at convergence (the product is free of the factors'
    rotation)."""
    products = []
    for m, name in zip(_factor_models(rng), ("V", "F"), strict=True):
        with m:
            approx = pm.fit(method="hmcssvi", random_seed=2, progressbar=False, tol=1e-10)
        post = approx.sample(400, random_seed=0).posterior
        U, second = post["U"].values[0], post[name].values[0]
        assert second.shape[1:] == ((C, K) if name == "V" else (K, C))
        right = second if name == "F" else second.transpose(0, 2, 1)
        products.append((U @ right).mean(0))
    np.testing.assert_allclose(products[0], products[1], atol=0.1)


@pytest.mark.slow
def test_biases_of_a_large_factorization_keep_their_joint_covariance():
    """``mu + a[u] + b[i] + (U[u] * V[i]).sum(-1)``: the intercept and the biases share
    one full covariance however many dimensions the factors' row blocks add (1860 of
    2041 here; counted in the limit, they left mu, a and b mean-field: mu's sd was 0.08x
    NUTS's on a 300 x 200 rank-3 factorization). With V's prior at sd 0.01 the product
    is negligible and the biases' posterior is the closed-form linear-Gaussian one."""
    rng = np.random.default_rng(3)
    n_u, n_i, rank, n, sigma = 100, 80, 12, 2000, 0.5
    u, i = rng.integers(0, n_u, n), rng.integers(0, n_i, n)
    y = 1.0 + rng.normal(0, 0.7, n_u)[u] + rng.normal(0, 0.7, n_i)[i] + rng.normal(0, sigma, n)
    with pm.Model() as model:
        mu = pm.Normal("mu", 0, 2)
        a = pm.Normal("a", 0, 0.7, shape=n_u)
        b = pm.Normal("b", 0, 0.7, shape=n_i)
        U = pm.Normal("U", 0, 1, shape=(n_u, rank))
        V = pm.Normal("V", 0, 0.01, shape=(n_i, rank))
        pm.Normal("y", mu + a[u] + b[i] + (U[u] * V[i]).sum(-1), sigma, observed=y)
    desc = pymc_mcssvi.describe(model)
    assert desc.structure("a").startswith("full (181 x 181)")
    assert desc.structure("U") == f"block {n_u} x ({rank} x {rank})"
    with model:
        approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    D = np.zeros((n, 1 + n_u + n_i))
    D[:, 0] = 1.0
    D[np.arange(n), 1 + u] = 1.0
    D[np.arange(n), 1 + n_u + i] = 1.0
    noise = sigma**2 + rank * 1.0 * 0.01**2  # the product's variance under the priors
    prior_prec = np.r_[1 / 4.0, np.full(n_u + n_i, 1 / 0.49)]
    cov = np.linalg.inv(np.diag(prior_prec) + D.T @ D / noise)
    mean = cov @ (D.T @ y / noise)
    sd = np.sqrt(np.diag(cov))
    m, s = approx.mean_data, approx.std_data
    fit_mean = np.r_[m["mu"].values, m["a"].values, m["b"].values]
    fit_sd = np.r_[s["mu"].values, s["a"].values, s["b"].values]
    assert np.max(np.abs(fit_mean - mean) / sd) < 0.1
    np.testing.assert_allclose(fit_sd / sd, 1.0, atol=0.05)


def _biased_factorization():
    """Bernoulli factorization 30 x 20, K = 2, half the cells observed, row and column
    biases with learned HalfNormal scales (issue 51's family, the benchmark's quick size)."""
    from scipy.special import expit

    n_r, n_c, k = 30, 20, 2
    rng = np.random.default_rng(5)
    a0, b0 = rng.normal(0, 0.5, n_r), rng.normal(0, 0.5, n_c)
    U0, V0 = rng.normal(size=(n_r, k)), rng.normal(size=(n_c, k))
    s, d = np.divmod(rng.permutation(n_r * n_c)[: n_r * n_c // 2], n_c)
    y = rng.binomial(1, expit(-0.2 + a0[s] + b0[d] + (U0[s] * V0[d]).sum(-1)))
    with pm.Model() as model:
        mu = pm.Normal("mu", 0, 1.5)
        sigma_a, sigma_b = pm.HalfNormal("sigma_a", 1.0), pm.HalfNormal("sigma_b", 1.0)
        a = pm.Normal("a", 0, sigma_a, shape=n_r)
        b = pm.Normal("b", 0, sigma_b, shape=n_c)
        U = pm.Normal("U", 0, 1, shape=(n_r, k))
        V = pm.Normal("V", 0, 1, shape=(n_c, k))
        pm.Bernoulli("y", logit_p=mu + a[s] + b[d] + (U[s] * V[d]).sum(-1), observed=y)
    return model


_BIASED_FITS = {}


def _biased_factorization_summaries():
    """``{name: (fit draws, NUTS draws)}`` for the two scales and the products
    ``U[r] . V[c]`` of every cell (invariant to the factors' signs and rotations)."""
    from tests.conftest import nuts_draws

    if _BIASED_FITS:
        return _BIASED_FITS
    model = _biased_factorization()
    with model:
        approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)

    def quantities(post):
        def flat(v):
            return post[v].values.reshape(-1, *post[v].shape[2:])

        prod = np.einsum("srk,sck->src", flat("U"), flat("V"))
        return {
            "sigma_a": flat("sigma_a"),
            "sigma_b": flat("sigma_b"),
            "products": prod.reshape(prod.shape[0], -1),
        }

    fit = quantities(approx.sample(4000, random_seed=2).posterior)
    ref = quantities(nuts_draws(model, "biased_factorization_30x20").posterior)
    _BIASED_FITS.update({k: (fit[k], ref[k]) for k in fit})
    return _BIASED_FITS


@pytest.mark.slow
def test_biased_factorization_bias_scales_close_to_nuts():
    """Issue 51's target for the biases beside a product: their learned scales' posterior
    means within 20% of NUTS's (+11% and +12% here; an earlier sweep found a bias
    scale collapsed to 0.057 where NUTS gives 0.24). Their sds are not: 0.26x and
    0.27x NUTS's (fit_warnings' matrix-factorization warning says so)."""
    out = _biased_factorization_summaries()
    for name in ("sigma_a", "sigma_b"):
        fit, ref = out[name]
        assert abs(fit.mean() / ref.mean() - 1) < 0.2, (name, fit.mean(), ref.mean())


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="issue 51: the factorized q(U) q(V) of the paper puts the products' means up to "
    "0.7 NUTS sd off (too large in magnitude), with or without the biases; a joint Gaussian "
    "over (U, V) halves that (0.35 on the 60 x 40 benchmark) but still misses 0.25",
)
def test_biased_factorization_products_close_to_nuts():
    """Issue 51's target for the products ``U[r] . V[c]``: means within 0.25 NUTS sd."""
    fit, ref = _biased_factorization_summaries()["products"]
    z = (fit.mean(0) - ref.mean(0)) / ref.std(0)
    assert np.abs(z).max() < 0.25, np.abs(z).max()
