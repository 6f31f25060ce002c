"""Rayleigh globals: the family's pure functions and the fitted q of a Rayleigh scale.

Checks
------
* :func:`~pymc_mcssvi.families.rayleigh.kl_rayleigh` against the closed form
  ``log(tau^2 / sigma^2) + sigma^2 / tau^2 - 1`` (broadcast over arrays), its
  minimum at ``sigma = tau``;
* the Gauss rules: :func:`log_exponential_nodes` integrates polynomials in
  ``t = log E`` of degree ``< 2n`` exactly (moments of the log-exponential
  density by numerical integration) and ``E[E^a] = Gamma(1 + a)``;
  :func:`laguerre_nodes` gives ``E[E^k] = k!``; :func:`rayleigh_nodes`
  reproduces ``E[w] = sigma sqrt(pi / 2)`` and ``E[w^2] = 2 sigma^2`` (and its
  derivative in ``sigma``);
* :func:`natural_step_rayleigh` with ``rho = 1`` lands on the fixed point
  ``theta_p + dT/deta`` for a bound ``T(eta) - KL`` with a non-trivial ``T``
  (and on ``(1 - rho) theta + rho (theta_p + dT/deta)`` for ``rho < 1``), and
  is capped at ``max_growth``;
* end to end, through ``pm.fit(method="mcssvi")``: a Rayleigh scale ``w2``
  multiplying a Gaussian predictor, ``y ~ N(w2 x b, 1)``, whose structured bound
  over ``q(b) q(w2)`` is closed form; the fit reaches the optimum found by
  coordinate ascent in NumPy, its bound never decreases, and its draws of ``w2``
  are Rayleigh with the fitted scale;
* the model errors of Rayleigh globals (vector-valued, more than two, no log
  transform).
"""

import math

import numpy as np
import pymc as pm
import pytensor.tensor as pt
import pytest
from scipy import integrate, stats

import pymc_mcssvi
from pymc_mcssvi import UnsupportedModelError
from pymc_mcssvi.families.rayleigh import (
    kl_rayleigh,
    laguerre_nodes,
    log_exponential_nodes,
    natural_step_rayleigh,
    rayleigh_nodes,
)

SQRT_HALF_PI = np.sqrt(np.pi / 2.0)


def test_kl_closed_form_broadcast():
    s = np.array([[0.3], [1.0], [2.5]])
    t = np.array([0.5, 1.0, 4.0])
    want = np.log(t**2 / s**2) + s**2 / t**2 - 1.0
    got = kl_rayleigh(pt.as_tensor(s), pt.as_tensor(t)).eval()
    assert got.shape == (3, 3)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-15)
    assert np.all(got[~np.isclose(s, t)] > 0)
    np.testing.assert_allclose(got[1, 1], 0.0, atol=1e-15)


def test_kl_is_minimal_at_the_prior_scale():
    sigma = pt.scalar("sigma", dtype="float64")
    kl = kl_rayleigh(sigma, pt.as_tensor(1.7))
    grad = pt.grad(kl, sigma)
    np.testing.assert_allclose(grad.eval({sigma: 1.7}), 0.0, atol=1e-14)
    # d/dsigma [-2 log sigma + sigma^2 / tau^2] = -2 / sigma + 2 sigma / tau^2
    np.testing.assert_allclose(grad.eval({sigma: 0.6}), -2 / 0.6 + 1.2 / 1.7**2, rtol=1e-13)


@pytest.mark.parametrize("n", [4, 6, 8])
def test_log_exponential_rule_is_exact_for_polynomials_in_t(n):
    t, w = log_exponential_nodes(n)
    assert t.shape == w.shape == (n,)
    assert np.all(w > 0) and np.all(np.diff(t) > 0)

    def moment(k):
        return integrate.quad(lambda s: s**k * np.exp(s - np.exp(s)), -np.inf, 6.0, limit=200)[0]

    # Moments of high degree are dominated by the far left tail (t^15 near t = -40),
    # which the rule's construction on a grid of t truncates: 5e-6 at n = 8.
    for k in range(2 * n):
        rtol = 1e-10 if k < 6 else 2e-5
        np.testing.assert_allclose(np.sum(w * t**k), moment(k), rtol=rtol, atol=1e-12)
    # E[t] = -euler_gamma, E[t^2] = euler_gamma^2 + pi^2 / 6
    np.testing.assert_allclose(np.sum(w * t), -np.euler_gamma, rtol=1e-9)
    np.testing.assert_allclose(np.sum(w * t**2), np.euler_gamma**2 + np.pi**2 / 6, rtol=1e-9)


def test_log_exponential_rule_fractional_moments():
    # E[E^a] = Gamma(1 + a): smooth in t; the larger a, the more nodes are needed.
    t, w = log_exponential_nodes(12)
    for a in (-0.25, 0.25, 0.5, 1.0):
        np.testing.assert_allclose(np.sum(w * np.exp(a * t)), math.gamma(1 + a), rtol=1e-9)
    t, w = log_exponential_nodes(16)
    for a in (1.5, 2.0):
        np.testing.assert_allclose(np.sum(w * np.exp(a * t)), math.gamma(1 + a), rtol=1e-7)
    # and the error of E[E] = 1 falls with the number of nodes
    errors = [
        abs(np.sum(w * np.exp(t)) - 1.0) for t, w in map(log_exponential_nodes, (4, 6, 8, 12))
    ]
    assert np.all(np.diff(errors) < 0) and errors[-1] < 1e-9, errors


@pytest.mark.parametrize("n", [3, 6, 10])
def test_laguerre_rule_gives_factorial_moments(n):
    x, w = laguerre_nodes(n)
    for k in range(2 * n):
        np.testing.assert_allclose(np.sum(w * x**k), math.factorial(k), rtol=1e-10)


@pytest.mark.parametrize("sigma", [0.2, 1.0, 3.7])
def test_rayleigh_nodes_moments(sigma):
    s = pt.scalar("s", dtype="float64")
    nodes, weights = rayleigh_nodes(s, 12)
    w, wt = nodes.eval({s: sigma}), weights.eval()
    assert np.all(w > 0)
    np.testing.assert_allclose(wt.sum(), 1.0, rtol=1e-13)
    np.testing.assert_allclose(np.sum(wt * w), sigma * SQRT_HALF_PI, rtol=1e-12)
    np.testing.assert_allclose(np.sum(wt * w**2), 2 * sigma**2, rtol=1e-9)
    # the nodes are linear in sigma: d E[w^2] / d sigma = 4 sigma through them
    d = pt.grad(pt.sum(weights * nodes**2), s)
    np.testing.assert_allclose(d.eval({s: sigma}), 4 * sigma, rtol=1e-9)


def test_rayleigh_nodes_default_sizes_are_accurate_for_the_first_moment():
    # The fits use 6 to 8 nodes: E[w] = sigma sqrt(pi / 2) to 1e-7 there.
    for n in (6, 8):
        w, wt = (x.eval() for x in rayleigh_nodes(pt.as_tensor(1.3), n))
        np.testing.assert_allclose(np.sum(wt * w), 1.3 * SQRT_HALF_PI, rtol=1e-6)


def _step(sigma0, tau, a, c, rho, max_growth=2.0):
    """``natural_step_rayleigh`` on the bound ``a E[w] - c E[w^2] - KL(q || Rayl(tau))``."""
    sigma = pt.scalar("sigma", dtype="float64")
    bound = a * sigma * SQRT_HALF_PI - c * 2 * sigma**2 - kl_rayleigh(sigma, pt.as_tensor(tau))
    new = natural_step_rayleigh(sigma, pt.grad(bound, sigma), rho, max_growth=max_growth)
    return float(new.eval({sigma: sigma0}))


def _expected(sigma0, tau, a, c, rho):
    """``(1 - rho) theta + rho (theta_p + dT/deta)`` in sigma; ``T(eta) = a sqrt(pi/2)
    sqrt(eta / 2) - c eta`` with ``eta = 2 sigma^2``, so ``dT/deta = a sqrt(pi/2) /
    (4 sigma) - c``."""
    theta, theta_p = -0.5 / sigma0**2, -0.5 / tau**2
    dT = a * SQRT_HALF_PI / (4 * sigma0) - c
    new = (1 - rho) * theta + rho * (theta_p + dT)
    return np.sqrt(-0.5 / new)


@pytest.mark.parametrize(
    ("sigma0", "tau", "a", "c"), [(0.8, 1.3, 0.5, 0.7), (2.0, 1.0, 3.0, 0.05), (1.1, 0.4, 0.0, 0.3)]
)
def test_natural_step_rho_one_lands_on_the_fixed_point(sigma0, tau, a, c):
    got = _step(sigma0, tau, a, c, 1.0, max_growth=np.inf)
    np.testing.assert_allclose(got, _expected(sigma0, tau, a, c, 1.0), rtol=1e-12)
    # a T linear in eta (a = 0): theta_new = theta_p - c from any start, in one step
    if a == 0.0:
        np.testing.assert_allclose(got, np.sqrt(-0.5 / (-0.5 / tau**2 - c)), rtol=1e-12)


@pytest.mark.parametrize("rho", [0.1, 0.5, 0.9])
def test_natural_step_partial_rho_interpolates_natural_parameters(rho):
    got = _step(0.8, 1.3, 0.5, 0.7, rho)
    np.testing.assert_allclose(got, _expected(0.8, 1.3, 0.5, 0.7, rho), rtol=1e-12)


def test_natural_step_growth_cap():
    # the exact step would take sigma from 0.5 to 1.196: capped at 2x, not at 3x
    exact = _expected(0.5, 1.0, 0.4, 0.1, 1.0)
    assert 1.15 < exact < 1.25
    np.testing.assert_allclose(_step(0.5, 1.0, 0.4, 0.1, 1.0, max_growth=np.inf), exact, rtol=1e-12)
    np.testing.assert_allclose(_step(0.5, 1.0, 0.4, 0.1, 1.0), 1.0, rtol=1e-12)
    np.testing.assert_allclose(_step(0.5, 1.0, 0.4, 0.1, 1.0, max_growth=3.0), exact, rtol=1e-12)
    # a partial step within the cap is the exact step
    half = _expected(0.5, 1.0, 0.4, 0.1, 0.2)
    assert half < 1.0
    np.testing.assert_allclose(_step(0.5, 1.0, 0.4, 0.1, 0.2), half, rtol=1e-12)


# ------------------------------------------------------------------ end to end
SB, TAU = 1.0, 1.0  # prior sd of b, Rayleigh prior scale of w2


@pytest.fixture(scope="module")
def scaled_predictor():
    """``y_i ~ N(w2 x_i b, 1)``, ``b ~ N(0, SB)``, ``w2 ~ Rayl(TAU)``."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=30)
    y = 1.2 * x + rng.normal(size=30)
    with pm.Model() as model:
        b = pm.Normal("b", 0.0, SB)
        w2 = pymc_mcssvi.Rayleigh("w2", sigma=TAU)
        pm.Normal("y", w2 * x * b, 1.0, observed=y)
    return model, x, y


def optimal_structured_q(x, y, iters=5000):
    """Maximizer of the bound over ``q(b) = N(m, v)``, ``q(w2) = Rayl(s)`` by coordinate ascent.

    With ``E[w2] = s sqrt(pi/2)`` and ``E[w2^2] = 2 s^2`` the bound is
    ``-N/2 log 2pi - (Syy - 2 Sxy E[w2] m + Sxx E[w2^2] (m^2 + v)) / 2 - KL_b - KL_w2``;
    ``q(b)`` given ``s`` is Gaussian-conjugate, and ``s`` given ``q(b)`` solves
    ``a - 4 c s + 2 / s - 2 s / tau^2 = 0``.
    """
    Sxx, Sxy, Syy = x @ x, x @ y, y @ y
    s = TAU
    for _ in range(iters):
        P = 1 / SB**2 + 2 * s**2 * Sxx
        m, v = s * SQRT_HALF_PI * Sxy / P, 1 / P
        a, c = SQRT_HALF_PI * m * Sxy, 0.5 * (m**2 + v) * Sxx
        A = 4 * c + 2 / TAU**2
        s = (a + np.sqrt(a * a + 8 * A)) / (2 * A)
    Ew, Ew2 = s * SQRT_HALF_PI, 2 * s**2
    elbo = (
        -0.5 * len(x) * np.log(2 * np.pi)
        - 0.5 * (Syy - 2 * Sxy * Ew * m + Sxx * Ew2 * (m**2 + v))
        - 0.5 * (v / SB**2 + m**2 / SB**2 - 1 - np.log(v / SB**2))
        - (np.log(TAU**2 / s**2) + s**2 / TAU**2 - 1)
    )
    return m, np.sqrt(v), s, elbo


def test_fit_reaches_the_closed_form_optimum(scaled_predictor):
    model, x, y = scaled_predictor
    m, sd, s, elbo = optimal_structured_q(x, y)
    with model:
        # 12 nodes: E[w2^2] exact to 1e-10 (the default 6 are 6e-5 off, which moves
        # the optimum by about 1e-3)
        approx = pm.fit(method="mcssvi", progressbar=False, n_rayleigh_nodes=12, tol=1e-12)
    assert approx.converged
    hist = approx.hist
    assert np.all(np.isfinite(hist))
    # hist is -ELBO of the accepted state: never increases under the adaptive schedule
    assert np.all(np.diff(hist) <= 1e-9 * np.abs(hist[1:]))
    assert hist[-1] < hist[0] - 1.0
    np.testing.assert_allclose(-hist[-1], elbo, rtol=1e-9)

    order = approx.ordering
    mean, std = approx.mean.eval(), approx.std.eval()
    b_slice, w_slice = order["b"][1], order["w2_log__"][1]
    np.testing.assert_allclose(mean[b_slice], m, rtol=1e-4)
    np.testing.assert_allclose(std[b_slice], sd, rtol=1e-4)
    # q(w2) in PyMC's log space: E[log w2] = log s + (log 2 - euler_gamma) / 2
    s_fit = np.exp(mean[w_slice][0] - 0.5 * (np.log(2.0) - np.euler_gamma))
    np.testing.assert_allclose(s_fit, s, rtol=1e-4)
    np.testing.assert_allclose(std[w_slice], np.pi / np.sqrt(24.0), rtol=1e-12)

    # draws of w2 are Rayleigh(s)
    post = approx.sample(4000, random_seed=1).posterior
    w2 = post["w2"].values.ravel()
    assert stats.kstest(w2, stats.rayleigh(scale=s).cdf).pvalue > 1e-3
    b = post["b"].values.ravel()
    np.testing.assert_allclose(b.mean(), m, atol=4 * sd / np.sqrt(b.size))


@pytest.mark.parametrize("case", ["vector", "three", "no_transform"])
def test_unsupported_rayleigh_globals_are_named(case):
    x = np.linspace(-1, 1, 10)
    with pm.Model():
        b = pm.Normal("b", 0, 1)
        if case == "vector":
            w = pymc_mcssvi.Rayleigh("w2", sigma=1.0, shape=2)
            scale, match = w[0] + w[1], "'w2': vector-valued Rayleigh"
        elif case == "three":
            ws = [pymc_mcssvi.Rayleigh(f"w{i}", sigma=1.0) for i in range(3)]
            scale, match = ws[0] * ws[1] * ws[2], "more than two Rayleigh globals"
        else:
            w = pymc_mcssvi.Rayleigh("w2", sigma=1.0, default_transform=None)
            scale, match = w, "'w2': a Rayleigh global needs PyMC's default log transform"
        pm.Normal("y", scale * x * b, 1.0, observed=x)
        with pytest.raises(UnsupportedModelError, match=match):
            pm.fit(method="mcssvi", n=1, progressbar=False)
