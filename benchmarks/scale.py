"""Logistic regression from Zarr: Dask data (issue 52).

Synthetic Bayesian logistic regression, ``X ~ N(0, 1)`` (``N x p``, no intercept),
``w ~ N(0, 0.3^2)`` (true weights), ``y ~ Bernoulli(logit = X w)``, plus 100,000
held-out rows of the same model. The data are written once to Zarr stores under
``/tmp/mcssvi-scale/n{N}_p{p}/`` (float64, chunks of 100,000 rows) and reused by
later runs. The fitted model has the prior ``w ~ N(0, 1)``.

Methods, each in a process of its own (``common.run_worker``) with a wall-clock cap
(the worker's watchdog writes what it has and exits when the cap is hit):

* ``dask_threads``: ``mc.dask_data`` on ``da.from_zarr(...)``, ``pm.fit(method="hmcssvi")``
  (Dask's threaded scheduler);
* ``dask_cluster``: the same, with a ``distributed.Client`` on
  ``LocalCluster(n_workers=2, threads_per_worker=1)`` active during the fit (its two
  worker processes' peak memory is read with ``client.run``);
* ``memory``: the data loaded from Zarr into memory and given with ``pm.Data``, the
  same ``pm.fit`` (also stopped when its resident memory passes ``--rss-cap-gb``);
* ``memory_nodiag``: the same with ``diagnose=False`` (the default ``"auto"`` runs the
  PSIS diagnosis on the whole data after the fit; it is skipped with Dask data);
* ``advi``: PyMC ADVI on ``pm.Minibatch(X, y, batch_size=5000)`` with ``total_size=N``,
  ``ADVI_STEPS`` steps or the cap;
* ``numpyro``: NumPyro SVI, ``AutoNormal``, Adam(0.01), ``plate(subsample_size=10000)``
  with indices drawn with replacement and substituted into the plate (its own draw
  is a permutation of all N rows per step), ``NUMPYRO_STEPS`` steps or the cap (float64).

Reported per method: wall time of set-up (data loading, model, compilation) and fit,
iterations, the worker's peak RSS (``VmHWM``), the held-out NLL per observation
(``common.heldout_nll`` on 200 draws of w from the method's q) and the time's ratio
to ``dask_threads``'s. The 1-minute load average is recorded at each worker's start
and end.

Run ``python benchmarks/scale.py`` (N = 1,000,000, p = 20) or
``python benchmarks/scale.py --n 4000000 --p 100 --methods dask_threads,advi,numpyro,memory``;
``--report-only`` re-renders the docs section from the saved results. Raw results:
``/tmp/mcssvi-scale/results_n{N}_p{p}.json``; the section ``scale`` of
``docs/benchmarks.md`` is rendered from every results file there.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import fmt, loadavg, log, vmhwm_mb, vmrss_mb  # noqa: E402

ROOT = Path("/tmp/mcssvi-scale")
SECTION = "scale"
CHUNK = 100_000
N_TEST = 100_000
W_SD = 0.3
SEED = 0
DRAWS = 200
ADVI_BATCH = 5_000
ADVI_STEPS = 30_000
NUMPYRO_BATCH = 10_000
NUMPYRO_STEPS = 20_000
NUMPYRO_LR = 0.01
METHODS = ("dask_threads", "dask_cluster", "memory", "memory_nodiag", "advi", "numpyro")
PLUGIN = ("dask_threads", "dask_cluster", "memory", "memory_nodiag")
LABELS = {
    "dask_threads": "plugin, Dask threads (Zarr)",
    "dask_cluster": "plugin, Dask LocalCluster 2 x 1 (Zarr)",
    "memory": "plugin, pm.Data in memory",
    "memory_nodiag": "plugin, pm.Data in memory, `diagnose=False`",
    "advi": f"PyMC ADVI, pm.Minibatch {ADVI_BATCH:,}",
    "numpyro": f"NumPyro SVI AutoNormal, subsample {NUMPYRO_BATCH:,}",
}


# --------------------------------------------------------------------------- data
def data_dir(n: int, p: int) -> Path:
    return ROOT / f"n{n}_p{p}"


def make_data(n: int, p: int) -> Path:
    """Write (once) the training and held-out Zarr stores; the meta file marks them done."""
    import zarr

    d = data_dir(n, p)
    meta = d / "meta.json"
    if meta.exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    w = np.random.default_rng(SEED).normal(0.0, W_SD, size=p)

    def store(name, shape, chunks):
        return zarr.open_array(
            str(d / f"{name}.zarr"), mode="w", shape=shape, chunks=chunks, dtype="float64"
        )

    for prefix, rows in (("", n), ("test_", N_TEST)):
        X = store(prefix + "X", (rows, p), (CHUNK, p))
        y = store(prefix + "y", (rows,), (CHUNK,))
        for k, start in enumerate(range(0, rows, CHUNK)):
            rng = np.random.default_rng([SEED, 1 if prefix else 0, k])
            m = min(CHUNK, rows - start)
            Xk = rng.normal(size=(m, p))
            eta = Xk @ w
            X[start : start + m] = Xk
            y[start : start + m] = (rng.random(m) < 1.0 / (1.0 + np.exp(-eta))).astype("float64")
    common.save_json(
        {"n": n, "p": p, "w_true": w, "chunk": CHUNK, "seconds": time.perf_counter() - t0}, meta
    )
    log(f"wrote {d} in {time.perf_counter() - t0:.1f} s")
    return d


def load(d: Path, name: str) -> np.ndarray:
    import zarr

    return np.asarray(zarr.open_array(str(d / f"{name}.zarr"), mode="r")[...])


# ------------------------------------------------------------------------ workers
class Watchdog:
    """Ends the worker (after writing what it has) at the wall-clock or memory cap."""

    def __init__(self, out: dict, path: str, cap_s: float, rss_cap_mb: float):
        self.out, self.path, self.cap_s, self.rss_cap_mb = out, path, cap_s, rss_cap_mb
        self.t0 = time.perf_counter()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            time.sleep(0.5)
            elapsed = time.perf_counter() - self.t0
            rss = vmrss_mb()
            why = None
            if elapsed > self.cap_s:
                why = f"cap hit: stopped after {elapsed:.0f} s (cap {self.cap_s:.0f} s)"
            elif rss > self.rss_cap_mb:
                why = f"memory cap hit: resident {rss:.0f} MB > {self.rss_cap_mb:.0f} MB"
            if why:
                self.out.update(
                    error=f"{why} in phase '{self.out.get('phase')}'",
                    seconds_at_stop=elapsed,
                    peak_mb=vmhwm_mb(),
                    load_end=loadavg(),
                )
                common.save_json(self.out, self.path)
                os._exit(0)


def _draws_nll(draws, d) -> float:
    return common.heldout_nll(
        np.asarray(draws).reshape(DRAWS, -1), load(d, "test_X"), load(d, "test_y")
    )


def _vmhwm_here():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_plugin(method: str, d: Path, n: int, p: int, out: dict) -> None:
    import pymc as pm

    import pymc_mcssvi as mc

    t0 = time.perf_counter()
    times = []
    out["phase"] = "model"
    with pm.Model() as model:
        if method.startswith("memory"):
            out["phase"] = "load"
            X, y = load(d, "X"), load(d, "y")
            out["load_s"] = time.perf_counter() - t0
            out["phase"] = "model"
            Xd = pm.Data("X", X, shape=X.shape)
            yd = pm.Data("y", y, shape=y.shape)
        else:
            import dask.array as da

            Xd = mc.dask_data("X", da.from_zarr(str(d / "X.zarr")))
            yd = mc.dask_data("y", da.from_zarr(str(d / "y.zarr")))
        w = pm.Normal("w", 0.0, 1.0, shape=p)
        pm.Bernoulli("obs", logit_p=Xd @ w, observed=yd)
    out["model_s"] = time.perf_counter() - t0

    def cb(approx, losses, i):
        times.append(time.perf_counter() - t0)
        out["iterations"] = len(times)
        out["iteration_times"] = times

    out["phase"] = "fit"
    client = cluster = None
    if method == "dask_cluster":
        import distributed

        cluster = distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        )
        client = distributed.Client(cluster)
        out["cluster_start_s"] = time.perf_counter() - t0
    try:
        # diagnose="auto" (the default) skips the PSIS diagnosis with Dask data
        kw = {"diagnose": False} if method == "memory_nodiag" else {}
        approx = pm.fit(method="hmcssvi", model=model, progressbar=False, callbacks=[cb], **kw)
        out["seconds"] = time.perf_counter() - t0
        out["peak_mb"] = vmhwm_mb()
        if client is not None:
            out["worker_peak_mb"] = client.run(_vmhwm_here)
    finally:
        if client is not None:
            client.close()
            cluster.close()
    out["phase"] = "evaluate"
    out["iterations"] = int(approx.n_iter)
    out["converged"] = approx.converged
    out["first_iteration_s"] = times[0] if times else None
    # pm.fit's work after the last iteration (post-fit profile, diagnostics)
    out["post_fit_s"] = out["seconds"] - times[-1] if times else None
    out["final_bound"] = float(np.asarray(approx.hist[-1]))
    # np.asarray: with the JAX backend these are JAX arrays
    out["mean"] = np.asarray(approx.mean.eval()).tolist()
    out["sd"] = np.asarray(approx.std.eval()).tolist()
    w = approx.sample(DRAWS, random_seed=1).posterior["w"].values
    out["nll"] = _draws_nll(w, d)


def run_advi(d: Path, n: int, p: int, out: dict, cap_s: float) -> None:
    import pymc as pm

    t0 = time.perf_counter()
    out["phase"] = "load"
    X, y = load(d, "X"), load(d, "y")
    out["load_s"] = time.perf_counter() - t0
    out["phase"] = "model"
    with pm.Model() as model:
        Xb, yb = pm.Minibatch(X, y, batch_size=ADVI_BATCH)
        w = pm.Normal("w", 0.0, 1.0, shape=p)
        pm.Bernoulli("obs", logit_p=Xb @ w, observed=yb, total_size=n)
    out["model_s"] = time.perf_counter() - t0
    stop_at = 0.95 * cap_s
    count = [0]

    def cb(approx, losses, i):
        count[0] += 1
        out["iterations"] = count[0]
        if time.perf_counter() - t0 > stop_at:
            raise StopIteration(f"time cap {stop_at:.0f} s")

    out["phase"] = "fit"
    approx = pm.fit(
        ADVI_STEPS, method="advi", model=model, callbacks=[cb], random_seed=0, progressbar=False
    )
    out["seconds"] = time.perf_counter() - t0
    out["peak_mb"] = vmhwm_mb()
    out["iterations"] = count[0]
    out["stopped_by_cap"] = count[0] < ADVI_STEPS
    out["final_loss"] = float(np.mean(approx.hist[-500:]))
    out["phase"] = "evaluate"
    w = approx.sample(DRAWS, random_seed=1).posterior["w"].values
    out["mean"] = w.reshape(DRAWS, -1).mean(0)
    out["nll"] = _draws_nll(w, d)


def run_numpyro(d: Path, n: int, p: int, out: dict, cap_s: float) -> None:
    import numpyro

    numpyro.enable_x64()
    import jax
    import jax.numpy as jnp
    import numpyro.distributions as dist
    from numpyro.infer import SVI, Trace_ELBO
    from numpyro.infer.autoguide import AutoNormal

    t0 = time.perf_counter()
    out["phase"] = "load"
    X, y = jnp.asarray(load(d, "X")), jnp.asarray(load(d, "y"))
    out["load_s"] = time.perf_counter() - t0

    # The plate's own subsampling (subsample_size alone) draws a permutation of all N
    # rows at every step (77 ms a step at N = 300,000 here); the indices are drawn
    # with replacement instead and substituted into the plate (its scale stays N / B).
    def model(X, y, idx):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([p]).to_event(1))
        with (
            numpyro.handlers.substitute(data={"data": idx}),
            numpyro.plate("data", n, subsample_size=NUMPYRO_BATCH) as rows,
        ):
            numpyro.sample("obs", dist.Bernoulli(logits=X[rows] @ w), obs=y[rows])

    guide = AutoNormal(model)
    svi = SVI(model, guide, numpyro.optim.Adam(NUMPYRO_LR), Trace_ELBO())
    out["phase"] = "compile"
    state = svi.init(jax.random.PRNGKey(0), X, y, jnp.arange(NUMPYRO_BATCH))
    block = 500

    # the data are arguments, not constants of the compiled program
    @jax.jit
    def steps(state, key, X, y):
        def body(s, k):
            idx = jax.random.randint(k, (NUMPYRO_BATCH,), 0, n)
            return svi.update(s, X, y, idx)

        return jax.lax.scan(body, state, jax.random.split(key, block))

    key = jax.random.PRNGKey(2)
    out["phase"] = "fit"
    stop_at = 0.95 * cap_s
    done, losses = 0, []
    while done < NUMPYRO_STEPS and time.perf_counter() - t0 < stop_at:
        key, sub = jax.random.split(key)
        state, loss = steps(state, sub, X, y)
        if done == 0:
            out["first_block_s"] = time.perf_counter() - t0
        loss.block_until_ready()
        done += block
        losses.append(float(jnp.mean(loss)))
        out["iterations"] = done
    out["seconds"] = time.perf_counter() - t0
    out["peak_mb"] = vmhwm_mb()
    out["iterations"] = done
    out["stopped_by_cap"] = done < NUMPYRO_STEPS
    out["final_loss"] = losses[-1]
    out["phase"] = "evaluate"
    params = svi.get_params(state)
    w = guide.sample_posterior(jax.random.PRNGKey(1), params, sample_shape=(DRAWS,))["w"]
    w = np.asarray(w)
    out["mean"] = w.mean(0)
    out["nll"] = _draws_nll(w, d)


def worker_main(args) -> None:
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("pymc").setLevel(logging.ERROR)
    method = args.worker
    out = {"method": method, "load_start": loadavg(), "run": common.run_record("full")}
    out["plugin"] = plugin_sources()
    Watchdog(out, args.out, args.cap, args.rss_cap_gb * 1024)
    d = data_dir(args.n, args.p)
    try:
        if method in PLUGIN:
            run_plugin(method, d, args.n, args.p, out)
        elif method == "advi":
            run_advi(d, args.n, args.p, out, args.cap)
        elif method == "numpyro":
            run_numpyro(d, args.n, args.p, out, args.cap)
        else:
            raise ValueError(method)
        out["phase"] = "done"
    except Exception as e:  # recorded, the benchmark goes on
        tb = traceback.format_exc()
        print(tb, file=sys.stderr)
        out["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        out["traceback_tail"] = tb.strip().splitlines()[-6:]
        out.setdefault("peak_mb", vmhwm_mb())
    out["load_end"] = loadavg()
    common.save_json(out, args.out)
    os._exit(0)  # do not wait for Dask / JAX threads


def plugin_sources() -> dict:
    """Where the imported ``pymc_mcssvi`` comes from, and a SHA-1 of its ``*.py``
    (the working tree's sources may be edited while a long run goes on: run on a
    ``git archive`` of a commit with ``--plugin-src``)."""
    import hashlib
    import importlib.util

    root = Path(importlib.util.find_spec("pymc_mcssvi").origin).parent
    h = hashlib.sha1()
    for f in sorted(root.rglob("*.py")):
        h.update(f.read_bytes())
    return {"path": str(root), "sha1": h.hexdigest()[:12]}


# ---------------------------------------------------------------------- reporting
def results_path(n: int, p: int) -> Path:
    return ROOT / f"results_n{n}_p{p}.json"


def _mb(x):
    return "–" if x is None else f"{x:,.0f}"


def render_case(res: dict) -> list[str]:
    n, p = res["n"], res["p"]
    ms = res["methods"]
    ref = ms.get("dask_threads", {})
    ref_s = ref.get("seconds") if not ref.get("error") else None
    L = [
        f"### N = {n:,}, p = {p} ({n * p * 8 / 1e9:.2f} GB of float64 in X)",
        "",
        f"Last run {res['date']}; cap {res['cap']:.0f} s of wall time per "
        f"method unless stated (set-up included); data written once in {fmt(res.get('data_seconds'), '.0f')} s.",
        "",
    ]
    rows = []
    for m in METHODS:
        if m not in ms:
            continue
        r = ms[m]
        secs = r.get("seconds")
        ratio = fmt(secs / ref_s, ".2f") + "x" if secs and ref_s else "–"
        peak = _mb(r.get("peak_mb"))
        if r.get("worker_peak_mb"):
            wp = list(r["worker_peak_mb"].values())
            peak += " (+ workers " + " + ".join(_mb(x) for x in wp) + ")"
        it = r.get("iterations")
        it = "–" if it is None else f"{it:,}"
        if r.get("stopped_by_cap"):
            it += " (cap)"
        if r.get("error") and secs is None:
            time_cell = f"**{r['error']}**"
            if r.get("seconds_at_stop"):
                time_cell += f" ({r['seconds_at_stop']:.0f} s)"
        else:
            time_cell = fmt(secs, ".1f")
            if r.get("first_iteration_s"):
                time_cell += (
                    f" (1st iteration ends at {r['first_iteration_s']:.1f}, "
                    f"after the last: {fmt(r.get('post_fit_s'), '.1f')})"
                )
            if r.get("error"):  # the fit ended, the evaluation after it did not
                time_cell += f"; then **{r['error']}**"
        rows.append(
            [
                LABELS[m]
                + (f" [{r['plugin_commit']}]" if m in PLUGIN else "")
                + (f" (cap {r['cap']:.0f} s)" if r.get("cap", res["cap"]) != res["cap"] else ""),
                time_cell,
                it,
                peak,
                fmt(r.get("nll"), ".5f"),
                ratio,
                f"{fmt(r.get('load_start'), '.2f')} / {fmt(r.get('load_end'), '.2f')}",
            ]
        )
    L.append(
        common.markdown_table(
            [
                "method",
                "set-up + fit, s",
                "iterations",
                "peak RSS, MB",
                "held-out NLL / obs",
                "time / plugin (threads)",
                "load at start / end",
            ],
            rows,
        )
    )
    L.append("")
    a, b = ms.get("dask_threads", {}), ms.get("dask_cluster", {})
    if a.get("final_bound") is not None and b.get("final_bound") is not None:
        fa, fb = a["final_bound"], b["final_bound"]
        dm = np.max(np.abs(np.asarray(a["mean"]) - np.asarray(b["mean"])))
        L.append(
            f"Final bound (`approx.hist[-1]`): threads {fa:.16g}, LocalCluster {fb:.16g}, "
            f"relative difference {abs(fa - fb) / abs(fa):.1e} ({a['iterations']} and "
            f"{b['iterations']} iterations; largest difference of q's means {dm:.1e})."
        )
        L.append("")
    if res.get("nll_true") is not None:
        L.append(
            f"Held-out NLL at the true weights: {res['nll_true']:.5f} (for reference; a "
            "posterior predictive can be below it on a finite test set)."
        )
        L.append("")
    for m in METHODS:
        r = ms.get(m, {})
        if r.get("traceback_tail"):
            L.append(f"{LABELS[m]}, last lines of the traceback:")
            L.append("")
            L.append("```")
            L.extend(r["traceback_tail"])
            L.append("```")
            L.append("")
    return L


def render(results: list[dict], notes: str = "") -> str:
    mi = common.machine_info()
    L = [
        "## Logistic regression from Zarr: Dask data (issue 52)",
        "",
        "`mc.dask_data` (commit 1a1c01c) against the same plugin fit on data in memory, "
        "PyMC ADVI on `pm.Minibatch` and NumPyro SVI. Model: `w ~ N(0, 1)` (p weights, "
        "no intercept), `y ~ Bernoulli(logit = X w)`; data `X ~ N(0, 1)`, true weights "
        f"drawn from `N(0, {W_SD}^2)`, {N_TEST:,} held-out rows of the same model; written "
        f"once to Zarr (float64, chunks of {CHUNK:,} rows) under `/tmp/mcssvi-scale/`. "
        f"Machine: {mi.get('machine')}, {mi.get('cpu_count')} logical CPUs "
        f"({mi.get('cpu_model', '?')}), {mi.get('mem_total_gb')} GB; another session ran "
        "the test suite at the same time (the load column: 1-minute load average at "
        "each worker's start and end).",
        "",
        "Each method runs in a process of its own; its time is wall time from the start "
        "of loading / building the model to the end of the fit (PyMC/PyTensor/JAX "
        "compilation included, held-out evaluation excluded); peak RSS is the "
        "process's `VmHWM` (for the LocalCluster, its two worker processes' `VmHWM` "
        "read with `client.run` are added in parentheses; the nanny and scheduler are "
        f"not counted). Held-out NLL: `-mean_i log mean_s p(y_i | w_s)` over {DRAWS} "
        'draws of w from each method\'s q. Plugin: `pm.fit(method="hmcssvi")` with its '
        "defaults (runs to its own convergence test); ADVI: "
        f"{ADVI_STEPS:,} steps of batch {ADVI_BATCH:,}, PyMC's default optimizer; NumPyro: "
        f"{NUMPYRO_STEPS:,} steps of Adam({NUMPYRO_LR}), batch {NUMPYRO_BATCH:,}, float64, "
        "row indices drawn with replacement (`jax.random.randint`) and substituted into "
        "`plate(subsample_size=...)`: the plate's own draw is a permutation of all N rows "
        "at every step, 77 ms a step at N = 300,000 here; both stop earlier at 95% of "
        "the cap. The plugin's time cell gives when its first iteration ended (set-up "
        "and compilation) and how long `pm.fit` ran after the last one (post-fit work).",
        "",
        "Reproduce: `python benchmarks/scale.py` (N = 1,000,000, p = 20, every method) and "
        "`python benchmarks/scale.py --n 4000000 --p 100 --methods "
        "dask_threads,advi,numpyro,memory` (about 10 and 15-20 minutes; the plugin rows "
        "below: `git archive e6bc6f5 pymc_mcssvi | tar -x -C /tmp/src` and "
        "`--plugin-src /tmp/src --plugin-commit e6bc6f5`, 4M x 100 Dask threads with "
        "`--cap 600`); `--report-only --notes FILE` re-renders this section; raw numbers "
        "in `/tmp/mcssvi-scale/results_*.json`.",
        "",
    ]
    for res in results:
        L.extend(render_case(res))
    if notes:
        L.extend([notes.strip(), ""])
    return "\n".join(L)


def all_results() -> list[dict]:
    out = [json.loads(f.read_text()) for f in sorted(ROOT.glob("results_n*_p*.json"))]
    return sorted(out, key=lambda r: r["n"] * r["p"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--p", type=int, default=20)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--cap", type=float, default=300.0, help="wall seconds per method")
    parser.add_argument("--rss-cap-gb", type=float, default=14.0)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--notes", default=None, help="markdown file added after the tables")
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument(
        "--plugin-src",
        default=None,
        help="directory holding a pymc_mcssvi package to benchmark (e.g. from git archive), "
        "put first on the workers' PYTHONPATH",
    )
    parser.add_argument("--plugin-commit", default=None, help="the commit of --plugin-src")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args)
    if not args.report_only:
        t0 = time.perf_counter()
        d = make_data(args.n, args.p)
        meta = json.loads((d / "meta.json").read_text())
        path = results_path(args.n, args.p)
        res = json.loads(path.read_text()) if path.exists() else {"methods": {}}
        res.update(
            n=args.n,
            p=args.p,
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            commit=common.code_state().get("commit"),
            data_seconds=meta["seconds"],
            machine=common.machine_info(),
            versions=common.library_versions(
                ("pymc", "pytensor", "numpy", "jax", "numpyro", "dask", "zarr", "pymc_mcssvi")
            ),
        )
        res.setdefault("cap", args.cap)  # the first run's; other caps are stated per method
        w_true = np.asarray(meta["w_true"])
        res["nll_true"] = common.heldout_nll(w_true[None, :], load(d, "test_X"), load(d, "test_y"))
        for m in [s.strip() for s in args.methods.split(",") if s.strip()]:
            log(f"{m} (N = {args.n:,}, p = {args.p})")
            wargs = [m, "--n", str(args.n), "--p", str(args.p), "--cap", str(args.cap)]
            wargs += ["--rss-cap-gb", str(args.rss_cap_gb)]
            env = None
            if args.plugin_src:
                env = dict(os.environ, PYTHONPATH=str(Path(args.plugin_src).resolve()))
            r = common.run_worker(__file__, wargs, {"method": m}, args.cap + 180, env=env)
            r["plugin_commit"] = args.plugin_commit or common.code_state().get("commit")
            r["cap"] = args.cap
            res["methods"][m] = r
            log(
                f"  {fmt(r.get('seconds'), '.1f')} s, {r.get('iterations')} iterations, "
                f"peak {fmt(r.get('peak_mb'), '.0f')} MB, NLL {fmt(r.get('nll'), '.5f')}, "
                f"load {r.get('load_start')}/{r.get('load_end')}"
                + (f", ERROR {r['error']}" if r.get("error") else "")
            )
            common.save_json(res, path)
        log(f"total {time.perf_counter() - t0:.0f} s; wrote {path}")
    notes = Path(args.notes).read_text() if args.notes else ""
    text = render(all_results(), notes)
    print(text)
    if not args.no_docs:
        common.write_section(SECTION, text, common.DOCS_PATH)
        log(f"wrote section '{SECTION}' of {common.DOCS_PATH}")


if __name__ == "__main__":
    main()
