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
    """Without separable rows the dense Hessian's directions are refused above the limit
    when the user chose the structure; the automatic layout gives the coupled global a
    diagonal q (its Hessian diagonal from the gradients) and says so. With separable
    rows, a model of the same size is accepted as is (one direction per column)."""
    D = MAX_GENERAL_DIM // 3 + 10
    tlm = recognize(_topics(D=D))
    assert tlm.general_rows == (1,) and tlm.dim > MAX_GENERAL_DIM
    assert tlm.general_diagonal == ()
    walk = _topics(lambda eta: 0.1 * pt.sum(eta[1:] * eta[:-1]), D=D)
    with pytest.raises(UnsupportedModelError, match="'lik'.*couples their rows"):
        recognize(walk, cov={"eta": "block"})
    tlm = recognize(walk)
    assert tlm.general_diagonal == (1,)
    assert any("q is diagonal for 'eta'" in n for n in tlm.notes)


def test_group_effects_of_a_non_affine_likelihood_are_separable():
    """Vectors of group effects are rows of one entry: ``a[g]``, ``log_alpha[g]`` and
    ``c[g]`` in a zero-inflated negative binomial (a general term: its three parameters
    depend on Gaussian globals) form one separable set; fixed effects with as many
    entries as there are groups couple and are left out (the set is tried again without
    them)."""
    import numpy as np

    rng = np.random.default_rng(3)
    G, N = 3, 60
    g = rng.integers(0, G, N)
    X = rng.normal(size=(N, G))
    with pm.Model() as m:
        a = pm.Normal("a", 0, 1, shape=G)
        log_alpha = pm.Normal("log_alpha", 1, 0.5, shape=G)
        b = pm.Normal("b", 0, 1, shape=G)
        c = pm.Normal("c", -1, 0.5, shape=G)
        pm.ZeroInflatedNegativeBinomial(
            "y",
            psi=pm.math.sigmoid(c[g]),
            mu=pm.math.exp(a[g] + X @ b),
            alpha=pm.math.exp(log_alpha)[g],
            observed=rng.poisson(2.0, N),
        )
    tlm = recognize(m)
    assert tlm.observed["y"] == "general"
    assert [tlm.gaussians[i].name for i in tlm.general_rows] == ["a", "log_alpha", "c"]
