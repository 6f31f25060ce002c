"""Models written with Bambi's formulas, fitted through Bambi's own ``fit``.

Bambi builds an ordinary PyMC model (non-centered group effects
``1|g = 1|g_offset * 1|g_sigma``, ``dims`` everywhere, the response's parameter
as a Deterministic) and passes ``inference_method="vi"`` on to ``pm.fit``, so
``model.fit(inference_method="vi", method="hmcssvi")`` runs the plugin with
nothing else to learn.
"""

import bambi as bmb
import numpy as np
import pandas as pd
import pytest

import pymc_mcssvi  # noqa: F401  (registers the methods with pm.fit)
from tests.conftest import nuts_draws


def _flat(post, name):
    x = post[name].values
    return x.reshape(x.shape[0] * x.shape[1], -1)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(5)
    G, n = 20, 400
    df = pd.DataFrame({"g": rng.integers(0, G, n).astype(str), "x": rng.normal(size=n)})
    gi = df["g"].astype(int).to_numpy()
    eta = 0.3 + rng.normal(scale=0.6, size=G)[gi] + 0.5 * df["x"].to_numpy()
    df["y"] = (rng.random(n) < 1 / (1 + np.exp(-eta))).astype(int)
    return df


@pytest.mark.slow
def test_bambi_glmm_fit_matches_nuts(data):
    """``bmb.Model("y ~ x + (1 | g)", family="bernoulli").fit(inference_method="vi",
    method="hmcssvi")``: fixed effects within 0.1 NUTS sd with sds within 10%, the
    group scale and the offsets within 0.15 sd with sds within 15%."""
    model = bmb.Model("y ~ x + (1 | g)", data, family="bernoulli")
    approx = model.fit(inference_method="vi", method="hmcssvi", random_seed=1, progressbar=False)
    assert approx.converged
    post = approx.sample(4000, random_seed=2).posterior
    ref = nuts_draws(model.backend.model, "bambi_glmm").posterior
    for name, mean_tol, sd_tol in [
        ("Intercept", 0.1, 0.10),
        ("x", 0.1, 0.10),
        ("1|g_sigma", 0.15, 0.15),
        ("1|g_offset", 0.15, 0.15),
        ("1|g", 0.15, 0.15),
    ]:
        a, b = _flat(post, name), _flat(ref, name)
        z = np.abs(a.mean(0) - b.mean(0)) / b.std(0)
        r = a.std(0) / b.std(0)
        assert z.max() < mean_tol, f"{name}: mean errors (NUTS sd units) {np.round(z, 3)}"
        assert np.all(np.abs(r - 1) < sd_tol), f"{name}: sd ratios {np.round(r, 3)}"


def test_bambi_predict_uses_the_draws(data):
    """Bambi's ``predict`` on new rows reads the approximation's draws: the
    probabilities it returns equal ``invlogit(Intercept + x * b + 1|g[g])`` computed
    from the same draws, and in-sample predictive draws have the data's shape."""
    model = bmb.Model("y ~ x + (1 | g)", data, family="bernoulli")
    approx = model.fit(inference_method="vi", method="hmcssvi", random_seed=1, progressbar=False)
    idata = approx.sample(300, random_seed=2)
    new = pd.DataFrame({"g": ["0", "3", "7"], "x": [0.0, 1.0, -2.0]})
    p = model.predict(idata, data=new, kind="response_params", inplace=False).posterior["p"]

    post = idata.posterior
    levels = list(post["g__factor_dim"].values)
    cols = [levels.index(g) for g in new["g"]]
    eta = (
        post["Intercept"].values[..., None]
        + post["x"].values[..., None] * new["x"].to_numpy()
        + post["1|g"].values[..., cols]
    )
    np.testing.assert_allclose(p.values, 1 / (1 + np.exp(-eta)), rtol=1e-10)
    pp = model.predict(idata, kind="response", inplace=False).posterior_predictive["y"]
    assert pp.shape == (1, 300, len(data))
    assert set(np.unique(pp.values)) <= {0, 1}
