"""Gaussian family views against dense NumPy / SciPy computations."""

import numpy as np
import pytensor.tensor as pt
import pytest
from scipy import stats

from pymc_mcssvi.families.gaussian import (
    GaussianBlocks,
    covariance,
    entropy,
    kl_to_gaussian,
    natural_step,
    precision,
    projected_hessian,
    sample,
)


def _spd(rng, R, K):
    A = rng.normal(size=(R, K, K))
    return A @ A.transpose(0, 2, 1) + K * np.eye(K)


@pytest.fixture(params=[(1, 4), (3, 2), (5, 1)], ids=["full", "block", "diag"])
def blocks(request, rng):
    R, K = request.param
    P = _spd(rng, R, K)
    m = rng.normal(size=(R, K))
    return m, P


@pytest.mark.parametrize("param", ["precision", "covariance"])
def test_views_match_dense(blocks, param):
    m, P = blocks
    S = np.linalg.inv(P)
    if param == "precision":
        factor = np.linalg.cholesky(P)
    else:
        factor = np.linalg.cholesky(S).transpose(0, 2, 1)  # upper C with S = C^T C
    st = GaussianBlocks(pt.as_tensor(m), pt.as_tensor(factor))
    np.testing.assert_allclose(covariance(st, param).eval(), S, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(precision(st, param).eval(), P, rtol=1e-10, atol=1e-10)
    want = sum(stats.multivariate_normal(m[r], S[r]).entropy() for r in range(len(m)))
    np.testing.assert_allclose(entropy(st, param).eval(), want, rtol=1e-12)


@pytest.mark.parametrize("param", ["precision", "covariance"])
def test_sample_moments(blocks, param, rng):
    m, P = blocks
    S = np.linalg.inv(P)
    factor = (
        np.linalg.cholesky(P) if param == "precision" else np.linalg.cholesky(S).transpose(0, 2, 1)
    )
    st = GaussianBlocks(pt.as_tensor(m), pt.as_tensor(factor))
    eps = rng.standard_normal((200_000, *m.shape))
    x = sample(st, param, pt.as_tensor(eps)).eval()
    np.testing.assert_allclose(x.mean(0), m, atol=0.02)
    emp = np.einsum("nri,nrj->rij", x - m, x - m) / len(x)
    np.testing.assert_allclose(emp, S, atol=0.02)


def test_kl_matches_closed_form(blocks, rng):
    m, P = blocks
    R, K = m.shape
    Pp = _spd(rng, R, K)
    mu = rng.normal(size=(R, K))
    st = GaussianBlocks(pt.as_tensor(m), pt.as_tensor(np.linalg.cholesky(P)))
    got = kl_to_gaussian(st, "precision", pt.as_tensor(mu), pt.as_tensor(Pp)).eval()
    want = 0.0
    for r in range(R):
        S, Sp = np.linalg.inv(P[r]), np.linalg.inv(Pp[r])
        d = mu[r] - m[r]
        want += 0.5 * (
            np.trace(Pp[r] @ S)
            + d @ Pp[r] @ d
            - K
            + np.linalg.slogdet(Sp)[1]
            - np.linalg.slogdet(S)[1]
        )
    np.testing.assert_allclose(got, want, rtol=1e-10)


def test_natural_step_rho_one_is_fixed_point_update(blocks, rng):
    """P <- -H and P m <- g - H m, exactly, for rho = 1."""
    m, P = blocks
    R, K = m.shape
    H = -_spd(rng, R, K)
    g = rng.normal(size=(R, K))
    st = GaussianBlocks(pt.as_tensor(m), pt.as_tensor(np.linalg.cholesky(P)))
    new = natural_step(st, pt.as_tensor(g), pt.as_tensor(H), 1.0)
    L = new.factor.eval()
    np.testing.assert_allclose(L @ L.transpose(0, 2, 1), -H, rtol=1e-10)
    want = np.linalg.solve(-H, (g - np.einsum("rij,rj->ri", H, m))[..., None])[..., 0]
    np.testing.assert_allclose(new.mean.eval(), want, rtol=1e-9)


def test_natural_step_projects_indefinite_precision(rng):
    P = np.eye(2)[None]
    st = GaussianBlocks(pt.as_tensor(np.zeros((1, 2))), pt.as_tensor(P))
    H = np.array([[[5.0, 1.0], [1.0, -1.0]]])  # -H is indefinite
    new = natural_step(st, pt.as_tensor(np.zeros((1, 2))), pt.as_tensor(H), 1.0)
    L = new.factor.eval()[0]
    lam, V = np.linalg.eigh(-H[0])
    want = (V * np.maximum(lam, 0)) @ V.T  # rho = 1: P = projection of -H (PSD, singular here)
    assert np.all(np.isfinite(L)) or np.linalg.matrix_rank(want) < 2
    new = natural_step(st, pt.as_tensor(np.zeros((1, 2))), pt.as_tensor(H), 0.5)
    L = new.factor.eval()[0]
    np.testing.assert_allclose(L @ L.T, 0.5 * np.eye(2) + 0.5 * want, atol=1e-12)


@pytest.mark.parametrize("K", [1, 3])
def test_projected_hessian_projects_only_the_indefinite_part(rng, K):
    """``H = H_prior + H_lik``: only ``H_lik`` is projected (paper, CTM update), so
    ``-H`` stays at least the prior's precision in every direction."""
    prior = -_spd(rng, 4, K)
    A = rng.normal(size=(4, K, K))
    lik = 3.0 * (A + A.transpose(0, 2, 1))  # indefinite (positive directions too)
    lik[0] = -_spd(rng, 1, K)[0]  # a negative definite block is left alone
    out = projected_hessian(pt.as_tensor(prior + lik), pt.as_tensor(lik)).eval()
    lam, V = np.linalg.eigh(lik)
    want = prior + (V * np.minimum(lam, 0.0)[:, None, :]) @ V.transpose(0, 2, 1)
    np.testing.assert_allclose(out, want, atol=1e-10)
    np.testing.assert_allclose(out[0], (prior + lik)[0], atol=1e-10)
    # -H - (-H_prior) is positive semi-definite
    assert np.linalg.eigvalsh(prior - out).min() > -1e-10
