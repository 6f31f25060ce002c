"""``pm.fit`` with the plugin's methods (:mod:`pymc_mcssvi.pymc.registration`).

Checks
------
* importing :mod:`pymc_mcssvi` installs the wrapper as ``pm.fit`` and makes it take
  ``"mcssvi"``, ``"hmcssvi"`` and ``"sdsvi"`` in any case, each running its class
  (the fits reach the closed-form posterior of a Gaussian regression);
* options of the inference class passed directly or in ``inf_kwargs`` (same
  result as constructing the class with them, another than without), and the
  ``TypeError`` when one is given both ways;
* ``random_seed``, ``start`` and ``start_sigma`` reach the inference (the same
  seed gives identical histories, another seed another one; the first iterate is
  the given start), and ``pm.fit``'s other arguments reach ``fit``;
* an inference instance as ``method`` (``n`` left out: run to convergence), the
  class as ``method`` (``TypeError`` saying what to pass), an unknown name
  (``KeyError`` with a "did you mean" hint);
* PyMC's own methods still go to PyMC, with PyMC's default ``n`` of 10,000.
"""

import numpy as np
import pymc as pm
import pymc.variational as pmv
import pymc.variational.inference as pmvi
import pytest

import pymc_mcssvi
from pymc_mcssvi import HMCSSVI, MCSSVI, SDSVI, StructuredApproximation
from pymc_mcssvi.pymc.registration import METHODS
from pymc_mcssvi.pymc.registration import fit as registered_fit

RNG = np.random.default_rng(7)
X = np.c_[np.ones(25), RNG.normal(size=25)]
Y_GAUSS = X @ [0.5, -1.0] + RNG.normal(size=25)
Y_COUNT = RNG.poisson(np.exp(X @ [0.3, 0.5]))


def gaussian_model():
    """``y ~ N(X b, 1)``, ``b ~ N(0, I)``: posterior ``N((I + X'X)^-1 X'y, (I + X'X)^-1)``."""
    with pm.Model() as model:
        b = pm.Normal("b", 0.0, 1.0, shape=2)
        pm.Normal("y", pm.math.dot(X, b), 1.0, observed=Y_GAUSS)
    return model


def poisson_model():
    with pm.Model() as model:
        b = pm.Normal("b", 0.0, 1.0, shape=2)
        pm.Poisson("y", pm.math.exp(pm.math.dot(X, b)), observed=Y_COUNT)
    return model


def gaussian_posterior():
    cov = np.linalg.inv(np.eye(2) + X.T @ X)
    return cov @ X.T @ Y_GAUSS, np.sqrt(np.diag(cov))


def test_import_installs_the_wrapper():
    assert pm.fit is pmv.fit is pmvi.fit is registered_fit
    assert {"mcssvi": MCSSVI, "hmcssvi": HMCSSVI, "sdsvi": SDSVI}.items() <= METHODS.items()


@pytest.mark.parametrize(
    ("name", "cls", "atol"),
    [("MCSSVI", MCSSVI, 1e-8), ("hmcssvi", HMCSSVI, 1e-6), ("SdSvi", SDSVI, 2e-3)],
)
def test_method_names_run_their_class(name, cls, atol, monkeypatch):
    ran = []
    fit = cls.fit

    def spy(self, n=None, **kwargs):
        ran.append((type(self), n))
        return fit(self, n, **kwargs)

    monkeypatch.setattr(cls, "fit", spy)
    model = gaussian_model()
    # outside the model context: the model is passed
    approx = pm.fit(method=name, model=model, progressbar=False)
    assert ran == [(cls, None)]  # n left at None: run until converged
    assert isinstance(approx, StructuredApproximation)
    assert approx.converged
    mean, sd = gaussian_posterior()
    np.testing.assert_allclose(approx.mean.eval(), mean, atol=atol)
    np.testing.assert_allclose(approx.std.eval(), sd, atol=atol)


def test_options_and_start_directly_or_in_inf_kwargs():
    start = {"b": np.array([0.7, -0.2])}
    first = []

    def record_first(approx, losses, i):
        if i == 1:
            first.append((approx.mean.eval(), approx.std.eval()))

    with poisson_model():
        direct = pm.fit(
            n=3,
            method="mcssvi",
            schedule=0.3,
            start=start,
            start_sigma=0.3,
            callbacks=[record_first],
            progressbar=False,
        ).hist
        nested = pm.fit(
            n=3,
            method="mcssvi",
            inf_kwargs={"schedule": 0.3, "start": start, "start_sigma": 0.3},
            progressbar=False,
        ).hist
        default_schedule = pm.fit(
            n=3, method="mcssvi", start=start, start_sigma=0.3, progressbar=False
        ).hist
    np.testing.assert_array_equal(direct, nested)
    assert len(direct) == 3 and np.all(np.isfinite(direct))
    # the first iteration evaluates (and accepts) the given start ...
    ((mean, sd),) = first
    np.testing.assert_allclose(mean, start["b"], rtol=1e-14)
    np.testing.assert_allclose(sd, [0.3, 0.3], rtol=1e-14)
    assert direct[0] == default_schedule[0]
    # ... and the schedule had an effect: a constant step of 0.3 is not the adaptive one
    assert not np.allclose(direct[1:], default_schedule[1:])


def test_option_given_both_ways_is_a_type_error():
    with poisson_model(), pytest.raises(TypeError, match="'schedule' given both directly"):
        pm.fit(n=2, method="mcssvi", schedule=0.3, inf_kwargs={"schedule": 0.5})


def test_random_seed_and_fit_arguments_are_forwarded():
    # Fresh Monte Carlo draws every iteration: the seed decides the path. max_iter and
    # tol are fit()'s arguments: the runs stop at max_iter without converging.
    opts = {"estimator": "mc", "fixed_draws": False, "n_draws": 16}
    with poisson_model():
        runs = [
            pm.fit(
                method="hmcssvi",
                random_seed=seed,
                inf_kwargs=opts,
                max_iter=3,
                tol=1e-12,
                progressbar=False,
            )
            for seed in (11, 11, 12)
        ]
    a, b, c = (r.hist for r in runs)
    assert len(a) == 3 and runs[0].converged is False
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(runs[0].mean.eval(), runs[1].mean.eval())
    assert np.all(np.isfinite(a)) and not np.allclose(a, c)


def test_instance_as_method():
    with gaussian_model():
        inference = MCSSVI(schedule="adaptive")
        approx = pm.fit(method=inference, progressbar=False)
    assert approx is inference.approx
    assert approx.converged  # n=None: to convergence
    np.testing.assert_allclose(approx.mean.eval(), gaussian_posterior()[0], atol=1e-8)


@pytest.mark.parametrize(("cls", "name"), [(MCSSVI, "mcssvi"), (HMCSSVI, "hmcssvi")])
def test_class_as_method_says_what_to_pass(cls, name):
    with gaussian_model():
        with pytest.raises(TypeError, match=rf"is a class: pass an instance.*method={name!r}"):
            pm.fit(method=cls)
        # also StructuredVI itself is a class, not a method
        with pytest.raises(TypeError, match="is a class"):
            pm.fit(method=pymc_mcssvi.StructuredVI)


@pytest.mark.parametrize(
    ("method", "hint"),
    [
        ("mcsvi", "mcssvi"),
        ("H-MCSSVI", "hmcssvi"),
        ("adavi", "advi"),
        ("fullrank-advi", "fullrank_advi"),
    ],
)
def test_unknown_method_is_a_key_error_with_a_hint(method, hint):
    with gaussian_model():
        with pytest.raises(KeyError) as err:
            pm.fit(method=method)
    msg = str(err.value)
    assert f"unknown method {method!r}" in msg
    assert f"did you mean {hint!r}" in msg
    assert "mcssvi" in msg and "advi" in msg  # the choices are listed


def test_unknown_method_far_from_any_name_has_no_hint():
    with gaussian_model(), pytest.raises(KeyError) as err:
        pm.fit(method="metropolis")
    assert "did you mean" not in str(err.value)


def test_pymc_methods_go_to_pymc_with_its_default_n(monkeypatch):
    with gaussian_model():
        approx = pm.fit(n=20, method="ADVI", random_seed=3, progressbar=False)
    assert isinstance(approx, pm.MeanField)
    assert len(approx.hist) == 20 and np.all(np.isfinite(approx.hist))

    seen = []
    monkeypatch.setattr(pm.ADVI, "fit", lambda self, n, **kw: seen.append(n) or "fitted")
    with gaussian_model():
        assert pm.fit(method="advi") == "fitted"
    assert seen == [10_000]
