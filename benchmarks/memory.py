"""Peak memory of a fitting process on large data: the chunked statistics' benchmark.

Run by hand: ``python benchmarks/memory.py [--only NAME,...] [--checkout PATH]
[--cap-gb 20] [--label TEXT]``; the runs are appended to
``benchmarks/results/memory.json`` (``docs/benchmarks.md``, "Peak memory on large
data", is written from it by hand). Each case fits one model in its own subprocess, for a
few iterations of the plugin's defaults (``pm.fit(method="hmcssvi")``, automatic
backend and chunking), and reports the process's peak resident memory (``VmHWM``),
the time to the first iteration (recognition and compilation included) and the time
per later iteration. ``--checkout`` imports ``pymc_mcssvi`` from another checkout
(a ``git worktree`` of an earlier commit) to measure before and after on the same
machine; ``--cap-gb`` limits each subprocess's address space, so that a case that
would exhaust the machine fails with ``MemoryError`` instead.

Cases
-----
``pmf_synth_full``
    Matrix factorization of a fully observed 1000 x 1000 binary matrix, K = 20,
    800,000 training ratings (``benchmarks/pmf.py``'s ``synth_binary``), full batch.
``insteval_ordinal_full``
    lme4 InstEval ratings as an ordinal factorization (K = 10, 58,737 training
    ratings, ``benchmarks/pmf.py``'s ``insteval_ordinal``), full batch.
``ctm_learned_topics``
    A correlated topic model with learned topics: 400 documents, V = 2,000 words,
    K = 10 topics, ``beta ~ Dirichlet(0.1)`` rows, document logits
    ``eta_d ~ N(mu, I)``, ``pm.Multinomial(n_d, softmax(eta_d) @ beta)`` (synthetic
    counts from the model); the topics as point hyperparameters with Adam steps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from common import run_record, vmhwm_mb

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "memory.json"
CASES = ["pmf_synth_full", "insteval_ordinal_full", "ctm_learned_topics"]
#: Iterations timed after the first (which includes compilation).
ITERATIONS = {"pmf_synth_full": 2, "insteval_ordinal_full": 4, "ctm_learned_topics": 3}


def _pmf_model(name):
    sys.path.insert(0, str(HERE))
    import pmf as pmf_bench

    ds = pmf_bench.load_dataset(name, dict(pmf_bench.FULL), 0)
    return pmf_bench.build_pymc(ds), {"start": pmf_bench.start_values(ds, 0)}, ds["info"]


def _ctm_model(D=400, V=2000, K=10, words=150, seed=0):
    import numpy as np
    import pymc as pm

    rng = np.random.default_rng(seed)
    beta = rng.dirichlet(np.full(V, 0.1), size=K)
    eta = rng.normal(0.0, 1.0, size=(D, K))
    theta = np.exp(eta) / np.exp(eta).sum(1, keepdims=True)
    counts = np.stack([rng.multinomial(words, theta[d] @ beta) for d in range(D)])
    with pm.Model() as model:
        topics = pm.Dirichlet("beta", a=np.full(V, 0.1), shape=(K, V))
        mu = pm.Normal("mu", 0.0, 1.0, shape=K)
        logits = pm.Normal("eta", mu, 1.0, shape=(D, K))
        p = pm.math.softmax(logits, axis=-1) @ topics
        pm.Multinomial("w", n=counts.sum(1), p=p, observed=counts)
    kwargs = {"hyper": "point", "hyper_optimizer": ("adam", 0.05)}
    info = {"documents": D, "vocabulary": V, "topics": K, "words per document": words}
    return model, kwargs, info


def run_case(name: str, checkout: str | None) -> dict:
    """One case in this process (the subprocess of :func:`main`)."""
    if checkout:
        sys.path.insert(0, checkout)
    import numpy as np

    import pymc_mcssvi

    t0 = time.perf_counter()
    if name == "ctm_learned_topics":
        model, kwargs, info = _ctm_model()
    else:
        model, kwargs, info = _pmf_model(
            name.rsplit("_", 1)[0].replace("pmf_synth", "synth_binary")
        )
    setup_mb = vmhwm_mb()
    with model:
        inf = pymc_mcssvi.HMCSSVI(random_seed=0, **kwargs)
        plan = inf.kernel.chunk_plan() if hasattr(inf.kernel, "chunk_plan") else {}
        t1 = time.perf_counter()
        inf.fit(n=1, tol=None, progressbar=False)
        t2 = time.perf_counter()
        n = ITERATIONS[name]
        approx = inf.fit(n=n, tol=None, progressbar=False)
        t3 = time.perf_counter()
    return {
        "case": name,
        "info": info,
        "peak_rss_mb": round(vmhwm_mb(), 1),
        "data_and_model_mb": round(setup_mb, 1),
        "backend": inf.backend_used,
        "chunks": {str(k): v for k, v in plan.items()},
        "recognition_s": round(t1 - t0, 2),
        "first_iteration_s": round(t2 - t1, 2),
        "seconds_per_iteration": round((t3 - t2) / n, 3),
        "last_neg_elbo": float(approx.hist[-1]),
        "finite": bool(np.isfinite(approx.hist[-1])),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated case names")
    parser.add_argument("--checkout", default=None, help="import pymc_mcssvi from this path")
    parser.add_argument("--cap-gb", type=float, default=20.0, help="address-space cap")
    parser.add_argument("--label", default=None, help="label of this run in the results")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        cap = int(args.cap_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        try:
            out = run_case(args.worker, args.checkout)
        except MemoryError as err:
            out = {"case": args.worker, "error": f"MemoryError: {err}", "peak_rss_mb": vmhwm_mb()}
        print("RESULT " + json.dumps(out), flush=True)
        return
    names = args.only.split(",") if args.only else CASES
    label = args.label or (args.checkout or "working tree")
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    runs = results.setdefault("runs", [])
    for name in names:
        # commit of this repository; with --checkout the plugin came from that path
        record = run_record("full", **({"checkout": args.checkout} if args.checkout else {}))
        cmd = [sys.executable, __file__, "--worker", name, "--cap-gb", str(args.cap_gb)]
        if args.checkout:
            cmd += ["--checkout", args.checkout]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=args.checkout or ROOT)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if lines:
            out = json.loads(lines[-1][7:])
        else:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            out = {"case": name, "error": f"exit {proc.returncode}: {' | '.join(tail)}"}
        out.update(
            label=label,
            wall_s=round(time.perf_counter() - t0, 1),
            date=time.strftime("%Y-%m-%d %H:%M"),
            machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
            run=record,
        )
        print(json.dumps(out), flush=True)
        runs.append(out)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
