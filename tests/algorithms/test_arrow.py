"""The arrow coupling of the fixed effects (head) with the random-effect blocks (body)."""

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import pytest

import pymc_mcssvi
from pymc_mcssvi.algorithms.arrow import Arrow, arrow_solve, arrow_view
from pymc_mcssvi.families.gaussian import GaussianBlocks


def _random_arrow(rng, p=3):
    """Arrow over a head (p), a block segment (5 x 2), a diagonal one (7 x 1) and an
    uncoupled block segment (2 x 2), with its dense precision in segment order."""
    shapes = [(1, p), (5, 2), (7, 1), (2, 2)]
    coupled = [False, True, True, False]
    dim = sum(r * k for r, k in shapes)
    offs = np.cumsum([0] + [r * k for r, k in shapes])
    P = np.zeros((dim, dim))
    factors, crosses = [], []
    for (r, k), o in zip(shapes, offs[:-1], strict=True):
        blocks = []
        for j in range(r):
            A = rng.normal(size=(k, k))
            B = A @ A.T + 4 * k * np.eye(k)
            P[o + j * k : o + (j + 1) * k, o + j * k : o + (j + 1) * k] = B
            blocks.append(np.linalg.cholesky(B))
        factors.append(pt.as_tensor(np.stack(blocks)))
    for (r, k), o, c in zip(shapes, offs[:-1], coupled, strict=True):
        if not c:
            crosses.append(None)
            continue
        Q = 0.5 * rng.normal(size=(r, k, p))
        P[o : o + r * k, :p] = Q.reshape(r * k, p)
        P[:p, o : o + r * k] = Q.reshape(r * k, p).T
        crosses.append(pt.as_tensor(Q))
    assert np.all(np.linalg.eigvalsh(P) > 0)
    return Arrow(0, factors, crosses), P, shapes


def _flat(xs):
    return np.concatenate([np.asarray(x.eval()).reshape(-1, *np.shape(x.eval())[2:]) for x in xs])


def test_arrow_solve_and_view_match_dense_algebra(rng):
    arrow, P, shapes = _random_arrow(rng)
    dim = P.shape[0]
    r = rng.normal(size=dim)
    offs = np.cumsum([0] + [a * b for a, b in shapes])
    rhs = [
        pt.as_tensor(r[o : o + a * b].reshape(a, b))
        for (a, b), o in zip(shapes, offs, strict=False)
    ]
    np.testing.assert_allclose(_flat(arrow_solve(arrow, rhs)), np.linalg.solve(P, r), rtol=1e-10)
    R = rng.normal(size=(dim, 4))  # several right-hand sides (the hyperparameters' columns)
    rhs = [
        pt.as_tensor(R[o : o + a * b].reshape(a, b, 4))
        for (a, b), o in zip(shapes, offs, strict=False)
    ]
    np.testing.assert_allclose(_flat(arrow_solve(arrow, rhs)), np.linalg.solve(P, R), rtol=1e-10)
    # inverse = blockdiag(body blocks)^-1 + G S^-1 G^T
    G, L_S = arrow_view(arrow)
    Gd = _flat(G)
    S_inv = np.linalg.inv(np.asarray(L_S.eval()) @ np.asarray(L_S.eval()).T)
    body = np.zeros_like(P)
    body[3:, 3:] = np.linalg.inv(P[3:, 3:])  # the body is block diagonal
    np.testing.assert_allclose(body + Gd @ S_inv @ Gd.T, np.linalg.inv(P), atol=1e-12)


def _lmm(rng, G=15, n=200):
    g = np.concatenate([np.arange(G), rng.integers(0, G, n - G)])
    x = rng.normal(size=n)
    y = 1.0 + 0.5 * x + rng.normal(scale=0.7, size=G)[g] + rng.normal(scale=0.8, size=n)
    with pm.Model(coords={"group": np.arange(G)}) as m:
        b0 = pm.Normal("b0", 0, 5)
        b1 = pm.Normal("b1", 0, 2.5)
        a = pm.Normal("a", 0, 0.7, dims="group")
        pm.Normal("y", b0 + b1 * x + a[g], 0.8, observed=y)
    D = np.column_stack([np.ones(n), x, np.eye(G)[g]])
    Pr = np.diag(np.r_[1 / 25, 1 / 6.25, np.full(G, 1 / 0.49)]) + D.T @ D / 0.64
    cov = np.linalg.inv(Pr)
    return m, cov @ D.T @ y / 0.64, cov


def test_conjugate_model_with_diagonal_effects_is_exact(rng):
    """Gaussian likelihood, effects in their own (diagonal) segment: the arrow step is Newton's
    step, so the means land on the exact posterior, and the reported covariance (the arrow's
    inverse) is the exact posterior covariance, cross-covariances with the intercept included."""
    m, mean, cov = _lmm(rng)
    with m:
        inf = pymc_mcssvi.HMCSSVI(cov={"a": "diag"}, random_seed=0)
        assert inf.kernel.arrow_head == 0
        assert [s.kind for s in inf.tlm.segments] == ["full", "diag"]
        approx = inf.fit(progressbar=False)
    assert approx.n_iter <= 6
    idx = np.concatenate(
        [
            np.arange(approx.ordering[v][1].start, approx.ordering[v][1].stop)
            for v in ("b0", "b1", "a")
        ]
    )
    np.testing.assert_allclose(np.asarray(approx.mean.eval())[idx], mean, atol=1e-8)
    np.testing.assert_allclose(np.asarray(approx.cov.eval())[np.ix_(idx, idx)], cov, atol=1e-8)
    draws = approx.sample_dict_fn(40000, random_seed=1)
    emp = np.cov(np.column_stack([draws["b0"], draws["b1"], draws["a"]]).T)
    np.testing.assert_allclose(np.sqrt(np.diag(emp)), np.sqrt(np.diag(cov)), rtol=0.02)
    # the factorized q alone is over-confident for the intercept
    with m:
        plain = pymc_mcssvi.HMCSSVI(cov={"a": "diag"}, linear_response=False, random_seed=0)
        sd = np.asarray(plain.fit(progressbar=False).std.eval())
    assert sd[0] < 0.8 * np.sqrt(cov[0, 0])


@pytest.mark.parametrize("head", ["dense", "gathered"])
def test_cross_hessian_matches_finite_differences(head, rng):
    """``X_s = E[d^2 log p / d w_s d w_head]`` equals ``d g_s / d m_head`` (Price's theorem).

    ``gathered``: the head also holds a small effect ``u[h]`` (10 dimensions, read
    through a gather), so its rows take the mixed path; the crosses are scattered from
    the head's few entries per row instead of its one-hot design."""
    G, n = 12, 150
    g = np.concatenate([np.arange(G), rng.integers(0, G, n - G)])
    h = rng.integers(0, 8, n)
    x = rng.normal(size=n)
    y = rng.poisson(np.exp(0.3 + 0.4 * x + rng.normal(0, 0.5, G)[g]))
    with pm.Model() as m:
        b = pm.Normal("b", 0, 2, shape=2)
        a = pm.Normal("a", 0, 0.5, shape=G)
        c = pm.Normal("c", 0, 0.5, shape=G)
        eta = b[0] + b[1] * x + a[g] + c[g] * x
        if head == "gathered":
            eta = eta + pm.Normal("u", 0, 0.5, shape=8)[h]
        pm.Poisson("y", pm.math.exp(eta), observed=y)
    with m:
        inf = pymc_mcssvi.HMCSSVI(cov={"a": "block", "c": "block"}, random_seed=0)
    k, st = inf.kernel, inf.store.symbolic
    assert [s.kind for s in inf.tlm.segments] == ["full", "block"]
    (hp,) = [p for p in k.bound.geometries[0].pieces if p.segment == 0]
    assert hp.mixed == (head == "gathered")
    for mu in st.cand.means:
        mu.set_value(mu.get_value() + 0.1 * rng.normal(size=mu.get_value().shape))
    cand = [GaussianBlocks(mu, f) for mu, f in zip(st.cand.means, st.cand.factors, strict=True)]
    ev = k.bound.evaluate(cand)
    fn = pytensor.function([], [ev.grads[1], ev.crosses[1]])
    head_mean = st.cand.means[0]
    m0 = head_mean.get_value()
    D = m0.shape[-1]
    eps = 1e-5
    fd = []
    for j in range(D):
        d = np.zeros_like(m0)
        d[0, j] = eps
        head_mean.set_value(m0 + d)
        up = fn()[0]
        head_mean.set_value(m0 - d)
        down = fn()[0]
        fd.append((up - down) / (2 * eps))
    head_mean.set_value(m0)
    X = fn()[1]
    assert X.shape == (G, 2, D)
    np.testing.assert_allclose(X, np.stack(fd, axis=-1), rtol=1e-5, atol=1e-8)


@pytest.mark.slow
@pytest.mark.parametrize("hyper", ["meanfield", "point"])
def test_block_layout_with_arrow_matches_the_full_covariance_fit(hyper, rng):
    """Poisson GLMM with non-centered intercepts and slopes: the group blocks' own segment plus
    the arrow coupling reports the fixed effects' and scales' sds of the full-covariance fit.

    The two q families have different optima (the scales' means differ by 0.1 sd); without
    the arrow the block layout's sd of ``b0`` is half the full fit's and the fit took 2088
    iterations on these data."""
    G, n = 40, 400
    g = np.concatenate([np.arange(G), rng.integers(0, G, n - G)])
    x = rng.normal(size=n)
    y = rng.poisson(np.exp(0.5 + rng.normal(0, 0.5, G)[g] + (0.3 + rng.normal(0, 0.3, G)[g]) * x))
    with pm.Model(coords={"group": np.arange(G)}) as m:
        b0 = pm.Normal("b0", 0.0, 5.0)
        b1 = pm.Normal("b1", 0.0, 2.5)
        sd_a = pm.HalfNormal("sd_a", 1.0)
        sd_b = pm.HalfNormal("sd_b", 1.0)
        z_a = pm.Normal("z_a", 0.0, 1.0, dims="group")
        z_b = pm.Normal("z_b", 0.0, 1.0, dims="group")
        pm.Poisson("y", pm.math.exp(b0 + sd_a * z_a[g] + (b1 + sd_b * z_b[g]) * x), observed=y)
    fits = {}
    for cov in ("full", {"z_a": "block", "z_b": "block"}):
        with m:
            inf = pymc_mcssvi.HMCSSVI(cov=cov, hyper=hyper, random_seed=1)
            approx = inf.fit(progressbar=False)
        assert approx.converged
        fits[str(cov)] = (np.asarray(approx.mean.eval()), np.asarray(approx.std.eval()), approx)
    (m_f, s_f, a_f), (m_b, s_b, a_b) = fits["full"], fits[str({"z_a": "block", "z_b": "block"})]
    for v in ("b0", "b1", "sd_a_log__", "sd_b_log__"):
        if v not in a_f.ordering or hyper == "point" and v.startswith("sd"):
            continue
        i = a_f.ordering[v][1]
        np.testing.assert_allclose(m_b[i], m_f[i], atol=0.15 * s_f[i].max())
        np.testing.assert_allclose(s_b[i], s_f[i], rtol=0.1)
    assert a_b.n_iter <= 2 * a_f.n_iter


def test_curvature_that_is_not_positive_definite_falls_back_to_q_blocks(rng):
    """A non-log-concave likelihood can make the arrow of -E[H] indefinite: the draws then use
    q's own blocks (not a stale view) and the joint step the blockwise solves."""
    from pymc_mcssvi.algorithms.hyperparameters import joint_newton_step

    m, _, _ = _lmm(rng)
    with m:
        inf = pymc_mcssvi.HMCSSVI(cov={"a": "diag"}, random_seed=0)
    k, st = inf.kernel, inf.store.symbolic
    G = st.base.means[1].get_value().shape[0]
    factors = [pt.as_tensor(np.eye(2)[None] * 1.5), pt.as_tensor(np.ones((G, 1, 1)))]
    bad = Arrow(0, factors, [None, pt.as_tensor(np.full((G, 1, 2), 3.0))])  # Schur < 0
    G_view, L_S = k._arrow_view(bad, factors[0], st.arrow)
    np.testing.assert_allclose(L_S.eval(), np.eye(2) * 1.5)
    np.testing.assert_allclose(G_view[0].eval(), np.eye(2)[None])
    assert not G_view[1].eval().any()
    # joint step: same result as without the arrow
    B = [pt.as_tensor(rng.normal(size=(1, 2, 1))), pt.as_tensor(rng.normal(size=(G, 1, 1)))]
    g = [pt.as_tensor(rng.normal(size=(1, 2))), pt.as_tensor(rng.normal(size=(G, 1)))]
    P_h = pt.as_tensor(np.eye(1) * 50.0)
    with_arrow = joint_newton_step(pt.as_tensor(np.ones(1)), P_h, 1.0, factors, g, B, arrow=bad)
    plain = joint_newton_step(pt.as_tensor(np.ones(1)), P_h, 1.0, factors, g, B)
    np.testing.assert_allclose(with_arrow.delta_h.eval(), plain.delta_h.eval())
    for a, b in zip(with_arrow.responses, plain.responses, strict=True):
        np.testing.assert_allclose(a.eval(), b.eval())


def _crossed(n_subj, n_item, nested=False):
    rng = np.random.default_rng(0)
    N = 3 * (n_subj + n_item)
    s = rng.integers(0, n_subj, N)
    i = s % n_item if nested else rng.integers(0, n_item, N)
    with pm.Model() as m:
        b0 = pm.Normal("b0", 0, 2)
        zs = pm.Normal("zs", 0, 1, shape=n_subj)
        zi = pm.Normal("zi", 0, 1, shape=n_item)
        pm.Poisson("y", pm.math.exp(b0 + 0.5 * zs[s] + 0.3 * zi[i]), observed=rng.poisson(2, N))
    return m


@pytest.mark.parametrize("nested", [False, True], ids=["crossed", "nested"])
def test_two_large_grouping_factors_keep_one_full_covariance(nested):
    """Observations reading two large effect vectors at different rows couple their
    blocks, which the arrow does not keep (block-Jacobi between the factors: 3873
    iterations on 900 x 200 crossed groups, 39 with the full q); one grouping factor
    keeps the arrow."""
    cov = {r["name"]: r["q"] for r in pymc_mcssvi.describe(_crossed(900, 200, nested)).variables}
    assert cov["zs"].startswith("full (1101 x 1101)"), cov
    big = {r["name"]: r["q"] for r in pymc_mcssvi.describe(_crossed(1800, 300, nested)).variables}
    assert not big["zs"].startswith("full"), big  # 2101 > MAX_CROSSED_FULL_DIM
    rng = np.random.default_rng(1)
    g = rng.integers(0, 1100, 3000)
    with pm.Model() as one:
        b0 = pm.Normal("b0", 0, 2)
        z = pm.Normal("z", 0, 1, shape=1100)
        pm.Poisson("y", pm.math.exp(b0 + 0.5 * z[g]), observed=rng.poisson(2, 3000))
    single = {r["name"]: r["q"] for r in pymc_mcssvi.describe(one).variables}
    assert not single["z"].startswith("full"), single


def _layout_of(spelling, G=150, n=1500):
    """The automatic q of a 151-301 dimension Bernoulli model, written ``spelling``."""
    rng = np.random.default_rng(2)
    g, h, x = rng.integers(0, G, n), rng.integers(0, G, n), rng.normal(size=n)
    X = rng.normal(size=(n, 100))
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1, shape=2)
        if spelling == "intercepts_and_slopes":
            a, c = pm.Normal("a", 0, 1, shape=G), pm.Normal("c", 0, 1, shape=G)
            eta = b[0] + b[1] * x + 0.7 * a[g] + 0.3 * c[g] * x
        elif spelling == "home_minus_away":  # two rows per observation
            a = pm.Normal("a", 0, 1, shape=G)
            eta = b[0] + a[g] - a[h]
        elif spelling == "effects_by_groups":  # stored (effects, groups)
            a = pm.Normal("a", 0, 1, shape=(2, G))
            eta = b[0] + a[0, g] + a[1, g] * x
        else:  # a vector read through a dense design too
            a = pm.Normal("a", 0, 1, shape=100)
            eta = b[0] + X @ a + a[g % 100]
        pm.Bernoulli("y", logit_p=eta, observed=rng.integers(0, 2, n))
    return {r["name"]: r["q"] for r in pymc_mcssvi.describe(m).variables}


@pytest.mark.parametrize(
    "spelling, arrow",
    [
        ("intercepts_and_slopes", True),
        ("home_minus_away", False),
        ("effects_by_groups", False),
        ("dense_and_gathered", False),
    ],
)
def test_effects_of_one_grouping_factor_take_the_arrow_from_256_dimensions(spelling, arrow):
    """Above ARROW_FULL_DIM dimensions, effects read through gathers of one grouping
    factor (one row per observation) get blocks and the arrow, which keeps the
    posterior's structure given the hyperparameters (150 groups of a logistic GLMM:
    13.0 s -> 3.4 s, the same accuracy against NUTS); effects whose posterior couples
    their rows keep the full covariance up to MAX_FULL_DIM."""
    q = _layout_of(spelling)
    assert q["a"].startswith("block" if arrow else "full"), q
    assert q["b"].startswith("full"), q


def test_effects_nested_through_their_prior_keep_the_full_covariance():
    """County effects centred on their state's effect (``a ~ N(b[state], s)``), both
    larger than SMALL_GLOBAL: the prior couples two body segments, which the arrow
    does not keep."""
    rng = np.random.default_rng(3)
    n_state, n_county, n = 70, 210, 1500
    state = np.arange(n_county) % n_state
    c = rng.integers(0, n_county, n)
    with pm.Model() as m:
        b0 = pm.Normal("b0", 0, 1)
        b = pm.Normal("b", 0, 1, shape=n_state)
        a = pm.Normal("a", b[state], 0.5, shape=n_county)
        pm.Bernoulli("y", logit_p=b0 + a[c], observed=rng.integers(0, 2, n))
    q = {r["name"]: r["q"] for r in pymc_mcssvi.describe(m).variables}
    assert q["a"].startswith("full"), q
