"""The fault-injection matrix (:mod:`tests.robustness.cases`): every bad input ends in
a clean error that names the culprit or in a fit with finite results
(:mod:`tests.robustness.classify`). Most cases are ``slow``; the fast suite runs a
representative subset (:data:`~tests.robustness.cases.FAST`). The counts are printed
in the session summary (``conftest.py``) and by ``python -m tests.robustness.report``.
"""

import pytest

import pymc_mcssvi
from tests.robustness.cases import FAST, Case, all_cases
from tests.robustness.classify import BAD, classify_error, names_culprit, results_problem, run

CASES = all_cases()


def _param(case):
    marks = () if case.id in FAST else (pytest.mark.slow,)
    return pytest.param(case, id=case.id, marks=marks)


def test_the_matrix_is_large_and_covers_every_family():
    assert len(CASES) >= 200
    assert {c.family for c in CASES} >= {
        "bernoulli",
        "poisson",
        "gaussian",
        "ordinal",
        "glmm",
        "mf",
        "topic",
        "minibatch",
    }
    assert set(FAST) <= {c.id for c in CASES}


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_input(case, record_property):
    outcome = run(case)
    record_property("fault_outcome", outcome.kind)
    record_property("fault_warned", outcome.warned)
    assert outcome.kind not in BAD, str(outcome)


# ------------------------------------------------------------ the classifier itself
def _case(build, names=("y",), **kw):
    return Case("self-test", "none", build, {"method": "hmcssvi", "n": 2}, names, **kw)


def test_classifier_calls_an_exception_from_numpy_a_raw_traceback():
    import numpy as np

    def build():
        return np.zeros(2).reshape(3)  # raises inside NumPy

    assert run(_case(build)).kind == "refused by PyMC"  # before pm.fit: not the plugin's
    try:
        build()
    except ValueError as err:
        assert classify_error(_case(build), err).kind == "raw traceback"
    ours = pymc_mcssvi.UnsupportedModelError("y", "bad")
    try:
        raise ours
    except ValueError as err:  # raised here, in the tests: not the package's code
        assert classify_error(_case(build), err).kind == "raw traceback"


def test_classifier_wants_the_name_quoted():
    assert names_culprit("Variable 'y': its data", ["y"])
    assert names_culprit("Variable 'y_observed': its data", ["y"])
    assert not names_culprit("the observed data contain NaN (every y)", ["y"])
    assert not names_culprit("n must be positive", ["n"])
    assert names_culprit("n must be positive", ["n"], keyword=True)
    assert names_culprit("unexpected arguments: obj_n_mc. The", ["obj_n_mc"], keyword=True)
    assert not names_culprit("an n-dimensional array", ["n"], keyword=True)


def test_classifier_finds_a_silent_nan():
    """A fit with finite results is a good outcome; the same approximation with its
    mean set to NaN by hand is caught."""
    import numpy as np
    import pymc as pm

    import pymc_mcssvi  # noqa: F401

    x = np.linspace(-1, 1, 20)

    def build():
        with pm.Model() as m:
            b = pm.Normal("b", 0, 1)
            pm.Normal("y", b * x, 1.0, observed=x)
        return m

    assert run(_case(build)).kind == "fit"
    assert run(_case(build, must_raise=True)).kind == "accepted"
    with build():
        approx = pm.fit(method="hmcssvi", n=3, tol=None, progressbar=False)
    assert results_problem(approx) == ""
    means = approx.inference.store.symbolic.base.means[0]
    means.set_value(np.full_like(means.get_value(), np.nan))
    assert "mean" in results_problem(approx)
