"""The joint Newton step of q(w)'s and q(h)'s means (mean-field hyperparameters)."""

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import pytest

import pymc_mcssvi
from pymc_mcssvi.algorithms import kernel as kernel_module
from pymc_mcssvi.algorithms.hyperparameters import joint_newton_step
from pymc_mcssvi.families.gaussian import GaussianBlocks


def _spd(rng, k, scale=1.0):
    A = rng.normal(size=(k, k))
    return scale * (A @ A.T + k * np.eye(k))


@pytest.mark.parametrize("K", [1, 2, 5], ids=["K1", "K2", "K5"])
def test_joint_step_solves_the_coupled_quadratic(K, rng):
    """On a quadratic bound, rho = 1 lands on the joint maximizer (dense solve as reference)."""
    R, n_h = 4, 3
    blocks = [_spd(rng, K) for _ in range(R)]
    P_h = _spd(rng, n_h, scale=5.0)
    B = 0.3 * rng.normal(size=(R, K, n_h))
    g_w = rng.normal(size=(R, K))
    g_h = rng.normal(size=n_h)
    L = np.stack([np.linalg.cholesky(b) for b in blocks])
    step = joint_newton_step(
        pt.as_tensor(g_h),
        pt.as_tensor(P_h),
        1.0,
        [pt.as_tensor(L)],
        [pt.as_tensor(g_w)],
        [pt.as_tensor(B)],
        max_step=1e6,
    )
    dh, shift = (x.eval() for x in (step.delta_h, step.shifts[0]))
    # Dense joint curvature [[P_w, -B], [-B^T, P_h]] of the bound's negative.
    D = R * K
    P_w = np.zeros((D, D))
    for r in range(R):
        P_w[r * K : (r + 1) * K, r * K : (r + 1) * K] = blocks[r]
    Bd = B.reshape(D, n_h)
    A = np.block([[P_w, -Bd], [-Bd.T, P_h]])
    want = np.linalg.solve(A, np.r_[g_w.ravel(), g_h])
    dw = np.stack([np.linalg.solve(blocks[r], g_w[r]) for r in range(R)]) + shift
    np.testing.assert_allclose(dh, want[D:], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dw.ravel(), want[:D], rtol=1e-10, atol=1e-12)


def test_joint_step_is_capped_and_ascends_where_the_curvature_is_indefinite(rng):
    P_h = np.eye(2)
    B = np.ones((1, 1, 2)) * 3.0  # S = I - 9 * ones: indefinite
    L = np.ones((1, 1, 1))
    g_h = np.array([1.0, -0.5])
    dh = joint_newton_step(
        pt.as_tensor(g_h),
        pt.as_tensor(P_h),
        1.0,
        [pt.as_tensor(L)],
        [pt.as_tensor(np.zeros((1, 1)))],
        [pt.as_tensor(B)],
        max_step=0.5,
    )
    dh = dh.delta_h.eval()
    assert np.all(np.isfinite(dh))
    assert np.max(np.abs(dh)) <= 0.5 + 1e-12


def _noncentered(rng, G=30, n=240):
    g = np.concatenate([np.arange(G), rng.integers(0, G, n - G)])
    x = rng.normal(size=n)
    a = rng.normal(scale=0.4, size=G)
    y = rng.poisson(np.exp(0.3 + 0.4 * x + a[g]))
    with pm.Model() as m:
        b0 = pm.Normal("b0", 0, 5)
        b1 = pm.Normal("b1", 0, 2.5)
        sd = pm.HalfNormal("sd", 1)
        z = pm.Normal("z", 0, 1, shape=G)
        pm.Poisson("y", mu=pm.math.exp(b0 + b1 * x + sd * z[g]), observed=y)
    return m


def test_cross_derivatives_match_finite_differences(rng):
    """Stein's estimates of E[d g_w / d h] and E[d H_w / d h] against central differences."""
    m = _noncentered(rng)
    with m:
        inf = pymc_mcssvi.HMCSSVI(random_seed=3)
        inf.fit(5, progressbar=False)
    k, st = inf.kernel, inf.store.symbolic
    hyp = k.hypers
    st.hyper.cand_factor.set_value(np.eye(1)[None] * 1e3)  # sd 1e-3: E[d g/d h] ~ d g/d h
    cand = [GaussianBlocks(mu, f) for mu, f in zip(st.cand.means, st.cand.factors, strict=True)]
    with m:
        ev = k.bound.evaluate(cand)
        outs = [ev.value, *ev.phase_values, *ev.grads, *ev.hessians]
        nv = 1 + len(ev.phase_values)
        nout = 2 * k.nseg
        avg, _, aux = hyp.evaluate(st.hyper, outs, n_values=nv, cross=range(nv, nv + nout))
        crosses = aux[2]
        assert sum(c is not None for c in crosses) >= 2  # a gradient and a Hessian
        fn = pytensor.function([], [*avg[nv : nv + nout], *[c for c in crosses if c is not None]])
    base = st.hyper.cand_mean.get_value()
    eps = 1e-4
    st.hyper.cand_mean.set_value(base + eps)
    up = fn()[:nout]
    st.hyper.cand_mean.set_value(base - eps)
    down = fn()[:nout]
    st.hyper.cand_mean.set_value(base)
    got = fn()[nout:]
    want = [(u - d) / (2 * eps) for u, d, c in zip(up, down, crosses, strict=True) if c is not None]
    for gt, wt in zip(got, want, strict=True):
        np.testing.assert_allclose(gt[..., 0], wt, rtol=1e-3, atol=1e-6 * np.abs(wt).max())


def test_coupled_and_separate_steps_reach_the_same_fit(rng, monkeypatch):
    """Same fixed point (the mean-field optimum) with and without the coupling."""
    m = _noncentered(rng)
    fits = {}
    for coupled in (True, False):
        if not coupled:
            monkeypatch.setattr(kernel_module, "MAX_COUPLED_HYPERS", 0)
        with m:
            inf = pymc_mcssvi.HMCSSVI(random_seed=3, linear_response=False)
            assert inf.kernel.coupled is coupled
            approx = inf.fit(progressbar=False, tol=1e-10, max_iter=3000)
        assert approx.converged
        fits[coupled] = (
            np.asarray(approx.mean.eval()),
            np.asarray(approx.std.eval()),
            float(inf.store.symbolic.hyper.base_mean.get_value()[0, 0]),
        )
    (m1, s1, h1), (m0, s0, h0) = fits[True], fits[False]
    np.testing.assert_allclose(m1, m0, atol=2e-3)
    np.testing.assert_allclose(s1, s0, rtol=2e-3)
    assert abs(h1 - h0) < 5e-3


def test_joint_step_with_a_failed_factorization_is_nan_not_an_error():
    """A NaN factor (failed Cholesky) gives a NaN step, which the caller replaces."""
    L = np.full((2, 1, 1), np.nan)
    dh = joint_newton_step(
        pt.as_tensor(np.ones(2)),
        pt.as_tensor(np.eye(2)),
        1.0,
        [pt.as_tensor(L)],
        [pt.as_tensor(np.ones((2, 1)))],
        [pt.as_tensor(np.ones((2, 1, 2)))],
    )
    assert np.all(np.isnan(dh.delta_h.eval()))


def test_coupling_removes_the_slow_scale_mode(monkeypatch):
    """Non-centered random intercepts: the separate steps creep along the scale (EM-like),
    the joint step does not. Deterministic (fixed data and seed)."""
    from tests.pymc.test_hierarchical import _random_intercepts

    m = _random_intercepts(False, np.random.default_rng(2))[0]
    n_iter, elbo = {}, {}
    for coupled in (True, False):
        if not coupled:
            monkeypatch.setattr(kernel_module, "MAX_COUPLED_HYPERS", 0)
        with m:
            approx = pymc_mcssvi.HMCSSVI(random_seed=3).fit(progressbar=False)
        assert approx.converged
        n_iter[coupled], elbo[coupled] = len(approx.hist), -approx.hist[-1]
    assert n_iter[True] <= n_iter[False] / 2, n_iter
    assert elbo[True] >= elbo[False] - 1e-3


# ------------------------------------------------------------- linear response
def test_linear_response_draws_match_the_reported_covariance(rng):
    """Draws of (w, h) have the mean and covariance that ``approx.cov`` reports,
    including the cross-covariance of the Gaussian globals with the hyperparameters.
    80,000 draws: the gridded q(h)'s long tail of ``log sd`` (to 20 sds) makes the
    sample cross-covariances noisy (with 20,000 draws they moved by 0.015 in
    correlation between seeds)."""
    n = 80_000
    m = _noncentered(rng)
    with m:
        approx = pymc_mcssvi.HMCSSVI(random_seed=3).fit(progressbar=False)
    cov = np.asarray(approx.cov.eval())
    mean = np.asarray(approx.mean.eval())
    fn = approx.sample_dict_fn
    draws = fn(n, random_seed=4)
    flat = np.concatenate(
        [np.asarray(draws[name]).reshape(n, -1) for name, *_ in approx.ordering.values()],
        axis=1,
    )
    np.testing.assert_allclose(flat.mean(0), mean, atol=4 * np.sqrt(np.diag(cov) / n).max())
    emp = np.cov(flat.T)
    sd = np.sqrt(np.diag(cov))
    np.testing.assert_allclose(np.sqrt(np.diag(emp)), sd, rtol=0.03)
    corr_emp = emp / np.outer(np.sqrt(np.diag(emp)), np.sqrt(np.diag(emp)))
    corr = cov / np.outer(sd, sd)
    np.testing.assert_allclose(corr_emp, corr, atol=0.03)
    # the hyperparameter is correlated with the effects it scales
    h_idx = approx.ordering["sd_log__"][1]
    z_idx = approx.ordering["z"][1]
    assert np.abs(corr[z_idx, h_idx]).max() > 0.1


def test_linear_response_widens_q_h_and_can_be_switched_off(rng):
    m = _noncentered(rng)
    sds = {}
    for lr in (True, False):
        with m:
            approx = pymc_mcssvi.HMCSSVI(random_seed=3, linear_response=lr).fit(progressbar=False)
        h_idx = approx.ordering["sd_log__"][1]
        sds[lr] = float(np.asarray(approx.std.eval())[h_idx][0])
        cov = np.asarray(approx.cov.eval())
        off = cov[: h_idx.start, h_idx]
        assert bool(np.abs(off).max() > 0) is lr
    assert sds[True] > 1.2 * sds[False], sds
