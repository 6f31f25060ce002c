"""The compiled backends give the same fit as the uncompiled step."""

import numpy as np
import pymc as pm
import pytest

import pymc_mcssvi
from pymc_mcssvi.algorithms.state import tree_leaves
from pymc_mcssvi.backend import compile as compile_module
from pymc_mcssvi.models import pmf
from pymc_mcssvi.pymc import inference

jax = pytest.importorskip("jax")


def _ordinal_pmf(seed=0):
    rng = np.random.default_rng(seed)
    R, C, K, n = 12, 9, 3, 80
    rows, cols = rng.integers(0, R, n), rng.integers(0, C, n)
    y = rng.integers(0, 5, n)
    return pmf(
        rows, cols, y, R, C, K, likelihood="ordinal", cutpoints=[-1.5, -0.4, 0.5, 1.6], n_levels=5
    )


def _python_and_jax_fits(model, n):
    """``n`` iterations of the same fit with the Python and the JAX step: ``(ref, inf, got)``."""
    with model:
        ref = pymc_mcssvi.HMCSSVI(random_seed=1).fit(n=n, progressbar=False, backend="python")
        inf = pymc_mcssvi.HMCSSVI(random_seed=1)
        got = inf.fit(n=n, progressbar=False, backend="jax")
    return ref, inf, got


def test_jax_step_matches_the_python_step():
    """Same bound trace and q (stacked Cholesky/inverse dispatched to JAX)."""
    ref, inf, got = _python_and_jax_fits(_ordinal_pmf(), n=6)
    assert inf.backend_used == "jax"
    np.testing.assert_allclose(got.hist, ref.hist, rtol=1e-9)
    np.testing.assert_allclose(got.mean.eval(), ref.mean.eval(), rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(got.std.eval(), ref.std.eval(), rtol=1e-7, atol=1e-9)


def test_a_slow_uncompiled_step_hands_over_to_jax(monkeypatch):
    """With the hand-over's thresholds at 0, the automatically chosen Python step runs
    two iterations and JAX the rest: the same bound trace and q as the Python step
    alone (the shared state goes on where it was). With the thresholds as they are,
    the same small fit stays uncompiled."""
    model = _ordinal_pmf()
    with model:
        ref = pymc_mcssvi.HMCSSVI(random_seed=1).fit(n=6, progressbar=False, backend="python")
        stays = pymc_mcssvi.HMCSSVI(random_seed=1)
        stays.fit(n=6, progressbar=False)
        monkeypatch.setattr(compile_module, "JAX_SWITCH_SECONDS", 0.0)
        monkeypatch.setattr(compile_module, "JAX_SWITCH_ITERATION_SECONDS", 0.0)
        inf = pymc_mcssvi.HMCSSVI(random_seed=1)
        assert inf.choose_backend() == "python"
        got = inf.fit(n=6, progressbar=False)
    assert stays.backend_used == "python"
    step = inf._step_fns[("python", "[]")][0]
    assert inf.backend_used == "jax" and step.calls == 2 and step.switched is not None
    np.testing.assert_allclose(got.hist, ref.hist, rtol=1e-9)
    np.testing.assert_allclose(got.mean.eval(), ref.mean.eval(), rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(got.std.eval(), ref.std.eval(), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("fails_at", ["compilation", "first-call"])
def test_a_hand_over_that_jax_cannot_run_stays_uncompiled(monkeypatch, fails_at):
    """JAX fails on the handed-over step (compiling it, or tracing it at its first call):
    the fit goes on with the Python step, the same trace as the Python step alone, its
    calls counted, and reports the Python backend."""
    model = _ordinal_pmf()
    real_compile = inference.StructuredVI._compile
    error = NotImplementedError("No JAX conversion for the given `Op`: Foo")

    class FailsWhenCalled:
        def __init__(self, store):
            self.store = store

        def __call__(self):
            raise error

    def fake_compile(self, backend, compile_kwargs, switch=None):
        if backend == "jax":
            if fails_at == "compilation":
                raise error
            return FailsWhenCalled(self.store)
        return real_compile(self, backend, compile_kwargs, switch=switch)

    with model:
        ref = pymc_mcssvi.HMCSSVI(random_seed=1).fit(n=6, progressbar=False, backend="python")
        monkeypatch.setattr(inference.StructuredVI, "_compile", fake_compile)
        monkeypatch.setattr(compile_module, "JAX_SWITCH_SECONDS", 0.0)
        monkeypatch.setattr(compile_module, "JAX_SWITCH_ITERATION_SECONDS", 0.0)
        inf = pymc_mcssvi.HMCSSVI(random_seed=1)
        got = inf.fit(n=6, progressbar=False)
    step = inf._step_fns[("python", "[]")][0]
    assert inf.backend_used == "python" and step.switched is None and step.calls == 6
    np.testing.assert_allclose(got.hist, ref.hist, rtol=1e-12)


@pytest.mark.slow
def test_jax_step_with_row_subsampling_takes_the_python_steps_subsets():
    """Row subsample windows are numbered by the step (no generator in the step), so the
    JAX and the Python step use the same subsets: the same stochastic trace, whose
    windows move on (the bound estimates differ from iteration to iteration)."""
    model = _ordinal_pmf(1)
    with model:
        ref = pymc_mcssvi.HMCSSVI(random_seed=2, row_subsample=2)
        ref_fit = ref.fit(n=8, progressbar=False, backend="python")
        inf = pymc_mcssvi.HMCSSVI(random_seed=2, row_subsample=2)
        got = inf.fit(n=8, progressbar=False, backend="jax")
    assert inf.backend_used == "jax" and not inf.kernel.monotone
    np.testing.assert_allclose(got.hist, ref_fit.hist, rtol=1e-9)
    np.testing.assert_allclose(got.mean.eval(), ref_fit.mean.eval(), rtol=1e-7, atol=1e-9)
    assert len(np.unique(np.round(got.hist, 6))) == len(got.hist)


@pytest.mark.parametrize(
    "error",
    [
        NotImplementedError("No JAX conversion for the given `Op`: Foo"),
        # PyTensor's JAX Reshape on a general likelihood term with a learned scale
        AttributeError("'NoneType' object has no attribute 'op'"),
    ],
    ids=["no-translation", "translation-fails"],
)
def test_automatic_jax_falls_back_when_an_op_has_no_translation(monkeypatch, error):
    model = _ordinal_pmf()
    compiled = []
    real_compile = inference.StructuredVI._compile

    def fake_compile(self, backend, compile_kwargs, switch=None):
        compiled.append(backend)
        if backend == "jax":
            raise error
        return real_compile(self, "python", {})

    monkeypatch.setattr(inference.StructuredVI, "_compile", fake_compile)
    monkeypatch.setattr(inference.StructuredVI, "choose_backend", lambda self: "jax")
    with model:
        inf = pymc_mcssvi.HMCSSVI(random_seed=1)
        inf.fit(n=2, progressbar=False)
        inf.fit(n=1, progressbar=False)
    assert compiled == ["jax", "python"]  # the fallback is remembered
    assert inf.backend_used == "python"
    monkeypatch.setattr(
        inf, "work_estimate", lambda **kw: 2 * compile_module.JAX_FALLBACK_COMPILE_WORK
    )
    assert inf._jax_fallback_backend() == "numba"
    with model, pytest.raises(type(error), match=str(error)[:12]):
        pymc_mcssvi.HMCSSVI(random_seed=1).fit(n=1, progressbar=False, backend="jax")


def _slopes_glmm(seed=0, J=20, N=120):
    """Random intercepts and slopes: the gradient of a Join in ``h``, vectorized over
    sigma points, gives a ``Blockwise(Split)`` that JAX could not trace."""
    import pymc as pm

    rng = np.random.default_rng(seed)
    g = np.concatenate([np.arange(J), rng.integers(0, J, N - J)])
    x = rng.normal(size=N)
    y = rng.poisson(np.exp(0.5 + rng.normal(0, 0.5, J)[g] + 0.3 * x))
    with pm.Model() as m:
        b0 = pm.Normal("b0", 0.0, 5.0)
        b1 = pm.Normal("b1", 0.0, 2.5)
        sd_a = pm.HalfNormal("sd_a", 1.0)
        sd_b = pm.HalfNormal("sd_b", 1.0)
        z_a = pm.Normal("z_a", 0.0, 1.0, shape=J)
        z_b = pm.Normal("z_b", 0.0, 1.0, shape=J)
        pm.Poisson("y", pm.math.exp(b0 + sd_a * z_a[g] + (b1 + sd_b * z_b[g]) * x), observed=y)
    return m


@pytest.mark.slow
def test_random_slope_glmm_runs_on_jax():
    """Static split positions (``unbatch_constant_split``): the step traces under JAX
    (a ``ConcretizationTypeError`` before) and gives the Python step's fit."""
    ref, inf, got = _python_and_jax_fits(_slopes_glmm(), n=4)
    assert inf.backend_used == "jax"
    np.testing.assert_allclose(got.hist, ref.hist, rtol=1e-10)
    np.testing.assert_allclose(got.mean.eval(), ref.mean.eval(), rtol=1e-8, atol=1e-10)


@pytest.mark.slow
def test_automatic_jax_falls_back_when_jax_cannot_trace_the_step(monkeypatch):
    """JAX traces on the first call: a failure there switches to the fallback backend."""
    model = _ordinal_pmf()
    calls = []

    def untraceable(self):
        calls.append(1)
        raise RuntimeError("Abstract tracer value encountered where concrete value is expected")

    with model:
        ref = pymc_mcssvi.HMCSSVI(random_seed=1).fit(n=4, progressbar=False, backend="python")
        monkeypatch.setattr(compile_module.HostStateStep, "__call__", untraceable)
        monkeypatch.setattr(inference.StructuredVI, "choose_backend", lambda self: "jax")
        inf = pymc_mcssvi.HMCSSVI(random_seed=1)
        got = inf.fit(n=4, progressbar=False)
        assert calls == [1] and inf.backend_used == "python"
        np.testing.assert_allclose(got.hist, ref.hist, rtol=1e-10)
        np.testing.assert_allclose(got.mean.eval(), ref.mean.eval(), rtol=1e-8, atol=1e-10)
        inf.fit(n=1, progressbar=False)
    assert calls == [1] and inf.backend_used == "python"  # the fallback is remembered
    with model, pytest.raises(RuntimeError, match="Abstract tracer"):
        pymc_mcssvi.HMCSSVI(random_seed=1).fit(n=1, progressbar=False, backend="jax")


def test_large_steps_compile_with_jax_when_it_is_installed(monkeypatch):
    model = _ordinal_pmf()
    with model:
        inf = pymc_mcssvi.HMCSSVI(random_seed=1)
    monkeypatch.setattr(
        inf, "work_estimate", lambda **kw: 10 * compile_module.COMPILE_WORK_THRESHOLD
    )
    assert inf.choose_backend() == "jax"
    monkeypatch.setattr(compile_module, "jax_available", lambda: False)
    assert inf.choose_backend() == "numba"


@pytest.mark.slow
def test_jax_fit_leaves_numpy_state_for_the_rest_of_the_fit():
    """Local posteriors, sampling and SciPy-backed helpers run after a JAX step."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((60, 3))
    y = rng.poisson(np.log1p(np.exp(X @ np.array([0.5, -0.3, 0.2]))))
    model = pymc_mcssvi.models.gme(X, y, prior_sd=1.0, tau=5.0)
    with model:
        ref = pymc_mcssvi.HMCSSVI(random_seed=0).fit(n=3, progressbar=False, backend="python")
        inf = pymc_mcssvi.HMCSSVI(random_seed=0)
        got = inf.fit(n=3, progressbar=False, backend="jax")
    for v in tree_leaves(inf.store.symbolic):
        assert type(v.get_value(borrow=True)) is np.ndarray, v.name
    # the same with a JAX mode passed through compile_kwargs
    from pytensor.compile.mode import get_mode

    with model:
        inf2 = pymc_mcssvi.HMCSSVI(random_seed=0)
        inf2.fit(n=2, progressbar=False, compile_kwargs={"mode": get_mode("JAX")})
    assert all(type(v.get_value(borrow=True)) is np.ndarray for v in inf2.store.symbolic.base.means)
    np.testing.assert_allclose(got.hist, ref.hist, rtol=1e-9)
    draws = got.sample(50, random_seed=1)
    assert np.all(np.isfinite(draws.posterior["f"].values))


def test_named_backends_skip_the_matrix_structure_rewrites():
    """A backend given by name compiles without PyTensor's matrix-structure rewrites
    (dense matrices by construction: the rewrites cost seconds and change nothing, the
    same-result check is ``test_jax_step_matches_the_python_step``); a mode the user
    passes is used as given."""
    from pytensor.compile.mode import get_mode

    from pymc_mcssvi.backend.modes import structure_rewrites

    names = set(structure_rewrites())
    assert names  # the set the exclusion is about is not empty
    for backend in ("jax", "numba"):
        mode = compile_module.named_backend_kwargs(backend, {})["mode"]
        assert names <= set(mode.provided_optimizer.exclude), backend
    user = get_mode("JAX")
    assert compile_module.named_backend_kwargs(None, {"mode": user})["mode"] is user


def test_steps_dominated_by_one_covariance_are_not_compiled():
    """The backend is chosen on the per-observation work: the factorizations of q's
    blocks run in LAPACK on every backend. Random-walk effects of 8 groups (249
    dimensions, one full covariance, 240 counts): 13.2 s with JAX's compilation
    against 5.1 s uncompiled."""
    rng = np.random.default_rng(4)
    G, T = 8, 30
    gi, ti = (a.ravel() for a in np.meshgrid(np.arange(G), np.arange(T), indexing="ij"))
    with pm.Model():
        a = pm.Normal("a", 0, 2)
        u = pm.Normal("u", 0, pm.HalfNormal("sg", 1), shape=G)
        z = pm.Normal("z", 0, 1, shape=(G, T))
        rw = pm.math.cumsum(pm.HalfNormal("s_rw", 0.3) * z, axis=1)
        pm.Poisson("y", pm.math.exp(a + u[gi] + rw[gi, ti]), observed=rng.poisson(2, G * T))
        inf = pymc_mcssvi.HMCSSVI(random_seed=1)
    assert inf.work_estimate() > compile_module.COMPILE_WORK_THRESHOLD
    assert inf.work_estimate(linear_algebra=False) < compile_module.COMPILE_WORK_THRESHOLD
    assert inf.choose_backend() == "python"


@pytest.mark.parametrize(
    ("groups", "backend"), [((5, 8, 12, 40, 600), "compiled"), ((60,), "python")]
)
def test_many_rows_of_quadrature_work_are_compiled(groups, backend, monkeypatch):
    """20,000 Bernoulli rows. With five grouping factors (4.7e7 estimated flops per
    iteration) the uncompiled fit took 95 s and JAX's 35 s, compilation included; it
    ran uncompiled below the old threshold of 1e8. With one factor of 60 groups (1.4e7,
    23 iterations) the uncompiled fit is the faster, 3.6 s against 5.9 s."""
    rng = np.random.default_rng(3)
    n = 20000
    x = rng.normal(size=n)
    with pm.Model():
        eta = pm.Normal("b0", 0, 2) + pm.Normal("b1", 0, 1) * x
        for j, size in enumerate(groups):
            idx = rng.integers(0, size, n)
            eta = eta + pm.HalfNormal(f"s{j}", 1) * pm.Normal(f"z{j}", 0, 1, shape=size)[idx]
        pm.Bernoulli("y", logit_p=eta, observed=rng.integers(0, 2, n))
        inf = pymc_mcssvi.HMCSSVI(random_seed=1)
    work = inf.work_estimate(linear_algebra=False)
    assert (work > compile_module.COMPILE_WORK_THRESHOLD) == (backend == "compiled")
    want = "jax" if backend == "compiled" and compile_module.jax_available() else "python"
    assert inf.choose_backend() == want
    # without JAX only numba compiles, and its cold compilation costs 40-190 s
    monkeypatch.setattr(compile_module, "jax_available", lambda: False)
    assert inf.choose_backend() == "python"


@pytest.mark.slow
def test_a_seeded_fit_is_reproducible_and_agrees_across_backends():
    """The same ``random_seed`` gives bit-identical fits and draws in one backend, and the
    Python, numba and JAX backends agree within 1e-8 (history, q's moments, draws) on a
    Poisson GLMM with a mean-field group scale (the profile q(h) after the fit)."""
    rng = np.random.default_rng(0)
    G, N = 8, 120
    g = rng.integers(0, G, N)
    x = rng.normal(size=N)
    y = rng.poisson(np.exp(0.3 + 0.5 * x + rng.normal(0, 0.5, G)[g]))

    def run(backend):
        with pm.Model():
            b = pm.Normal("b", 0, 1, shape=2)
            s = pm.HalfNormal("s", 1)
            z = pm.Normal("z", 0, 1, shape=G)
            pm.Poisson("y", pm.math.exp(b[0] + b[1] * x + s * z[g]), observed=y)
            approx = pm.fit(method="hmcssvi", random_seed=3, backend=backend, progressbar=False)
            post = approx.sample(100, random_seed=1).posterior
        return [
            approx.hist,
            approx.mean.eval(),
            approx.std.eval(),
            post["b"].values,
            post["s"].values,
        ]

    first = run("python")
    for a, b in zip(first, run("python"), strict=True):
        np.testing.assert_array_equal(a, b)
    for backend in ("numba", "jax"):
        for a, b in zip(first, run(backend), strict=True):
            assert a.shape == b.shape, backend
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-8, err_msg=backend)
