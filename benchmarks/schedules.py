"""Step-size schedules on the GLM workload: -ELBO gap to the optimum bound after 10, 30, 60 iterations.

The workload is `glm_logistic.py`'s (N = 50,000, D = 100, Toeplitz 0.8, seed 0;
``--quick``: N = 5,000, D = 20). The optimum is computed in the same run as in
`glm_logistic.py`: the best -ELBO of 150-iteration MC-SSVI and H-MC-SSVI runs with
the default (adaptive) step size. Each row runs :data:`ITERS` iterations with
``tol=None``; the -ELBO is the plugin's exact (Gauss-Hermite) bound, so the gaps
carry no Monte Carlo noise. The rows are the package's defaults, the paper's
1/t schedule for MC-SSVI, and the paper's H-MC-SSVI (1/t schedule and an Adagrad
mean step with rate 1.0, paper section "Experiments"), plus the Adagrad mean step
under the adaptive schedule.

Run by hand: ``python benchmarks/schedules.py`` (about two minutes on 2 cores;
``--quick`` a few seconds); prints a markdown table and writes
``benchmarks/results/schedules.json`` (``schedules_quick.json`` with ``--quick``),
every row with its ``run`` record (commit, date, machine, load). The paper's
claim 2 on ``docs/paper_reproduction.md`` is rendered from it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ITERS = 60
LONG_ITERS = 150
CHECKPOINTS = (10, 30, 60)
#: passes to "reach the optimum": within this relative distance of it
REL = 1e-4
FULL = dict(n=50_000, d=100, n_test=10_000)
QUICK = dict(n=5_000, d=20, n_test=2_000)
PAPER = {"schedule": "inverse", "mean_optimizer": ("adagrad", 1.0)}
#: (key, label, class, options)
RUNS = [
    ("mcssvi_adaptive", "MC-SSVI, adaptive (default)", "MCSSVI", {}),
    ("hmcssvi_adaptive", "H-MC-SSVI, adaptive (default)", "HMCSSVI", {}),
    (
        "hmcssvi_adagrad_adaptive",
        "H-MC-SSVI, adaptive + Adagrad 1.0",
        "HMCSSVI",
        {"mean_optimizer": ("adagrad", 1.0)},
    ),
    ("mcssvi_inverse", "MC-SSVI, 1/t (paper)", "MCSSVI", {"schedule": "inverse"}),
    ("hmcssvi_paper", "H-MC-SSVI, 1/t + Adagrad 1.0 (paper)", "HMCSSVI", PAPER),
]


def passes_to(hist, optimum, rel=REL):
    """First iteration (1-based) from which the -ELBO stays within ``rel`` of ``optimum``."""
    _, i = common.time_to_within(np.arange(1, len(hist) + 1), hist, optimum, rel=rel)
    return None if i is None else i + 1


def fit_hist(model, cls, n, **kw):
    import pymc_mcssvi

    record = common.run_record()
    t0 = time.perf_counter()
    with model:
        approx = getattr(pymc_mcssvi, cls)(random_seed=0, **kw).fit(
            n=n, tol=None, progressbar=False, diagnose=False
        )
    return np.asarray(approx.hist), time.perf_counter() - t0, record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 5,000, D = 20")
    args = parser.parse_args(argv)
    import pymc as pm

    cfg = dict(QUICK if args.quick else FULL)
    common.set_run_mode("quick" if args.quick else "full")
    record = common.run_record()
    data = common.logistic_regression_data(cfg["n"], cfg["d"], cfg["n_test"], seed=0)
    with pm.Model() as model:
        w = pm.Normal("w", 0, 1, shape=cfg["d"])
        pm.Bernoulli("y", logit_p=data.X @ w, observed=data.y)
    long_runs = {}
    for key, cls in (("mcssvi", "MCSSVI"), ("hmcssvi", "HMCSSVI")):
        hist, wall, rec = fit_hist(model, cls, LONG_ITERS)
        long_runs[key] = {"final": float(hist[-1]), "best": float(hist.min()), "wall": wall}
        long_runs[key]["run"] = rec
        common.log(f"long {key}: best -ELBO {hist.min():.6f} ({wall:.1f} s)")
    optimum = min(r["best"] for r in long_runs.values())
    rows = {}
    print(f"optimum -ELBO {optimum:.4f}")
    print("| method | gap after 10 | after 30 | after 60 (nats) | passes to 0.01% |")
    print("|---|---|---|---|---|")
    for key, label, cls, kw in RUNS:
        hist, wall, rec = fit_hist(model, cls, ITERS, **kw)
        gaps = {str(k): float(hist[k - 1] - optimum) for k in CHECKPOINTS}
        rows[key] = {
            "label": label,
            "class": cls,
            "options": {k: list(v) if isinstance(v, tuple) else v for k, v in kw.items()},
            "hist": hist,
            "gaps": gaps,
            "increases": int(np.sum(np.diff(hist) > 1e-9 * abs(optimum))),
            "passes_to_optimum": passes_to(hist, optimum),
            "wall": wall,
            "run": rec,
        }
        p = rows[key]["passes_to_optimum"]
        print(
            f"| {label} | "
            + " | ".join(f"{g:,.1f}" for g in gaps.values())
            + f" | {p if p else 'not within ' + str(ITERS)} |",
            flush=True,
        )
    results = {
        "meta": {
            "date": common.today(),
            "machine": common.machine_info(),
            "versions": common.library_versions(("pymc", "pytensor", "numpy", "pymc_mcssvi")),
            "code": common.code_state(),
            "quick": args.quick,
            "cfg": cfg,
            "iters": ITERS,
            "long_iters": LONG_ITERS,
            "checkpoints": list(CHECKPOINTS),
            "rel": REL,
        },
        "run": record,
        "optimum": optimum,
        "long_runs": long_runs,
        "runs": rows,
    }
    out = RESULTS / ("schedules_quick.json" if args.quick else "schedules.json")
    common.save_json(results, out)
    common.log(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
