"""The diagonal of a large coupled global's Hessian from the gradients (Stein's identity).

A general term that couples the entries of a global with a diagonal q took one
Hessian-vector product per entry (a topic model's ``K x V`` topic-word logits: refused
above 2,000). :func:`~pymc_mcssvi.recognize.model.stein_diagonal` globals take
``E[g(w) (w - m)] / S`` instead. On a Gaussian target, mean field has a closed form:
means equal the exact posterior means, precisions equal the diagonal of the exact
precision, which the fit must reach.
"""

import numpy as np
import pymc as pm
import pytest

import pymc_mcssvi  # noqa: F401
from pymc_mcssvi.recognize.model import (
    AUTO_GENERAL_DIRECTIONS,
    MAX_GENERAL_DIM,
    MIN_STEIN_DIAGONAL,
    recognize,
)


def _quadratic(n, seed=0, coupling=0.02):
    rng = np.random.default_rng(seed)
    B = rng.normal(0, coupling, (n, n))
    A = B @ B.T + np.diag(rng.uniform(0.5, 3.0, n))
    b = rng.normal(0, 2.0, n)
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=n)
        pm.Potential("quad", -0.5 * w @ A @ w + b @ w)
    P = A + np.eye(n)
    return m, np.linalg.solve(P, b), 1 / np.sqrt(np.diag(P))


def test_stein_diagonal_reaches_the_mean_field_optimum_of_a_gaussian():
    n = MIN_STEIN_DIAGONAL + 44
    m, mean, sd = _quadratic(n)
    tlm = recognize(m, cov="diag")
    assert tlm.general_diagonal == (0,)
    approx = pm.fit(method="hmcssvi", model=m, cov="diag", progressbar=False, random_seed=1)
    # the means are exact at the fixed point (the antithetic draws make E[g] exact);
    # the precisions carry the draws' cross moments of the other entries: small here
    np.testing.assert_allclose(approx.mean.eval(), mean, atol=1e-5)
    ratio = approx.std.eval() / sd
    assert np.all(np.abs(ratio - 1) < 0.03), (ratio.min(), ratio.max())


def test_below_the_size_the_products_are_kept():
    m, _, _ = _quadratic(MIN_STEIN_DIAGONAL - 6)
    assert recognize(m, cov="diag").general_diagonal == ()


def test_topic_logits_beyond_the_product_limit_get_a_diagonal_q():
    """A topic model whose ``K x V`` logits need more products than the limit: the
    automatic layout gives them a diagonal q with a note, instead of refusing."""
    D, K, V = 30, 4, MAX_GENERAL_DIM // 4 + 50
    rng = np.random.default_rng(0)
    counts = rng.poisson(0.05, (D, V))
    counts[:, 0] += 1
    with pm.Model() as m:
        eta = pm.Normal("eta", 0, 1, shape=(D, K - 1))
        lg = pm.Normal("logit_beta", 0, 1, shape=(K, V))
        theta = pm.math.softmax(pm.math.concatenate([eta, np.zeros((D, 1))], axis=1), axis=-1)
        p = theta @ pm.math.softmax(lg, axis=-1)
        pm.Multinomial("w", n=counts.sum(1), p=p, observed=counts)
    tlm = recognize(m)
    lb = [i for i, g in enumerate(tlm.gaussians) if g.name == "logit_beta"]
    assert tlm.general_diagonal == tuple(lb)
    assert any("q is diagonal for 'logit_beta'" in n for n in tlm.notes)
    # a structure the user chose is kept: then the limit applies
    with pytest.raises(pymc_mcssvi.exceptions.UnsupportedModelError, match="limited to"):
        recognize(m, cov={"logit_beta": "block"})


def _small_ctm(D, K, V, seed=0):
    counts = np.random.default_rng(seed).multinomial(30, np.ones(V) / V, size=D)
    with pm.Model() as m:
        mu = pm.Normal("mu", 0, 1, shape=K - 1)
        eta = pm.Normal("eta", mu, 1, shape=(D, K - 1))
        lg = pm.Normal("logit_beta", 0, 1, shape=(K, V))
        theta = pm.math.softmax(pm.math.concatenate([eta, np.zeros((D, 1))], axis=1), axis=-1)
        pm.Multinomial("w", n=30, p=theta @ pm.math.softmax(lg, axis=-1), observed=counts)
    return m


def test_the_automatic_layout_keeps_within_its_direction_budget():
    """Between :data:`AUTO_GENERAL_DIRECTIONS` and the limit, the automatic layout gives
    the topic logits a diagonal q (one product per entry costs an iteration each); the
    user's ``cov=`` keeps one full covariance up to the limit."""
    K, V = 3, 200
    D = 50
    assert AUTO_GENERAL_DIRECTIONS < K * V + D * (K - 1) <= MAX_GENERAL_DIM
    m = _small_ctm(D, K, V)
    tlm = recognize(m)
    names = [tlm.gaussians[i].name for i in tlm.general_diagonal]
    assert names == ["logit_beta"]
    assert recognize(m, cov="full").general_diagonal == ()


def test_a_join_of_the_logits_compiles_with_jax():
    """``softmax([eta, 0])``: the gradient of the join is a split whose positions,
    batched over draws and Hessian colors, JAX could not trace (the step fell back to
    numba's object mode: 75 s to compile a 50-document CTM). The sizes are read at a
    fixed point, so the split is static."""
    pytest.importorskip("jax")
    m = _small_ctm(50, 3, 200)
    approx = pm.fit(n=2, method="hmcssvi", model=m, progressbar=False, backend="jax")
    assert np.all(np.isfinite(approx.hist))


def test_equal_topics_are_left_at_the_start():
    """Topic-word logits at their prior mean make every topic equal (a saddle): the
    start moves them off it, seeded, as a matrix factorization's factors."""
    from pymc_mcssvi.pymc.start import initial_q

    D, K, V = 10, 3, MIN_STEIN_DIAGONAL
    counts = np.random.default_rng(0).multinomial(20, np.ones(V) / V, size=D)
    with pm.Model() as m:
        eta = pm.Normal("eta", 0, 1, shape=(D, K - 1))
        lg = pm.Normal("logit_beta", 0, 1, shape=(K, V))
        theta = pm.math.softmax(pm.math.concatenate([eta, np.zeros((D, 1))], axis=1), axis=-1)
        pm.Multinomial(
            "w", n=counts.sum(1), p=theta @ pm.math.softmax(lg, axis=-1), observed=counts
        )
    tlm = recognize(m, cov={"logit_beta": "diag"})
    (gid,) = tlm.general_diagonal

    def start(seed):
        q = initial_q(m, tlm, "precision", None, 1.0, None, seed)
        seg = next(s for s, seg in enumerate(tlm.segments) if gid in seg.members)
        return q.means[seg].reshape(K, V)

    lb = start(1)
    assert 0.2 < lb.std() < 0.4 and np.abs(lb[0] - lb[1]).max() > 0.1
    np.testing.assert_array_equal(lb, start(1))
    assert not np.allclose(lb, start(2))
