"""q(h) from the profile on a grid (``pymc_mcssvi.posterior.profile_grid``)."""

import numpy as np
import pymc as pm
import pytest

import pymc_mcssvi
from pymc_mcssvi.posterior import hyper_marginal
from pymc_mcssvi.posterior.settings import SETTINGS
from pymc_mcssvi.pymc import inference
from tests.posterior.test_marginal import _exact_scale_posterior, _lmm, _lmm_model


def _exact_scale_marginal(g, x, y, G):
    """Mean and 5% quantile of the exact posterior of ``sd_a``
    (:func:`~tests.posterior.test_marginal._exact_scale_posterior`), on a grid reaching
    far into its left tail."""
    ha = np.linspace(np.log(0.0005), np.log(2.0), 200)
    p = _exact_scale_posterior(g, x, y, G, ha)
    return float(p @ np.exp(ha)), float(np.exp(np.interp(0.05, np.cumsum(p), ha)))


@pytest.mark.slow
@pytest.mark.parametrize("centered", [True, False], ids=["centered", "noncentered"])
def test_group_scale_left_tail_against_the_exact_marginal(centered, monkeypatch):
    """Gaussian LMM, 10 groups, a small group scale: the exact posterior of ``sd_a`` has a
    long left tail (its density in ``log sd_a`` falls as the HalfNormal prior's,
    ``exp(log sd_a)``). The gridded q(h) follows it: 5% quantile within 10% of the exact
    one, mean within 2% (measured: +2-3% and -0.5%). The axis marginal, whose tails
    decay as a Gaussian's beyond 4 sds, put the 5% quantile 35-82% high."""
    rng = np.random.default_rng(0)
    g, x, y = _lmm(rng, G=10)
    mean, q05 = _exact_scale_marginal(g, x, y, 10)
    got = {}
    for grid in (True, False):
        if not grid:
            monkeypatch.setattr(inference, "MAX_GRID_HYPERS", 0)
        with _lmm_model(g, x, y, 10, centered):
            inf = pymc_mcssvi.HMCSSVI(random_seed=1)
            approx = inf.fit(progressbar=False)
        assert (inf._grid is not None and int(inf._grid[0].get_value()) == 1) == grid
        d = approx.sample(20_000, random_seed=2).posterior["sd_a"].values.ravel()
        got[grid] = (d.mean(), np.quantile(d, 0.05))
        # the reported moments are the draws' (unconstrained space)
        mu = np.asarray(approx.mean.eval())[approx.ordering["sd_a_log__"][1]][0]
        assert abs(mu - np.mean(np.log(d))) < 0.02
    assert abs(got[True][1] / q05 - 1) < 0.10, (got, q05)
    assert abs(got[True][0] / mean - 1) < 0.02, (got, mean)
    assert got[False][1] / q05 - 1 > 0.25, (got, q05)  # what the grid fixes


def test_grid_nodes_serve_draws_when_refits_are_not_affordable(monkeypatch):
    """With re-fits per draw not affordable, the draws of the Gaussian globals come from
    q(w | h) at the grid's nodes, interpolated between them. On the Gaussian LMM their
    mean and sd match those of exact re-fits at every draw (same ``h`` draws: same seed)
    to within Monte Carlo error."""
    rng = np.random.default_rng(1)
    g, x, y = _lmm(rng, G=10)
    with _lmm_model(g, x, y, 10, centered=False):
        approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    exact = approx.sample(8000, random_seed=2).posterior["a"].values.reshape(8000, -1)
    monkeypatch.setattr(SETTINGS, "exact_conditional_work", 0.0)
    nodes = approx.sample(8000, random_seed=2).posterior["a"].values.reshape(8000, -1)
    z = (nodes.mean(0) - exact.mean(0)) / exact.std(0)
    ratio = nodes.std(0) / exact.std(0)
    assert np.all(np.abs(z) < 0.06), np.round(z, 3)
    assert np.all(np.abs(ratio - 1) < 0.05), np.round(ratio, 3)


def test_grid_affordability_is_judged_without_compiling_the_batched_refit(monkeypatch):
    """The grid's re-fits are budgeted from the memory the profile's own step (one
    re-fit at one point, already compiled) held: a grid that is not affordable does not
    compile the batched re-fit to find out. That memory is the batched step's per draw
    plus the data, which both hold once (measured 1.10-1.18x on the GLMM benchmark)."""
    from pymc_mcssvi.posterior import conditional

    rng = np.random.default_rng(0)
    g, x, y = _lmm(rng, G=10)
    with _lmm_model(g, x, y, 10, centered=False):
        inf = pymc_mcssvi.HMCSSVI(random_seed=1)
        inf.fit(progressbar=False)
    cg = inf._posterior._conditional_globals
    assert int(inf._grid[0].get_value()) == 1 and cg._fn is not None
    single = conditional.step_measure(inf._posterior._profile_fn.fn)[0]
    mu = inf.store.symbolic.hyper.base_mean.get_value()[0]
    shapes = inf.kernel.hypers.spec.shapes
    per_draw = cg.bytes_per_draw(hyper_marginal.by_variable(np.tile(mu, (2, 1)), shapes))
    assert per_draw <= single <= 1.5 * per_draw, (single, per_draw)
    monkeypatch.setattr(SETTINGS, "exact_conditional_bytes", 1.0)
    with _lmm_model(g, x, y, 10, centered=False):
        inf = pymc_mcssvi.HMCSSVI(random_seed=1)
        inf.fit(progressbar=False)
    assert int(inf._grid[0].get_value()) == 0 and inf._posterior._conditional_globals._fn is None


def test_a_batched_refit_that_fails_keeps_the_axis_marginal(monkeypatch):
    """Measuring the batched re-fit (where the profile's step cannot stand in for it)
    compiles it: if that fails, the fit still ends, with the axis marginal."""
    from pymc_mcssvi.posterior import conditional

    def broken(self):
        raise RuntimeError("cannot vectorize")

    monkeypatch.setattr(hyper_marginal, "step_measure", lambda fn: None)
    monkeypatch.setattr(conditional.ConditionalGlobals, "_compile", broken)
    rng = np.random.default_rng(0)
    g, x, y = _lmm(rng, G=10)
    with _lmm_model(g, x, y, 10, centered=False):
        inf = pymc_mcssvi.HMCSSVI(random_seed=1)
        approx = inf.fit(progressbar=False)
    assert approx.converged and int(inf._grid[0].get_value()) == 0
    assert int(inf._marginal[0].get_value()) == 1  # the axis marginal
