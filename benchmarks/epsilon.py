"""Epsilon-like logistic regression, 100,000 x 2,000: full batch and minibatch 2,000 (issue 52).

The paper's GLM experiment fits the *epsilon* data set (100,000 rows, 2,000 features,
prior ``w ~ N(0, I)``) with MC-SSVI, H-MC-SSVI and D-SVI on minibatches of 2,000 rows
and with H-MC-SSVI in full batch. Here a synthetic stand-in of the same size:

* ``X = Z L^T * SCALE / sqrt(p)`` with ``Z ~ N(0, 1)`` and ``L L^T`` the Toeplitz
  correlation ``RHO^|i - j|`` (neighbouring features correlated, as in
  ``common.logistic_regression_data``), so that the logit ``X w`` has sd about
  ``SCALE`` for weights from the prior;
* true weights ``w ~ N(0, 1)`` (one draw), ``y ~ Bernoulli(logit = X w)``;
* ``N_TEST`` held-out rows of the same model.

The data are written once (``.npy``, float64) under ``/tmp/mcssvi-epsilon/`` and reused.
The fitted model: ``w ~ N(0, 1)`` (``p`` weights, no intercept),
``y ~ Bernoulli(logit_p = X @ w)``, the data through ``pm.Data("X", X)`` without
``shape=`` (the default user way) or ``pm.Minibatch(X, y, batch_size=2000)`` with
``total_size=N``.

Methods, each in a process of its own (``common.run_worker``) with a wall-clock cap
(the worker's watchdog writes what it has and exits when the cap is hit):

* ``hmcssvi``: ``pm.fit(method="hmcssvi")`` full batch, defaults;
* ``hmcssvi_mb``: ``pm.fit(method="hmcssvi")`` on ``pm.Minibatch`` (defaults: the
  stochastic steps, then full-data steps from the iterates' average);
* ``hmcssvi_mb_chunk``: the same with ``chunk_size=BATCH`` (see the docs section: the
  default fails to compile at this size);
* ``sdsvi``: ``pm.fit(method="sdsvi")`` full batch, defaults;
* ``hmcssvi_fullcov``: ``pm.fit(method="hmcssvi", cov="full")`` full batch (one
  2,000 x 2,000 covariance, as the paper's algorithms keep; the default is
  mean field above 1,000 dimensions);
* ``advi_mb``: PyMC ADVI on ``pm.Minibatch``, defaults, steps until the cap;
* ``advi_full``: PyMC ADVI on the ``pm.Data`` model, steps until the cap;
* ``numpyro``: NumPyro SVI, ``AutoNormal``, Adam(``NUMPYRO_LR``), float64, 2,000 row
  indices per step drawn with replacement and substituted into
  ``plate(subsample_size=2000)`` (as in ``scale.py``), until the cap.

Every worker records traces: the plugin's callback each iteration's time, -ELBO
(``losses[-1]``) and q's mean and sd (``approx.mean`` / ``approx.std``; at most every
``SNAP_S`` seconds, and every iteration of a full-batch fit); the full-data steps that
end a ``pm.Minibatch`` fit (an inner fit of the plugin that takes no callbacks) are
traced by a wrapper of ``StructuredVI.fit`` that hands the same callback to it;
ADVI's and NumPyro's q are read at most every ``SNAP_S`` seconds. The time spent reading
q is subtracted from the times. After the fit each snapshot's held-out NLL is computed
on ``TRACE_DRAWS`` draws ``mean + sd * z`` (the same ``z`` for every snapshot and
method), giving an NLL-vs-time curve per method, and the time to within ``NLL_REL`` of
the best held-out NLL of all methods.

Reported per method: wall time of set-up (data loading, model, compilation) and fit,
the set-up time (to the end of the first iteration minus a median iteration),
iterations, ms per iteration, the worker's peak RSS (``VmHWM``), the held-out NLL per
observation on ``DRAWS`` draws of q, the final bound where defined, the time to within
0.1% of the best held-out NLL and its ratio to the full-batch plugin's. The 1-minute
load average is recorded at each worker's start and end.

Run ``python benchmarks/epsilon.py`` (about 45 minutes on 2 cores); to run the plugin
from a frozen copy of its sources: ``git archive HEAD pymc_mcssvi | tar -x -C /tmp/epsrc``
and ``--plugin-src /tmp/epsrc --plugin-commit <hash>``. ``--report-only`` re-renders
the docs section from ``/tmp/mcssvi-epsilon/results.json``; ``--quick`` runs a small
smoke test (N = 5,000, p = 200, caps of 60 s) that writes neither the docs nor
``benchmarks/results/``. Results: ``benchmarks/results/epsilon.json`` (without the
snapshots' vectors) and the section ``epsilon`` of ``docs/benchmarks.md``.
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

ROOT = Path("/tmp/mcssvi-epsilon")
RESULTS = Path(__file__).resolve().parent / "results" / "epsilon.json"
SECTION = "epsilon"
N, P, N_TEST = 100_000, 2_000, 10_000
RHO = 0.8
SCALE = 2.5
SEED = 0
GEN_CHUNK = 10_000
BATCH = 2_000
DRAWS = 200
TRACE_DRAWS = 50
TRACE_SEED = 7
SNAP_S = 2.0  # seconds between snapshots of q (full-batch plugin fits: every iteration)
NLL_REL = 1e-3
NUMPYRO_LR = 0.01
NUMPYRO_BLOCK = 100
BIG_STEPS = 10_000_000  # ADVI / NumPyro: only the cap stops them
PLUGIN_CAP = 400.0
PEER_CAP = 300.0
AT_TIMES = (60, 100, 150, 200, 250, 275, 300, 350, 395, 450)  # NLL-at-a-time table
METHODS = (
    "hmcssvi",
    "hmcssvi_mb",
    "hmcssvi_mb_chunk",
    "sdsvi",
    "hmcssvi_fullcov",
    "advi_mb",
    "advi_full",
    "numpyro",
)
PLUGIN = ("hmcssvi", "hmcssvi_mb", "hmcssvi_mb_chunk", "sdsvi", "hmcssvi_fullcov")
MINIBATCH = ("hmcssvi_mb", "hmcssvi_mb_chunk", "advi_mb", "numpyro")
REF = "hmcssvi"
LABELS = {
    "hmcssvi": 'plugin H-MC-SSVI, full batch (`pm.fit(method="hmcssvi")`)',
    "hmcssvi_mb": f"plugin H-MC-SSVI, pm.Minibatch {BATCH:,} (defaults)",
    "hmcssvi_mb_chunk": f"plugin H-MC-SSVI, pm.Minibatch {BATCH:,}, `chunk_size={BATCH}`",
    "sdsvi": 'plugin S-DSVI, full batch (`method="sdsvi"`)',
    "hmcssvi_fullcov": 'plugin H-MC-SSVI, full batch, `cov="full"`',
    "advi_mb": f"PyMC ADVI, pm.Minibatch {BATCH:,}",
    "advi_full": "PyMC ADVI, full batch (pm.Data)",
    "numpyro": f"NumPyro SVI AutoNormal, subsample {BATCH:,}",
}
DEFAULT_METHODS = (
    "hmcssvi",
    "hmcssvi_mb",
    "hmcssvi_mb_chunk",
    "sdsvi",
    "advi_mb",
    "numpyro",
    "advi_full",
)


# --------------------------------------------------------------------------- data
def data_dir(n: int, p: int) -> Path:
    return ROOT / f"n{n}_p{p}"


def make_data(n: int, p: int, n_test: int) -> Path:
    """Write (once) X, y and the held-out rows as ``.npy``; the meta file marks them done."""
    from scipy.linalg import toeplitz

    d = data_dir(n, p)
    meta = d / "meta.json"
    if meta.exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rng = np.random.default_rng(SEED)
    w = rng.normal(size=p)
    chol = np.linalg.cholesky(toeplitz(RHO ** np.arange(p)))
    c = SCALE / np.sqrt(p)
    for prefix, rows in (("", n), ("test_", n_test)):
        X = np.lib.format.open_memmap(
            d / f"{prefix}X.npy", mode="w+", dtype="float64", shape=(rows, p)
        )
        y = np.empty(rows)
        for k, start in enumerate(range(0, rows, GEN_CHUNK)):
            r = np.random.default_rng([SEED, 1 if prefix else 0, k])
            m = min(GEN_CHUNK, rows - start)
            Xk = (r.standard_normal((m, p)) @ chol.T) * c
            X[start : start + m] = Xk
            y[start : start + m] = r.random(m) < 1.0 / (1.0 + np.exp(-(Xk @ w)))
        X.flush()
        del X
        np.save(d / f"{prefix}y.npy", y)
    eta = load(d, "test_X") @ w
    common.save_json(
        {
            "n": n,
            "p": p,
            "n_test": n_test,
            "rho": RHO,
            "scale": SCALE,
            "seed": SEED,
            "w_true": w,
            "logit_sd_test": float(eta.std()),
            "y_mean": float(np.load(d / "y.npy").mean()),
            "seconds": time.perf_counter() - t0,
        },
        meta,
    )
    log(f"wrote {d} in {time.perf_counter() - t0:.1f} s (logit sd {eta.std():.2f})")
    return d


def load(d: Path, name: str) -> np.ndarray:
    return np.load(d / f"{name}.npy")


def load_jax(d: Path, name: str):
    """A ``.npy`` read into a JAX array chunk by chunk (written in place into a donated
    buffer: held once, not three times as ``jnp.asarray`` of the NumPy array)."""
    import jax
    import jax.numpy as jnp

    z = np.load(d / f"{name}.npy", mmap_mode="r")
    out = jnp.zeros(z.shape, dtype=z.dtype)
    put = jax.jit(
        lambda a, b, i: jax.lax.dynamic_update_slice(a, b, (i,) + (0,) * (a.ndim - 1)),
        donate_argnums=0,
    )
    step = 10_000
    for start in range(0, z.shape[0], step):
        block = np.ascontiguousarray(z[start : start + step])
        out = put(out, jnp.asarray(block), start)
    return out.block_until_ready()


# ------------------------------------------------------------------------ workers
class Watchdog:
    """Ends the worker (after writing what it has) at the wall-clock or memory cap."""

    def __init__(self, out: dict, path: str, cap_s: float, rss_cap_mb: float, snaps: list):
        self.out, self.path, self.cap_s, self.rss_cap_mb = out, path, cap_s, rss_cap_mb
        self.snaps = snaps
        self.t0 = time.perf_counter()
        self.out["rss_trace"] = []  # (seconds since the worker started, resident MB) every 2 s
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
                self.out["snapshots"] = _snap_lists(self.snaps)
                common.save_json(self.out, self.path)
                os._exit(0)


def _snap_lists(snaps):
    return [
        (t, step, phase, m.tolist(), s.tolist(), None if dr is None else dr.tolist())
        for t, step, phase, m, s, dr in list(snaps)
    ]


def snapshot_nlls(snaps: list, d: Path) -> list:
    """Held-out NLL of each snapshot ``(t, step, phase, mean, sd, draws)`` on
    ``TRACE_DRAWS`` draws: ``mean + sd * z`` for a mean-field q, the snapshot's
    ``draws`` (``mean + L z``) for a q with a full covariance; the same ``z`` (seed
    ``TRACE_SEED``) for every snapshot and method; computed after the fit, outside the
    timed region. Returns ``(t, step, phase, nll)``."""
    Xt, yt = load(d, "test_X"), load(d, "test_y")
    z = None
    out = []
    for t, step, phase, mean, sd, draws in snaps:
        if draws is None:
            mean, sd = np.asarray(mean, dtype="float64"), np.asarray(sd, dtype="float64")
            if z is None:
                z = np.random.default_rng(TRACE_SEED).standard_normal((TRACE_DRAWS, mean.size))
            draws = mean + sd * z
        out.append((t, step, phase, common.heldout_nll(np.asarray(draws), Xt, yt)))
    return out


def _draws_nll(draws, d) -> float:
    return common.heldout_nll(
        np.asarray(draws).reshape(DRAWS, -1), load(d, "test_X"), load(d, "test_y")
    )


def _q(approx):
    return (
        np.asarray(approx.mean.eval(), dtype="float64").copy(),
        np.asarray(approx.std.eval(), dtype="float64").copy(),
    )


class PluginReader:
    """q's mean and sd (and, for a q whose covariance is not diagonal, ``TRACE_DRAWS``
    draws ``mean + L z`` with the common ``z``, ``L L^T`` the covariance) from one
    compiled function per approximation (``.eval()`` compiles at every call: 0.2-0.3 s)."""

    def __init__(self):
        self.fns = {}
        self.z = None

    def __call__(self, approx):
        import pytensor

        key = id(approx)
        if key not in self.fns:
            self.fns[key] = pytensor.function([], [approx.mean, approx.std, approx.cov])
        vals = self.fns[key]()
        mean = np.asarray(vals[0], dtype="float64").copy()
        sd = np.asarray(vals[1], dtype="float64").copy()
        draws = None
        # the start is diagonal whatever the layout: look at every snapshot's q
        if np.any(vals[2] - np.diag(np.diag(vals[2]))):
            if self.z is None:
                self.z = np.random.default_rng(TRACE_SEED).standard_normal((TRACE_DRAWS, mean.size))
            L = np.linalg.cholesky(0.5 * (vals[2] + vals[2].T))
            draws = mean + self.z @ L.T
        return mean, sd, draws


def run_plugin(method: str, d: Path, n: int, out: dict, snaps: list) -> None:
    import pymc as pm

    import pymc_mcssvi as mc  # noqa: F401  (registers the methods)
    from pymc_mcssvi.pymc import inference as inf_mod

    t0 = time.perf_counter()
    times, bounds, phases = [], [], []
    eval_s = [0.0]
    last_snap = [-np.inf]
    out["phase"] = "load"
    X, y = load(d, "X"), load(d, "y")
    out["load_s"] = time.perf_counter() - t0
    out["phase"] = "model"
    minibatch = method in MINIBATCH
    with pm.Model() as model:
        if minibatch:
            Xd, yd = pm.Minibatch(X, y, batch_size=BATCH)
        else:
            Xd, yd = pm.Data("X", X), pm.Data("y", y)
        w = pm.Normal("w", 0.0, 1.0, shape=X.shape[1])
        pm.Bernoulli("obs", logit_p=Xd @ w, observed=yd, total_size=n if minibatch else None)
    out["model_s"] = time.perf_counter() - t0
    every_iteration = not minibatch
    phase = ["fit"]
    read = PluginReader()

    def cb(approx, losses, i):
        now = time.perf_counter()
        t = now - t0 - eval_s[0]
        times.append(t)
        bounds.append(float(np.asarray(losses)[-1]))
        phases.append(phase[0])
        if every_iteration or len(times) == 1 or t - last_snap[0] >= SNAP_S:
            snaps.append((t, len(times), phase[0], *read(approx)))
            last_snap[0] = t
            eval_s[0] += time.perf_counter() - now
        out["iterations"] = len(times)
        out["iteration_times"] = times
        out["iteration_bounds"] = bounds
        out["iteration_phases"] = phases
        out["snapshot_eval_s"] = eval_s[0]

    # The full-data steps that end a pm.Minibatch fit are an inner fit of the plugin,
    # called without callbacks: hand it the same callback (phase "full-data steps").
    orig_fit = inf_mod.StructuredVI.fit
    depth = [0]

    def traced_fit(self, n=None, score=None, callbacks=None, *a, **k):
        depth[0] += 1
        try:
            if depth[0] > 1 and not callbacks:
                phase[0] = "full-data steps"
                out["full_data_steps_start_s"] = time.perf_counter() - t0 - eval_s[0]
                callbacks = [cb]
            return orig_fit(self, n, score, callbacks, *a, **k)
        finally:
            depth[0] -= 1

    inf_mod.StructuredVI.fit = traced_fit
    kw = {}
    if method == "hmcssvi_mb_chunk":
        kw["chunk_size"] = BATCH
    if method == "hmcssvi_fullcov":
        kw["cov"] = "full"
    name = "sdsvi" if method == "sdsvi" else "hmcssvi"
    out["fit_call"] = f'pm.fit(method="{name}", progressbar=False, callbacks=[cb], **{kw})'
    out["phase"] = "fit"
    approx = pm.fit(method=name, model=model, progressbar=False, callbacks=[cb], **kw)
    out["seconds"] = time.perf_counter() - t0
    out["peak_mb"] = vmhwm_mb()
    out["phase"] = "evaluate"
    out["fit_seconds_net"] = out["seconds"] - eval_s[0]
    out["iterations"] = int(approx.n_iter)
    out["callback_iterations"] = len(times)
    out["converged"] = approx.converged
    out["first_iteration_s"] = times[0] if times else None
    out["post_fit_s"] = out["fit_seconds_net"] - times[-1] if times else None
    out["final_bound"] = float(np.asarray(approx.hist[-1]))
    mean, sd, draws = read(approx)
    if not snaps or snaps[-1][1] != len(times) or snaps[-1][2] != phase[0]:
        # the returned q (a pm.Minibatch fit without full-data steps: the iterates' average)
        snaps.append((out["fit_seconds_net"], len(times), "returned", mean, sd, draws))
    out["mean"], out["sd"] = mean, sd
    wd = approx.sample(DRAWS, random_seed=1).posterior["w"].values
    out["nll"] = _draws_nll(wd, d)


def run_advi(method: str, d: Path, n: int, out: dict, snaps: list, cap_s: float, seed: int):
    import pymc as pm

    t0 = time.perf_counter()
    out["phase"] = "load"
    X, y = load(d, "X"), load(d, "y")
    out["load_s"] = time.perf_counter() - t0
    out["phase"] = "model"
    with pm.Model() as model:
        if method == "advi_mb":
            Xb, yb = pm.Minibatch(X, y, batch_size=BATCH)
            w = pm.Normal("w", 0.0, 1.0, shape=X.shape[1])
            pm.Bernoulli("obs", logit_p=Xb @ w, observed=yb, total_size=n)
        else:
            Xd, yd = pm.Data("X", X), pm.Data("y", y)
            w = pm.Normal("w", 0.0, 1.0, shape=X.shape[1])
            pm.Bernoulli("obs", logit_p=Xd @ w, observed=yd)
    out["model_s"] = time.perf_counter() - t0
    stop_at = 0.92 * cap_s
    count, eval_s, last = [0], [0.0], [-np.inf]
    step_times = []

    def cb(approx, losses, i):
        count[0] += 1
        now = time.perf_counter()
        t = now - t0 - eval_s[0]
        if count[0] <= 2:
            step_times.append(t)
        out["iterations"] = count[0]
        if count[0] == 1 or t - last[0] >= SNAP_S:
            mean, sd = _q(approx)
            snaps.append((t, count[0], "fit", mean, sd, None))
            last[0] = t
            eval_s[0] += time.perf_counter() - now
            out["snapshot_eval_s"] = eval_s[0]
        if now - t0 > stop_at:
            raise StopIteration(f"time cap {stop_at:.0f} s")

    out["phase"] = "fit"
    out["random_seed"] = seed
    approx = pm.fit(
        BIG_STEPS, method="advi", model=model, callbacks=[cb], random_seed=seed, progressbar=False
    )
    out["seconds"] = time.perf_counter() - t0
    out["fit_seconds_net"] = out["seconds"] - eval_s[0]
    out["peak_mb"] = vmhwm_mb()
    out["iterations"] = count[0]
    out["stopped_by_cap"] = count[0] < BIG_STEPS
    out["first_iteration_s"] = step_times[0] if step_times else None
    if count[0] > 1:
        out["ms_per_iteration"] = 1e3 * (out["fit_seconds_net"] - step_times[0]) / (count[0] - 1)
    hist = np.asarray(approx.hist)
    out["final_loss"] = float(np.mean(hist[-min(500, len(hist)) :]))
    out["phase"] = "evaluate"
    mean, sd = _q(approx)
    snaps.append((out["fit_seconds_net"], count[0], "fit", mean, sd, None))
    del X, y
    wd = approx.sample(DRAWS, random_seed=1).posterior["w"].values
    out["nll"] = _draws_nll(wd, d)


def run_numpyro(d: Path, n: int, out: dict, snaps: list, cap_s: float) -> None:
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
    p = X.shape[1]
    out["load_s"] = time.perf_counter() - t0
    out["peak_mb_after_load"] = vmhwm_mb()

    def model(X, y, idx):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([p]).to_event(1))
        with (
            numpyro.handlers.substitute(data={"data": idx}),
            numpyro.plate("data", n, subsample_size=BATCH) as rows,
        ):
            numpyro.sample("obs", dist.Bernoulli(logits=X[rows] @ w), obs=y[rows])

    guide = AutoNormal(model)
    svi = SVI(model, guide, numpyro.optim.Adam(NUMPYRO_LR), Trace_ELBO())
    out["phase"] = "compile"
    state = svi.init(jax.random.PRNGKey(0), X, y, jnp.arange(BATCH))

    @jax.jit
    def steps(state, key, X, y):
        def body(s, k):
            idx = jax.random.randint(k, (BATCH,), 0, n)
            return svi.update(s, X, y, idx)

        return jax.lax.scan(body, state, jax.random.split(key, NUMPYRO_BLOCK))

    key = jax.random.PRNGKey(2)
    out["phase"] = "fit"
    stop_at = 0.92 * cap_s
    done, losses = 0, []
    eval_s, last = [0.0], [-np.inf]

    def snapshot(force=False):
        now = time.perf_counter()
        t = now - t0 - eval_s[0]
        if force or t - last[0] >= SNAP_S:
            params = svi.get_params(state)
            mean = np.asarray(params["w_auto_loc"], dtype="float64").copy()
            sd = np.asarray(params["w_auto_scale"], dtype="float64").copy()
            snaps.append((t, done, "fit", mean, sd, None))
            last[0] = t
            eval_s[0] += time.perf_counter() - now

    while done < BIG_STEPS and time.perf_counter() - t0 < stop_at:
        key, sub = jax.random.split(key)
        state, loss = steps(state, sub, X, y)
        loss.block_until_ready()
        done += NUMPYRO_BLOCK
        if done == NUMPYRO_BLOCK:
            out["first_iteration_s"] = time.perf_counter() - t0
        losses.append(float(jnp.mean(loss)))
        out["iterations"] = done
        snapshot(force=done == NUMPYRO_BLOCK)
    out["seconds"] = time.perf_counter() - t0
    out["fit_seconds_net"] = out["seconds"] - eval_s[0]
    out["peak_mb"] = vmhwm_mb()
    out["iterations"] = done
    out["stopped_by_cap"] = done < BIG_STEPS
    if done > NUMPYRO_BLOCK:
        out["ms_per_iteration"] = (
            1e3 * (out["fit_seconds_net"] - out["first_iteration_s"]) / (done - NUMPYRO_BLOCK)
        )
    out["final_loss"] = float(np.mean(losses[-5:]))
    snapshot(force=True)
    out["phase"] = "evaluate"
    params = svi.get_params(state)
    wd = guide.sample_posterior(jax.random.PRNGKey(1), params, sample_shape=(DRAWS,))["w"]
    wd = np.asarray(wd)
    del X, y
    out["nll"] = _draws_nll(wd, d)


def worker_main(args) -> None:
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("pymc").setLevel(logging.ERROR)
    method = args.worker
    out = {"method": method, "load_start": loadavg(), "run": common.run_record("full")}
    snaps: list = []
    Watchdog(out, args.out, args.cap, args.rss_cap_gb * 1024, snaps)
    d = data_dir(args.n, args.p)
    try:
        if method in PLUGIN:
            out["plugin"] = plugin_sources()
            run_plugin(method, d, args.n, out, snaps)
        elif method.startswith("advi"):
            run_advi(method, d, args.n, out, snaps, args.cap, args.advi_seed)
        elif method == "numpyro":
            run_numpyro(d, args.n, out, snaps, args.cap)
        else:
            raise ValueError(method)
        out["phase"] = "done"
    except Exception as e:  # recorded, the benchmark goes on
        tb = traceback.format_exc()
        print(tb, file=sys.stderr)
        out["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        out["error_s"] = time.perf_counter() - _T0
        out["traceback_tail"] = tb.strip().splitlines()[-14:]
        out.setdefault("peak_mb", vmhwm_mb())
    out["load_end"] = loadavg()
    out["snapshots"] = _snap_lists(snaps)
    common.save_json(out, args.out)
    os._exit(0)  # do not wait for JAX threads


_T0 = time.perf_counter()


def plugin_sources() -> dict:
    """Where the imported ``pymc_mcssvi`` comes from, and a SHA-1 of its ``*.py``."""
    import hashlib
    import importlib.util

    root = Path(importlib.util.find_spec("pymc_mcssvi").origin).parent
    h = hashlib.sha1()
    for f in sorted(root.rglob("*.py")):
        h.update(f.read_bytes())
    return {"path": str(root), "sha1": h.hexdigest()[:12]}


# ---------------------------------------------------------------------- derived
def summarize(r: dict) -> dict:
    """Set-up time, iterations, ms per iteration from a method's record."""
    s = {}
    it = r.get("iteration_times")
    if it:
        t = np.asarray(it)
        dt = np.diff(t)
        if r.get("iteration_phases"):
            ph = np.asarray(r["iteration_phases"])
            s["ms_fit"] = (
                1e3 * float(np.median(dt[ph[1:] == "fit"])) if (ph[1:] == "fit").any() else None
            )
            fd = ph[1:] == "full-data steps"
            # the first full-data step includes the inner fit's set-up
            s["ms_full_data"] = 1e3 * float(np.median(dt[fd][1:])) if fd.sum() > 1 else None
            s["n_fit"] = int((ph == "fit").sum())
            s["n_full_data"] = int((ph == "full-data steps").sum())
        s["ms"] = 1e3 * float(np.median(dt)) if len(dt) else None
        s["setup"] = float(t[0] - np.median(dt)) if len(dt) else float(t[0])
    else:
        s["ms"] = r.get("ms_per_iteration")
        if r.get("first_iteration_s") is not None and s["ms"] is not None:
            per_first = NUMPYRO_BLOCK if r["method"] == "numpyro" else 1
            s["setup"] = r["first_iteration_s"] - per_first * s["ms"] / 1e3
    return s


def derived(res: dict) -> dict:
    ms = res["methods"]
    curves = {m: r["snapshot_nll"] for m, r in ms.items() if r.get("snapshot_nll")}
    out = {}
    if not curves:
        return out
    best_m = min(curves, key=lambda m: min(x[3] for x in curves[m]))
    best = min(x[3] for x in curves[best_m])
    out["nll_best"], out["nll_best_method"] = best, best_m
    out["nll_time"] = {}
    for m, c in curves.items():
        t = [x[0] for x in c]
        v = [x[3] for x in c]
        tt, i = common.time_to_within(t, v, best, rel=NLL_REL)
        first = next((x for x in c if x[3] <= (1 + NLL_REL) * best), None)
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


# ---------------------------------------------------------------------- reporting
def _mb(x):
    return "–" if x is None else f"{x:,.0f}"


def _load_span(ms: dict) -> str:
    ls = [r["load_s"] for r in ms.values() if r.get("load_s") is not None]
    return f"{min(ls):.0f}-{max(ls):.0f}" if ls else "?"


def _dates(ms: dict) -> str:
    """The span of the methods' start dates (``run.date``, local time)."""
    ds = sorted(r["run"]["date"] for r in ms.values() if r.get("run", {}).get("date"))
    if not ds:
        return "?"
    return ds[0] if ds[0] == ds[-1] else f"{ds[0]} to {ds[-1][-5:]} (local time)"


def render(res: dict, notes: str = "") -> str:
    ms = res["methods"]
    mi = res["machine"]
    meta = res["data"]
    dv = derived(res)
    ref_t = dv.get("nll_time", {}).get(REF, {}).get("sustained_s")
    commits = sorted({r.get("plugin_commit") for m, r in ms.items() if m in PLUGIN} - {None})
    L = [
        "## Epsilon-like logistic regression, 100,000 x 2,000 (issue 52)",
        "",
        "The paper's GLM experiment (the *epsilon* data, 100,000 x 2,000, prior `N(0, I)`, "
        "minibatches of 2,000 and H-MC-SSVI in full batch) on a synthetic stand-in of the "
        f"same size: `X = Z L^T * {SCALE} / sqrt(p)`, `Z ~ N(0, 1)`, `L L^T` the Toeplitz "
        f"correlation `{RHO}^|i-j|` between features; true `w ~ N(0, 1)` (one draw); "
        f"`y ~ Bernoulli(logit = X w)` (logit sd {meta['logit_sd_test']:.2f}, "
        f"{100 * meta['y_mean']:.1f}% ones); {meta['n_test']:,} held-out rows of the same "
        f"model. Data written once to `.npy` under `/tmp/mcssvi-epsilon/` "
        f"({meta['seconds']:.0f} s). Model: `w ~ pm.Normal(0, 1, shape=2000)`, "
        '`pm.Bernoulli(logit_p=X @ w)`; full batch with `pm.Data("X", X)` and '
        f'`pm.Data("y", y)` (no `shape=`), minibatch with `pm.Minibatch(X, y, '
        f"batch_size={BATCH})` and `total_size=100_000`.",
        "",
        f"Run {_dates(ms)} on {mi.get('cpu_count')} logical CPUs ({mi.get('cpu_model', '?')}), "
        f"{mi.get('mem_total_gb')} GB, {mi.get('platform')}; another session ran CPU jobs at "
        "the same time (load column: 1-minute load average at each worker's start and end). "
        f"Plugin from a frozen `git archive` of commit {', '.join(commits) or '?'}. Versions: "
        + ", ".join(f"{k} {v}" for k, v in res["versions"].items())
        + ".",
        "",
        "Each method runs in a process of its own, with a wall-clock cap (plugin "
        f"{res['caps']['plugin']:.0f} s, peers {res['caps']['peer']:.0f} s unless stated; "
        "ADVI and NumPyro "
        "stop themselves at 92% of it). Fit time: wall time from loading the data "
        f"(`np.load` of the 1.6 GB X, {_load_span(ms)} s here) to the end of `pm.fit` / the "
        "last step (for a fit the cap ended: the cap), compilation included, "
        "held-out evaluation and reading q for the traces excluded. Set-up: end of the first "
        "iteration minus a median iteration. Final -ELBO: the plugin's bound "
        "(`approx.hist[-1]`, or the last iteration's when the cap ended the fit); for ADVI "
        "and NumPyro the mean of their last losses, a Monte Carlo estimate (ADVI on "
        "`pm.Minibatch`: times N / B, by which PyMC divides it). "
        "Peak RSS: the worker's `VmHWM`. Held-out NLL: "
        f"`-mean_i log mean_s p(y_i | w_s)` on {DRAWS} draws from the final q (a capped plugin "
        f"fit: its last snapshot, {TRACE_DRAWS} draws). Time to within 0.1%: q is read every "
        f"{SNAP_S:g} s or less (full-batch plugin fits: every iteration); each snapshot's "
        f"held-out NLL on {TRACE_DRAWS} draws `mean + sd * z` with the same `z` for all; the "
        "first time after which every snapshot stays within `1.001 x` the best snapshot NLL "
        "of all methods"
        + (
            f" ({dv['nll_best']:.5f}, {LABELS[dv['nll_best_method']]})"
            if dv.get("nll_best")
            else ""
        )
        + "; the ratio is to the full-batch H-MC-SSVI's time.",
        "",
    ]
    rows = []
    for m in METHODS:
        if m not in ms:
            continue
        r = ms[m]
        s = summarize(r)
        nt = dv.get("nll_time", {}).get(m, {})
        secs = r.get("fit_seconds_net", r.get("seconds"))
        err = " ".join((r.get("error") or "").split())
        capped = err.startswith("cap hit")
        it = r.get("iterations")
        itc = "–" if it is None else f"{it:,}"
        if s.get("n_full_data"):
            itc += f" ({s['n_fit']:,} minibatch + {s['n_full_data']:,} full-data)"
        if m in PLUGIN and r.get("converged") is not None:
            itc += ", converged" if r["converged"] else ", not converged"
        elif r.get("stopped_by_cap") or capped:
            itc += f" (cap {r.get('cap', 0):.0f} s)"
        if capped and secs is None:
            # the watchdog ended the worker during the fit: the fit's time is the cap
            tcell = f"{r['seconds_at_stop']:.0f} (cap"
            if r.get("iteration_times"):
                tcell += f"; last iteration at {r['iteration_times'][-1]:.0f}"
            tcell += ")"
        elif err and secs is None:
            tcell = f"**{err.split('. ')[0]}**"
            at = r.get("seconds_at_stop") or r.get("error_s")
            if at:
                tcell += f" (at {at:.0f} s)"
        else:
            tcell = fmt(secs, ".1f")
            if r.get("iteration_times") and r.get("post_fit_s") is not None:
                tcell += f" (last iteration at {r['iteration_times'][-1]:.1f})"
            if err:
                tcell += f"; then **{err}**"
        msc = fmt(s.get("ms"), ",.1f" if (s.get("ms") or 0) < 100 else ",.0f")
        if s.get("ms_full_data"):
            msc = f"{fmt(s.get('ms_fit'), '.1f')}; full-data steps {fmt(s['ms_full_data'], ',.0f')}"
        nll = r.get("nll")
        nllc = fmt(nll, ".5f")
        if nll is None and nt.get("final") is not None:
            nllc = f"{nt['final']:.5f} (last snapshot, {TRACE_DRAWS} draws)"
        bound = r.get("final_bound")
        bcell = fmt(bound, ",.1f") if bound is not None else "–"
        if bound is None and r.get("iteration_bounds"):
            bcell = f"{r['iteration_bounds'][-1]:,.1f} (last iteration)"
        if bound is None and r.get("final_loss") is not None:
            # ADVI: mean of the last 500 losses (PyMC divides a minibatch model's loss
            # by N / B: multiplied back); NumPyro: mean of the last 5 blocks' losses
            loss = r["final_loss"] * (res["n"] / BATCH if m == "advi_mb" else 1.0)
            bcell = f"≈ {loss:,.0f} (MC estimate)"
        if m in MINIBATCH and m in PLUGIN and bound is not None and not s.get("n_full_data"):
            bcell += " (minibatch estimate)"
        sus = nt.get("sustained_s")
        rows.append(
            [
                LABELS[m] + (f" [{r['plugin_commit']}]" if m in PLUGIN else ""),
                tcell,
                fmt(s.get("setup"), ".1f"),
                itc,
                msc,
                _mb(r.get("peak_mb")),
                nllc,
                bcell,
                fmt(sus, ".1f"),
                fmt(sus / ref_t, ".2f") + "x" if sus and ref_t else "–",
                f"{fmt(r.get('load_start'), '.2f')} / {fmt(r.get('load_end'), '.2f')}",
            ]
        )
    L.append(
        common.markdown_table(
            [
                "method",
                "fit incl. set-up, s",
                "set-up, s",
                "iterations / steps",
                "ms / iteration",
                "peak RSS, MB",
                "held-out NLL / obs",
                "final -ELBO",
                "time to 0.1% of best NLL, s",
                "/ plugin full batch",
                "load start / end",
            ],
            rows,
        )
    )
    L.append("")
    if res.get("nll_true") is not None:
        L.append(
            f"Held-out NLL at the true weights: {res['nll_true']:.5f} (a posterior predictive "
            "can be below it on a finite test set)."
        )
        L.append("")
    if dv.get("nll_time"):
        rows = []
        for m in METHODS:
            v = dv["nll_time"].get(m)
            if v is None:
                continue
            rows.append(
                [
                    LABELS[m],
                    fmt(v["first_s"], ".1f")
                    + ("" if v["first_step"] is None else f" (iteration {v['first_step']:,})"),
                    fmt(v["sustained_s"], ".1f")
                    + (
                        ""
                        if v["sustained_step"] is None
                        else f" (iteration {v['sustained_step']:,})"
                    ),
                    f"{v['min']:.5f}",
                    f"{v['final']:.5f} at {v['final_s']:.0f} s",
                ]
            )
        L.append(
            f"Held-out NLL traces ({TRACE_DRAWS} draws per snapshot), target "
            f"{(1 + NLL_REL) * dv['nll_best']:.5f}:"
        )
        L.append("")
        L.append(
            common.markdown_table(
                ["method", "first within, s", "sustained within, s", "lowest NLL", "last snapshot"],
                rows,
            )
        )
        L.append("")
    at = [t for t in AT_TIMES if any((r.get("cap") or 0) > t for r in ms.values())]
    rows = []
    for m in METHODS:
        c = ms.get(m, {}).get("snapshot_nll")
        if not c:
            continue
        cells = []
        for t in at:
            v = [x[3] for x in c if x[0] <= t]
            cells.append(f"{v[-1]:.5f}" if v and c[-1][0] >= t - 2 * SNAP_S else "–")
        rows.append([LABELS[m], *cells])
    if rows:
        L.append(
            "Held-out NLL of the last snapshot at or before a time (the same clock: "
            "from loading the data; – before the first snapshot or after the run ended):"
        )
        L.append("")
        L.append(common.markdown_table(["method", *[f"{t} s" for t in at]], rows))
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
    commit = commits[0] if len(commits) == 1 else "<commit>"
    groups: dict = {}
    for m in METHODS:
        if m in ms:
            caps = res["caps"].copy()
            caps["plugin" if m in PLUGIN else "peer"] = ms[m].get("cap")
            groups.setdefault((caps["plugin"], caps["peer"]), []).append(m)
    cmds = [
        f"`python benchmarks/epsilon.py --plugin-src /tmp/epsrc --plugin-commit {commit} "
        f"--methods {','.join(g)}"
        + (f" --plugin-cap {pc:.0f}" if pc != PLUGIN_CAP else "")
        + (f" --peer-cap {rc:.0f}" if rc != PEER_CAP else "")
        + " --no-docs`"
        for (pc, rc), g in groups.items()
    ]
    L.append(
        "Reproduce: `rm -rf /tmp/epsrc && mkdir -p /tmp/epsrc && git archive "
        f"{commit} pymc_mcssvi | tar -x -C /tmp/epsrc`, then "
        + ", then ".join(cmds)
        + " (each merges its methods into `/tmp/mcssvi-epsilon/results.json`; the data are "
        "written by the first), then `python benchmarks/epsilon.py --report-only --notes "
        "FILE` to render this section and `benchmarks/results/epsilon.json` (the numbers "
        "without the snapshots' vectors). Without options the script runs the methods "
        f"{', '.join(DEFAULT_METHODS)} (about 45 minutes)."
    )
    L.append("")
    if notes:
        L.extend([notes.strip(), ""])
    return "\n".join(L)


def stripped(res: dict) -> dict:
    """The results without the snapshots' vectors (for the repository)."""
    out = json.loads(json.dumps(common._jsonable(res)))
    for r in out["methods"].values():
        for k in ("snapshots", "mean", "sd"):
            r.pop(k, None)
    out["data"].pop("w_true", None)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    parser.add_argument("--plugin-cap", type=float, default=PLUGIN_CAP)
    parser.add_argument("--peer-cap", type=float, default=PEER_CAP)
    parser.add_argument("--rss-cap-gb", type=float, default=14.0)
    parser.add_argument("--advi-seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--notes", default=None, help="markdown file added after the tables")
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument("--plugin-src", default=None)
    parser.add_argument("--plugin-commit", default=None)
    # worker arguments
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=N, help=argparse.SUPPRESS)
    parser.add_argument("--p", type=int, default=P, help=argparse.SUPPRESS)
    parser.add_argument("--cap", type=float, default=PLUGIN_CAP, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args)
    n, p, n_test = (5_000, 200, 2_000) if args.quick else (N, P, N_TEST)
    if args.quick:
        args.plugin_cap = args.peer_cap = 60.0
    res_path = ROOT / ("results_quick.json" if args.quick else "results.json")
    methods = [s.strip() for s in args.methods.split(",") if s.strip()]
    if not args.report_only:
        t0 = time.perf_counter()
        d = make_data(n, p, n_test)
        meta = json.loads((d / "meta.json").read_text())
        res = json.loads(res_path.read_text()) if res_path.exists() else {"methods": {}}
        res.update(
            n=n,
            p=p,
            data=meta,
            date=common.today() + " (local)",
            commit=common.code_state().get("commit"),
            machine=common.machine_info(),
            versions=common.library_versions(
                ("pymc", "pytensor", "numpy", "jax", "numpyro", "pymc_mcssvi")
            ),
        )
        # the first run's caps; other caps are stated per method
        res.setdefault("caps", {"plugin": args.plugin_cap, "peer": args.peer_cap})
        res["methods_run"] = sorted(
            set(res.get("methods_run", [])) | set(methods), key=METHODS.index
        )
        w_true = np.asarray(meta["w_true"])
        res["nll_true"] = common.heldout_nll(w_true[None, :], load(d, "test_X"), load(d, "test_y"))
        for m in methods:
            cap = args.plugin_cap if m in PLUGIN else args.peer_cap
            log(f"{m} (N = {n:,}, p = {p}, cap {cap:.0f} s)")
            wargs = [m, "--n", str(n), "--p", str(p), "--cap", str(cap)]
            wargs += ["--rss-cap-gb", str(args.rss_cap_gb), "--advi-seed", str(args.advi_seed)]
            env = None
            if args.plugin_src and m in PLUGIN:
                env = dict(os.environ, PYTHONPATH=str(Path(args.plugin_src).resolve()))
            r = common.run_worker(__file__, wargs, {"method": m}, cap + 300, env=env)
            if m in PLUGIN:
                r["plugin_commit"] = args.plugin_commit or common.code_state().get("commit")
            r["cap"] = cap
            if r.get("snapshots"):
                r["snapshot_nll"] = snapshot_nlls(r["snapshots"], d)
            res["methods"][m] = r
            log(
                f"  {fmt(r.get('seconds'), '.1f')} s, {r.get('iterations')} iterations, "
                f"peak {fmt(r.get('peak_mb'), '.0f')} MB, NLL {fmt(r.get('nll'), '.5f')}, "
                f"load {r.get('load_start')}/{r.get('load_end')}"
                + (f", ERROR {r['error']}" if r.get("error") else "")
            )
            common.save_json(res, res_path)
        log(f"total {time.perf_counter() - t0:.0f} s; wrote {res_path}")
    res = json.loads(res_path.read_text())
    notes = Path(args.notes).read_text() if args.notes else ""
    text = render(res, notes)
    print(text)
    if not args.quick and not args.no_docs:
        common.save_json(stripped(res), RESULTS)
        common.write_section(SECTION, text, common.DOCS_PATH)
        log(f"wrote {RESULTS} and section '{SECTION}' of {common.DOCS_PATH}")


if __name__ == "__main__":
    main()
