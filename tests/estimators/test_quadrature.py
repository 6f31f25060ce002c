"""One-dimensional expectations against adaptive numerical integration (SciPy)."""

import numpy as np
import pymc as pm
import pytensor.tensor as pt
import pytest
from scipy import integrate, stats

from pymc_mcssvi.estimators.quadrature import expected_derivatives
from pymc_mcssvi.quadrature_rules import gauss_hermite


def test_gauss_hermite_moments():
    z, w = gauss_hermite(12)
    for k, want in [(0, 1.0), (2, 1.0), (4, 3.0), (6, 15.0), (8, 105.0)]:
        np.testing.assert_allclose(np.sum(w * z**k), want, rtol=1e-12)


LIKELIHOODS = {
    "bernoulli_logit": lambda f: pm.Bernoulli.dist(logit_p=f),
    "poisson_log": lambda f: pm.Poisson.dist(mu=pt.exp(f)),
    "normal": lambda f: pm.Normal.dist(mu=f, sigma=0.7),
    "studentt": lambda f: pm.StudentT.dist(nu=4, mu=f, sigma=0.5),
    "gamma_log": lambda f: pm.Gamma.dist(alpha=3.0, beta=3.0 / pt.exp(f)),
    "negbin_log": lambda f: pm.NegativeBinomial.dist(mu=pt.exp(f), alpha=2.0),
    "binomial_logit": lambda f: pm.Binomial.dist(n=10, logit_p=f),
    "bernoulli_probit": lambda f: pm.Bernoulli.dist(p=0.5 * (1 + pt.erf(f / np.sqrt(2)))),
}
OBS = {
    "bernoulli_logit": 1,
    "poisson_log": 3,
    "normal": 0.4,
    "studentt": 1.5,
    "gamma_log": 1.7,
    "negbin_log": 4,
    "binomial_logit": 7,
    "bernoulli_probit": 0,
}


@pytest.mark.parametrize("name", list(LIKELIHOODS))
@pytest.mark.parametrize("mean,var", [(0.3, 0.04), (1.0, 0.5)])
def test_expectations_match_numerical_integration(name, mean, var):
    from pytensor.graph.rewriting.utils import rewrite_graph

    f = pt.vector("f")
    y = OBS[name]
    logp = pm.logp(LIKELIHOODS[name](f), np.full(1, y))
    logp = rewrite_graph(logp, include=("canonicalize", "stabilize"))
    T, a, b = expected_derivatives(logp, f, pt.as_tensor([mean]), pt.as_tensor([var]), n_points=100)
    got = [x.eval()[0] for x in (T, a, b)]

    import pytensor

    fn = pytensor.function(
        [f], [logp, pt.grad(logp.sum(), f), pt.grad(pt.grad(logp.sum(), f).sum(), f)]
    )
    sd = np.sqrt(var)

    def integrand(x, k):
        return fn(np.array([x]))[k][0] * stats.norm(mean, sd).pdf(x)

    for k in range(3):
        want = integrate.quad(
            integrand, mean - 12 * sd, mean + 12 * sd, args=(k,), epsabs=1e-13, epsrel=1e-12
        )[0]
        np.testing.assert_allclose(got[k], want, rtol=1e-8, atol=1e-10)


def test_derivatives_stay_finite_far_in_the_tails():
    """The stabilized logistic log-likelihood has finite derivatives at |eta| ~ 1e3."""
    from pytensor.graph.rewriting.utils import rewrite_graph

    f = pt.vector("f")
    logp = rewrite_graph(
        pm.logp(pm.Bernoulli.dist(logit_p=f), np.array([1, 0])),
        include=("canonicalize", "stabilize"),
    )
    T, a, b = expected_derivatives(
        logp, f, pt.as_tensor([-800.0, 900.0]), pt.as_tensor([400.0, 400.0])
    )
    for x in (T, a, b):
        assert np.all(np.isfinite(x.eval()))


def test_monte_carlo_option_is_unbiased():
    f = pt.vector("f")
    logp = pm.logp(pm.Poisson.dist(mu=pt.exp(f)), np.array([2]))
    T_q, a_q, b_q = expected_derivatives(
        logp, f, pt.as_tensor([0.5]), pt.as_tensor([0.2]), n_points=30
    )
    T_mc, a_mc, b_mc = expected_derivatives(
        logp, f, pt.as_tensor([0.5]), pt.as_tensor([0.2]), method="mc", n_points=200_000
    )
    # 200k unseeded draws: standard errors ~1% of alpha and beta; 5% is ~5 standard errors
    for q, mc in [(T_q, T_mc), (a_q, a_mc), (b_q, b_mc)]:
        np.testing.assert_allclose(mc.eval(), q.eval(), rtol=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bernoulli_logit", "poisson_log", "studentt"])
def test_node_by_node_quadrature_of_a_jax_step_is_the_stacked_one(name):
    """A graph built for a JAX step sums the quadrature a node at a time (an
    ``OpFromGraph`` per node, fused by XLA); the numbers are the stacked form's, with
    batch axes (sigma points) and a data array the points' values read, and in the
    tails (the softplus of a non-positive argument rewritten to log1p(exp))."""
    pytest.importorskip("jax")
    import pytensor
    from pytensor.graph.rewriting.basic import in2out

    from pymc_mcssvi.estimators.quadrature import softplus_of_nonpositive

    rng = np.random.default_rng(0)
    n = 7
    f = pt.vector("f")
    y = np.abs(rng.normal(size=n)).round(0) if name != "bernoulli_logit" else rng.integers(0, 2, n)
    from pymc_mcssvi.recognize.stabilize import stable_logp

    # the plugin's likelihood terms are stabilized so (recognize.likelihood)
    logp = stable_logp(pm.logp(LIKELIHOODS[name](f), y))
    mean_value = rng.normal(0.0, 3.0, size=(4, n)) * np.array([[1], [1], [1], [100.0]])
    var_value = rng.uniform(0.01, 4.0, size=(4, n))
    mean, var = pt.matrix("mean"), pt.matrix("var")
    stacked = expected_derivatives(logp, f, mean, var, n_points=12)
    by_node = expected_derivatives(logp, f, mean, var, n_points=12, by_node=True)
    from pytensor.compile.builders import OpFromGraph
    from pytensor.graph.traversal import applys_between

    ops = [a.op for a in applys_between([mean, var], by_node)]
    assert sum(isinstance(op, OpFromGraph) for op in ops) == 12
    mode = pytensor.compile.get_mode("JAX").register((in2out(softplus_of_nonpositive), 59.1))
    fn = pytensor.function([mean, var], [*stacked, *by_node], mode=mode)
    out = fn(mean_value, var_value)
    for a, b in zip(out[:3], out[3:], strict=True):
        assert np.all(np.isfinite(b))
        np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-12)
