"""Distributional models: likelihoods whose second parameter is a regression too.

The plugin reads them as two affine predictors and takes the bound's expectations by
2-D Gauss-Hermite quadrature (``describe`` reads "two affine predictors"). Four models
as users write them, on data generated from them:

- ``hetero_glmm``: ``Normal(b0 + b1 x + sd_g z[g], exp(s[c] + s_x x))`` (bambi's
  ``y ~ x + (1|g)``, ``sigma ~ x + c``), 5000 rows, 100 groups;
- ``negbin_dispersion``: ``NegativeBinomial(exp(b0 + b1 x + sd_g z[g]),
  exp(log_alpha[g]))``, 2000 rows, 40 groups;
- ``beta_precision``: ``Beta(invlogit(a + X b), exp(g0 + X g))``, 2000 rows;
- ``irt_2pl``: ``Bernoulli(logit_p=exp(log_a)[item] * (theta[person] - b[item]))``,
  300 persons x 20 items, hierarchical difficulties.

Methods in the same run: H-MC-SSVI (``pm.fit(method="hmcssvi")``, defaults), PyMC
ADVI (30,000 iterations) and FullRankADVI (20,000), both with PyMC's defaults and
timed for the whole run, and NUTS (``pm.sample(1000, tune=1000, chains=2,
cores=2)``) as the reference. Accuracy from 4000 draws of each approximation: the
largest ``|mean - mean_NUTS| / sd_NUTS`` and the range of ``sd / sd_NUTS`` over every
coordinate of every free variable (constrained space). Wall times include
compilation (cold: the first fit of each method on each model in the process).

Run ``python benchmarks/distributional.py`` (about 10 minutes on 2 cores). Writes
``benchmarks/results/distributional.json`` and the ``distributional`` section of
``docs/benchmarks.md``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pymc as pm

import pymc_mcssvi

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import run_record  # noqa: E402

START, END = "<!-- distributional:start -->", "<!-- distributional:end -->"


def hetero_glmm(rng):
    n, G = 5000, 100
    g, x, c = rng.integers(0, G, n), rng.normal(size=n), rng.integers(0, 3, n)
    y = 1 + 0.5 * x + rng.normal(0, 0.5, G)[g]
    y = y + np.exp(np.array([-0.6, 0.0, 0.5])[c] + 0.3 * x) * rng.normal(size=n)
    with pm.Model(coords={"g": np.arange(G), "c": ["lo", "mid", "hi"]}) as m:
        b0, b1 = pm.Normal("b0", 0, 2), pm.Normal("b1", 0, 1)
        sd_g = pm.HalfNormal("sd_g", 1)
        z = pm.Normal("z", 0, 1, dims="g")
        s = pm.Normal("s", 0, 1, dims="c")
        s_x = pm.Normal("s_x", 0, 1)
        pm.Normal("y", b0 + b1 * x + sd_g * z[g], pm.math.exp(s[c] + s_x * x), observed=y)
    return m


def negbin_dispersion(rng):
    n, G = 2000, 40
    g, x = rng.integers(0, G, n), rng.normal(size=n)
    alpha = np.exp(rng.normal(1.0, 0.5, G))[g]
    mu = np.exp(1.0 + 0.4 * x + rng.normal(0, 0.4, G)[g])
    y = rng.negative_binomial(alpha, alpha / (alpha + mu))
    with pm.Model(coords={"g": np.arange(G)}) as m:
        b0, b1 = pm.Normal("b0", 0, 2), pm.Normal("b1", 0, 1)
        sd_g = pm.HalfNormal("sd_g", 1)
        z = pm.Normal("z", 0, 1, dims="g")
        log_alpha = pm.Normal("log_alpha", 1, 1, dims="g")
        pm.NegativeBinomial(
            "y",
            mu=pm.math.exp(b0 + b1 * x + sd_g * z[g]),
            alpha=pm.math.exp(log_alpha[g]),
            observed=y,
        )
    return m


def beta_precision(rng):
    n = 2000
    X = rng.normal(size=(n, 2))
    mu = 1 / (1 + np.exp(-(0.3 + X @ np.array([0.6, -0.5]))))
    phi = np.exp(2.5 + 0.6 * X[:, 0])
    y = np.clip(rng.beta(mu * phi, (1 - mu) * phi), 1e-6, 1 - 1e-6)
    with pm.Model() as m:
        a, b = pm.Normal("a", 0, 2), pm.Normal("b", 0, 1, shape=2)
        g0, gc = pm.Normal("g0", 0, 2), pm.Normal("g", 0, 1, shape=2)
        pm.Beta("y", mu=pm.math.invlogit(a + X @ b), nu=pm.math.exp(g0 + X @ gc), observed=y)
    return m


def irt_2pl(rng):
    P, n_items = 300, 20
    th, bd = rng.normal(size=P), rng.normal(0, 1, n_items)
    ad = rng.lognormal(0, 0.3, n_items)
    grid = np.meshgrid(np.arange(P), np.arange(n_items), indexing="ij")
    pi, ii = (a.ravel() for a in grid)
    y = rng.binomial(1, 1 / (1 + np.exp(-ad[ii] * (th[pi] - bd[ii]))))
    with pm.Model() as m:
        theta = pm.Normal("theta", 0, 1, shape=P)
        mu_b, s_b = pm.Normal("mu_b", 0, 2), pm.HalfNormal("s_b", 2)
        b = pm.Normal("b", mu_b, s_b, shape=n_items)
        log_a = pm.Normal("log_a", 0, 0.5, shape=n_items)
        pm.Bernoulli("y", logit_p=pm.math.exp(log_a)[ii] * (theta[pi] - b[ii]), observed=y)
    return m


MODELS = {
    "hetero_glmm": hetero_glmm,
    "negbin_dispersion": negbin_dispersion,
    "beta_precision": beta_precision,
    "irt_2pl": irt_2pl,
}


def _flat(idata, names):
    post = idata.posterior
    return np.concatenate(
        [post[v].values.reshape(post.sizes["chain"] * post.sizes["draw"], -1) for v in names],
        axis=1,
    )


def _fit(model, method, n=None):
    kw = {"method": method, "progressbar": False, "random_seed": 1}
    if n is not None:
        kw["n"] = n
    t = time.perf_counter()
    with model, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        approx = pm.fit(**kw)
    return approx, time.perf_counter() - t


def run_model(name):
    model = MODELS[name](np.random.default_rng(2026))
    names = [v.name for v in model.free_RVs]
    out = {
        "predictor": pymc_mcssvi.describe(model).predictor("y"),
        "methods": {},
        "run": run_record("full"),
    }
    nuts_record = run_record("full")
    t = time.perf_counter()
    with model, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        idata = pm.sample(1000, tune=1000, chains=2, cores=2, random_seed=1, progressbar=False)
    nuts_s = time.perf_counter() - t
    ref = _flat(idata, names)
    ref_m, ref_s = ref.mean(0), ref.std(0)
    div = int(idata.sample_stats["diverging"].sum())
    out["methods"]["NUTS"] = {"seconds": nuts_s, "divergences": div, "run": nuts_record}
    for label, method, n in (
        ("H-MC-SSVI", "hmcssvi", None),
        ("ADVI", "advi", 30000),
        ("FullRankADVI", "fullrank_advi", 20000),
    ):
        record = run_record("full")
        approx, secs = _fit(model, method, n)
        draws = _flat(approx.sample(4000, random_seed=3), names)
        z = np.abs(draws.mean(0) - ref_m) / ref_s
        r = draws.std(0) / ref_s
        out["methods"][label] = {
            "seconds": secs,
            "max_z": float(z.max()),
            "sd_ratio": [float(r.min()), float(r.max())],
            "mean_abs_sd_error": float(np.mean(np.abs(r - 1))),
            "run": record,
        }
        print(name, label, f"{secs:.1f} s, max z {z.max():.2f}, sd {r.min():.2f}-{r.max():.2f}")
    print(name, "NUTS", f"{nuts_s:.1f} s, {div} divergences")
    return out


def _markdown(results, meta):
    lines = [
        START,
        "## Distributional models: two affine predictors",
        "",
        f"Run {meta['date']} on {meta['machine']}; Python {meta['python']}, pymc "
        f"{pm.__version__}, pymc_mcssvi at commit {meta['commit']}. Script: "
        "`python benchmarks/distributional.py`; raw numbers in "
        "`benchmarks/results/distributional.json`. Models and settings: the script's "
        "docstring. *max z*: largest |mean - mean_NUTS| / sd_NUTS over every coordinate; "
        "*sd ratio*: range of sd / sd_NUTS; *mean sd err*: mean |sd / sd_NUTS - 1|; "
        "*x NUTS*, *x FullRankADVI*: their wall time over H-MC-SSVI's (compilation "
        "included; ADVI and FullRankADVI run a fixed 30,000 / 20,000 iterations).",
        "",
        "| model | predictor | method | wall s | max z | sd ratio | mean sd err |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, res in results.items():
        for label, r in res["methods"].items():
            if label == "NUTS":
                lines.append(
                    f"| {name} | {res['predictor']} | NUTS (reference, "
                    f"{r['divergences']} div.) | {r['seconds']:.1f} | 0 | 1 | 0 |"
                )
                continue
            lo, hi = r["sd_ratio"]
            lines.append(
                f"| {name} | {res['predictor']} | {label} | {r['seconds']:.1f} | "
                f"{r['max_z']:.2f} | {lo:.2f}-{hi:.2f} | {r['mean_abs_sd_error']:.3f} |"
            )
    lines += ["", "| model | x NUTS | x FullRankADVI | x ADVI |", "|---|---|---|---|"]
    for name, res in results.items():
        m = res["methods"]
        ours = m["H-MC-SSVI"]["seconds"]
        lines.append(
            f"| {name} | {m['NUTS']['seconds'] / ours:.1f} | "
            f"{m['FullRankADVI']['seconds'] / ours:.1f} | {m['ADVI']['seconds'] / ours:.1f} |"
        )
    lines += ["", END]
    return "\n".join(lines)


def main():
    results = {name: run_model(name) for name in MODELS}
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    meta = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.processor() or platform.machine()} ({os.cpu_count()} "
        f"logical CPUs), {platform.platform()}",
        "python": platform.python_version(),
        "commit": commit,
    }
    (ROOT / "benchmarks/results").mkdir(exist_ok=True)
    (ROOT / "benchmarks/results/distributional.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=2)
    )
    doc = ROOT / "docs/benchmarks.md"
    text = doc.read_text()
    section = _markdown(results, meta)
    if START in text:
        text = text[: text.index(START)] + section + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    doc.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
