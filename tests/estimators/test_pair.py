"""Likelihoods with two affine predictors (distributional regression): the 2-D
quadrature against closed forms, and the bound's g, H and arrow crosses against
autodiff of its value."""

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import pytest

from pymc_mcssvi import describe
from pymc_mcssvi.bounds.structured import StructuredBound
from pymc_mcssvi.estimators.quadrature import expected_pair_derivatives
from pymc_mcssvi.families.gaussian import GaussianBlocks


def test_pair_quadrature_matches_the_tilted_gaussian_closed_form():
    """``l = -s - (y - f)^2 exp(-2 s) / 2`` (a Normal in mean and log sd) under a
    correlated Gaussian: ``E[h(f) exp(-2 s)] = exp(-2 m_s + 2 v_s) E[h(f - 2 c)]``."""
    f, s = pt.vector("f"), pt.vector("s")
    y = np.array([0.3, -1.2, 2.0])
    logp = -s - 0.5 * (y - f) ** 2 * pt.exp(-2 * s)
    m1, v1 = np.array([0.1, -0.5, 1.0]), np.array([0.25, 0.1, 0.4])
    m2, v2 = np.array([0.2, -0.3, 0.0]), np.array([0.09, 0.04, 0.16])
    c = np.array([0.05, -0.03, 0.12])  # correlations 0.33, -0.47, 0.47
    T, (a1, a2), (b11, b12, b22) = expected_pair_derivatives(
        logp, (f, s), [pt.constant(x) for x in (m1, v1, m2, v2, c)]
    )
    tilt = np.exp(-2 * m2 + 2 * v2)
    r = y - m1 + 2 * c
    Q = tilt * (r**2 + v1)
    want = {
        "T": -m2 - 0.5 * Q,
        "a1": tilt * r,
        "a2": -1 + Q,
        "b11": -tilt,
        "b12": -2 * tilt * r,
        "b22": -2 * Q,
    }
    got = pytensor.function([], [T, a1, a2, b11, b12, b22])()
    for (name, w), g in zip(want.items(), got, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-7, err_msg=name)


def _distributional_model(rng, groups=300, n=900):
    """Fixed effects shared by both predictors, one grouping factor's effects in each:
    the arrow layout (head b, one block per group)."""
    g = rng.integers(0, groups, n)
    x = rng.uniform(-1, 1, size=n)
    y = rng.normal(size=n)
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1, shape=3)
        z = pm.Normal("z", 0, 1, shape=groups)
        w = pm.Normal("w", 0, 1, shape=groups)
        mu = b[0] + b[1] * x + 0.5 * z[g]
        log_sigma = b[2] * x + 0.3 * w[g] - 0.2
        pm.Normal("y", mu, pm.math.exp(log_sigma), observed=y)
    return m, g, x, y


def _states(rng, tlm, off_diagonal=0.1, diagonal=2.0):
    out = []
    for seg in tlm.segments:
        A = rng.normal(size=(seg.rows, seg.k, seg.k)) * off_diagonal + np.eye(seg.k) * diagonal
        out.append((rng.normal(size=(seg.rows, seg.k)) * 0.3, np.tril(A)))
    return out


def test_pair_value_is_the_closed_form_expectation_under_q():
    """The bound's expected log joint against the Normal's closed form under q's joint
    Gaussian of (mu, log sigma) per row, whose covariance is formed here from dense
    designs and q's blocks (correlated within the head and within each group's block)."""
    rng = np.random.default_rng(5)
    m, g, x, y = _distributional_model(rng)
    tlm = describe(m).tlm
    values = _states(rng, tlm, off_diagonal=0.6, diagonal=3.0)
    ev = StructuredBound(tlm).evaluate(
        [GaussianBlocks(pt.constant(a), pt.constant(b)) for a, b in values]
    )
    got = float(ev.expected_loglik.eval())
    # flat coordinates b (3), z, w with their means and covariance from q's blocks
    names = [gl.name for gl in tlm.gaussians]
    where = []  # (segment, row, col) of each flat coordinate
    for name in ("b", "z", "w"):
        gid = names.index(name)
        s = next(i for i, seg in enumerate(tlm.segments) if gid in seg.members)
        seg = tlm.segments[s]
        for j in range(tlm.gaussians[gid].size):
            where.append((s, seg.row_of[gid][j], seg.col_of[gid][j]))
    dim = len(where)
    mean = np.array([values[s][0][r, c] for s, r, c in where])
    cov = np.zeros((dim, dim))
    block_cov = [np.linalg.inv(L @ np.swapaxes(L, -1, -2)) for _, L in values]
    for i, (s1, r1, c1) in enumerate(where):
        for j, (s2, r2, c2) in enumerate(where):
            if s1 == s2 and r1 == r2:
                cov[i, j] = block_cov[s1][r1, c1, c2]
    G, n = 300, len(y)
    D1, D2 = np.zeros((n, dim)), np.zeros((n, dim))
    D1[:, 0], D1[:, 1], D1[np.arange(n), 3 + g] = 1.0, x, 0.5
    D2[:, 2], D2[np.arange(n), 3 + G + g] = x, 0.3
    m1, m2 = D1 @ mean, D2 @ mean - 0.2
    v1 = np.einsum("ni,ij,nj->n", D1, cov, D1)
    v2 = np.einsum("ni,ij,nj->n", D2, cov, D2)
    c = np.einsum("ni,ij,nj->n", D1, cov, D2)
    assert np.max(np.abs(c) / np.sqrt(v1 * v2)) > 0.2  # the correlation matters
    log2pi = np.log(2 * np.pi)
    lik = -m2 - 0.5 * log2pi - 0.5 * np.exp(-2 * m2 + 2 * v2) * ((y - m1 + 2 * c) ** 2 + v1)
    prior = -0.5 * log2pi - 0.5 * (mean**2 + np.diag(cov))
    np.testing.assert_allclose(got, lik.sum() + prior.sum(), rtol=1e-7)


@pytest.mark.slow
def test_pair_g_h_and_arrow_crosses_are_derivatives_of_the_expected_log_joint():
    """For a Gaussian q, ``dE/dm = E[grad]`` and ``d2E/dm2 = E[Hessian]``: the blocks
    of ``H`` and the crosses with the arrow's head are second derivatives of the
    value in the means (the same quadrature nodes on both sides: agreement to
    rounding). The cross term of the two predictors enters through the sum's
    geometry (polarization), so a wrong sign or a missing half shows here."""
    rng = np.random.default_rng(4)
    m, *_ = _distributional_model(rng)
    desc = describe(m)
    assert desc.predictor("y") == "two affine predictors"
    tlm = desc.tlm
    bound = StructuredBound(tlm)
    assert bound.arrow_head is not None
    head = bound.arrow_head
    values = _states(rng, tlm)
    means = [pt.matrix(f"mean_{s}", shape=a.shape) for s, (a, _) in enumerate(values)]
    states = [GaussianBlocks(mu, pt.constant(L)) for mu, (_, L) in zip(means, values, strict=True)]
    ev = bound.evaluate(states)
    E = ev.expected_loglik
    auto_g = pt.grad(E, means)
    outs = [*ev.grads, *auto_g]
    checks = []
    for s, seg in enumerate(tlm.segments):
        jac = pt.jacobian(auto_g[s].reshape((-1,)), means[s], vectorize=True)
        jac = jac.reshape((seg.rows, seg.k, seg.rows, seg.k))
        r = pt.arange(seg.rows)
        outs += [ev.hessians[s], jac[r, :, r, :]]
        checks.append(f"H[{s}]")
        if s != head:
            cross = pt.jacobian(auto_g[s].reshape((-1,)), means[head], vectorize=True)
            outs += [ev.crosses[s], cross.reshape((seg.rows, seg.k, -1))]
            checks.append(f"cross[{s}]")
    got = pytensor.function(means, outs, on_unused_input="ignore")(*[a for a, _ in values])
    nseg = len(tlm.segments)
    for s in range(nseg):
        np.testing.assert_allclose(got[s], got[nseg + s], rtol=1e-8, atol=1e-9, err_msg=f"g[{s}]")
    pairs = got[2 * nseg :]
    for k, name in enumerate(checks):
        np.testing.assert_allclose(
            pairs[2 * k], pairs[2 * k + 1], rtol=1e-8, atol=1e-9, err_msg=name
        )
