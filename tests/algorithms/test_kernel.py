"""The step kernel's safeguards."""

import numpy as np


def test_stochastic_trust_region_caps_the_mahalanobis_length_of_mean_steps():
    """Long steps shrink to STOCHASTIC_MAX_MEAN_STEP sds of the current q; short ones stay."""
    from pymc_mcssvi.algorithms.kernel import STOCHASTIC_MAX_MEAN_STEP, _trust_region
    from pymc_mcssvi.families.gaussian import GaussianBlocks

    rng = np.random.default_rng(0)
    R, K = 4, 3
    A = rng.standard_normal((R, K, K))
    P = A @ np.swapaxes(A, -1, -2) + 2 * np.eye(K)
    L = np.linalg.cholesky(P)
    m_old = rng.standard_normal((R, K))
    steps = rng.standard_normal((R, K))
    lengths = np.sqrt(np.einsum("rk,rkl,rl->r", steps, P, steps))
    steps *= np.array([0.5, 2.0, 5.0, 40.0])[:, None] * STOCHASTIC_MAX_MEAN_STEP / lengths[:, None]
    out = _trust_region(GaussianBlocks(m_old + steps, L), GaussianBlocks(m_old, L))
    got = out.mean.eval() - m_old
    got_len = np.sqrt(np.einsum("rk,rkl,rl->r", got, P, got))
    np.testing.assert_allclose(got[0], steps[0], rtol=1e-12)  # within the region
    np.testing.assert_allclose(got_len[1:], STOCHASTIC_MAX_MEAN_STEP, rtol=1e-10)
    # shortened along the same direction
    cos = np.sum(got * steps, -1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(steps, axis=-1)
    np.testing.assert_allclose(cos, 1.0, rtol=1e-12)
