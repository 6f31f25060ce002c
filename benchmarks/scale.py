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

Traces (issue 52's 10M x 100 targets): the plugin's callback records each iteration's
time, -ELBO (``losses[-1]``), resident memory and q's mean and sd (``approx.mean`` /
``approx.std``); a Dask callback records each ``dask.compute`` (one per pass over
the data, threaded scheduler only); ADVI's q is read every ``ADVI_SNAP`` steps and
NumPyro's after each block of 500 steps (the time spent reading q is subtracted from
the times). After the fit each snapshot's held-out NLL is computed on
``TRACE_DRAWS`` draws with common random numbers, giving an NLL-vs-time curve per
method; ``dask_tight`` is the Dask threads fit with ``tol=TIGHT_TOL`` (a better
optimum bound). The renderer derives passes to ``|bound - bound_opt| / |bound_opt|
<= 1e-4``, the bound difference threads vs LocalCluster per common iteration, and
each method's time to ``nll <= 1.001 x`` the best snapshot NLL of all methods.
``numpyro`` reads Zarr into a JAX array chunk by chunk (held once), ADVI into NumPy.

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
TRACE_DRAWS = 50  # draws per snapshot of the NLL-vs-time curves (fixed normals, seed TRACE_SEED)
TRACE_SEED = 7
BOUND_REL = 1e-4  # passes to |bound - bound_opt| / |bound_opt| <= BOUND_REL
NLL_REL = 1e-3  # time to nll <= (1 + NLL_REL) * best held-out NLL of all methods
ADVI_SNAP = 500  # ADVI steps between snapshots of q
ADVI_BATCH = 5_000
ADVI_STEPS = 30_000
NUMPYRO_BATCH = 10_000
NUMPYRO_STEPS = 20_000
NUMPYRO_LR = 0.01
METHODS = (
    "dask_threads",
    "dask_tight",
    "dask_cluster",
    "memory",
    "memory_nodiag",
    "advi",
    "numpyro",
)
PLUGIN = ("dask_threads", "dask_tight", "dask_cluster", "memory", "memory_nodiag")
TIGHT_TOL = 1e-10
LABELS = {
    "dask_threads": "plugin, Dask threads (Zarr)",
    "dask_tight": f"plugin, Dask threads (Zarr), `tol={TIGHT_TOL:g}`",
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


def load_jax(d: Path, name: str):
    """A Zarr array read into a JAX array chunk by chunk: written in place (a donated
    buffer), so it is held once (``jnp.asarray`` of the NumPy array held it 3 times at
    the peak: the NumPy array and two copies)."""
    import jax
    import jax.numpy as jnp
    import zarr

    z = zarr.open_array(str(d / f"{name}.zarr"), mode="r")
    out = jnp.zeros(z.shape, dtype=z.dtype)
    put = jax.jit(
        lambda a, b, i: jax.lax.dynamic_update_slice(a, b, (i,) + (0,) * (a.ndim - 1)),
        donate_argnums=0,
    )
    step = z.chunks[0]
    for start in range(0, z.shape[0], step):
        out = put(out, jnp.asarray(z[start : start + step]), start)
    return out.block_until_ready()


# ------------------------------------------------------------------------ workers
class Watchdog:
    """Ends the worker (after writing what it has) at the wall-clock or memory cap."""

    def __init__(self, out: dict, path: str, cap_s: float, rss_cap_mb: float):
        self.out, self.path, self.cap_s, self.rss_cap_mb = out, path, cap_s, rss_cap_mb
        self.t0 = time.perf_counter()
        # (seconds since the worker started, resident MB) every 2 s: where memory peaks
        self.out["rss_trace"] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        k = 0
        while True:
            time.sleep(0.5)
            elapsed = time.perf_counter() - self.t0
            rss = vmrss_mb()
            k += 1
            if k % 4 == 0:
                self.out["rss_trace"].append((round(elapsed, 1), round(rss)))
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


def snapshot_nlls(snaps: list, d: Path) -> list:
    """Held-out NLL of each snapshot ``(t, step, mean, sd)`` of a mean-field q, on
    ``TRACE_DRAWS`` draws ``mean + sd * z`` with the same ``z`` for every snapshot and
    method (seed ``TRACE_SEED``); computed after the fit, outside the timed region."""
    Xt, yt = load(d, "test_X"), load(d, "test_y")
    z = None
    out = []
    for t, step, mean, sd in snaps:
        mean, sd = np.asarray(mean, dtype="float64"), np.asarray(sd, dtype="float64")
        if z is None:
            z = np.random.default_rng(TRACE_SEED).standard_normal((TRACE_DRAWS, mean.size))
        out.append((t, step, common.heldout_nll(mean + sd * z, Xt, yt)))
    return out


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
    # per iteration: (seconds, iteration, -ELBO, q's mean, q's sd); the seconds exclude
    # the time spent reading q here (eval_s)
    snaps, bounds, rss = [], [], []
    eval_s = [0.0]
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
        now = time.perf_counter()
        times.append(now - t0)
        t = now - t0 - eval_s[0]
        bounds.append(float(np.asarray(losses)[-1]))
        rss.append(round(vmrss_mb()))
        mean = np.asarray(approx.mean.eval(), dtype="float64").tolist()
        sd = np.asarray(approx.std.eval(), dtype="float64").tolist()
        snaps.append((t, int(i), mean, sd))
        eval_s[0] += time.perf_counter() - now
        out["iterations"] = len(times)
        out["iteration_times"] = times
        out["iteration_bounds"] = bounds
        out["iteration_rss_mb"] = rss
        out["snapshots"] = snaps
        out["snapshot_eval_s"] = eval_s[0]

    # every Dask graph computed on the local (threaded) scheduler: one per pass over
    # the data; (start, end) in seconds since t0 (not seen with a distributed Client)
    passes = []
    out["dask_passes"] = passes
    dask_cb = None
    if method.startswith("dask") and method != "dask_cluster":
        from dask.callbacks import Callback

        def _start(dsk):
            passes.append([round(time.perf_counter() - t0, 3), None])

        def _finish(dsk, state, errored):
            passes[-1][1] = round(time.perf_counter() - t0, 3)

        dask_cb = Callback(start=_start, finish=_finish)
        dask_cb.register()

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
        if method == "dask_tight":
            kw = {"tol": TIGHT_TOL}
        approx = pm.fit(method="hmcssvi", model=model, progressbar=False, callbacks=[cb], **kw)
        out["seconds"] = time.perf_counter() - t0
        out["peak_mb"] = vmhwm_mb()
        if client is not None:
            out["worker_peak_mb"] = client.run(_vmhwm_here)
    finally:
        if dask_cb is not None:
            dask_cb.unregister()
        if client is not None:
            client.close()
            cluster.close()
    out["phase"] = "evaluate"
    out["fit_seconds_net"] = out["seconds"] - eval_s[0]
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
    out["phase"] = "evaluate snapshots"
    out["snapshot_nll"] = snapshot_nlls(snaps, d)


def run_advi(d: Path, n: int, p: int, out: dict, cap_s: float, n_steps: int, seed: int = 0) -> None:
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
    snaps, eval_s = [], [0.0]
    out["snapshots"] = snaps

    def cb(approx, losses, i):
        count[0] += 1
        out["iterations"] = count[0]
        now = time.perf_counter()
        if count[0] == 1 or count[0] % ADVI_SNAP == 0:
            # q's mean and sd every ADVI_SNAP steps; the time reading them is excluded
            mean = np.asarray(approx.mean.eval(), dtype="float64").tolist()
            sd = np.asarray(approx.std.eval(), dtype="float64").tolist()
            snaps.append((now - t0 - eval_s[0], count[0], mean, sd))
            eval_s[0] += time.perf_counter() - now
            out["snapshot_eval_s"] = eval_s[0]
        if now - t0 > stop_at:
            raise StopIteration(f"time cap {stop_at:.0f} s")

    out["phase"] = "fit"
    out["steps_asked"] = n_steps
    out["random_seed"] = seed
    approx = pm.fit(
        n_steps, method="advi", model=model, callbacks=[cb], random_seed=seed, progressbar=False
    )
    out["seconds"] = time.perf_counter() - t0
    out["fit_seconds_net"] = out["seconds"] - eval_s[0]
    mean = np.asarray(approx.mean.eval(), dtype="float64").tolist()
    sd = np.asarray(approx.std.eval(), dtype="float64").tolist()
    snaps.append((out["fit_seconds_net"], count[0], mean, sd))
    out["peak_mb"] = vmhwm_mb()
    out["iterations"] = count[0]
    out["stopped_by_cap"] = count[0] < n_steps
    out["final_loss"] = float(np.mean(approx.hist[-500:]))
    out["phase"] = "evaluate"
    del X, y
    w = approx.sample(DRAWS, random_seed=1).posterior["w"].values
    out["mean"] = w.reshape(DRAWS, -1).mean(0)
    out["nll"] = _draws_nll(w, d)
    out["phase"] = "evaluate snapshots"
    out["snapshot_nll"] = snapshot_nlls(snaps, d)


def run_numpyro(d: Path, n: int, p: int, out: dict, cap_s: float, n_steps: int) -> None:
    import numpyro

    numpyro.enable_x64()
    import jax
    import jax.numpy as jnp
    import numpyro.distributions as dist
    from numpyro.infer import SVI, Trace_ELBO
    from numpyro.infer.autoguide import AutoNormal

    t0 = time.perf_counter()
    out["phase"] = "load"
    X, y = load_jax(d, "X"), load_jax(d, "y")
    out["load_s"] = time.perf_counter() - t0
    out["peak_mb_after_load"] = vmhwm_mb()

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
    out["steps_asked"] = n_steps
    stop_at = 0.95 * cap_s
    done, losses = 0, []
    snaps, eval_s = [], [0.0]
    out["snapshots"] = snaps

    def snapshot():
        # q's mean and sd after each block (AutoNormal's loc and scale of w)
        now = time.perf_counter()
        params = svi.get_params(state)
        mean = np.asarray(params["w_auto_loc"], dtype="float64").tolist()
        sd = np.asarray(params["w_auto_scale"], dtype="float64").tolist()
        snaps.append((now - t0 - eval_s[0], done, mean, sd))
        eval_s[0] += time.perf_counter() - now

    while done < n_steps and time.perf_counter() - t0 < stop_at:
        key, sub = jax.random.split(key)
        state, loss = steps(state, sub, X, y)
        if done == 0:
            out["first_block_s"] = time.perf_counter() - t0
        loss.block_until_ready()
        done += block
        losses.append(float(jnp.mean(loss)))
        out["iterations"] = done
        snapshot()
    out["seconds"] = time.perf_counter() - t0
    out["fit_seconds_net"] = out["seconds"] - eval_s[0]
    out["peak_mb"] = vmhwm_mb()
    out["iterations"] = done
    out["stopped_by_cap"] = done < n_steps
    out["final_loss"] = losses[-1]
    out["phase"] = "evaluate"
    params = svi.get_params(state)
    w = guide.sample_posterior(jax.random.PRNGKey(1), params, sample_shape=(DRAWS,))["w"]
    w = np.asarray(w)
    out["mean"] = w.mean(0)
    del X, y
    out["nll"] = _draws_nll(w, d)
    out["phase"] = "evaluate snapshots"
    out["snapshot_nll"] = snapshot_nlls(snaps, d)


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
            run_advi(d, args.n, args.p, out, args.cap, args.advi_steps, args.advi_seed)
        elif method == "numpyro":
            run_numpyro(d, args.n, args.p, out, args.cap, args.numpyro_steps)
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
            if r.get("error") and r.get("snapshot_nll_by"):
                time_cell += (
                    "; the worker's cap then stopped its scoring of the snapshots "
                    "(scored afterwards by the main process)"
                )
            elif r.get("error"):  # the fit ended, the evaluation after it did not
                time_cell += f"; then **{r['error']}**"
        rows.append(
            [
                LABELS[m]
                + (f" [{r['plugin_commit']}]" if m in PLUGIN else "")
                + (f" (`random_seed={r['random_seed']}`)" if r.get("random_seed") else "")
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
    L.extend(render_traces(res))
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


def _passes_to(bounds, opt, rel):
    """1-based iteration from which ``|bound - opt| / |opt| <= rel`` holds to the end."""
    b = np.asarray(bounds, dtype="float64")
    _, i = common.first_sustained(np.arange(1, len(b) + 1), np.abs(b - opt) <= rel * abs(opt))
    return None if i is None else i + 1


def derived(res: dict) -> dict:
    """The issue-52 numbers from the per-iteration and snapshot traces."""
    ms = res["methods"]
    out = {}
    plug = {m: r for m, r in ms.items() if m in PLUGIN and r.get("iteration_bounds")}
    if plug:
        # -ELBO: lower is better; the optimum is the best any plugin run reached
        opt_m = min(plug, key=lambda m: min(plug[m]["iteration_bounds"]))
        opt = min(plug[opt_m]["iteration_bounds"])
        out["bound_opt"], out["bound_opt_method"] = opt, opt_m
        out["passes"] = {
            m: {rel: _passes_to(r["iteration_bounds"], opt, rel) for rel in (1e-4, 1e-6, 1e-8)}
            for m, r in plug.items()
        }
    a, b = ms.get("dask_threads", {}), ms.get("dask_cluster", {})
    if a.get("iteration_bounds") and b.get("iteration_bounds"):
        ba, bb = np.asarray(a["iteration_bounds"]), np.asarray(b["iteration_bounds"])
        k = min(len(ba), len(bb))
        rel = np.abs(ba[:k] - bb[:k]) / np.abs(ba[:k])
        out["cluster"] = {"common": k, "max_rel": float(rel.max()), "last_rel": float(rel[-1])}
        out["cluster"]["threads_n"], out["cluster"]["cluster_n"] = len(ba), len(bb)
        if a.get("snapshots") and b.get("snapshots"):
            ma = np.asarray(a["snapshots"][k - 1][2])
            mb = np.asarray(b["snapshots"][k - 1][2])
            out["cluster"]["mean_diff"] = float(np.max(np.abs(ma - mb)))
    curves = {m: r["snapshot_nll"] for m, r in ms.items() if r.get("snapshot_nll")}
    if curves:
        best_m = min(curves, key=lambda m: min(v for _, _, v in curves[m]))
        best = min(v for _, _, v in curves[best_m])
        out["nll_best"], out["nll_best_method"] = best, best_m
        out["nll_time"] = {}
        for m, c in curves.items():
            t = [x[0] for x in c]
            v = [x[2] for x in c]
            tt, i = common.time_to_within(t, v, best, rel=NLL_REL)
            first = next((x for x in c if x[2] <= (1 + NLL_REL) * best), None)
            out["nll_time"][m] = {
                "sustained_s": None if i is None else tt,
                "sustained_step": None if i is None else c[i][1],
                "first_s": None if first is None else first[0],
                "first_step": None if first is None else first[1],
                "final": v[-1],
                "min": min(v),
                "final_s": t[-1],
            }
    return out


def render_traces(res: dict) -> list[str]:
    """Bound, passes, time to the best held-out NLL (runs with traces only)."""
    ms = res["methods"]
    dv = derived(res)
    if not dv:
        return []
    L = []
    if "passes" in dv:
        opt = dv["bound_opt"]
        L.append(
            f"**Passes to the optimum bound.** -ELBO per iteration from the `pm.fit` "
            f"callback's `losses`; bound_opt = {opt:.10g}, the lowest any plugin run "
            f"reached ({LABELS[dv['bound_opt_method']]}). For a full-batch Dask fit one "
            "iteration reads every chunk once (one `dask.compute` per iteration, counted "
            "with a Dask callback on the threaded scheduler)."
        )
        L.append("")
        rows = []
        for m, ps in dv["passes"].items():
            r = ms[m]
            b = r["iteration_bounds"]
            np_ = len(r.get("dask_passes") or [])
            rows.append(
                [
                    LABELS[m],
                    str(len(b)) + (f" ({np_} `dask.compute`)" if np_ else ""),
                    *[("–" if ps[k] is None else str(ps[k])) for k in (1e-4, 1e-6, 1e-8)],
                    f"{abs(b[-1] - opt) / abs(opt):.1e}",
                    "yes" if ps[1e-4] is not None and ps[1e-4] <= 15 else "**no**",
                ]
            )
        L.append(
            common.markdown_table(
                [
                    "method",
                    "iterations",
                    "passes to 1e-4",
                    "to 1e-6",
                    "to 1e-8",
                    "final |b - opt| / |opt|",
                    "target (1e-4 in <= 15)",
                ],
                rows,
            )
        )
        L.append("")
        for m in ("dask_threads", "dask_cluster", "dask_tight"):
            r = ms.get(m, {})
            if not r.get("iteration_times"):
                continue
            it = np.diff([0.0, *r["iteration_times"]])
            cells = ", ".join(f"{x:.1f}" for x in it)
            line = f"{LABELS[m]}: seconds per iteration (the first includes set-up) {cells}"
            dp = [x for x in r.get("dask_passes") or [] if x[1] is not None]
            if dp:
                line += "; of which reading and reducing the chunks (`dask.compute`) " + ", ".join(
                    f"{e - s_:.1f}" for s_, e in dp
                )
            if r.get("iteration_rss_mb"):
                line += "; resident MB at each iteration's end " + ", ".join(
                    f"{x:,}" for x in r["iteration_rss_mb"]
                )
            if r.get("rss_trace"):
                tmax, rmax = max(r["rss_trace"], key=lambda x: x[1])
                line += f"; highest 2-s sample of resident memory {rmax:,} MB at {tmax:.0f} s"
            L.extend([line + ".", ""])
    if "cluster" in dv:
        c = dv["cluster"]
        L.append(
            f"**Threads vs LocalCluster**: the -ELBO of the {c['common']} iterations both "
            f"ran (threads {c['threads_n']}, LocalCluster {c['cluster_n']}) differ by at "
            f"most {c['max_rel']:.1e} relative (last common iteration {c['last_rel']:.1e}; "
            f"largest difference of q's means there {c.get('mean_diff', float('nan')):.1e}); "
            "target 1e-8."
        )
        L.append("")
    if "nll_time" in dv:
        best = dv["nll_best"]
        L.append(
            f"**Time to the best held-out NLL.** Held-out NLL of q at each snapshot "
            f"(plugin: every iteration; ADVI: every {ADVI_SNAP} steps; NumPyro: every block "
            f"of 500 steps) on {TRACE_DRAWS} draws `mean + sd * z`, the same `z` (seed "
            f"{TRACE_SEED}) for every snapshot and method, computed after the fit; times "
            "from the start of loading / building the model, as in the table above "
            "(compilation included), the time spent "
            f"reading q at the snapshots subtracted. Best of all methods: {best:.6f} "
            f"({LABELS[dv['nll_best_method']]}); target: NLL <= (1 + {NLL_REL:g}) x best "
            f"= {(1 + NLL_REL) * best:.6f}. *Sustained*: from that snapshot on, every later "
            "one is within."
        )
        L.append("")
        ref = dv["nll_time"].get("dask_threads", {}).get("sustained_s")
        rows = []
        for m in METHODS:
            v = dv["nll_time"].get(m)
            if v is None:
                continue
            s_ = v["sustained_s"]
            rows.append(
                [
                    LABELS[m],
                    fmt(v["first_s"], ".1f")
                    + ("" if v["first_step"] is None else f" (step {v['first_step']:,})"),
                    fmt(s_, ".1f")
                    + ("" if v["sustained_step"] is None else f" (step {v['sustained_step']:,})"),
                    fmt(s_ / ref, ".2f") + "x" if s_ and ref else "–",
                    f"{v['final']:.6f} at {v['final_s']:.0f} s",
                    f"{v['min']:.6f}",
                ]
            )
        L.append(
            common.markdown_table(
                [
                    "method",
                    "first within, s",
                    "sustained within, s",
                    "sustained / plugin (threads)",
                    "last snapshot's NLL",
                    "lowest NLL",
                ],
                rows,
            )
        )
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
        "10M x 100 (issue 52's targets; the plugin from `git archive 0c1ae95 pymc_mcssvi "
        "| tar -x -C /tmp/src`): `python benchmarks/scale.py --n 10000000 --p 100 "
        "--methods dask_threads,dask_cluster --cap 1200 --rss-cap-gb 20 --plugin-src "
        "/tmp/src --plugin-commit 0c1ae95`, then `--methods advi,numpyro --cap 600 "
        "--rss-cap-gb 20 --advi-steps 10000000 --numpyro-steps 10000000` (the step "
        "counts only make the cap stop them). These runs also record per-iteration "
        "traces (the plugin's -ELBO, q's mean and sd, the time of each `dask.compute`, "
        "resident memory) and snapshots of ADVI's and NumPyro's q, rendered below the "
        "case's table.",
        "",
    ]
    for res in results:
        L.extend(render_case(res))
    if notes:
        L.extend([notes.strip(), ""])
    return "\n".join(L)


def all_results() -> list[dict]:
    out = []
    for f in sorted(ROOT.glob("results_n*_p*.json")):
        res = json.loads(f.read_text())
        if fill_snapshot_nll(res):
            common.save_json(res, f)
        out.append(res)
    return sorted(out, key=lambda r: r["n"] * r["p"])


def fill_snapshot_nll(res: dict) -> bool:
    """Held-out NLLs of the snapshots of a worker stopped by its cap (it recorded the
    snapshots but not their NLLs); True when any were added."""
    d = data_dir(res["n"], res["p"])
    added = False
    for r in res["methods"].values():
        if r.get("snapshots") and not r.get("snapshot_nll") and (d / "meta.json").exists():
            r["snapshot_nll"] = snapshot_nlls(r["snapshots"], d)
            r["snapshot_nll_by"] = "the main process, after the worker stopped"
            added = True
    return added


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--p", type=int, default=20)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--cap", type=float, default=300.0, help="wall seconds per method")
    parser.add_argument("--rss-cap-gb", type=float, default=14.0)
    parser.add_argument("--advi-steps", type=int, default=ADVI_STEPS)
    parser.add_argument("--numpyro-steps", type=int, default=NUMPYRO_STEPS)
    parser.add_argument("--advi-seed", type=int, default=0, help="pm.fit's random_seed")
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
            wargs += ["--advi-steps", str(args.advi_steps)]
            wargs += ["--numpyro-steps", str(args.numpyro_steps)]
            wargs += ["--advi-seed", str(args.advi_seed)]
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
