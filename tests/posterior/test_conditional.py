"""Draws of the Gaussian globals from q(w | h) re-fitted at each draw of the hyperparameters."""

import numpy as np
import pymc as pm

import pymc_mcssvi  # noqa: F401  (registers the methods)
from pymc_mcssvi.posterior.conditional import ConditionalGlobals
from pymc_mcssvi.posterior.settings import SETTINGS


def _lmm(rng, G=5, n=60):
    g = np.concatenate([np.arange(G), rng.integers(0, G, n - G)])
    y = 1.0 + rng.normal(scale=0.7, size=G)[g] + rng.normal(scale=0.8, size=n)
    with pm.Model() as m:
        b0 = pm.Normal("b0", 0, 5)
        sd_a = pm.HalfNormal("sd_a", 1)
        sigma = pm.HalfNormal("sigma", 1)
        a = pm.Normal("a", 0, sd_a, shape=G)
        pm.Normal("y", b0 + a[g], sigma, observed=y)
    return m, g, y


def test_refit_is_the_exact_conditional_posterior_of_a_gaussian_model(rng):
    """Gaussian likelihood: at any (sd_a, sigma) the re-fitted q(w | h) is the closed-form
    posterior of (b0, a) given them, for every draw of a batch (natural steps with rho = 1
    are exact in one step; the batch is vectorized)."""
    m, g, y = _lmm(rng)
    with m:
        approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    sampler = approx._conditional_samplers()[0]
    assert isinstance(sampler, ConditionalGlobals)
    h = np.array([[-1.5, -0.4], [-0.2, -0.2], [0.5, 0.3]])  # log sd_a, log sigma
    means, factors, values = sampler.refit([h[:, 0], h[:, 1]])
    assert np.isfinite(values).all()
    group = approx.groups[0]
    G = g.max() + 1
    D = np.column_stack([np.ones(len(y)), np.eye(G)[g]])
    order = np.r_[group.ordering["b0"][1], np.arange(G) + group.ordering["a"][1].start]
    for i, (la, ls) in enumerate(h):
        s_a, s_y = np.exp(la), np.exp(ls)
        P = np.diag(np.r_[1 / 25, np.full(G, 1 / s_a**2)]) + D.T @ D / s_y**2
        mean = np.linalg.solve(P, D.T @ y / s_y**2)
        flat_m, flat_P = np.empty(group.ddim), np.zeros((group.ddim, group.ddim))
        for m_s, L_s, idx in zip(means, factors, group.flat_maps, strict=True):
            idx = np.asarray(idx)
            flat_m[idx.reshape(-1)] = m_s[i].reshape(-1)
            for r in range(idx.shape[0]):
                flat_P[np.ix_(idx[r], idx[r])] = L_s[i, r] @ L_s[i, r].T
        np.testing.assert_allclose(flat_m[order], mean, atol=1e-8)
        np.testing.assert_allclose(flat_P[np.ix_(order, order)], P, rtol=1e-8, atol=1e-8)


def test_draws_are_reproducible_and_not_refitted_when_too_expensive(rng, monkeypatch):
    m, _, _ = _lmm(rng)
    with m:
        approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    a1 = approx.sample(50, random_seed=3).posterior["a"].values
    a2 = approx.sample(50, random_seed=3).posterior["a"].values
    np.testing.assert_array_equal(a1, a2)
    sampler = approx._conditional_samplers()[0]
    calls = []
    monkeypatch.setattr(sampler, "refit", lambda hs: calls.append(hs) or 1 / 0)
    monkeypatch.setattr(SETTINGS, "exact_conditional_work", 0.0)
    approx.sample(50, random_seed=3)  # the linear-response draws: no re-fit
    assert calls == []


def test_a_gridded_q_h_draws_from_its_nodes_without_a_refit_per_draw(rng, monkeypatch):
    """With one or two hyperparameter coordinates q(h) is gridded and q(w | h) was
    re-fitted at every node: the draws interpolate between the nodes, also where a
    re-fit at every draw would be affordable (it was no closer to NUTS and 30x
    slower: radon 2000 draws 6.7-7.2 s against 0.2 s). The interpolated draws keep
    the conditional spread: ``a``'s sds follow the exact posterior averaged over
    q(h) (checked against a re-fit at every draw)."""
    m, _, _ = _lmm(rng, G=5, n=40)
    with m:
        approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    sampler = approx._conditional_samplers()[0]
    assert sampler.nodes is not None and sampler.affordable(2000)
    exact = sampler.refit
    calls = []
    monkeypatch.setattr(sampler, "refit", lambda *a, **k: calls.append(1) or exact(*a, **k))
    post = approx.sample(2000, random_seed=3).posterior
    assert calls == []
    # a re-fit at every draw: the same moments within Monte Carlo error
    monkeypatch.setattr(sampler, "nodes", None)
    ref = approx.sample(2000, random_seed=4).posterior
    assert calls
    for v in ("a", "b0"):
        sd = ref[v].std(("chain", "draw")).values
        z = np.abs(post[v].mean(("chain", "draw")).values - ref[v].mean(("chain", "draw")).values)
        np.testing.assert_array_less(z / sd, 0.1)
        np.testing.assert_allclose(post[v].std(("chain", "draw")).values, sd, rtol=0.08)


def test_special_functions_count_in_the_refit_budget(rng):
    """A Beta likelihood's re-fit evaluates digamma and its derivatives (SciPy's Hurwitz
    zeta) at every draw, row and node: far above the fit's 10 flops per node. 1000
    re-fitted draws took 18 s; counted at their measured cost they are not affordable,
    while the same number of a Gaussian model's draws (no special function) are."""
    x = rng.normal(size=400)
    mu = 1 / (1 + np.exp(-(0.2 + 0.5 * x)))
    y = np.clip(rng.beta(mu * 20, (1 - mu) * 20), 1e-4, 1 - 1e-4)
    with pm.Model() as beta:
        a, b = pm.Normal("a", 0, 2), pm.Normal("b", 0, 2)
        kappa = pm.Gamma("kappa", 2, 0.1)
        pm.Beta("y", mu=pm.math.sigmoid(a + b * x), nu=kappa, observed=y)
    for model, expensive in ((beta, True), (_lmm(rng)[0], False)):
        with model:
            approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
        sampler = approx._conditional_samplers()[0]
        names = [v.name for v in sampler.kernel.hypers.spec.values]
        hs = [np.asarray(approx.sample_dict_fn(2, random_seed=0)[n]) for n in names]
        assert sampler.affordable(1000) and sampler.affordable(1000, hs) != expensive
        assert (sampler._measure(hs)[1] > 0) == expensive


def _poisson_intercepts(rng, G=6, n=90):
    g = np.concatenate([np.arange(G), rng.integers(0, G, n - G)])
    y = rng.poisson(np.exp(0.5 + rng.normal(scale=0.6, size=G)[g]))
    with pm.Model() as m:
        b0 = pm.Normal("b0", 0, 2)
        sd_a = pm.HalfNormal("sd_a", 1)
        a = pm.Normal("a", 0, sd_a, shape=G)
        pm.Poisson("y", pm.math.exp(b0 + a[g]), observed=y)
    return m


def _counting(sampler):
    """Wrap the compiled re-fit step to record the draws each call computed."""
    sampler.refit([np.zeros(1)], max_steps=1)  # compiles it
    fn, rows = sampler._fn, []

    def step(hs, *args):
        rows.append(hs[0].shape[0])
        return fn(hs, *args)

    sampler._fn = step
    return rows


def test_batched_refits_match_single_draws_and_stop_each_on_its_own(rng):
    """Non-conjugate re-fits converge in different numbers of steps: each draw of a batch
    stops on its own (later calls compute the draws still moving only) and ends where
    its re-fit alone does; with a ``floor`` a draw far below it stops early, below it and
    below its converged value, while the draws above it are unchanged."""
    m = _poisson_intercepts(rng)
    with m:
        approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    sampler = approx._conditional_samplers()[0]
    rows = _counting(sampler)
    h = np.array([-6.0, -1.0, -0.5, 0.4])  # log sd_a: the first far in the tail
    means, _, values = sampler.refit([h])
    assert np.isfinite(values).all()
    assert rows[0] == 4 and min(rows) < 4  # converged draws left the batch
    full = sum(rows)
    for i in range(len(h)):
        m_i, _, v_i = sampler.refit([h[i : i + 1]])
        np.testing.assert_allclose(v_i[0], values[i], rtol=0, atol=1e-9)
        for a, b in zip(m_i, means, strict=True):
            np.testing.assert_allclose(a[0], b[i], atol=1e-8)
    rows.clear()
    floor = values[1:].min() - 1.0
    assert values[0] < floor - 5.0
    _, _, floored = sampler.refit([h], floor=floor)
    np.testing.assert_allclose(floored[1:], values[1:], rtol=0, atol=1e-9)
    assert floored[0] < floor and floored[0] <= values[0] + 1e-9
    assert sum(rows) < full  # the far draw stopped early


def test_draws_past_the_refit_count_move_the_nearest_refit(rng, monkeypatch):
    """``sample(n)`` re-fits at most ``SETTINGS.max_refit_draws`` draws (its cost stops
    growing with ``n``: ``sample(1000)`` took 3-4.6 s where ``sample(2000)`` fell back to
    the view in 0.1 s); the others take the nearest re-fit moved by the linear response,
    and their moments are those of a re-fit at every draw."""
    m = _poisson_intercepts(rng)
    with m:
        approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
    sampler = approx._conditional_samplers()[0]
    sampler.nodes = None  # re-fits, not the gridded q(h)'s nodes
    rows = _counting(sampler)
    monkeypatch.setattr(SETTINGS, "max_refit_draws", 64)
    monkeypatch.setattr(SETTINGS, "refit_batch_draws", 32)
    moved = approx.sample(1500, random_seed=3).posterior
    refitted = sum(r for r in rows)  # draws computed per step call
    assert 64 <= refitted <= 64 * SETTINGS.max_conditional_steps, rows
    assert max(rows) <= 32 and sum(1 for r in rows if r == 32) >= 2
    monkeypatch.setattr(SETTINGS, "max_refit_draws", 10**6)
    monkeypatch.setattr(SETTINGS, "refit_batch_draws", 10**6)
    exact = approx.sample(1500, random_seed=4).posterior
    for name in ("a", "b0"):
        a, b = moved[name].values.reshape(1500, -1), exact[name].values.reshape(1500, -1)
        se = b.std(0) / np.sqrt(1500)
        np.testing.assert_array_less(np.abs(a.mean(0) - b.mean(0)), 4 * se + 1e-3)
        np.testing.assert_allclose(a.std(0), b.std(0), rtol=0.1)
