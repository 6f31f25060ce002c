"""Save, load and resume a fit without pickle (:mod:`pymc_mcssvi.pymc.persist`), and
pickle that works.

The saved state must give the same numbers: a loaded approximation the same
moments and seeded draws as the one saved, and a fit resumed from a file the same
history and q as a fit that was never interrupted.
"""

from __future__ import annotations

import pickle

import numpy as np
import pymc as pm
import pytest

import pymc_mcssvi
from pymc_mcssvi.pymc.persist import SavedFitError

RNG = np.random.default_rng(0)
G, N = 8, 120
GROUP = RNG.integers(0, G, N)
X = RNG.normal(size=N)
Y = RNG.poisson(np.exp(0.3 + 0.5 * X + RNG.normal(0, 0.5, G)[GROUP]))


def glmm(y=Y):
    """A Poisson GLMM: Gaussian globals, a group scale (mean-field q(h) with the
    profile after the fit), built again each time as a user would in a new session."""
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1, shape=2)
        s = pm.HalfNormal("s", 1)
        z = pm.Normal("z", 0, 1, shape=G)
        pm.Poisson("y", pm.math.exp(b[0] + b[1] * X + s * z[GROUP]), observed=y)
    return m


def _draws(approx, seed=1):
    post = approx.sample(40, random_seed=seed).posterior
    return {v: post[v].values for v in ("b", "s", "z")}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("fit") / "glmm.nc"
    with glmm():
        approx = pm.fit(method="hmcssvi", random_seed=3, progressbar=False)
    approx.save(path)
    return approx, path


def test_a_loaded_fit_has_the_same_moments_and_draws(saved):
    approx, path = saved
    loaded = pymc_mcssvi.load(path, glmm())
    assert isinstance(loaded, pymc_mcssvi.StructuredApproximation)
    np.testing.assert_array_equal(loaded.mean.eval(), approx.mean.eval())
    np.testing.assert_array_equal(loaded.std.eval(), approx.std.eval())
    np.testing.assert_array_equal(loaded.hist, approx.hist)
    assert loaded.converged is approx.converged is True
    a, b = _draws(approx), _draws(loaded)
    for v in a:
        np.testing.assert_array_equal(a[v], b[v])


@pytest.mark.parametrize("via", ["path", "approximation"])
def test_a_resumed_fit_continues_the_original_trace(tmp_path, via):
    """5 iterations, saved, then 7 more in a new model object: the same history, q and
    draws as 12 iterations in one go (to 1e-10; here bit for bit)."""
    with glmm():
        whole = pm.fit(n=12, method="hmcssvi", random_seed=3, progressbar=False)
    with glmm():
        first = pm.fit(n=5, method="hmcssvi", random_seed=3, progressbar=False)
    start = first
    if via == "path":
        start = tmp_path / "first.nc"
        first.save(start)
    with glmm():
        rest = pm.fit(n=7, method="hmcssvi", start=start, progressbar=False)
    assert len(rest.hist) == 12
    np.testing.assert_allclose(rest.hist, whole.hist, rtol=0, atol=1e-10)
    np.testing.assert_allclose(rest.mean.eval(), whole.mean.eval(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(rest.std.eval(), whole.std.eval(), rtol=0, atol=1e-10)
    a, b = _draws(whole), _draws(rest)
    for v in a:
        np.testing.assert_allclose(a[v], b[v], rtol=0, atol=1e-10)
    # resuming from an approximation leaves it as it was
    assert len(first.hist) == 5


def test_a_fit_of_other_data_or_another_model_is_refused(saved):
    _, path = saved
    other = Y.copy()
    other[0] += 1
    with pytest.raises(SavedFitError, match=r"observed y: its data differ"):
        pymc_mcssvi.load(path, glmm(other))
    with pm.Model() as m:
        pm.Normal("b", 0, 1, shape=3)
        pm.Normal("y", 0, 1, observed=np.zeros(3))
    with pytest.raises(SavedFitError, match=r"free b: it differs.*free s is not in this model"):
        pymc_mcssvi.load(path, m)


def test_resuming_with_another_method_or_other_options_is_refused(saved):
    _, path = saved
    with glmm():
        with pytest.raises(ValueError, match="method='hmcssvi'"):
            pm.fit(n=2, method="mcssvi", start=path, progressbar=False)
        with pytest.raises(TypeError, match="drop hyper"):
            pm.fit(n=2, method="hmcssvi", start=path, hyper="point", progressbar=False)


def test_files_that_are_not_saved_fits_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no saved fit"):
        pymc_mcssvi.load(tmp_path / "missing.nc", glmm())
    import xarray as xr

    other = tmp_path / "other.nc"
    xr.Dataset({"a": ("x", np.arange(3.0))}).to_netcdf(other, engine="h5netcdf")
    with pytest.raises(SavedFitError, match="not a saved pymc-mcssvi fit"):
        pymc_mcssvi.load(other, glmm())


def test_standard_pickle_round_trips_and_keeps_the_draws(saved):
    """``pickle.dumps(approx)`` raised ``AttributeError: 'functools.partial' object has
    no attribute '__name__'`` (a PyMC model pickles with cloudpickle only)."""
    approx, _ = saved
    loaded = pickle.loads(pickle.dumps(approx))
    assert loaded.inference is None
    a, b = _draws(approx), _draws(loaded)
    for v in a:
        np.testing.assert_array_equal(a[v], b[v])
    with pytest.raises(ValueError, match="save the approximation that pm.fit returned"):
        loaded.save("never-written.nc")


def test_a_minibatch_fit_keeps_its_iterate_average(tmp_path):
    """A ``pm.Minibatch`` fit's q is the iterates' average: the average (and its
    windows' locations, which the stopping rule reads) is saved with the state."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=2000)
    y = 1.0 - 0.5 * x + rng.normal(size=2000)

    def build():
        xm, ym = pm.Minibatch(x, y, batch_size=200)
        with pm.Model() as m:
            w = pm.Normal("w", 0, 1, shape=2)
            pm.Normal("y", w[0] + w[1] * xm, 1.0, observed=ym, total_size=2000)
        return m

    with build():
        approx = pm.fit(n=60, method="hmcssvi", random_seed=0, progressbar=False)
    path = tmp_path / "mb.nc"
    approx.save(path)
    loaded = pymc_mcssvi.load(path, build())
    np.testing.assert_array_equal(loaded.mean.eval(), approx.mean.eval())
    before, after = approx.inference._average, loaded.inference._average
    assert after.t == before.t == 60
    for (P0, h0), (P1, h1) in zip(before.blocks, after.blocks, strict=True):
        np.testing.assert_array_equal(P0, P1)
        np.testing.assert_array_equal(h0, h1)
    assert len(loaded.inference._average_locations) == len(approx.inference._average_locations)


def test_draws_write_to_netcdf(saved, tmp_path):
    """ArviZ's ``to_netcdf`` needs h5netcdf (now a dependency)."""
    approx, _ = saved
    idata = approx.sample(20, random_seed=0)
    idata.to_netcdf(tmp_path / "draws.nc")
    assert (tmp_path / "draws.nc").stat().st_size > 0
