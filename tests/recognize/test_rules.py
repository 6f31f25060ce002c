"""The recognizer's rules (:mod:`pymc_mcssvi.recognize.rules`): the first rule that
claims an observed variable decides its term, so the order is the preference.

Each test builds the :class:`Observed` / :class:`Globals` records the recognizer builds
and checks which rule claims, and what happens when a rule is taken out.
"""

from __future__ import annotations

import numpy as np
import pymc as pm
import pytest
from pymc.logprob.utils import CheckParameterValue
from pytensor.graph.traversal import ancestors

from pymc_mcssvi.exceptions import UnsupportedModelError
from pymc_mcssvi.recognize import rules as R
from pymc_mcssvi.recognize.graph import remove_checks
from pymc_mcssvi.recognize.roles import assign_roles


def _records(model, name):
    """The :class:`Observed` record of ``name`` and the model's :class:`Globals`."""
    roles = assign_roles(model)
    point = {v: roles.initial_point[v.name] for v in model.value_vars}
    gvalues = {g.value: i for i, g in enumerate(roles.gaussians)}
    gshapes = {g.value: g.shape for g in roles.gaussians}
    obs = model[name]
    return R.Observed(obs, roles.observed_logps[obs]), R.Globals(model, gvalues, gshapes, point)


def _glm():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 2))
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Bernoulli("y", logit_p=X @ b, observed=rng.integers(0, 2, 40))
    return m


def _factorization():
    rng = np.random.default_rng(1)
    r, c = rng.integers(0, 6, 50), rng.integers(0, 5, 50)
    with pm.Model() as m:
        U = pm.Normal("U", 0, 1, shape=(6, 2))
        V = pm.Normal("V", 0, 1, shape=(5, 2))
        pm.Normal("y", (U[r] * V[c]).sum(-1), 1.0, observed=rng.normal(size=50))
    return m


def test_each_form_is_claimed_by_its_own_rule():
    """A GLM is claimed by ``affine_predictor`` and a factorization by ``bilinear``: no
    earlier rule claims them, and the claim carries exactly one term."""
    obs, g = _records(_glm(), "y")
    claim = R.classify(obs, g)
    assert claim.predictor is not None
    assert (claim.pair, claim.bilinear, claim.general) == (None, None, None)
    assert claim.form == "dense affine"

    obs, g = _records(_factorization(), "y")
    claim = R.classify(obs, g)
    assert claim.bilinear is not None and claim.predictor is None
    assert claim.form == "bilinear"
    assert len(claim.row_sources) == 2


def test_taking_a_rule_out_hands_the_variable_to_the_next_one():
    """Without ``affine_predictor`` a GLM falls through to the Monte Carlo path; without
    ``bilinear`` a factorization does too. ``general`` always claims."""
    without = tuple(r for r in R.RULES if r is not R.affine_predictor)
    claim = R.classify(*_records(_glm(), "y"), rules=without)
    assert claim.general is not None and claim.predictor is None
    assert claim.form == "general"

    without = tuple(r for r in R.RULES if r is not R.bilinear)
    claim = R.classify(*_records(_factorization(), "y"), rules=without)
    assert claim.general is not None and claim.bilinear is None


def test_a_likelihood_free_of_the_globals_is_a_constant_before_any_form():
    """``constant`` comes first: a likelihood that does not read a Gaussian global is added
    as is, even though ``affine_predictor`` would also claim it (an affine predictor with
    no global)."""
    rng = np.random.default_rng(2)
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1)
        s = pm.HalfNormal("s", 1)
        pm.Normal("y", b, 1, observed=rng.normal(size=5))
        pm.Normal("z", 0, s, observed=rng.normal(size=5))
    obs, g = _records(m, "z")
    claim = R.classify(obs, g)
    assert claim.form.startswith("constant")
    assert [c.name for c in claim.constants] == ["z"]
    assert claim.predictor is None and claim.general is None


def test_an_out_of_range_index_is_refused_before_any_form():
    """``gather_indices_in_range`` never claims but refuses an index past a global's rows
    before a form (and its graph rewrites) sees it."""
    with pm.Model() as m:
        a = pm.Normal("a", 0, 1, shape=3)
        pm.Normal("y", a[np.array([0, 1, 5])], 1.0, observed=np.zeros(3))
    obs, g = _records(m, "y")
    with pytest.raises(UnsupportedModelError, match="'y'"):
        R.classify(obs, g)


def test_a_custom_rule_list_claims_in_its_own_order():
    """A rule placed first wins; a list whose last rule can decline is a programming error."""

    def everything_general(obs, g):
        return R.Claim("custom", general=R.GeneralTerm(obs.name, obs.logp, "custom"))

    claim = R.classify(*_records(_glm(), "y"), rules=(everything_general, *R.RULES))
    assert claim.form == "custom"
    with pytest.raises(AssertionError, match="must always claim"):
        R.classify(*_records(_glm(), "y"), rules=(R.constant,))


def test_the_monte_carlo_term_has_no_raising_parameter_check():
    """A general term's log density turns PyMC's parameter checks into -inf: inside a
    chunked step's scan the compile mode's rewrite does not reach them, and a candidate
    q(h) with a scale at 0 raised ``ParameterValueError`` instead of being rejected."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=30)
    with pm.Model() as m:
        w = pm.Dirichlet("w", a=np.ones(2))
        b = pm.Normal("b", 0, 2, shape=2)
        sigma = pm.HalfNormal("sigma", 1, shape=2)
        mu = pm.math.stack([b[0] * x, b[1] * x], axis=-1)
        pm.NormalMixture("y", w=w, mu=mu, sigma=sigma, observed=x)
    obs, g = _records(m, "y")
    checks = [
        v
        for v in ancestors([obs.logp])
        if v.owner is not None and isinstance(v.owner.op, CheckParameterValue)
    ]
    assert checks, "the model's log density should hold a check for this test to mean anything"
    claim = R.classify(obs, g)
    assert claim.general is not None
    left = [
        v
        for v in ancestors([claim.general.logp])
        if v.owner is not None and isinstance(v.owner.op, CheckParameterValue)
    ]
    assert not left
    # and where a check fails the term is -inf, not an exception or NaN
    inputs = {v: np.asarray(p) for v, p in g.point.items()}
    sig = m.rvs_to_values[m["sigma"]]
    inputs[sig] = np.array([np.log(0.5), -np.inf])  # log-transformed: sigma = (0.5, 0)
    lp = claim.general.logp.sum().eval(
        {k: v for k, v in inputs.items() if k in set(ancestors([claim.general.logp]))}
    )
    assert lp == -np.inf
    assert remove_checks(claim.general.logp) is claim.general.logp
