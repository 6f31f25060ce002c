"""Rayleigh family: KL, quadrature and the natural-gradient step."""

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import pytest
from scipy import integrate, stats

import pymc_mcssvi
from pymc_mcssvi.families.rayleigh import (
    kl_rayleigh,
    log_exponential_nodes,
    natural_step_rayleigh,
    rayleigh_nodes,
)


@pytest.mark.parametrize(("s", "tau"), [(1.0, 1.0), (0.5, 2.0), (3.0, 1.5)])
def test_kl_matches_numerical_integration(s, tau):
    q, p = stats.rayleigh(scale=s), stats.rayleigh(scale=tau)
    want = integrate.quad(
        lambda w: q.pdf(w) * (q.logpdf(w) - p.logpdf(w)), 0, np.inf, epsrel=1e-12
    )[0]
    np.testing.assert_allclose(
        kl_rayleigh(pt.as_tensor(np.float64(s)), pt.as_tensor(np.float64(tau))).eval(),
        want,
        rtol=1e-9,
        atol=1e-12,
    )


def test_quadrature_nodes_integrate_rayleigh_moments():
    w, wt = (x.eval() for x in rayleigh_nodes(pt.as_tensor(np.float64(2.0)), 12))
    for f, exact in [
        (lambda x: x**2, 2 * 4.0),
        (np.sqrt, stats.rayleigh(scale=2.0).expect(np.sqrt)),
        (np.log, stats.rayleigh(scale=2.0).expect(np.log)),
    ]:
        np.testing.assert_allclose(np.sum(wt * f(w)), exact, rtol=1e-6)
    t, v = log_exponential_nodes(6)
    np.testing.assert_allclose(v.sum(), 1.0, rtol=1e-12)


def test_natural_step_with_rho_one_on_the_prior_alone_lands_on_the_prior():
    # Bound = -KL(q || p): dL/dsigma at sigma, and theta_new = theta_p exactly for rho = 1.
    sigma = pt.scalar("s", dtype="float64")
    L = -kl_rayleigh(sigma, pt.as_tensor(np.float64(1.7)))
    new = natural_step_rayleigh(sigma, pt.grad(L, sigma), 1.0, max_growth=np.inf)
    np.testing.assert_allclose(new.eval({sigma: 0.4}), 1.7, rtol=1e-12)
    np.testing.assert_allclose(new.eval({sigma: 3.1}), 1.7, rtol=1e-12)  # shrinking: never capped
    # A step that would leave theta >= 0 grows sigma by the largest allowed factor.
    one, big = pt.as_tensor(1.0), pt.as_tensor(100.0)
    assert np.isclose(natural_step_rayleigh(one, big, 1.0).eval(), 2.0)
    assert np.isclose(natural_step_rayleigh(one, big, 1.0, max_growth=10.0).eval(), 10.0)


@pytest.fixture(scope="module")
def gme():
    rng = np.random.default_rng(3)
    N, D = 120, 2
    X = rng.normal(size=(N, D))
    f = X @ [0.5, -0.4] + np.sqrt(0.6) * rng.normal(size=N)
    y = rng.poisson(np.log1p(np.exp(f)))
    with pm.Model() as m:
        w1 = pm.Normal("w1", 0, 1, shape=D)
        w2 = pymc_mcssvi.Rayleigh("w2", sigma=1.0)
        fl = pm.Normal("f", X @ w1, pm.math.sqrt(w2), shape=N)
        pm.Poisson("y", pm.math.log1pexp(fl), observed=y)
    return m


@pytest.mark.slow
def test_bound_gradient_in_rayleigh_scale_matches_finite_differences(gme):
    with gme:
        inf = pymc_mcssvi.MCSSVI()
    k, st = inf.kernel, inf.store.symbolic
    _, info = k.step(st)
    sig = st.rayleigh.cand[0]
    value = info.candidate_bound
    from pymc_mcssvi.families.gaussian import GaussianBlocks

    ev = inf.bound.evaluate(
        [GaussianBlocks(m, f) for m, f in zip(st.cand.means, st.cand.factors, strict=True)]
    )
    total = k.rayleighs.evaluate(st.rayleigh, [ev.value])[0]
    fn = pytensor.function([], [total, pt.grad(total, sig)])
    st.cand.means[0].set_value(np.array([[0.4, -0.3]]))
    st.cand.factors[0].set_value(np.diag([8.0, 9.0])[None])
    for s0 in (0.5, 0.9):
        sig.set_value(np.asarray(s0))
        _, g = fn()
        h = 1e-5
        sig.set_value(np.asarray(s0 + h))
        up = fn()[0]
        sig.set_value(np.asarray(s0 - h))
        down = fn()[0]
        np.testing.assert_allclose(g, (up - down) / (2 * h), rtol=1e-6)
    del value


@pytest.mark.slow
@pytest.mark.parametrize("method", ["mcssvi", "hmcssvi", "sdsvi"])
def test_all_algorithms_reach_the_same_gme_optimum(gme, method):
    with gme:
        ref = pymc_mcssvi.MCSSVI().fit(progressbar=False)
        approx = pm.fit(method=method, progressbar=False, max_iter=3000)
    np.testing.assert_allclose(approx.hist[-1], ref.hist[-1], rtol=1e-5)
    np.testing.assert_allclose(approx.mean.eval(), ref.mean.eval(), atol=5e-3)
