"""Minibatch fits against NUTS: issue 50, item 3.

A Bayesian logistic regression with 20,000 rows, 4 correlated covariates and an
intercept (``common.logistic_regression_data``, weights ``w ~ N(0, 2^2)``), fitted
five ways in one run:

``hmcssvi``
    ``pm.fit(method="hmcssvi")`` on ``pm.Minibatch(X, y, batch_size=500)`` with
    ``total_size`` (defaults: the stochastic steps end with full-data steps from the
    iterates' average), for each of :data:`SEEDS`;
``hmcssvi_nopolish``
    the same with ``inf_kwargs={"polish": False}`` (the iterate average only);
``hmcssvi_full``
    ``pm.fit(method="hmcssvi")`` on the full-batch model;
``advi``
    PyMC's ADVI on the minibatch model, at most :data:`ADVI_N` iterations or until
    ``pm.callbacks.CheckParametersConvergence`` stops it;
``nuts``
    ``pm.sample`` on the full data (:data:`NUTS`).

Each method runs in a subprocess of its own, so that its peak memory (``VmHWM``)
is its own (for NUTS: the parent process; the chains run in worker processes).
Reported per fit: seconds of ``pm.fit`` / ``pm.sample`` (compilation included),
iterations, ``approx.converged`` where it applies, the largest ``|z|`` of the
posterior means against NUTS's in NUTS sds, the sd ratios to NUTS (from
:data:`DRAWS` draws of each approximation) and the peak memory. Target (issue 50):
the default minibatch fit within 0.1 NUTS sd of NUTS's means.

Run ``python benchmarks/minibatch.py`` (about 5 minutes on 2 cores); ``--no-docs``
leaves ``docs/benchmarks.md`` alone. Writes ``benchmarks/results/minibatch.json``
and the ``minibatch`` section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import fmt, log, vmhwm_mb  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SECTION = "minibatch"
N_ROWS, D = 20_000, 5
BATCH = 500
SEEDS = (0, 1, 2)
DRAWS = 4000
ADVI_N = 20_000
NUTS = dict(chains=2, tune=1000, draws=1000, cores=2)
METHODS = ("nuts", "hmcssvi", "hmcssvi_nopolish", "hmcssvi_full", "advi")
WORKER_TIMEOUT = 1800.0


def build_model(minibatch: bool):
    import pymc as pm

    data = common.logistic_regression_data(N_ROWS, D, 0, seed=0)
    X, y = data.X, data.y.astype("float64")
    with pm.Model() as model:
        w = pm.Normal("w", 0.0, 2.0, shape=D)
        if minibatch:
            Xb, yb = pm.Minibatch(X, y, batch_size=BATCH)
            pm.Bernoulli("y", logit_p=Xb @ w, observed=yb, total_size=N_ROWS)
        else:
            pm.Bernoulli("y", logit_p=X @ w, observed=y)
    return model, data


def _moments(approx, seed) -> dict:
    w = approx.sample(DRAWS, random_seed=seed).posterior["w"].values.reshape(-1, D)
    return {"mean": w.mean(0).tolist(), "sd": w.std(0).tolist()}


def run_method(method: str) -> dict:
    import pymc as pm

    import pymc_mcssvi  # noqa: F401  (registers method="hmcssvi")

    out = {"method": method, "fits": [], "run": common.run_record("full")}
    model, data = build_model(minibatch=method not in ("nuts", "hmcssvi_full"))
    out["w_true"] = data.w_true.tolist()
    with model:
        if method == "nuts":
            t0 = time.perf_counter()
            idata = pm.sample(
                **NUTS, random_seed=0, progressbar=False, compute_convergence_checks=False
            )
            seconds = time.perf_counter() - t0
            import arviz as az

            w = idata.posterior["w"].values.reshape(-1, D)
            out["fits"].append(
                {
                    "seed": 0,
                    "seconds": seconds,
                    "iterations": NUTS["tune"] + NUTS["draws"],
                    "mean": w.mean(0).tolist(),
                    "sd": w.std(0).tolist(),
                    "divergences": int(idata.sample_stats["diverging"].sum()),
                    "rhat_max": float(az.rhat(idata)["w"].max()),
                    "ess_bulk_min": float(az.ess(idata)["w"].min()),
                }
            )
        elif method == "advi":
            cb = pm.variational.callbacks.CheckParametersConvergence(diff="absolute")
            t0 = time.perf_counter()
            approx = pm.fit(ADVI_N, method="advi", callbacks=[cb], random_seed=0, progressbar=False)
            seconds = time.perf_counter() - t0
            out["fits"].append(
                {
                    "seed": 0,
                    "seconds": seconds,
                    "iterations": len(approx.hist),
                    **_moments(approx, 0),
                }
            )
        else:
            seeds = (0,) if method == "hmcssvi_full" else SEEDS
            inf_kwargs = {"polish": False} if method == "hmcssvi_nopolish" else {}
            for seed in seeds:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    t0 = time.perf_counter()
                    approx = pm.fit(
                        method="hmcssvi", random_seed=seed, progressbar=False, inf_kwargs=inf_kwargs
                    )
                    seconds = time.perf_counter() - t0
                out["fits"].append(
                    {
                        "seed": seed,
                        "seconds": seconds,
                        "iterations": int(approx.n_iter),
                        "converged": approx.converged,
                        **_moments(approx, seed),
                        "warnings": sorted(
                            {
                                f"{w.category.__name__}: {str(w.message)[:200]}"
                                for w in caught
                                if not issubclass(w.category, DeprecationWarning | FutureWarning)
                            }
                        ),
                    }
                )
                log(f"  {method} seed {seed}: {seconds:.1f} s, {approx.n_iter} iterations")
    out["peak_mb"] = vmhwm_mb()
    return out


def worker_main(method: str, path: str) -> None:
    import traceback

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("pymc").setLevel(logging.ERROR)
    try:
        res = run_method(method)
    except Exception as e:  # recorded, the benchmark goes on
        traceback.print_exc()
        res = {"method": method, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    common.save_json(res, path)


def compare(results: dict) -> None:
    """Add ``max_z`` and the sd ratios against NUTS to every fit."""
    ref = results["methods"]["nuts"]["fits"][0]
    ref_mean, ref_sd = np.asarray(ref["mean"]), np.asarray(ref["sd"])
    for r in results["methods"].values():
        for fit in r.get("fits", []):
            fit.update(common.moment_errors(fit["mean"], fit["sd"], ref_mean, ref_sd))


# ============================================================================ report
def render(results: dict) -> str:
    meta = results["meta"]
    mach, v, code = meta["machine"], meta["versions"], meta["code_start"]
    L = ["(bench-minibatch)=", "## Minibatch fits against NUTS", ""]
    L.append(
        f"Run {meta['date']} on {mach.get('cpu_model', mach.get('machine'))} "
        f"({mach.get('cpu_count')} logical CPUs, shared with other jobs: load average "
        f"{meta['load_start']} at the start, {meta['load_end']} at the end; "
        f"{mach.get('mem_total_gb')} GB), PyMC {v.get('pymc')}, PyTensor {v.get('pytensor')}, "
        f"NumPy {v.get('numpy')}, commit {code.get('commit')}"
        + (" with uncommitted changes to the plugin" if code.get("plugin_dirty") else "")
        + f" (plugin sources sha1 {code.get('plugin_sources_sha1')}). Total "
        f"{meta['total_wall'] / 60:.1f} min."
        + "".join(
            f" {', '.join(later['methods'])}: run {later['date']} (load {later['load_start']} / "
            f"{later['load_end']}), commit {later['code_start'].get('commit')}."
            for later in meta.get("later_runs", [])
        )
        + " Reproduce: `python benchmarks/minibatch.py` (`--only METHOD,...`); raw "
        "numbers in `benchmarks/results/minibatch.json`."
    )
    L.append("")
    L.append(
        f"Issue 50, item 3: logistic regression, {N_ROWS:,} rows, {D - 1} correlated covariates "
        f"(Toeplitz 0.8) and an intercept, `w ~ Normal(0, 2)`; `pm.Minibatch(X, y, "
        f"batch_size={BATCH})` with `total_size={N_ROWS}` (y cast to float). *hmcssvi*: "
        '`pm.fit(method="hmcssvi")` defaults on the minibatch model (ends with full-data '
        'steps); *no polish*: the same with `inf_kwargs={"polish": False}` (iterate average '
        "only); *full batch*: the plugin on the full-data model; *ADVI*: "
        f'`pm.fit({ADVI_N}, method="advi", callbacks=[CheckParametersConvergence(diff="absolute")])` '
        f"on the minibatch model; *NUTS*: {NUTS['chains']} chains x {NUTS['draws']} draws after "
        f"{NUTS['tune']} tuning steps on the full data. Moments from {DRAWS} draws of each "
        "approximation. *max |z|*: largest distance of a posterior mean from NUTS's in NUTS "
        "sds; *sd ratio*: q's sd over NUTS's (min-max over the 5 weights). Seconds include "
        "compilation; each method runs in a subprocess of its own, whose `VmHWM` is *peak MB* "
        "(NUTS: the parent process, the chains run in workers). Target: *hmcssvi* within "
        "0.1 NUTS sd."
    )
    L.append("")
    labels = {
        "hmcssvi": "hmcssvi (minibatch, polish)",
        "hmcssvi_nopolish": "hmcssvi (minibatch, polish=False)",
        "hmcssvi_full": "hmcssvi (full batch)",
        "advi": "ADVI (minibatch)",
        "nuts": "NUTS (full data)",
    }
    rows = []
    for m in ("hmcssvi", "hmcssvi_nopolish", "hmcssvi_full", "advi", "nuts"):
        r = results["methods"].get(m, {})
        if r.get("error"):
            rows.append([labels[m], r["error"][:150], *[""] * 7])
            continue
        for fit in r["fits"]:
            conv = fit.get("converged")
            rows.append(
                [
                    labels[m],
                    fit["seed"],
                    fmt(fit["seconds"], ".1f"),
                    fit["iterations"],
                    "–" if conv is None else conv,
                    fmt(fit["max_z"], ".3f"),
                    fmt(fit["rms_z"], ".3f"),
                    f"{fit['sd_ratio_min']:.2f}-{fit['sd_ratio_max']:.2f}",
                    fmt(r["peak_mb"], ".0f"),
                ]
            )
    L.append(
        common.markdown_table(
            [
                "method",
                "seed",
                "seconds",
                "iterations",
                "converged",
                "max abs z",
                "rms z",
                "sd ratio",
                "peak MB",
            ],
            rows,
        )
    )
    L.append("")
    nuts = results["methods"].get("nuts", {}).get("fits", [{}])[0]
    if nuts:
        L.append(
            f"NUTS: {nuts.get('divergences')} divergences, max r-hat {fmt(nuts.get('rhat_max'), '.3f')}, "
            f"min bulk ESS {fmt(nuts.get('ess_bulk_min'), '.0f')}. The NUTS means themselves carry "
            f"Monte Carlo error of about 1/sqrt(ESS) = "
            f"{fmt(1 / np.sqrt(nuts.get('ess_bulk_min', np.nan)), '.3f')} sd."
        )
        L.append("")
    if results.get("verdict"):
        L.append(results["verdict"])
        L.append("")
    if results.get("analysis"):
        L.append(results["analysis"])
        L.append("")
    notes = [
        f"{labels[m]}, seed {fit['seed']}: {w}"
        for m, r in results["methods"].items()
        for fit in r.get("fits", [])
        for w in fit.get("warnings", [])
    ]
    if notes:
        L.append("Warnings during the fits:\n")
        L.extend(f"- {n}" for n in notes)
        L.append("")
    return "\n".join(L)


def verdict(results: dict) -> str:
    fits = results["methods"].get("hmcssvi", {}).get("fits", [])
    if not fits:
        return ""
    worst = max(f["max_z"] for f in fits)
    ok = "meets" if worst <= 0.1 else "misses"
    return (
        f"Target (default minibatch fit within 0.1 NUTS sd of NUTS's means): the worst of "
        f"{len(fits)} seeds is {worst:.3f} sd, which {ok} it."
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--no-docs", action="store_true", help="do not touch docs/benchmarks.md")
    parser.add_argument(
        "--analysis", default=None, help="with --report-from: markdown file added as discussion"
    )
    parser.add_argument(
        "--only", default=None, help="comma-separated methods: " + ",".join(METHODS)
    )
    parser.add_argument(
        "--report-from", default=None, help="re-render the docs section from a JSON"
    )
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.out)
    out_path = RESULTS / "minibatch.json"
    if args.report_from:
        results = json.loads(Path(args.report_from).read_text())
        if args.analysis:
            results["analysis"] = Path(args.analysis).read_text().strip()
            common.save_json(results, args.report_from)
    else:
        meta = {
            "date": common.today(),
            "machine": common.machine_info(),
            "versions": common.library_versions(("pymc", "pytensor", "numpy", "pymc_mcssvi")),
            "load_start": common.loadavg(),
            "code_start": common.code_state(),
            "n_rows": N_ROWS,
            "d": D,
            "batch_size": BATCH,
            "seeds": SEEDS,
            "nuts": NUTS,
            "advi_n": ADVI_N,
            "draws": DRAWS,
        }
        # one data set: the file's "run" is its record; every method has its own
        results = {"meta": meta, "methods": {}, "run": common.run_record("full")}
        run = meta
        names = METHODS if not args.only else [s.strip() for s in args.only.split(",")]
        if args.only and out_path.exists():
            # add to an earlier run: its meta stays, this run is recorded beside it
            old = json.loads(out_path.read_text())
            results = old | {"methods": {k: v for k, v in old["methods"].items() if k not in names}}
            meta["methods"] = names
            results["meta"].setdefault("later_runs", []).append(meta)
        t0 = time.perf_counter()
        for m in names:
            log(m)
            results["methods"][m] = r = common.run_worker(
                __file__, [m], {"method": m}, WORKER_TIMEOUT
            )
            if r.get("error"):
                log(f"  error: {r['error']}")
            else:
                log(
                    f"  peak {r['peak_mb']:.0f} MB, {[round(f['seconds'], 1) for f in r['fits']]} s"
                )
            common.save_json(results, out_path)
        run["load_end"] = common.loadavg()
        run["code_end"] = common.code_state()
        run["total_wall"] = time.perf_counter() - t0
        if not results["methods"]["nuts"].get("error"):
            compare(results)
        results["methods"] = {k: results["methods"][k] for k in METHODS if k in results["methods"]}
        results["verdict"] = verdict(results)
        common.save_json(results, out_path)
        log(f"wrote {out_path}")
    print(render(results))
    if not args.no_docs:
        common.write_section(SECTION, render(results), common.DOCS_PATH)
        log(f"wrote section '{SECTION}' of {common.DOCS_PATH}")
    return results


if __name__ == "__main__":
    main()
