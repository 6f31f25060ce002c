"""BLAS threads per iteration: one OpenBLAS thread against two, and what ``blas_threads=None``
chooses (:func:`pymc_mcssvi.backend.compile.blas_threads_for`).

Two models whose steps do many small or thin products: a correlated topic model with
learned topics (50 documents, V = 50, K = 3, 64 Monte Carlo draws: 252 coordinates, an
estimated 5.5e8 flops an iteration) and a logistic regression (20,000 x 500, one
500 x 500 block). Each is compiled once (the automatic backend), then runs 8 iterations
with ``blas_threads=1``, 8 with ``2``, again 1 and 2 (the median of the two), and 8 with
the default. The machine's load averages are recorded before and after: the comparison
is meant for a machine that is also doing other work, where spinning BLAS threads cost
most.

Run ``python benchmarks/blas_threads.py``; writes ``benchmarks/results/blas_threads.json``
and ``.md`` (also printed).
"""

from __future__ import annotations

import os
import time
import warnings

import common
import numpy as np
import pymc as pm
import pytensor.tensor as pt

import pymc_mcssvi
from pymc_mcssvi.backend.compile import blas_threads_for

OUT = common.REPO_ROOT / "benchmarks" / "results"
ITERS = 8


def topic_model():
    rng = np.random.default_rng(0)
    D, V, K = 50, 50, 3
    beta = rng.dirichlet(np.full(V, 0.1), size=K)
    eta = rng.normal(0, 1.0, size=(D, K - 1))
    th = np.exp(np.c_[eta, np.zeros(D)])
    th /= th.sum(1, keepdims=True)
    N = rng.integers(40, 80, size=D)
    C = np.stack([rng.multinomial(N[d], th[d] @ beta) for d in range(D)])
    with pm.Model() as m:
        mu = pm.Normal("mu", 0, 1, shape=K - 1)
        e = pm.Normal("eta", mu, 1, shape=(D, K - 1))
        lb = pm.Normal("logit_beta", 0, 1, shape=(K, V))
        theta = pm.math.softmax(pt.concatenate([e, pt.zeros((D, 1))], axis=1), axis=-1)
        pm.Multinomial("w", n=N, p=theta @ pm.math.softmax(lb, axis=-1), observed=C)
    return m


def logistic():
    rng = np.random.default_rng(0)
    N, D = 20_000, 500
    X = rng.normal(size=(N, D))
    y = rng.binomial(1, 1 / (1 + np.exp(-X @ (rng.normal(size=D) / np.sqrt(D)))))
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1, shape=D)
        pm.Bernoulli("y", logit_p=X @ b, observed=y)
    return m


def per_iteration(inf, threads):
    t = time.perf_counter()
    inf.fit(n=ITERS, progressbar=False, diagnose=False, tol=None, blas_threads=threads)
    return (time.perf_counter() - t) / ITERS


def measure(name, build):
    with build():
        inf = pymc_mcssvi.HMCSSVI(random_seed=0)
        load_before = os.getloadavg()
        inf.fit(n=2, progressbar=False, diagnose=False, tol=None)  # compile
        one = [per_iteration(inf, 1)]
        two = [per_iteration(inf, 2)]
        one.append(per_iteration(inf, 1))
        two.append(per_iteration(inf, 2))
        default = per_iteration(inf, None)
        largest = max(seg.k for seg in inf.tlm.segments)
        return {
            "model": name,
            "backend": inf.backend_used,
            "work": inf.work_estimate(),
            "largest_block": largest,
            "one_thread": float(np.median(one)),
            "two_threads": float(np.median(two)),
            "default": default,
            "default_choice": blas_threads_for(inf.work_estimate(), largest),
            "load_before": load_before,
            "load_after": os.getloadavg(),
        }


def main():
    warnings.filterwarnings("ignore")
    rows = [measure("CTM, 50 documents, V = 50, K = 3", topic_model)]
    rows.append(measure("logistic regression, 20,000 x 500", logistic))
    info = common.machine_info()
    meta = {
        "date": common.today(),
        "machine": f"{info.get('cpu_model') or info['machine']}, {info['cpu_count']} logical CPUs",
        **common.code_state(),
    }
    common.save_json({"meta": meta, "rows": rows}, OUT / "blas_threads.json")
    headers = [
        "model",
        "backend",
        "estimated flops/it",
        "largest block",
        "1 thread (s/it)",
        "2 threads (s/it)",
        "ratio",
        "default (s/it)",
        "default's choice",
        "load before",
        "load after",
    ]
    table = []
    for r in rows:
        choice = "BLAS's own" if r["default_choice"] is None else f"{r['default_choice']} thread"
        table.append(
            [
                r["model"],
                r["backend"],
                f"{r['work']:.2g}",
                r["largest_block"],
                f"{r['one_thread']:.3f}",
                f"{r['two_threads']:.3f}",
                f"{r['two_threads'] / r['one_thread']:.1f}x",
                f"{r['default']:.3f}",
                choice,
                "/".join(f"{x:.1f}" for x in r["load_before"]),
                "/".join(f"{x:.1f}" for x in r["load_after"]),
            ]
        )
    lines = [
        f"Measured {meta['date']} on {meta['machine']}, commit {meta.get('commit', '?')}.",
        "",
        common.markdown_table(headers, table),
    ]
    text = "\n".join(lines) + "\n"
    (OUT / "blas_threads.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
