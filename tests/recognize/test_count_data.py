"""Bad documents get an error naming the likelihood, before any compilation."""

import numpy as np
import pymc as pm
import pytensor.tensor as pt
import pytest

from pymc_mcssvi.exceptions import UnsupportedModelError
from pymc_mcssvi.recognize import recognize

D, V, K = 12, 20, 3


def _counts():
    return np.random.default_rng(0).multinomial(30, np.ones(V) / V, size=D)


def _collapsed(counts, n=None):
    beta = np.random.default_rng(1).dirichlet(np.ones(V), K)
    with pm.Model() as m:
        eta = pm.Normal("eta", 0, 1, shape=(D, K - 1))
        theta = pm.math.softmax(pt.concatenate([eta, pt.zeros((D, 1))], axis=1), axis=-1)
        n = counts.sum(1) if n is None else n
        pm.Multinomial("words", n=n, p=theta @ beta, observed=counts)
    return m


def test_good_counts_pass():
    recognize(_collapsed(_counts()))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c.__setitem__((2, 3), -1), "non-negative whole numbers; -1 at \\(2, 3\\)"),
        (lambda c: c.__setitem__(4, 0), "1 row\\(s\\) have no counts \\(rows 4\\)"),
    ],
    ids=["negative", "empty_document"],
)
def test_bad_counts_name_the_variable(edit, match):
    c = _counts()
    edit(c)
    with pytest.raises(UnsupportedModelError, match="'words'.*" + match):
        recognize(_collapsed(c, n=np.maximum(c.sum(1), 1)))


def test_n_that_is_not_the_row_sums():
    c = _counts()
    with pytest.raises(UnsupportedModelError, match="'words'.*its n \\(31 at row 0\\).*n=counts"):
        recognize(_collapsed(c, n=c.sum(1) + 1))


def test_word_index_beyond_the_vocabulary():
    rng = np.random.default_rng(2)
    doc = rng.integers(0, D, 200)
    words = rng.integers(0, V, 200)
    words[7] = V + 3
    beta = rng.dirichlet(np.ones(V), K)
    with pm.Model() as m:
        eta = pm.Normal("eta", 0, 1, shape=(D, K - 1))
        theta = pm.math.softmax(pt.concatenate([eta, pt.zeros((D, 1))], axis=1), axis=-1)
        pm.Categorical("w", p=(theta @ beta)[doc], observed=words)
    with pytest.raises(
        UnsupportedModelError, match="'w'.*23 at \\(7,\\) is not a category index in 0..19"
    ):
        recognize(m)
