"""``g`` and ``H`` of the structured bound against finite differences.

Bonnet's and Price's theorems: ``dE_q[l]/dm = g`` and ``dE_q[l]/dS = H / 2``
(so a symmetric perturbation of ``S_ij`` and ``S_ji`` changes ``E`` by ``H_ij``).
The expected log joint ``E`` is evaluated by the same bound (40-node quadrature,
so that its own error is far below the finite-difference step).
"""

from types import SimpleNamespace

import numpy as np
import pymc as pm
import pytensor
import pytest

import pymc_mcssvi
from pymc_mcssvi.families.gaussian import GaussianBlocks


def _functions(inf):
    st = inf.store.symbolic
    states = [GaussianBlocks(m, f) for m, f in zip(st.cand.means, st.cand.factors, strict=True)]
    ev = inf.bound.evaluate(states)
    hypers = inf.kernel.hypers
    repl = hypers.spec.replacements(st.hyper.cand) if getattr(hypers, "mode", "") == "point" else {}
    outs = [ev.expected_loglik, *ev.grads, *ev.hessians]
    if repl:
        outs = pytensor.graph.replace.graph_replace(outs, repl, strict=False)
    fn = pytensor.function([], outs)
    return SimpleNamespace(nseg=inf.kernel.nseg, cand=st.cand), fn


def _set(k, means, covs):
    for s, (m, S) in enumerate(zip(means, covs, strict=True)):
        k.cand.means[s].set_value(m)
        k.cand.factors[s].set_value(np.linalg.cholesky(np.linalg.inv(S)))


def _check(inf, rng, h=1e-5, rtol=2e-5, atol=1e-6):
    k, fn = _functions(inf)
    nseg = k.nseg
    means = [rng.normal(size=m.get_value().shape) * 0.3 for m in k.cand.means]
    covs = []
    for f in k.cand.factors:
        R, K, _ = f.get_value().shape
        A = rng.normal(size=(R, K, K)) * 0.2
        covs.append(A @ A.transpose(0, 2, 1) + 0.05 * np.eye(K))
    _set(k, means, covs)
    out = fn()
    grads, hess = out[1 : 1 + nseg], out[1 + nseg :]

    def E(ms, Ss):
        _set(k, ms, Ss)
        return fn()[0]

    for s in range(nseg):
        R, K = means[s].shape
        for r in range(R):
            for i in range(K):
                mp = [m.copy() for m in means]
                mm = [m.copy() for m in means]
                mp[s][r, i] += h
                mm[s][r, i] -= h
                fd = (E(mp, covs) - E(mm, covs)) / (2 * h)
                np.testing.assert_allclose(grads[s][r, i], fd, rtol=rtol, atol=atol)
                for j in range(i, K):
                    Sp = [S.copy() for S in covs]
                    Sm = [S.copy() for S in covs]
                    for S, sign in ((Sp, 1), (Sm, -1)):
                        S[s][r, i, j] += sign * h
                        if i != j:
                            S[s][r, j, i] += sign * h
                    fd = (E(means, Sp) - E(means, Sm)) / (2 * h)
                    want = hess[s][r, i, j] * (1.0 if i != j else 0.5)
                    np.testing.assert_allclose(want, fd, rtol=rtol, atol=atol)


def test_dense_glm(rng):
    X = rng.normal(size=(60, 3))
    y = rng.integers(0, 2, 60)
    with pm.Model():
        b = pm.Normal("b", 0, 2)
        w = pm.Normal("w", 0, 1, shape=3)
        pm.Bernoulli("y", logit_p=b + X @ w, observed=y)
        inf = pymc_mcssvi.MCSSVI(n_points=40)
    _check(inf, rng)


@pytest.mark.parametrize("cov", ["block", "diag", "full"])
def test_gathered_random_effects(rng, cov):
    n, G = 80, 5
    g = rng.integers(0, G, n)
    x = rng.normal(size=n)
    y = rng.poisson(2.0, n)
    with pm.Model():
        b = pm.Normal("b", 0, 1, shape=2)
        a = pm.Normal("a", 0, 1, shape=(G, 2))
        eta = b[0] + b[1] * x + a[g, 0] + a[g, 1] * x
        pm.Poisson("y", pm.math.exp(eta), observed=y)
        inf = pymc_mcssvi.MCSSVI(n_points=40, cov={"a": cov})
    assert inf.tlm.segments[-1].kind == cov or cov == "full"
    _check(inf, rng)


def test_nonlinear_general_path_gradient_and_hessian(rng):
    """General estimator: g is the exact gradient of its (fixed-draw) objective, H = dg/dm.
    (One decay rate per group: a scalar rate alone would be a hyperparameter.)"""
    t = np.tile(np.linspace(0, 4, 15), 2)
    grp = np.repeat([0, 1], 15)
    y = 2.0 * np.exp(-np.array([0.7, 1.0])[grp] * t) + rng.normal(0, 0.1, t.size)
    with pm.Model():
        a = pm.Normal("a", 1, 1)
        b = pm.Normal("b", 0.5, 0.5, shape=2)
        # b[grp] also alone (a third predictor besides a and -b[grp] t): the general path
        pm.Normal("y", a * pm.math.exp(-b[grp] * t - 0.1 * b[grp] ** 2), 0.1, observed=y)
        inf = pymc_mcssvi.MCSSVI(n_draws=16)
    assert inf.tlm.observed["y"] == "general"
    k, fn = _functions(inf)
    m0 = np.array([[1.5, 0.6, 0.9]])
    S0 = np.array([[[0.02, 0.003, 0.001], [0.003, 0.01, 0.002], [0.001, 0.002, 0.015]]])
    _set(k, [m0], [S0])
    _, g, H = fn()
    h = 1e-6
    for i in range(3):
        mp, mm = m0.copy(), m0.copy()
        mp[0, i] += h
        mm[0, i] -= h
        _set(k, [mp], [S0])
        Ep, gp, _ = fn()
        _set(k, [mm], [S0])
        Em, gm, _ = fn()
        np.testing.assert_allclose(g[0, i], (Ep - Em) / (2 * h), rtol=1e-6)
        np.testing.assert_allclose(H[0, :, i], (gp - gm)[0] / (2 * h), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cov", ["block", "diag", "full"])
def test_sensitivities_are_the_design_column_norms(rng, cov):
    """``StructuredBound.sensitivities``: per coordinate, the squared norm of its column of
    the likelihood's predictor Jacobian (here read from finite differences of the
    predictor), on every path (dense, gathers, mixed), a non-centered scale included."""
    n, G = 60, 5
    g = rng.integers(0, G, n)
    x = rng.normal(size=n)
    y = rng.poisson(2.0, n)
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1, shape=2)
        s = pm.HalfNormal("s", 1)
        a = pm.Normal("a", 0, 1, shape=(G, 2))
        eta = b[0] + b[1] * x + s * a[g, 0] + a[g, 1] * x
        pm.Deterministic("eta", eta)
        pm.Poisson("y", pm.math.exp(eta), observed=y)
        inf = pymc_mcssvi.MCSSVI(cov={"a": cov})
    k = inf.kernel
    sens = pytensor.function(list(k.hypers.spec.values), inf.bound.sensitivities(k.nseg))
    s_val = 0.7
    got = sens(np.log(s_val))
    # the Jacobian of eta in each global's coordinates, by finite differences
    eta = m.replace_rvs_by_values([m["eta"]])[0]
    eta_fn = m.compile_fn(eta, inputs=m.value_vars, point_fn=False, on_unused_input="ignore")
    point = {"b": np.zeros(2), "s_log__": np.log(s_val), "a": np.zeros((G, 2))}
    base = eta_fn(**point)
    for seg_out, seg in zip(got, inf.tlm.segments, strict=True):
        assert seg_out.shape == (seg.rows, seg.k)
    want = {}
    for name, shape in (("b", (2,)), ("a", (G, 2))):
        cols = np.zeros(shape)
        for idx in np.ndindex(shape):
            p = {**point, name: point[name].copy()}
            p[name][idx] += 1e-6
            cols[idx] = np.sum(((eta_fn(**p) - base) / 1e-6) ** 2)
        want[name] = cols
    for out, seg in zip(got, inf.tlm.segments, strict=True):
        for gid in seg.members:
            gl = inf.tlm.gaussians[gid]
            vals = np.asarray(out)[seg.row_of[gid], seg.col_of[gid]]
            np.testing.assert_allclose(vals.reshape(want[gl.name].shape), want[gl.name], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("cov", ["full", "block"])
def test_colored_hessian_of_row_separable_general_term(rng, cov):
    """A correlated topic model's likelihood ``softmax(eta[d]) @ beta`` (multinomial,
    a general term) never couples two documents: its Hessian blocks come from one
    Hessian-vector product per topic. ``g`` and ``H`` are the exact derivatives of the
    fixed-draw objective (``H = dg/dm``, including the zeros between documents in the
    full layout and the couplings with ``mu``, which has its own products)."""
    D, K, V = 5, 2, 6
    beta = rng.dirichlet(np.ones(V), size=K)
    counts = rng.multinomial(12, np.ones(V) / V, size=D)
    with pm.Model():
        mu = pm.Normal("mu", 0, 1, shape=K)
        eta = pm.Normal("eta", mu, 1.0, shape=(D, K))
        p = pm.math.softmax(eta, axis=-1) @ beta + 0.01 * pm.math.sigmoid(mu.sum())
        pm.Multinomial("w", n=counts.sum(1), p=p / p.sum(-1, keepdims=True), observed=counts)
        inf = pymc_mcssvi.MCSSVI(n_draws=8, cov={"eta": cov, "mu": "full"})
    assert inf.tlm.observed["w"] == "general (MultinomialRV: multivariate)"
    assert inf.tlm.general_rows == (1,)
    k, fn = _functions(inf)
    means = [rng.normal(size=m.get_value().shape) * 0.3 for m in k.cand.means]
    covs = [
        np.broadcast_to(0.05 * np.eye(f.get_value().shape[-1]), f.get_value().shape).copy()
        for f in k.cand.factors
    ]
    _set(k, means, covs)
    out = fn()
    grads, hess = out[1 : 1 + k.nseg], out[1 + k.nseg :]
    h = 1e-6
    for s in range(k.nseg):
        R, K_s = means[s].shape
        for r in range(R):
            for i in range(K_s):
                mp, mm = [m.copy() for m in means], [m.copy() for m in means]
                mp[s][r, i] += h
                mm[s][r, i] -= h
                _set(k, mp, covs)
                Ep, gp = (lambda o: (o[0], o[1 + s]))(fn())
                _set(k, mm, covs)
                Em, gm = (lambda o: (o[0], o[1 + s]))(fn())
                np.testing.assert_allclose(grads[s][r, i], (Ep - Em) / (2 * h), rtol=1e-6)
                np.testing.assert_allclose(
                    hess[s][r, :, i], (gp - gm)[r] / (2 * h), rtol=1e-5, atol=1e-6
                )
    assert any(np.abs(H).max() > 0.1 for H in hess)


def _gathered_models(rng):
    P, n_items = 12, 4
    pp, ii = (a.ravel() for a in np.meshgrid(np.arange(P), np.arange(n_items), indexing="ij"))
    with pm.Model() as two_pl:  # item response: crossed gathers, one rows set colored
        th = pm.Normal("theta", 0, 1, shape=P)
        b = pm.Normal("b", 0, 2, shape=n_items)
        log_a = pm.Normal("log_a", 0, 0.5, shape=n_items)
        a = pm.Deterministic("a", pm.math.exp(log_a))
        # a person-specific factor on the discrimination: three predictors, the general
        # path (the plain 2PL's two, log_a[item] and theta - b, are a two-predictor term)
        s = pm.Normal("s", 0, 1, shape=P)
        logit = a[ii] * (th[pp] - b[ii]) * (1 + 0.1 * s[pp])
        pm.Bernoulli("y", logit_p=logit, observed=rng.integers(0, 2, pp.size))
    w, lo, w3 = rng.integers(0, P, 30), rng.integers(0, P, 30), rng.integers(0, P, 30)
    with pm.Model() as paired:  # the same global read three times per observation
        s = pm.Normal("s", 0, 1, shape=P)
        eta = pm.math.exp(s[w]) - pm.math.exp(s[lo]) + 0.5 * pm.math.tanh(s[w3])
        pm.Bernoulli("y", logit_p=eta, observed=rng.integers(0, 2, 30))
        # a second general term, of another length
        u, v, u3 = rng.integers(0, P, 9), rng.integers(0, P, 9), rng.integers(0, P, 9)
        mu = pm.math.exp(0.5 * s[u]) + pm.math.exp(-s[v]) + pm.math.exp(s[u3] - 2)
        pm.Poisson("z", mu=mu, observed=rng.poisson(2.0, 9))
    g, t = np.repeat(np.arange(5), 6), np.tile(np.linspace(0, 3, 6), 5)
    with pm.Model() as curves:  # per-group effects, joint rows in the block layout
        amp = pm.Normal("amp", 1, 1, shape=5)
        rate = pm.Normal("rate", 0.5, 0.3, shape=5)
        base = pm.Normal("base", 0, 1, shape=5)  # a third predictor: the general path
        mean = base[g] + amp[g] * pm.math.exp(-rate[g] * t)
        pm.Normal("y", mean, 0.2, observed=rng.normal(size=30))
    return {"two_pl": two_pl, "paired": paired, "curves": curves}


@pytest.mark.slow
@pytest.mark.parametrize("cov", ["full", "block", "diag"])
@pytest.mark.parametrize("name", ["two_pl", "paired", "curves"])
def test_per_observation_hessian_is_the_colored_one(rng, name, cov):
    """The per-observation form of a general term (every global read through gathers)
    gives the colored Hessian-vector products' ``T``, ``g`` and ``H`` for the same
    draws, in every layout (blocks that hold both coordinates of a pair, and none).
    Those are exact (``test_colored_hessian_of_row_separable_general_term``)."""
    from pymc.pytensorf import compile

    from pymc_mcssvi.estimators.general import GeneralEstimator, PerObservation
    from pymc_mcssvi.recognize import recognize

    tlm = recognize(_gathered_models(rng)[name], cov=cov)
    assert tlm.observed["y"] == "general"
    est = GeneralEstimator(tlm, n_draws=8)
    per_obs = PerObservation.build(tlm, est.offsets, est.maps)
    assert per_obs is not None
    states = []
    for seg in tlm.segments:
        A = np.tril(rng.normal(size=(seg.rows, seg.k, seg.k))) * 0.2 + np.eye(seg.k)
        states.append(GaussianBlocks(rng.normal(size=(seg.rows, seg.k)) * 0.3, A))
    est.per_observation = per_obs
    T1, g1, H1 = est.expectations(states, "covariance")
    est.per_observation = None
    T0, g0, H0 = est.expectations(states, "covariance")
    out = compile([], [T1, *g1, *H1, T0, *g0, *H0])()
    # finite where a draw puts sigmoid(x) at 1 in float64 (log(1 - sigmoid(x)) is
    # differentiated in its stable form; the colored products gave NaN on `paired`)
    assert all(np.isfinite(o).all() for o in out)
    n = len(out) // 2
    for mine, colored in zip(out[:n], out[n:], strict=True):
        np.testing.assert_allclose(mine, colored, rtol=1e-9, atol=1e-11)
    assert max(np.abs(H).max() for H in out[1 + len(g0) : n]) > 0.1
