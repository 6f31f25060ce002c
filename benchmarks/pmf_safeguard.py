"""Row-subsampled factorization against the full-batch bound: the stochastic trust region
(issue 52, "subsampled fits must not drift or diverge ... measured against the
full-batch bound").

Row-subsampled fits (``row_subsample=B``) take every step: no backtracking guards
them against a step from an unlucky subsample. Two safeguards do: the Robbins-Monro
delay ``tau`` (by default the mean row weight, which damps the first steps) and a trust
region that shortens each block's mean step to at most
``pymc_mcssvi.algorithms.kernel.STOCHASTIC_MAX_MEAN_STEP`` (10) sds of the current q.
This script runs, on ``benchmarks/pmf.py``'s 1000 x 1000 synthetic matrices (K = 20,
800,000 training ratings), each capped at :data:`CAP` s:

* **H-MC-SSVI**: full batch, defaults: the reference bound;
* **H-MC-SSVI B=10**: 10 ratings per row and column an iteration, defaults (both
  safeguards);
* **H-MC-SSVI (no trust region) B=10**: the same with the trust region switched off.

At log-spaced snapshots each worker records the full-batch -ELBO of the current q
(``pmf.TrainELBO``: the expected log likelihood over 100,000 training ratings scaled to
all of them, 16 joint draws, KL in closed form) and the held-out NLL. *drift* is the
last snapshot's -ELBO minus the curve's lowest, relative to the lowest: a fit that
drifts or diverges shows it there; *gap to full batch* compares the last -ELBO with the
full-batch fit's.

Run ``python benchmarks/pmf_safeguard.py`` (``--only``, ``--reuse``,
``--report-only``); raw results ``benchmarks/results/pmf_safeguard.json``, the section
``pmf_safeguard`` of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pmf  # noqa: E402
from common import fmt  # noqa: E402

SECTION = "pmf_safeguard"
RESULTS = pmf.RESULTS / "pmf_safeguard.json"
CAP = 200.0
B = 10
DATASETS = ["synth_count", "synth_binary"]
METHODS = ["H-MC-SSVI", pmf.variant("H-MC-SSVI", B), pmf.variant(pmf.NO_TRUST, B)]


def config() -> dict:
    """``pmf.FULL`` with every method capped at :data:`CAP` seconds."""
    cfg = dict(pmf.FULL)
    cfg.update(
        max_seconds={"default": CAP},
        worker_timeout=CAP + 900.0,
        subsample={"default": [B]},
        full_batch={"default": True},
        max_iter=10_000_000,
    )
    return cfg


def summary(res: dict) -> dict:
    """Final and lowest -ELBO of a worker's curve, its drift, and the final held-out NLL."""
    _, v, _ = pmf.curve_arrays(res, "negelbo")
    v = v[np.isfinite(v)]
    out = {"final_nll": pmf.final_nll(res), "iterations": res.get("iterations")}
    if len(v):
        out.update(final_negelbo=float(v[-1]), best_negelbo=float(v.min()))
        out["drift"] = (v[-1] - v.min()) / abs(v.min())
    return out


def _stop(res: dict) -> str:
    """How a worker's fit ended: the error's class (the divergence guard's
    ``DivergenceError``: the last good state is scored), the time cap, or convergence."""
    if res.get("error"):
        return res["error"].split(":")[0]
    return "cap" if res.get("stopped_by_time") else "converged"


def render(results: dict, run_info: dict) -> str:
    lines = [
        "## Row-subsampled factorization against the full-batch bound (issue 52)",
        "",
        f"Run {run_info['date']} on {run_info['machine']}; 1-minute load {run_info['load']}; "
        f"plugin commit {run_info['commit']}. Reproduce: `python benchmarks/pmf_safeguard.py`; "
        "data, methods and columns in its module docstring. Every fit capped at "
        f"{CAP:.0f} s; -ELBO in nats per training rating (800,000 ratings).",
        "",
        "| data | method | stop | iterations | final -ELBO / rating | lowest | drift | "
        "gap to full batch | final held-out NLL | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in results.items():
        ref = summary(rows["H-MC-SSVI"]) if "H-MC-SSVI" in rows else {}
        n = 800_000
        for method, res in rows.items():
            s = summary(res)
            gap = None
            if "final_negelbo" in s and "final_negelbo" in ref:
                gap = (s["final_negelbo"] - ref["final_negelbo"]) / abs(ref["final_negelbo"])
            lines.append(
                f"| {name} | {method} | {_stop(res)} | {fmt(s.get('iterations'), 'd')} | "
                f"{fmt(s.get('final_negelbo', np.nan) / n, '.4f')} | "
                f"{fmt(s.get('best_negelbo', np.nan) / n, '.4f')} | "
                f"{fmt(s.get('drift'), '+.2%')} | {fmt(gap, '+.2%')} | "
                f"{fmt(s['final_nll'], '.4f')} | {fmt(res.get('peak_rss_fit_mb'), '.0f')} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None):
    pmf.run_section(
        argv,
        __doc__.splitlines()[0],
        RESULTS,
        SECTION,
        DATASETS,
        lambda name: METHODS,
        config,
        render,
    )


if __name__ == "__main__":
    main()
