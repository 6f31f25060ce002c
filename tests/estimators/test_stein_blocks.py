"""Per-row Hessian blocks from the gradients (Stein's identity).

A general term whose rows are separable (a topic model's documents) took one
Hessian-vector product per block coordinate: at K = 50 topics, 49 passes over the data
per draw. Blocks of :data:`~pymc_mcssvi.recognize.model.MIN_STEIN_BLOCK` or more
coordinates take ``E[g (w - m)^T] Sigma^-1`` from the gradients instead. With fixed
moment-matched draws the estimate is exact for a quadratic log density, so a Gaussian
target's fit must land on the exact posterior (mean and every block's covariance).
"""

import numpy as np
import pymc as pm
import pytensor.tensor as pt
import pytest

import pymc_mcssvi  # noqa: F401
from pymc_mcssvi.estimators.general import GeneralEstimator
from pymc_mcssvi.families.gaussian import GaussianBlocks
from pymc_mcssvi.recognize.model import MIN_STEIN_BLOCK, recognize
from pymc_mcssvi.terms.base import Chunk


def _rows(R, k, seed=0, quadratic=True):
    """``R`` independent rows of ``k`` coordinates: a Gaussian target (precision
    ``I + A_r``) or a log-sum-exp one, written so that only the general path takes it."""
    rng = np.random.default_rng(seed)
    B = rng.normal(0, 0.3, (R, k, k))
    A = B @ B.transpose(0, 2, 1) + 0.5 * np.eye(k)
    b = rng.normal(0, 2.0, (R, k))
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=(R, k))
        if quadratic:
            pm.Potential("quad", -0.5 * pt.sum(w[:, :, None] * A * w[:, None, :]) + pt.sum(b * w))
        else:  # a multinomial-like log density: counts b^2 over softmax(w) per row
            n = np.round(b**2)
            pm.Potential("lse", pt.sum(n * pm.math.log_softmax(w, axis=-1)))
    return m, A, b


def _state(R, k, seed=0):
    rng = np.random.default_rng(seed)
    mean = rng.normal(size=(R, k))
    factor = np.tril(rng.normal(0, 0.2, (R, k, k))) + 2 * np.eye(k)
    return GaussianBlocks(pt.constant(mean), pt.constant(factor))


@pytest.mark.parametrize("parameterization", ["precision", "covariance"])
def test_stein_blocks_are_exact_for_a_quadratic_log_density(parameterization):
    # at any q (not only at the optimum), the blocks equal the log density's Hessian -A
    R, k = 80, MIN_STEIN_BLOCK + 6
    m, A, _ = _rows(R, k)
    tlm = recognize(m)
    assert [(s.kind, s.k) for s in tlm.segments] == [("block", k)]
    assert tlm.general_stein_blocks == (0,)
    assert any("Stein" in note for note in tlm.notes)
    est = GeneralEstimator(tlm)
    _, _, H = est.expectations([_state(R, k)], parameterization)
    np.testing.assert_allclose(H[0].eval(), -A, atol=1e-9)
    # a chunk of the draws gives its weighted part: two halves add up to the whole
    half = est.n_draws // 2
    parts = [
        est.expectations(
            [_state(R, k)],
            parameterization,
            draws=Chunk(pt.constant(np.arange(a, a + half)), pt.constant(np.ones(half))),
        )[2][0].eval()
        for a in (0, half)
    ]
    np.testing.assert_allclose(parts[0] + parts[1], -A, atol=1e-9)


def test_a_gaussian_fit_from_a_poor_start_lands_on_the_exact_posterior():
    R, k = 80, MIN_STEIN_BLOCK + 6
    m, A, b = _rows(R, k)
    approx = pm.fit(method="hmcssvi", model=m, progressbar=False, random_seed=1, start_sigma=5.0)
    P = A + np.eye(k)
    np.testing.assert_allclose(
        approx.mean.eval().reshape(R, k), np.linalg.solve(P, b[..., None])[..., 0], atol=1e-6
    )
    cov = approx.cov.eval()
    blocks = np.stack([cov[r * k : (r + 1) * k, r * k : (r + 1) * k] for r in range(R)])
    np.testing.assert_allclose(blocks, np.linalg.inv(P), atol=1e-6)


def test_small_blocks_and_the_users_blocks_keep_the_products():
    m, _, _ = _rows(80, MIN_STEIN_BLOCK - 1)
    assert recognize(m).general_stein_blocks == ()
    m, _, _ = _rows(80, MIN_STEIN_BLOCK + 6)
    assert recognize(m, cov={"w": "block"}).general_stein_blocks == ()


def test_the_draws_cover_the_block():
    # moment matching needs more draws per antithetic half than block coordinates
    k = MIN_STEIN_BLOCK + 16
    m, _, _ = _rows(60, k)
    assert GeneralEstimator(recognize(m), n_draws=16).n_draws >= 2 * (k + 1)


def test_stein_blocks_agree_with_the_products_off_the_quadratic_case():
    # a softmax log density: Stein's estimate and the products' differ per draw, and
    # their fixed points must agree to the Monte Carlo error
    R, k = 60, MIN_STEIN_BLOCK + 2
    m, _, _ = _rows(R, k, quadratic=False)
    kw = {"method": "hmcssvi", "model": m, "progressbar": False, "random_seed": 1}
    stein = pm.fit(**kw)
    products = pm.fit(cov={"w": "block"}, **kw)
    sd = products.std.eval()
    z = (stein.mean.eval() - products.mean.eval()) / sd
    assert np.abs(z).max() < 0.1, np.abs(z).max()
    ratio = stein.std.eval() / sd
    assert np.abs(ratio - 1).max() < 0.1, (ratio.min(), ratio.max())
