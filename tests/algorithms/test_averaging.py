"""Iterate averaging of stochastic fits (:mod:`pymc_mcssvi.algorithms.averaging`).

Checks
------
* averaging identical iterates returns that iterate, in the ``"precision"`` and
  the ``"covariance"`` parameterization (several segments, several blocks);
* the average of Gaussian blocks is formed in natural parameters ``(P, P m)``
  with the documented polynomial-decay weights (iterate ``t`` enters with
  ``w_t = (eta + 1) / (t + eta)``, ``eta = DECAY``), compared with a NumPy
  computation of those weights, and differs from averaging the means directly;
* hyperparameter parts: ``("point", values)`` averaged with the same weights,
  ``("gaussian", mean, factor)`` in natural parameters;
* :meth:`IterateAverage.location`: the means and marginal sds of the average.
"""

import numpy as np
import pytest

from pymc_mcssvi.algorithms.averaging import DECAY, IterateAverage


def random_lower(rng, R, K, lo=0.5, hi=2.0):
    """``(R, K, K)`` lower-triangular factors with positive diagonals."""
    L = np.tril(rng.normal(scale=0.3, size=(R, K, K)), -1)
    idx = np.arange(K)
    L[:, idx, idx] = rng.uniform(lo, hi, size=(R, K))
    return L


def decay_weights(T, eta=DECAY):
    """Weight of iterate ``s = 1..T`` in the average after ``T`` updates: ``w_s`` times
    ``(1 - w_r)`` for every later ``r``."""
    w = (eta + 1.0) / (np.arange(1, T + 1) + eta)
    w = np.minimum(w, 1.0)
    out = np.empty(T)
    for s in range(T):
        out[s] = w[s] * np.prod(1.0 - w[s + 1 :])
    return out


def precision_of(factor, parameterization):
    """``P`` of blocks given by their lower factor (of ``P`` or of the covariance)."""
    LLt = factor @ np.swapaxes(factor, -1, -2)
    return LLt if parameterization == "precision" else np.linalg.inv(LLt)


def test_decay_weights_closed_form():
    # The reference weights themselves: with eta = 3 they are 4 s (s+1) (s+2) / (T..T+3).
    T = 9
    s = np.arange(1, T + 1)
    want = 4.0 * s * (s + 1) * (s + 2) / (T * (T + 1) * (T + 2) * (T + 3))
    np.testing.assert_allclose(decay_weights(T, 3.0), want, rtol=1e-13)
    np.testing.assert_allclose(decay_weights(T).sum(), 1.0, rtol=1e-13)


@pytest.mark.parametrize("parameterization", ["precision", "covariance"])
def test_identical_iterates_average_to_themselves(parameterization, rng):
    means = [rng.normal(size=(3, 2)), rng.normal(size=(1, 4))]
    factors = [random_lower(rng, 3, 2), random_lower(rng, 1, 4)]
    avg = IterateAverage(parameterization)
    for _ in range(7):
        avg.update([m.copy() for m in means], [f.copy() for f in factors], None)
    out_means, out_factors, hyper = avg.result()
    assert hyper is None
    for m, f, om, of in zip(means, factors, out_means, out_factors, strict=True):
        assert om.shape == m.shape and of.shape == f.shape
        np.testing.assert_allclose(om, m, rtol=1e-10, atol=1e-12)
        # lower Cholesky factors with a positive diagonal are unique
        np.testing.assert_allclose(of, f, rtol=1e-10, atol=1e-12)
        np.testing.assert_array_equal(of, np.tril(of))


@pytest.mark.parametrize("parameterization", ["precision", "covariance"])
def test_average_is_formed_in_natural_parameters(parameterization, rng):
    R, K, T = 2, 3, 6
    means = [rng.normal(scale=2.0, size=(R, K)) for _ in range(T)]
    # precisions that differ by a factor of up to 16 between iterates
    factors = [random_lower(rng, R, K, lo=0.5, hi=2.0) for _ in range(T)]
    avg = IterateAverage(parameterization)
    for m, f in zip(means, factors, strict=True):
        avg.update([m], [f], None)
    (mean,), (factor,), _ = avg.result()

    c = decay_weights(T)
    Ps = [precision_of(f, parameterization) for f in factors]
    P = sum(ci * Pi for ci, Pi in zip(c, Ps, strict=True))
    h = sum(ci * (Pi @ mi[..., None])[..., 0] for ci, Pi, mi in zip(c, Ps, means, strict=True))
    want_mean = np.linalg.solve(P, h[..., None])[..., 0]
    np.testing.assert_allclose(mean, want_mean, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(precision_of(factor, parameterization), P, rtol=1e-9, atol=1e-12)
    want_factor = np.linalg.cholesky(P if parameterization == "precision" else np.linalg.inv(P))
    np.testing.assert_allclose(factor, want_factor, rtol=1e-9, atol=1e-12)

    # Not the weighted average of the means (which the natural average is not).
    naive = sum(ci * mi for ci, mi in zip(c, means, strict=True))
    assert np.max(np.abs(naive - mean)) > 1e-2


def test_first_iterate_is_taken_whole_and_the_second_gets_weight_w2(rng):
    # w_1 = (eta + 1) / (1 + eta) = 1; then the second iterate enters with (eta + 1) / (2 + eta).
    m1, m2 = np.array([[1.0]]), np.array([[3.0]])
    L1, L2 = np.array([[[1.0]]]), np.array([[[2.0]]])  # P = 1 and P = 4
    avg = IterateAverage("precision")
    avg.update([m1], [L1], None)
    (mean,), (factor,), _ = avg.result()
    assert mean[0, 0] == 1.0 and factor[0, 0, 0] == 1.0
    avg.update([m2], [L2], None)
    w = (DECAY + 1.0) / (2.0 + DECAY)
    P = (1 - w) * 1.0 + w * 4.0
    h = (1 - w) * 1.0 + w * 4.0 * 3.0
    (mean,), (factor,), _ = avg.result()
    np.testing.assert_allclose(mean[0, 0], h / P, rtol=1e-13)
    np.testing.assert_allclose(factor[0, 0, 0], np.sqrt(P), rtol=1e-13)


def test_point_hyperparameters_are_averaged_with_the_same_weights(rng):
    T = 5
    values = [rng.normal(size=3) for _ in range(T)]
    m, L = np.zeros((1, 1)), np.ones((1, 1, 1))
    avg = IterateAverage("precision")
    for v in values:
        avg.update([m], [L], ("point", v))
    _, _, hyper = avg.result()
    assert hyper[0] == "point"
    want = sum(ci * v for ci, v in zip(decay_weights(T), values, strict=True))
    np.testing.assert_allclose(hyper[1], want, rtol=1e-12)
    # identical point values stay put
    same = IterateAverage("covariance")
    for _ in range(4):
        same.update([m], [L], ("point", np.array([0.25, -1.5])))
    np.testing.assert_allclose(same.result()[2][1], [0.25, -1.5], rtol=1e-14)


def test_gaussian_hyperparameters_are_averaged_in_natural_parameters(rng):
    T, n = 4, 2
    hm = [rng.normal(size=n) for _ in range(T)]
    hL = [random_lower(rng, 1, n)[0] for _ in range(T)]  # precision factors of q(h)
    m, L = np.zeros((1, 1)), np.ones((1, 1, 1))
    # the blocks are in the covariance parameterization, q(h) always in the precision one
    avg = IterateAverage("covariance")
    for mu, f in zip(hm, hL, strict=True):
        avg.update([m], [L], ("gaussian", mu, f))
    _, _, hyper = avg.result()
    assert hyper[0] == "gaussian"
    c = decay_weights(T)
    P = sum(ci * f @ f.T for ci, f in zip(c, hL, strict=True))
    h = sum(ci * f @ f.T @ mu for ci, f, mu in zip(c, hL, hm, strict=True))
    np.testing.assert_allclose(hyper[1], np.linalg.solve(P, h), rtol=1e-10)
    np.testing.assert_allclose(hyper[2], np.linalg.cholesky(P), rtol=1e-10)
    # identical q(h) iterates give that q(h) back
    same = IterateAverage("precision")
    for _ in range(3):
        same.update([m], [L], ("gaussian", hm[0], hL[0]))
    _, _, (_, mu, f) = same.result()
    np.testing.assert_allclose(mu, hm[0], rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(f, hL[0], rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("parameterization", ["precision", "covariance"])
def test_location_of_blocks_and_point_hyperparameters(parameterization, rng):
    means = [rng.normal(size=(2, 2)), rng.normal(size=(1, 3))]
    factors = [random_lower(rng, 2, 2), random_lower(rng, 1, 3)]
    point = np.array([0.5, -2.0])
    avg = IterateAverage(parameterization)
    avg.update(means, factors, ("point", point))
    loc_means, loc_sds = avg.location()
    want_means = np.concatenate([means[0].ravel(), means[1].ravel(), point])
    cov = [np.linalg.inv(precision_of(f, parameterization)) for f in factors]
    want_sds = np.concatenate(
        [np.sqrt(np.diagonal(S, axis1=-2, axis2=-1)).ravel() for S in cov] + [np.ones(2)]
    )
    np.testing.assert_allclose(loc_means, want_means, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(loc_sds, want_sds, rtol=1e-10)


def test_location_with_gaussian_hyperparameters_matches_result(rng):
    avg = IterateAverage("precision")
    for _ in range(5):
        avg.update(
            [rng.normal(size=(3, 1))],
            [random_lower(rng, 3, 1)],
            ("gaussian", rng.normal(size=2), random_lower(rng, 1, 2)[0]),
        )
    loc_means, loc_sds = avg.location()
    (mean,), (factor,), (_, hmean, hfactor) = avg.result()
    assert loc_means.shape == loc_sds.shape == (5,)
    np.testing.assert_allclose(loc_means, np.r_[mean.ravel(), hmean], rtol=1e-10)
    block_sds = 1.0 / factor[:, 0, 0]  # K = 1: sd = 1 / sqrt(P)
    h_sds = np.sqrt(np.diag(np.linalg.inv(hfactor @ hfactor.T)))
    np.testing.assert_allclose(loc_sds, np.r_[block_sds, h_sds], rtol=1e-10)


def test_noisy_iterates_average_closer_than_the_last_iterate(rng):
    # Iterates scattered around a fixed block: the average is much closer than a single one.
    target = np.array([[1.0, -2.0]])
    L = np.linalg.cholesky(np.array([[4.0, 1.0], [1.0, 2.0]]))[None]
    avg = IterateAverage("precision")
    errs = []
    for _ in range(300):
        m = target + rng.normal(scale=0.5, size=target.shape)
        errs.append(np.abs(m - target).max())
        avg.update([m], [L], None)
    (mean,), (factor,), _ = avg.result()
    np.testing.assert_allclose(factor, L, rtol=1e-10)
    # the average covers about the last quarter of the iterates: sd ~ 0.5 / sqrt(75)
    assert np.abs(mean - target).max() < 0.25
    assert np.abs(mean - target).max() < 0.5 * np.median(errs)
