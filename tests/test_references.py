"""The stored NUTS references are used only for the model they were drawn from."""

import numpy as np
import pymc as pm

from tests.conftest import StoredDraws, decoded, model_fingerprint, thinned


def _model(y, prior_sd=1.0, name="w"):
    X = np.linspace(-1, 1, 2 * len(y)).reshape(len(y), 2)
    with pm.Model() as m:
        w = pm.Normal(name, 0, prior_sd, shape=2)
        pm.Deterministic("eta", X @ w)
        pm.Poisson("y", pm.math.exp(X @ w), observed=y)
    return m


def test_fingerprint_follows_the_data_the_priors_and_the_settings():
    y = np.array([0, 3, 1, 2, 5])
    base = model_fingerprint(_model(y), "key", 2500)
    assert model_fingerprint(_model(y.copy()), "key", 2500) == base  # rebuilt: the same
    y2 = y.copy()
    y2[2] += 1
    assert model_fingerprint(_model(y2), "key", 2500) != base
    assert model_fingerprint(_model(y, prior_sd=1.5), "key", 2500) != base
    assert model_fingerprint(_model(y, name="v"), "key", 2500) != base
    assert model_fingerprint(_model(y), "key", 1000) != base


def test_stored_draws_read_as_a_posterior():
    a = np.arange(24, dtype="float32").reshape(2, 3, 4)
    post = StoredDraws({"w": a}).posterior
    assert dict(post.sizes) == {"chain": 2, "draw": 3, "w_dim_0": 4}
    np.testing.assert_array_equal(post["w"].values, a)


def test_stored_codes_round_trip_within_a_ten_thousandth_of_an_sd(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "w": rng.normal(3.0, 0.01, size=(4, 2500, 5)),
        "const": np.full((4, 2500), 2.0),
        "k": rng.integers(0, 3, size=(4, 2500)),
    }
    np.savez_compressed(tmp_path / "r.npz", **thinned(arrays))
    with np.load(tmp_path / "r.npz") as stored:
        back = decoded(stored)
    w = arrays["w"][:, ::2]
    assert back["w"].shape == w.shape
    assert np.abs(back["w"] - w).max() < 1e-4 * w.std(axis=(0, 1)).min()
    np.testing.assert_array_equal(back["const"], 2.0)
    np.testing.assert_array_equal(back["k"], arrays["k"][:, ::2])
