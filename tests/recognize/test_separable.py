"""Which Gaussian globals a general term couples only within rows (numerical probes)."""

import pymc as pm
import pytensor.tensor as pt
import pytest

from pymc_mcssvi.exceptions import UnsupportedModelError
from pymc_mcssvi.recognize import recognize
from pymc_mcssvi.recognize.model import MAX_GENERAL_DIM


def _topics(coupling=None, D=9, K=3):
    with pm.Model() as m:
        mu = pm.Normal("mu", 0, 1, shape=K)
        eta = pm.Normal("eta", mu, 1.0, shape=(D, K))
        lp = pm.math.logsumexp(eta, axis=-1).sum()
        if coupling is not None:
            lp = lp + coupling(eta)
        pm.Potential("lik", lp)
    return m


def test_documents_of_a_topic_model_are_separable():
    assert recognize(_topics()).general_rows == (1,)


@pytest.mark.parametrize(
    "coupling",
    [
        lambda eta: 0.1 * pt.tanh(eta[5, 0] * eta[6, 2]),  # one pair of rows only
        lambda eta: 0.1 * pt.sum(eta[1:] * eta[:-1]),  # neighbouring rows (a random walk)
        lambda eta: pm.math.logsumexp(eta, axis=0).sum(),  # softmax over documents
    ],
    ids=["one_pair", "neighbours", "across_rows"],
)
def test_a_coupling_of_any_two_rows_is_found(coupling):
    assert recognize(_topics(coupling)).general_rows == ()


def test_hessian_directions_above_the_limit_name_the_term():
    """Without separable rows the dense Hessian's directions are refused above the limit;
    with them, a model of the same size is accepted (one direction per column)."""
    D = MAX_GENERAL_DIM // 3 + 10
    tlm = recognize(_topics(D=D))
    assert tlm.general_rows == (1,) and tlm.dim > MAX_GENERAL_DIM
    with pytest.raises(UnsupportedModelError, match="'lik'.*couples their rows"):
        recognize(_topics(lambda eta: 0.1 * pt.sum(eta[1:] * eta[:-1]), D=D))
