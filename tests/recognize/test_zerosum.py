"""``pm.ZeroSumNormal`` effects: Gaussian globals in their unconstrained space."""

import numpy as np
import pymc as pm
import pytensor.tensor as pt
import pytest
from pymc.distributions.transforms import ZeroSumTransform
from scipy import stats

import pymc_mcssvi
from pymc_mcssvi.recognize import recognize
from pymc_mcssvi.recognize.zerosum import LinearZeroSumTransform, zerosum_as_linear


@pytest.mark.parametrize(
    "axes, shape",
    [((-1,), (6,)), ((-1,), (3, 4)), ((-2, -1), (3, 4))],
    ids=["1d", "batch", "2axes"],
)
def test_linear_backward_map_is_pymcs(axes, shape, rng):
    v = rng.normal(size=shape)
    ours = LinearZeroSumTransform(axes, shape).backward(pt.as_tensor(v)).eval()
    theirs = ZeroSumTransform(axes).backward(pt.as_tensor(v)).eval()
    np.testing.assert_allclose(ours, theirs, atol=1e-14)
    for ax in axes:
        np.testing.assert_allclose(ours.sum(ax), 0.0, atol=1e-12)
    # the map is an isometry onto the zero-sum subspace: sum a^2 = sum v^2
    np.testing.assert_allclose((ours**2).sum(), (v**2).sum(), rtol=1e-12)
    back = ZeroSumTransform(axes).forward(pt.as_tensor(ours)).eval()
    np.testing.assert_allclose(back, v, atol=1e-12)


def test_model_transforms_are_restored():
    with pm.Model() as m:
        a = pm.ZeroSumNormal("a", sigma=1.0, shape=5)
    with zerosum_as_linear(m):
        assert isinstance(m.rvs_to_transforms[a], LinearZeroSumTransform)
    assert type(m.rvs_to_transforms[a]) is ZeroSumTransform


def _zerosum_matrix(axes, value_shape):
    """``vec(a) = Z vec(v)`` for the zero-sum map (columns: images of unit vectors)."""
    n = int(np.prod(value_shape))
    cols = [
        ZeroSumTransform(axes).backward(pt.as_tensor(e.reshape(value_shape))).eval().ravel()
        for e in np.eye(n)
    ]
    return np.column_stack(cols)


@pytest.fixture(scope="module")
def conjugate_zerosum():
    """Gaussian likelihood, fixed scales: main effects of two factors and their interaction."""
    rng = np.random.default_rng(41)
    G1, G2, n = 4, 3, 150
    g1, g2 = rng.integers(0, G1, n), rng.integers(0, G2, n)
    x = rng.normal(size=n)
    y = 0.5 + 0.3 * x + rng.normal(0, 0.6, G1)[g1] + rng.normal(0, 0.4, (G1, G2))[g1, g2]
    y = y + rng.normal(0, 0.7, n)
    coords = {"f1": np.arange(G1), "f2": np.arange(G2)}
    with pm.Model(coords=coords) as m:
        b = pm.Normal("b", 0.0, 2.0, shape=2)
        a = pm.ZeroSumNormal("a", sigma=0.8, dims="f1")
        ab = pm.ZeroSumNormal("ab", sigma=0.5, dims=("f1", "f2"), n_zerosum_axes=2)
        pm.Normal("y", b[0] + b[1] * x + a[g1] + ab[g1, g2], 0.7, observed=y)
    # exact posterior in the unconstrained space (b, v_a, v_ab)
    Za = _zerosum_matrix((-1,), (G1 - 1,))
    Zab = _zerosum_matrix((-2, -1), (G1 - 1, G2 - 1))
    D = np.column_stack([np.ones(n), x, Za[g1], Zab[g1 * G2 + g2]])
    prior_var = np.r_[4.0, 4.0, np.full(G1 - 1, 0.64), np.full((G1 - 1) * (G2 - 1), 0.25)]
    P = np.diag(1 / prior_var) + D.T @ D / 0.49
    mean = np.linalg.solve(P, D.T @ y / 0.49)
    logml = stats.multivariate_normal(
        np.zeros(n), D @ np.diag(prior_var) @ D.T + 0.49 * np.eye(n)
    ).logpdf(y)
    return m, mean, P, logml, (Za, Zab)


def test_zerosum_effects_are_gaussian_globals(conjugate_zerosum):
    m = conjugate_zerosum[0]
    tlm = recognize(m)
    assert [g.name for g in tlm.gaussians] == ["b", "a", "ab"]
    assert [g.prior for g in tlm.gaussians] == ["normal", "zerosum", "zerosum"]
    assert [g.shape for g in tlm.gaussians] == [(2,), (3,), (3, 2)]
    assert tlm.hypers == []
    assert tlm.general_terms == []


def test_one_natural_step_is_the_exact_posterior(conjugate_zerosum):
    """rho = 1 on a conjugate model lands on the posterior; the bound is the log evidence."""
    m, mean, P, logml, (Za, Zab) = conjugate_zerosum
    with m:
        approx = pymc_mcssvi.MCSSVI(schedule=1.0).fit(n=3, progressbar=False)
    order = [approx.ordering[v][1] for v in ("b", "a_zerosum__", "ab_zerosum__")]
    idx = np.concatenate([np.arange(s.start, s.stop) for s in order])
    np.testing.assert_allclose(np.asarray(approx.mean.eval())[idx], mean, atol=1e-8)
    cov = np.asarray(approx.cov.eval())[np.ix_(idx, idx)]
    np.testing.assert_allclose(cov, np.linalg.inv(P), atol=1e-9)
    np.testing.assert_allclose(-approx.hist[-1], logml, rtol=1e-9)
    # draws come back on the constrained scale: zero sums, mean Z m
    post = approx.sample(2000, random_seed=1).posterior
    a = post["a"].values.reshape(2000, -1)
    ab = post["ab"].values.reshape(2000, 4, 3)
    np.testing.assert_allclose(a.sum(-1), 0.0, atol=1e-12)
    np.testing.assert_allclose(ab.sum(-1), 0.0, atol=1e-12)
    np.testing.assert_allclose(ab.sum(-2), 0.0, atol=1e-12)
    sd = np.sqrt(np.diag(Za @ np.linalg.inv(P)[2:5, 2:5] @ Za.T))
    assert np.all(np.abs(a.mean(0) - Za @ mean[2:5]) < 4 * sd / np.sqrt(2000))
