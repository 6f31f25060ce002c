"""The Python backend evaluates every element-wise op with NumPy, never per element."""

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import pytest
from scipy.special import polygamma

import pymc_mcssvi
from pymc_mcssvi.backend import compile as compile_module
from pymc_mcssvi.backend.modes import per_element_ops, python_step_mode


def test_trigamma_is_a_scipy_ufunc():
    """The derivative of digamma (Beta, Gamma, Student-t likelihoods with learned shapes)."""
    x = pt.vector("x")
    d = pytensor.grad(pt.sum(pt.digamma(x)), x)
    fn = pytensor.function([x], [d, pytensor.grad(pt.sum(d), x)], mode=python_step_mode())
    assert per_element_ops(fn.maker.fgraph) == []
    vals = np.array([0.3, 1.0, 7.5, 250.0])
    d1, d2 = fn(vals)
    np.testing.assert_allclose(d1, polygamma(1, vals), rtol=1e-12)
    np.testing.assert_allclose(d2, polygamma(2, vals), rtol=1e-12)


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda x: pt.softplus(x), id="softplus"),
        pytest.param(lambda x: pt.log1mexp(-pt.abs(x) - 1e-300), id="log1mexp"),
        pytest.param(lambda x: pt.clip(x, -2.0, 3.0), id="clip"),
        pytest.param(lambda x: pt.second(pt.outer(x, x), x[0]), id="fill"),
        pytest.param(lambda x: pt.ones_like(x[:, None] * x[None, :3]) * 2.5, id="fill-broadcast"),
    ],
)
def test_rewritten_ops_match_pytensor_everywhere(build):
    """Same values as PyTensor's own implementation, extremes included, and no per-element op."""
    x = pt.vector("x")
    out = build(x)
    fn = pytensor.function([x], out, mode=python_step_mode())
    ref = pytensor.function([x], out, mode="FAST_COMPILE")
    assert per_element_ops(ref.maker.fgraph), "the reference should use the per-element op"
    assert per_element_ops(fn.maker.fgraph) == []
    vals = np.array(
        [-800.0, -40.0, -1.0, -1e-12, 0.0, 1e-12, 0.5, 20.0, 40.0, 800.0, np.inf, -np.inf]
    )
    with np.errstate(all="ignore"):
        got, want = fn(vals), ref(vals)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=0)


def _gaussian_lmm():
    rng = np.random.default_rng(0)
    g = rng.integers(0, 8, 120)
    x = rng.normal(size=120)
    y = 1.0 + 0.5 * x + rng.normal(size=8)[g] + rng.normal(size=120)
    with pm.Model() as model:
        b = pm.Normal("b", 0, 2, shape=2)
        s = pm.HalfNormal("s", 1.0)
        a = pm.Normal("a", 0, s, shape=8)
        pm.Normal("y", b[0] + b[1] * x + a[g], pm.HalfNormal("sy", 1.0), observed=y)
    return model


def _logit_glmm():
    rng = np.random.default_rng(1)
    g = rng.integers(0, 6, 150)
    x = rng.normal(size=150)
    with pm.Model() as model:
        b = pm.Normal("b", 0, 2, shape=2)
        s = pm.HalfNormal("s", 1.0)
        z = pm.Normal("z", 0, 1, shape=6)
        pm.Bernoulli("y", logit_p=b[0] + b[1] * x + s * z[g], observed=rng.integers(0, 2, 150))
    return model


@pytest.mark.parametrize("make", [_gaussian_lmm, _logit_glmm], ids=["gaussian-lmm", "logit-glmm"])
def test_python_steps_have_no_per_element_ops(make):
    """The whole compiled step (bound, gradients, hyperparameter sigma points)."""
    with make():
        inf = pymc_mcssvi.HMCSSVI(random_seed=0)
        inf.fit(n=2, progressbar=False, backend="python")
    (fn, backend) = next(iter(inf._step_fns.values()))
    assert backend == "python"
    assert per_element_ops(fn.maker.fgraph) == []


@pytest.mark.slow
def test_python_step_upgrades_mid_fit_without_changing_it(monkeypatch):
    """The step compiled with merging only and the fully rewritten one compute the same
    iterations, and the upgrade continues the random draws instead of reseeding them."""

    def fit(upgrade_at, seed=0):
        monkeypatch.setattr(compile_module, "UPGRADE_AT", upgrade_at)
        with _logit_glmm():
            inf = pymc_mcssvi.HMCSSVI(random_seed=seed, estimator="mc", fixed_draws=False)
            approx = inf.fit(max_iter=9, progressbar=False, backend="python")
        (step, _) = next(iter(inf._step_fns.values()))
        assert step.upgraded and step.calls == 9
        return np.asarray(approx.hist)

    full = fit(0)
    # the draws matter: a reseeded upgrade would repeat the first ones and differ
    assert np.abs(fit(0, seed=1) - full).max() > 1e-3
    np.testing.assert_allclose(fit(4), full, rtol=1e-10)


def test_python_step_upgrades_when_a_fit_asks_for_more_iterations(monkeypatch):

    monkeypatch.setattr(compile_module, "UPGRADE_AT", 4)
    with _logit_glmm():
        inf = pymc_mcssvi.HMCSSVI(random_seed=0)
        inf.fit(n=2, progressbar=False, backend="python")
        (step, _) = next(iter(inf._step_fns.values()))
        assert not step.upgraded
        cheap_nodes = len(step.maker.fgraph.apply_nodes)
        inf.fit(n=3, progressbar=False, backend="python")
    assert step.upgraded and step.calls == 5
    assert len(step.maker.fgraph.apply_nodes) < cheap_nodes


def _c_loop_available() -> bool:
    try:
        from pytensor.link.c.cvm import CVM  # noqa: F401  (compiles lazylinker_c if needed)
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _c_loop_available(), reason="PyTensor's C loop needs a C compiler")
def test_python_backend_runs_its_nodes_in_the_c_loop(monkeypatch):
    """The step and the skewed q(h)'s profile re-fit are run by PyTensor's C loop, and a
    whole fit (profile included) is the same as with the Python loop."""
    from pytensor.link.vm import VMLinker

    from pymc_mcssvi.backend import modes as python_vm

    def fit():
        with _gaussian_lmm():
            inf = pymc_mcssvi.HMCSSVI(random_seed=0)
            approx = inf.fit(max_iter=30, progressbar=False, backend="python")
        (step, _) = next(iter(inf._step_fns.values()))
        return inf, step, approx

    inf, step, approx = fit()
    assert type(step.fn.vm).__name__ == "CVM"
    assert inf._posterior._profile_fn is not None, "the fit should have computed the skewed q(h)"
    profile_vms = {
        type(c.cell_contents.vm).__name__
        for c in inf._posterior._profile_fn.__closure__
        if hasattr(c.cell_contents, "vm")
    }
    assert profile_vms == {"CVM"}
    monkeypatch.setattr(
        python_vm,
        "python_linker",
        lambda: VMLinker(use_cloop=False, c_thunks=False, allow_gc=False),
    )
    inf_py, step_py, approx_py = fit()
    assert type(step_py.fn.vm).__name__ != "CVM"
    np.testing.assert_array_equal(approx_py.hist, approx.hist)
    draws = [a.sample(200, random_seed=3).posterior for a in (approx, approx_py)]
    for name in ("b", "s", "a", "sy"):
        np.testing.assert_allclose(draws[0][name].values, draws[1][name].values, rtol=1e-12)
