"""GME benchmark: the paper's "GME with Poisson likelihood" experiment on generated data.

Model (paper section 3.3, ``pymc_mcssvi.models.gme``)::

    w1 ~ N(0, prior_sd^2 I_D),  w2 ~ Rayleigh(tau = 5)      (w2 is the VARIANCE of f)
    f_i | w ~ N(x_i^T w1, w2),  y_i | f_i ~ Poisson(log(1 + exp(f_i)))

Data: N = 25,000 rows (80/20 train/test split: 20,000 / 5,000), D = 50 features
drawn with Toeplitz correlation ``0.5**|i-j|`` and z-scored with the training
statistics (as in the paper); the true (w1, w2) are ONE draw from the priors. We
use ``prior_sd = 1/sqrt(D)`` so that the noise-free predictor ``x^T w1`` has
variance about 1 (``E[w1^T C w1] = tr(C)/D = 1``); with the softplus link and
the Rayleigh(5) noise the Poisson rates stay moderate (mean about 1.5).

Methods, in one run on the same data (wall clock per iteration recorded by a
fit callback; the held-out evaluation is done afterwards from parameter
snapshots taken at log-spaced iterations, and the snapshot time is excluded):

1. H-MC-SSVI (package default: covariance-preconditioned mean step),
   H-MC-SSVI with the paper's Adagrad(1.0) mean step, MC-SSVI, S-DSVI (package
   default: Adam 0.1) and the paper's S-DSVI (Adagrad 1.0 on both steps), all
   with the optimal bound (paper eq. vlbi), full batch; plus H-MC-SSVI with
   minibatches of 2000 rows (as in the paper), with the default and with the
   paper's mean step;
2. H-MC-SSVI with the Jensen bound (paper eq. vlb);
3. mean field: PyMC ADVI on the model as written (f stays a latent variable);
4. GLM without the noise term, ``y ~ Poisson(log1pexp(X w1))``, with H-MC-SSVI.

Held-out NLL per observation: ``-mean_i log p(y_i* | data)`` with
``p(y* | data) = E_q[ int p(y* | f) N(f; x*^T w1, w2) df ]`` (40 Gauss-Hermite
nodes over f; w2 = 0 for the GLM). The table's value averages over 2000 draws of
(w1, w2) from ``approx.sample`` (in probability space, then the log); the
curves (and an "exact" column) integrate q(w1) analytically -- every q(w1)
here is Gaussian and independent of q(w2), so ``x*^T w1 ~ N(x*^T m, x*^T S x*)``
-- and q(w2) with 64 stratified quantiles, which removes the Monte Carlo noise.

A NUTS check on a small GME (N = 500, D = 5, same generator) compares the
H-MC-SSVI posterior means of w1 (within 0.15 NUTS sd) and the mean of the
Rayleigh q(w2) (within 15% of the NUTS posterior mean).

Run ``python benchmarks/gme.py`` (about an hour on 2 cores); ``--quick`` is a
small smoke test that writes ``benchmarks/results/gme_quick.json`` only;
``--only NAME,...`` runs the named rows and keeps the other rows of an existing
results file (each row's ``run`` record says which run it comes from).
Writes the ``gme`` section of ``docs/benchmarks.md``, the plot
``docs/_static/gme_nll_vs_time.png`` and ``benchmarks/results/gme.json``.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
from scipy.linalg import toeplitz
from scipy.special import gammaln, logsumexp, ndtri

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import IterationRecorder, fmt, loadavg, log, log_spaced  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PLOT = common.REPO_ROOT / "docs" / "_static" / "gme_nll_vs_time.png"
SECTION = "gme"

#: NUTS check thresholds.
W1_Z_MAX = 0.15
W2_REL_MAX = 0.15
#: "Reaches the best NLL": within this many nats per observation of the best final NLL.
NLL_ATOL = 1e-3
#: The paper's first-order rule (Adagrad, global learning rate 1.0).
ADAGRAD = ("adagrad", 1.0)
PAPER_H = "H-MC-SSVI (paper: Adagrad)"
PAPER_S = "S-DSVI (paper: Adagrad)"
MB = "H-MC-SSVI (minibatch 2000)"
MB_PAPER = "H-MC-SSVI (paper: Adagrad; minibatch 2000)"
#: Optimal-bound full-batch rows (the "best NLL" is the best of their final NLLs).
OPTIMAL_FULL = ("H-MC-SSVI", PAPER_H, "MC-SSVI", "S-DSVI", PAPER_S)
#: Row order of the table and the results file.
ORDER = (
    *OPTIMAL_FULL,
    "H-MC-SSVI (Jensen bound)",
    MB,
    MB_PAPER,
    "ADVI (mean field)",
    "GLM (H-MC-SSVI)",
)

FULL = dict(
    n=25_000,
    d=50,
    rho=0.5,
    tau=5.0,
    max_iter=250,
    max_seconds=360.0,
    sdsvi_max_iter=1500,
    sdsvi_max_seconds=420.0,
    mb_max_iter=3000,
    advi_iters=20_000,
    n_draws=2000,
    n_snapshots=40,
    nuts_n=500,
    nuts_d=5,
    nuts_draws=1000,
    nuts_tune=1500,
)
QUICK = dict(
    n=2500,
    d=10,
    rho=0.5,
    tau=5.0,
    max_iter=150,
    max_seconds=120.0,
    sdsvi_max_iter=200,
    sdsvi_max_seconds=120.0,
    mb_max_iter=200,
    advi_iters=3000,
    n_draws=300,
    n_snapshots=12,
    nuts_n=200,
    nuts_d=3,
    nuts_draws=300,
    nuts_tune=500,
)


# ============================================================================ data
def gme_data(n, d, rho=0.5, tau=5.0, prior_sd=None, train_frac=0.8, seed=0):
    """Generated GME data: Toeplitz features (z-scored on the train rows), truth from the priors.

    Returns a dict with ``X, y, X_test, y_test, w1, w2, prior_sd, tau`` (``y`` as
    int32: PyMC's Poisson casts int64 observations, which breaks ``pm.Minibatch``).
    """
    rng = np.random.default_rng(seed)
    prior_sd = 1.0 / np.sqrt(d) if prior_sd is None else prior_sd
    chol = np.linalg.cholesky(toeplitz(rho ** np.arange(d)))
    X = rng.standard_normal((n, d)) @ chol.T
    n_train = int(round(train_frac * n))
    mu, sd = X[:n_train].mean(0), X[:n_train].std(0)
    X = (X - mu) / sd
    w1 = rng.normal(0.0, prior_sd, size=d)
    w2 = tau * np.sqrt(2.0 * rng.exponential())  # Rayleigh(tau) draw: the variance of f
    f = X @ w1 + np.sqrt(w2) * rng.standard_normal(n)
    y = rng.poisson(np.logaddexp(0.0, f)).astype("int32")
    return dict(
        X=X[:n_train],
        y=y[:n_train],
        X_test=X[n_train:],
        y_test=y[n_train:],
        w1=w1,
        w2=float(w2),
        prior_sd=float(prior_sd),
        tau=float(tau),
        config=dict(n=n, d=d, rho=rho, tau=tau, prior_sd=prior_sd, seed=seed, n_train=n_train),
    )


# ====================================================================== predictive
def _gh(n):
    z, w = np.polynomial.hermite_e.hermegauss(n)
    return z, np.log(w / np.sqrt(2.0 * np.pi))


def _poisson_softplus_logpmf(y, f):
    rate = np.logaddexp(0.0, f)
    lograte = np.where(f < -30.0, f, np.log(np.maximum(rate, 1e-300)))
    return y * lograte - rate - gammaln(y + 1.0)


def log_marginal(y, mean, var, n_gh=40):
    """``log int Poisson(y | softplus(f)) N(f; mean, var) df`` elementwise (Gauss-Hermite)."""
    z, logw = _gh(n_gh)
    sd = np.sqrt(np.maximum(var, 0.0))
    f = mean[..., None] + sd[..., None] * z
    return logsumexp(_poisson_softplus_logpmf(y[..., None], f) + logw, axis=-1)


def nll_draws(W1, W2, X, y, n_gh=40, chunk=16):
    """Held-out NLL per observation from posterior draws (the brief's definition).

    ``-mean_i log( mean_s int p(y_i | f) N(f; x_i^T w1_s, w2_s) df )``.
    """
    W1 = np.asarray(W1, dtype="float64")
    W2 = np.broadcast_to(np.asarray(W2, dtype="float64"), (W1.shape[0],))
    acc = None
    for s in range(0, W1.shape[0], chunk):
        mu = W1[s : s + chunk] @ X.T
        var = np.broadcast_to(W2[s : s + chunk, None], mu.shape)
        part = logsumexp(log_marginal(y[None, :], mu, var, n_gh), axis=0)
        acc = part if acc is None else np.logaddexp(acc, part)
    return float(-np.mean(acc - np.log(W1.shape[0])))


def w2_nodes(kind, params, J=64):
    """Stratified quantiles of q(w2): Rayleigh(scale), lognormal(mu, sd), or a point 0."""
    u = (np.arange(J) + 0.5) / J
    if kind == "rayleigh":
        return params * np.sqrt(-2.0 * np.log1p(-u))
    if kind == "lognormal":
        mu, sd = params
        return np.exp(mu + sd * ndtri(u))
    return np.zeros(1)


def nll_exact(m, S, w2, X, y, n_gh=40):
    """Held-out NLL with q(w1) = N(m, S) integrated exactly and q(w2) on quantile nodes ``w2``."""
    mu = X @ m
    v = np.einsum("ij,jk,ik->i", X, S, X) if S.ndim == 2 else (X**2) @ S
    parts = np.stack([log_marginal(y, mu, v + a, n_gh) for a in np.atleast_1d(w2)])
    return float(-np.mean(logsumexp(parts, axis=0) - np.log(parts.shape[0])))


# ============================================================================ runs
class SnapshotRecorder(IterationRecorder):
    """:class:`common.IterationRecorder` that snapshots at a given set of iterations."""

    def __init__(self, snapshot, at, max_seconds=None):
        super().__init__(snapshot=snapshot)
        self.at = set(int(a) for a in at)
        self.max_seconds = max_seconds

    def __call__(self, approx, losses, i):
        now = time.perf_counter()
        if self.t0 is None:
            self.t0 = now
        t = now - self.t0 - self._snap_time
        self.times.append(t)
        self.losses.append(float(losses[-1]) if losses is not None and len(losses) else np.nan)
        k = len(self.times)
        if k in self.at:
            s0 = time.perf_counter()
            self.snapshots.append((k, t, self.snapshot(approx)))
            self._snap_time += time.perf_counter() - s0
        if self.max_seconds is not None and t > self.max_seconds:
            self.stopped_by_time = True
            raise StopIteration(f"time cap {self.max_seconds:.0f} s reached")


class StructuredReader:
    """Snapshots and q parameters of a StructuredApproximation (w1 Gaussian, w2 Rayleigh)."""

    def __init__(self, approx):
        import pytensor

        g = approx.groups[0]
        ray = [x for x in approx.groups if type(x).__name__ == "RayleighGroup"]
        self.shared = list(g.shared_params.values())
        outs = [g.mean, g.cov]
        if ray:
            self.shared += list(ray[0].shared_params.values())
            outs.append(ray[0]._scale_vector())
        self.has_w2 = bool(ray)
        self.fn = pytensor.function([], outs, mode="FAST_COMPILE")

    def snapshot(self, approx=None):
        return [p.get_value().copy() for p in self.shared]

    def q(self, snap=None):
        keep = None
        if snap is not None:
            keep = [p.get_value() for p in self.shared]
            for p, v in zip(self.shared, snap, strict=True):
                p.set_value(v)
        out = self.fn()
        if keep is not None:
            for p, v in zip(self.shared, keep, strict=True):
                p.set_value(v)
        m, S = np.asarray(out[0], "float64"), np.asarray(out[1], "float64")
        scale = float(np.asarray(out[2]).reshape(-1)[0]) if self.has_w2 else None
        return {"m": m, "S": S, "w2_kind": "rayleigh" if self.has_w2 else "zero", "w2": scale}


class ADVIReader:
    """Snapshots and q parameters of PyMC's mean-field approximation (w1 and log w2)."""

    def __init__(self, approx):
        g = approx.groups[0]
        self.shared = [g.params_dict["mu"], g.params_dict["rho"]]
        self.order = g.ordering

    def snapshot(self, approx=None):
        return [p.get_value().copy() for p in self.shared]

    def q(self, snap=None):
        mu, rho = snap if snap is not None else self.snapshot()
        sd = np.logaddexp(0.0, rho)
        s1 = self.order["w1"][1]
        s2 = [v for k, v in self.order.items() if k.startswith("w2")][0][1]
        return {
            "m": mu[s1].astype("float64"),
            "S": np.diag(sd[s1] ** 2).astype("float64"),
            "w2_kind": "lognormal",
            "w2": (float(mu[s2][0]), float(sd[s2][0])),
        }


def q_nll(q, X, y):
    """Exact-in-w1 held-out NLL of a q dict from a reader."""
    if q["w2_kind"] == "zero":
        nodes = np.zeros(1)
    else:
        nodes = w2_nodes(q["w2_kind"], q["w2"])
    return nll_exact(q["m"], q["S"], nodes, X, y)


def q_w2_mean(q):
    if q["w2_kind"] == "rayleigh":
        return q["w2"] * np.sqrt(np.pi / 2.0)
    if q["w2_kind"] == "lognormal":
        mu, sd = q["w2"]
        return float(np.exp(mu + 0.5 * sd**2))
    return 0.0


class Run:
    def __init__(self, name, kind, color, style="-"):
        self.name, self.kind, self.color, self.style = name, kind, color, style
        self.error = None
        self.rec = None
        self.wall = np.nan
        self.iterations = None
        self.hist = None
        self.approx = None
        self.reader = None
        self.extra = {}


def run_structured(
    run, model, cls, cfg, seed, max_iter, inf_kwargs=None, fit_kwargs=None, max_seconds=None
):
    """One cold fit of a pymc_mcssvi method; times include recognition and compilation."""
    log(f"{run.name}: fit (max_iter={max_iter}, {inf_kwargs or 'defaults'})")
    run.extra["run"] = common.run_record()
    holder = {}

    def snap(approx):
        if "reader" not in holder:
            holder["reader"] = StructuredReader(approx)
        return holder["reader"].snapshot()

    rec = SnapshotRecorder(snap, log_spaced(max_iter, cfg["n_snapshots"]), max_seconds)
    load0, c0 = loadavg(), time.process_time()
    rec.start()
    t0 = time.perf_counter()
    inf = None
    try:
        with model:
            inf = cls(random_seed=seed, **(inf_kwargs or {}))
            run.extra["recognition_s"] = time.perf_counter() - t0
            approx = inf.fit(
                progressbar=False, callbacks=[rec], max_iter=max_iter, **(fit_kwargs or {})
            )
    except Exception as e:
        run.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        run.extra["traceback"] = traceback.format_exc(limit=-4)
        approx = getattr(e, "approx", None)
        log(f"{run.name}: FAILED {run.error}")
    run.wall = time.perf_counter() - t0 - rec.overhead
    run.rec = rec
    run.extra.update(cpu=time.process_time() - c0, load=(load0, loadavg()))
    if inf is not None:
        run.extra["backend_used"] = inf.backend_used
        try:
            run.extra["backend_auto"] = inf.choose_backend()
            run.extra["work_estimate"] = float(
                inf.bound.work_estimate(inf._n_inner if inf.tlm.locals else 1)
            )
        except Exception:  # pragma: no cover - diagnostics only
            pass
    if approx is not None and len(rec.times):
        run.approx = approx
        run.reader = holder.get("reader") or StructuredReader(approx)
        run.hist = np.asarray(approx.hist)
        run.iterations = int(approx.n_iter)
        run.extra["converged"] = approx.converged
        run.extra["stopped_by_time"] = bool(getattr(rec, "stopped_by_time", False))
        run.extra["per_iter_s"] = rec.per_iteration()
        run.extra["setup_s"] = rec.setup_time()
        # the final state is always a snapshot
        if not rec.snapshots or rec.snapshots[-1][0] != len(rec.times):
            rec.snapshots.append((len(rec.times), rec.times[-1], run.reader.snapshot()))
        log(
            f"{run.name}: {run.iterations} it., {run.wall:.1f} s, backend {run.extra.get('backend_used')}, "
            f"{1e3 * run.extra['per_iter_s']:.0f} ms/it., converged={approx.converged}, "
            f"-ELBO={run.hist[-1]:.6g}"
        )
    return run


def run_advi(run, model, cfg, seed):
    import pymc as pm

    n = cfg["advi_iters"]
    log(f"{run.name}: pm.fit(n={n}, method='advi', backend='numba')")
    run.extra["run"] = common.run_record()
    holder = {}

    def snap(approx):
        if "reader" not in holder:
            holder["reader"] = ADVIReader(approx)
        return holder["reader"].snapshot()

    rec = SnapshotRecorder(snap, log_spaced(n, cfg["n_snapshots"]))
    load0, c0 = loadavg(), time.process_time()
    rec.start()
    t0 = time.perf_counter()
    try:
        with model:
            approx = pm.fit(
                n=n,
                method="advi",
                random_seed=seed,
                progressbar=False,
                callbacks=[rec],
                backend="numba",
            )
    except Exception as e:
        run.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        log(f"{run.name}: FAILED {run.error}")
        approx = None
    run.wall = time.perf_counter() - t0 - rec.overhead
    run.rec = rec
    run.extra.update(cpu=time.process_time() - c0, load=(load0, loadavg()), backend_used="numba")
    if approx is not None:
        run.approx = approx
        run.reader = holder.get("reader") or ADVIReader(approx)
        run.hist = np.asarray(approx.hist)
        run.iterations = len(run.hist)
        run.extra["per_iter_s"] = rec.per_iteration()
        run.extra["setup_s"] = rec.setup_time()
        if not rec.snapshots or rec.snapshots[-1][0] != len(rec.times):
            rec.snapshots.append((len(rec.times), rec.times[-1], run.reader.snapshot()))
        log(
            f"{run.name}: {run.iterations} it., {run.wall:.1f} s, -ELBO(avg last 1000)="
            f"{np.mean(run.hist[-1000:]):.6g}"
        )
    return run


def evaluate_run(run, data, n_draws, seed):
    """Held-out NLL along the run (exact in w1) and at the end (from ``approx.sample`` draws)."""
    res = {"name": run.name, "kind": run.kind, "error": run.error, **run.extra}
    res.pop("traceback", None)
    if run.error:
        res["traceback"] = run.extra.get("traceback")
    if run.reader is None:
        return res
    Xt, yt = data["X_test"], data["y_test"]
    curve = []
    for k, t, snap in run.rec.snapshots:
        q = run.reader.q(snap)
        curve.append((k, t, q_nll(q, Xt, yt)))
    res["curve"] = curve
    q = run.reader.q()
    res["nll_exact"] = q_nll(q, Xt, yt)
    res["w1_mean"] = q["m"]
    res["w1_sd"] = np.sqrt(np.diag(q["S"]))
    res["w2_mean"] = q_w2_mean(q)
    res["q_w2"] = q["w2"]
    t0 = time.perf_counter()
    idata = run.approx.sample(n_draws, random_seed=seed)
    W1 = np.asarray(idata.posterior["w1"].values).reshape(-1, Xt.shape[1])
    if "w2" in idata.posterior:
        W2 = np.asarray(idata.posterior["w2"].values).reshape(-1)
    else:
        W2 = np.zeros(W1.shape[0])
    res["nll"] = nll_draws(W1, W2, Xt, yt)
    res["w2_draws_mean"] = float(np.mean(W2))
    res["eval_s"] = time.perf_counter() - t0
    res["wall"] = run.wall
    res["iterations"] = run.iterations
    res["times"] = downsample(run.rec.times)
    res["hist"] = downsample(run.hist)
    if run.kind == "advi":
        res["final_negelbo"] = float(np.mean(run.hist[-1000:]))
    elif run.kind == "minibatch":
        res["final_negelbo"] = float(np.mean(run.hist[-50:]))
    else:
        res["final_negelbo"] = float(run.hist[-1])
    return res


def downsample(x, k=300):
    x = np.asarray(x, dtype="float64")
    if len(x) <= k:
        return x
    return x[np.unique(np.round(np.geomspace(1, len(x), k)).astype(int) - 1)]


def warm_up(pm, pymc_mcssvi, cfg):
    """Pay the process-level one-off costs before any timed fit.

    A tiny GME (different data, so no compiled graph of the timed runs is reused)
    fitted for two iterations with H-MC-SSVI on the python and numba backends,
    and a few ADVI iterations with numba. Without this, whichever method runs
    first pays ~20-30 s of PyTensor/numba start-up that the others do not.
    """
    t0 = time.perf_counter()
    d = gme_data(60, 3, seed=12345)
    m = pymc_mcssvi.models.gme(d["X"], d["y"], prior_sd=d["prior_sd"], tau=cfg["tau"])
    with m:
        for backend in ("python", "numba"):
            pymc_mcssvi.HMCSSVI(random_seed=0).fit(
                n=2, tol=None, progressbar=False, backend=backend
            )
        pm.fit(n=10, method="advi", progressbar=False, backend="numba")
    dt = time.perf_counter() - t0
    log(f"warm-up: {dt:.1f} s (not part of any timing)")
    return dt


# ============================================================================ NUTS
def nuts_check(cfg, seed):
    """Small GME: H-MC-SSVI's q against NUTS on the model as written."""
    import arviz as az
    import pymc as pm

    import pymc_mcssvi

    data = gme_data(
        int(round(cfg["nuts_n"] / 0.8)), cfg["nuts_d"], cfg["rho"], cfg["tau"], seed=seed + 100
    )
    X, y = data["X"], data["y"]
    model = pymc_mcssvi.models.gme(X, y, prior_sd=data["prior_sd"], tau=cfg["tau"])
    out = {
        "n": len(y),
        "d": X.shape[1],
        "w1_true": data["w1"],
        "w2_true": data["w2"],
        "run": common.run_record(),
    }
    log(f"NUTS check: N={len(y)}, D={X.shape[1]}, true w2={data['w2']:.3f}")
    t0 = time.perf_counter()
    with model:
        idata = pm.sample(
            cfg["nuts_draws"],
            tune=cfg["nuts_tune"],
            chains=2,
            cores=2,
            target_accept=0.95,
            random_seed=seed,
            progressbar=False,
            compute_convergence_checks=False,
        )
    out["nuts_wall"] = time.perf_counter() - t0
    post = idata.posterior
    W1 = np.asarray(post["w1"].values).reshape(-1, X.shape[1])
    W2 = np.asarray(post["w2"].values).reshape(-1)
    out["divergences"] = int(np.asarray(idata.sample_stats["diverging"].values).sum())
    out["rhat_max"] = float(max(float(az.rhat(post["w1"]).max()), float(az.rhat(post["w2"]))))
    out["ess_min"] = float(min(float(az.ess(post["w1"]).min()), float(az.ess(post["w2"]))))
    out["nuts_w1_mean"], out["nuts_w1_sd"] = W1.mean(0), W1.std(0)
    out["nuts_w2_mean"], out["nuts_w2_sd"] = float(W2.mean()), float(W2.std())
    log(
        f"NUTS: {out['nuts_wall']:.1f} s, {out['divergences']} divergences, r_hat max "
        f"{out['rhat_max']:.3f}, ESS min {out['ess_min']:.0f}"
    )
    with model:
        t0 = time.perf_counter()
        inf = pymc_mcssvi.HMCSSVI(random_seed=seed)
        approx = inf.fit(progressbar=False)
        out["vi_wall"] = time.perf_counter() - t0
    q = StructuredReader(approx).q()
    out["vi_iterations"] = int(approx.n_iter)
    out["vi_backend"] = inf.backend_used
    out["vi_w1_mean"], out["vi_w1_sd"] = q["m"], np.sqrt(np.diag(q["S"]))
    out["vi_w2_mean"] = q_w2_mean(q)
    out["vi_w2_sd"] = q["w2"] * np.sqrt(2.0 - np.pi / 2.0)
    z = (q["m"] - out["nuts_w1_mean"]) / out["nuts_w1_sd"]
    out["w1_z"] = z
    out["w1_max_z"] = float(np.max(np.abs(z)))
    out["w1_sd_ratio"] = out["vi_w1_sd"] / out["nuts_w1_sd"]
    out["w2_rel"] = float((out["vi_w2_mean"] - out["nuts_w2_mean"]) / out["nuts_w2_mean"])
    out["w2_sd_ratio"] = float(out["vi_w2_sd"] / out["nuts_w2_sd"])
    out["w1_pass"] = bool(out["w1_max_z"] <= W1_Z_MAX)
    out["w2_pass"] = bool(abs(out["w2_rel"]) <= W2_REL_MAX)
    log(
        f"NUTS check: max |z| w1 = {out['w1_max_z']:.3f} ({'PASS' if out['w1_pass'] else 'MISS'}), "
        f"w2 mean VI {out['vi_w2_mean']:.3f} vs NUTS {out['nuts_w2_mean']:.3f} "
        f"({100 * out['w2_rel']:+.1f}%, {'PASS' if out['w2_pass'] else 'MISS'})"
    )
    return out


# ======================================================================== analysis
def time_to(curve, target, atol=NLL_ATOL):
    """First snapshot time after which the NLL stays within ``atol`` of ``target``."""
    if not curve:
        return np.nan
    t = [c[1] for c in curve]
    v = np.asarray([c[2] for c in curve])
    return common.time_to_within(t, v, target, atol=atol)[0]


def findings(res, nuts):
    by = {r["name"]: r for r in res if r.get("nll") is not None}
    out = {}
    hm = by.get("H-MC-SSVI")
    opt_names = [n for n in OPTIMAL_FULL if n in by]
    # the level: the best final NLL of the runs that converged (the bound's optimum); a run
    # stopped at its cap is still moving, and its final NLL can be below the optimum's
    done = [n for n in opt_names if by[n].get("converged")] or opt_names
    best = min((by[n]["nll_exact"] for n in done), default=np.nan)
    out["best_optimal_nll_exact"] = best
    out["best_from"] = done
    for r in res:
        if r.get("curve"):
            r["time_to_best"] = time_to(r["curve"], best)
    if hm is not None:
        base = hm["nll"]
        for n in ("H-MC-SSVI (Jensen bound)", "ADVI (mean field)", "GLM (H-MC-SSVI)"):
            if n in by:
                out[f"nll_ratio[{n}]"] = by[n]["nll"] / base
                out[f"nll_diff[{n}]"] = by[n]["nll"] - base
    return out


# ========================================================================== report
def make_plot(res, path, meta):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in res:
        if not r.get("curve"):
            continue
        c = np.asarray([[x[1], x[2]] for x in r["curve"]])
        ax.plot(
            c[:, 0],
            c[:, 1],
            r["style"],
            color=r["color"],
            marker="o",
            ms=3,
            lw=1.5,
            label=r["name"],
        )
    ax.set_xscale("log")
    ax.set_xlabel("wall time (s, including recognition and compilation)")
    ax.set_ylabel("held-out NLL per observation")
    vals = [x[2] for r in res for x in r.get("curve", [])]
    finals = [r["nll_exact"] for r in res if r.get("nll_exact") is not None]
    if vals and finals:
        lo = min(finals)
        hi = max(finals) + 0.6 * (max(finals) - lo) + 0.02
        ax.set_ylim(lo - 0.1 * (hi - lo), hi)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    cfg = meta["data"]
    ax.set_title(
        f"GME, Poisson softplus: N_train={cfg['n_train']}, D={cfg['d']} "
        f"(log-spaced snapshots; exact-in-w1 predictive)",
        fontsize=9,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(results, docs_path, plot_rel):
    meta = results["meta"]
    res = results["runs"]
    nuts = results.get("nuts") or {}
    headers = [
        "method",
        "bound / q",
        "held-out NLL (2000 draws)",
        "NLL exact-in-w1",
        "wall (s)",
        "iterations",
        "s / it.",
        "time to best NLL (s)",
        "final -ELBO",
        "E_q[w2]",
        "backend",
    ]
    rows = []
    for r in res:
        if r.get("nll") is None:
            rows.append([r["name"], r["bound"], f"failed: {r.get('error')}"] + ["–"] * 8)
            continue
        neg = fmt(r.get("final_negelbo"), ".6g")
        rows.append(
            [
                r["name"],
                r["bound"],
                fmt(r["nll"], ".4f"),
                fmt(r["nll_exact"], ".4f"),
                fmt(r["wall"], ".1f"),
                f"{r['iterations']}" + ("" if r.get("converged") in (True, None) else " (cap)"),
                fmt(r.get("per_iter_s"), ".3g"),
                fmt(r.get("time_to_best"), ".1f"),
                neg,
                fmt(r.get("w2_mean"), ".3f"),
                r.get("backend_used", "–"),
            ]
        )
    table = common.markdown_table(headers, rows)
    d = meta["data"]
    lines = [
        '## GME with Poisson likelihood (paper section 3.3 / experiment "GME with Poisson likelihood")',
        "",
        f"Run: {meta['date']} on {meta['machine'].get('cpu_model', '?')} "
        f"({meta['machine'].get('cpu_count')} logical CPUs, load before/after in `results/gme.json`); "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
        + f"; plugin commit {meta.get('commit', '?')}"
        + (" (with uncommitted plugin changes)" if meta.get("plugin_dirty") else "")
        + ". Script: `python benchmarks/gme.py`"
        + (
            " (PyTensor compile cache emptied for the run, so compile times are cold)."
            if not meta.get("warm_cache")
            else " with the normal PyTensor compile cache (warm: compiled ops from earlier runs are "
            "reused; a cold numba cache adds minutes per method on this machine: in a test the "
            "tiny warm-up below took 355 s with an empty cache, under load; here it took "
            f"{meta.get('warmup_s', float('nan')):.0f} s)."
        ),
        *(
            f"Rows re-run on {lr['date']} at commit {lr.get('commit', '?')}"
            + (" (with uncommitted plugin changes)" if lr.get("plugin_dirty") else "")
            + f": {', '.join(lr.get('rows_run', []))} (each row's `run` record in the JSON says "
            "which run it comes from; times compare only within one run)."
            for lr in meta.get("later_runs", [])
        ),
        "",
        f"Data: N = {d['n']} rows generated from the GME ({d['n_train']} train / {d['n'] - d['n_train']} test), "
        f"D = {d['d']} Toeplitz-correlated features (0.5^|i-j|, z-scored on the train rows), "
        f"true w1 ~ N(0, I/D) and w2 ~ Rayleigh(5) drawn once (w2 = {meta['w2_true']:.3f}, the variance of f), "
        f"y ~ Poisson(log(1 + e^f)) (train mean {meta['y_mean']:.2f}, max {meta['y_max']}). "
        "Prior sd of w1 is 1/sqrt(D) so that x^T w1 has variance about 1. "
        "Model: `pymc_mcssvi.models.gme(X, y, prior_sd=1/sqrt(D), tau=5)`; GLM: same without f.",
        "",
        "Timing: one process; before the timed fits a tiny GME (other data, so no timed graph is "
        "reused) is fitted for 2 iterations on the python and numba backends and with ADVI, so that "
        "process start-up costs are not charged to whichever method runs first. Caps: "
        f"{meta['cfg']['max_iter']} iterations or {meta['cfg']['max_seconds']:.0f} s per fit "
        f"(S-DSVI: {meta['cfg']['sdsvi_max_iter']} iterations or {meta['cfg']['sdsvi_max_seconds']:.0f} s); "
        f"ADVI runs {meta['cfg']['advi_iters']} iterations (PyMC defaults, numba backend). "
        "The H-MC-SSVI default stops at convergence (relative bound change below 1e-7).",
        "",
        "Held-out NLL per observation: -mean log E_q[∫ p(y*|f) N(f; x*^T w1, w2) df] with 40 "
        'Gauss-Hermite nodes over f; "2000 draws" averages over `approx.sample(2000)` draws of '
        '(w1, w2) in probability space; "exact-in-w1" integrates the Gaussian q(w1) analytically '
        "and q(w2) on 64 quantiles (used for the curves). Wall time includes model recognition and "
        'compilation; the NLL evaluation at log-spaced snapshots is excluded. "time to best NLL": '
        f"first time after which the curve stays within {NLL_ATOL} nats/obs of (or below) the best "
        "final exact NLL among the optimal-bound full-batch runs that converged (the bound's "
        "optimum; a run stopped at its cap is still moving). -ELBO: the plugin's bound for the "
        "structured runs (optimal or Jensen), PyMC's MC estimate averaged over the last 1000 "
        "iterations for ADVI (same model, so all GME values bound the same -log p(y)); the GLM's is "
        'for a different model. "(cap)": stopped at the iteration/time cap, not converged.',
        "",
        table,
        "",
        f"![GME held-out NLL vs wall time]({plot_rel})",
        "",
        "### Findings",
        "",
    ]
    lines += results.get("findings_text", [])
    lines += ["", "### NUTS check (small GME)", ""]
    if nuts.get("error"):
        lines.append(f"NUTS check failed: {nuts['error']}")
    elif nuts:
        lines += [
            f"N = {nuts['n']}, D = {nuts['d']} (same generator, true w2 = {nuts['w2_true']:.3f}); "
            f"NUTS: 2 chains x {meta['cfg']['nuts_draws']} draws ({meta['cfg']['nuts_tune']} tune), "
            f"target_accept = 0.95, f sampled as written; {nuts['divergences']} divergences, "
            f"r_hat max {nuts['rhat_max']:.3f}, ESS min {nuts['ess_min']:.0f}, {nuts['nuts_wall']:.0f} s. "
            f"H-MC-SSVI (default): {nuts['vi_iterations']} iterations, {nuts['vi_wall']:.1f} s.",
            "",
            common.markdown_table(
                ["check", "value", "threshold", "result"],
                [
                    [
                        "max over w1 of abs(mean_VI - mean_NUTS) / sd_NUTS",
                        fmt(nuts["w1_max_z"], ".3f"),
                        f"<= {W1_Z_MAX}",
                        "PASS" if nuts["w1_pass"] else "MISS",
                    ],
                    [
                        "E_q[w2] (Rayleigh q) vs NUTS mean of w2",
                        f"{nuts['vi_w2_mean']:.3f} vs {nuts['nuts_w2_mean']:.3f} "
                        f"({100 * nuts['w2_rel']:+.1f}%)",
                        f"within {int(100 * W2_REL_MAX)}%",
                        "PASS" if nuts["w2_pass"] else "MISS",
                    ],
                    [
                        "sd ratio VI / NUTS: w1 (min-max), w2",
                        f"{np.min(nuts['w1_sd_ratio']):.2f}-{np.max(nuts['w1_sd_ratio']):.2f}, "
                        f"{nuts['w2_sd_ratio']:.2f}",
                        "(information)",
                        "",
                    ],
                ],
            ),
        ]
    lines += ["", "Raw numbers: `benchmarks/results/gme.json`."]
    common.write_section(SECTION, "\n".join(lines), docs_path)


def findings_text(res, fnd, nuts):
    by = {r["name"]: r for r in res if r.get("nll") is not None}
    L = []

    def nll(n):
        return by[n]["nll"] if n in by else np.nan

    hm = "H-MC-SSVI"
    if hm not in by:
        return ["H-MC-SSVI failed; no findings."]
    base = nll(hm)

    def cmp(name, claim):
        if name not in by:
            return f"- {claim}: not measured ({name} failed)."
        v = nll(name)
        ok = v > base
        return (
            f"- {claim}: **{'confirmed' if ok else 'refuted'}**: {name} NLL {v:.4f} vs {base:.4f} "
            f"(ratio {v / base:.4f}, difference {v - base:+.4f} nats/obs)."
        )

    opt = {n: nll(n) for n in (*OPTIMAL_FULL, MB, MB_PAPER) if n in by}
    non_opt = {n: nll(n) for n in ("H-MC-SSVI (Jensen bound)", "ADVI (mean field)") if n in by}
    best_opt = min(opt.values())
    ok = bool(non_opt) and best_opt < min(non_opt.values())
    L.append(
        f"- Optimal bound gives the best held-out NLL: **{'confirmed' if ok else 'refuted'}**: "
        + ", ".join(f"{k} {v:.4f}" for k, v in opt.items())
        + " vs "
        + ", ".join(f"{k} {v:.4f}" for k, v in non_opt.items())
        + "."
    )
    L.append(cmp("H-MC-SSVI (Jensen bound)", "Jensen bound worse than the optimal bound"))
    L.append(cmp("ADVI (mean field)", "Mean field worse than the optimal bound"))
    L.append(cmp("GLM (H-MC-SSVI)", "GME beats GLM"))
    # -ELBO tightness
    neg = {
        n: by[n].get("final_negelbo")
        for n in (hm, "H-MC-SSVI (Jensen bound)", "ADVI (mean field)")
        if n in by
    }
    if len(neg) > 1:
        L.append(
            "- Bound values (-ELBO, lower = tighter bound on -log p(y)): "
            + ", ".join(f"{k} {v:,.1f}" for k, v in neg.items())
            + "."
        )
    # speed
    tt = {r["name"]: r.get("time_to_best") for r in res if r.get("curve")}
    fin = {k: v for k, v in tt.items() if v is not None and np.isfinite(v)}
    order = sorted(fin, key=fin.get)
    L.append(
        f"- Time to reach the best NLL (within {NLL_ATOL} nats/obs of {fnd['best_optimal_nll_exact']:.4f}): "
        + ", ".join(f"{k} {fin[k]:.1f} s" for k in order)
        + (
            "; never reached by " + ", ".join(k for k in tt if k not in fin)
            if any(k not in fin for k in tt)
            else ""
        )
        + "."
    )
    if hm in fin:
        first = order[0] if order else None
        L.append(
            f"- H-MC-SSVI reaches the best NLL fastest: **{'confirmed' if first == hm else 'refuted'}**"
            + (f" (fastest: {first})" if first != hm else "")
            + "; ratios of time to best NLL, relative to H-MC-SSVI: "
            + ", ".join(f"{k} x{fin[k] / fin[hm]:.2f}" for k in order if k != hm)
            + "."
        )
    pa = "H-MC-SSVI (paper: Adagrad)"
    if pa in fin:
        L.append(
            "- The paper's H-MC-SSVI (Adagrad mean step) vs the other optimal-bound full-batch runs: "
            + ", ".join(f"{k} x{fin[k] / fin[pa]:.2f}" for k in order if k != pa)
            + f" of its {fin[pa]:.1f} s."
        )
    natural = [n for n in ("H-MC-SSVI", PAPER_H, "MC-SSVI") if n in tt]
    for sd in ("S-DSVI", PAPER_S):
        if sd not in tt:
            continue
        slow = all(fin.get(sd, np.inf) >= fin.get(n, np.inf) for n in natural)
        sd_time = (
            f"{fin[sd]:.1f} s"
            if sd in fin
            else f"not within {NLL_ATOL} nats/obs by the end of its run"
        )
        L.append(
            f"- {sd} is slower than the natural-gradient full-batch methods: "
            f"**{'confirmed' if slow else 'refuted'}** "
            f"({sd}: {sd_time}"
            f"; {by[sd]['iterations'] if sd in by else '?'} iterations, {by[sd]['wall'] if sd in by else float('nan'):.0f} s)."
        )
    a, b = by.get(hm), by.get("MC-SSVI")
    if a and b:
        ha, hb = np.asarray(a["hist"]), np.asarray(b["hist"])
        same_hist = len(ha) == len(hb) and np.allclose(ha, hb, rtol=1e-10)
        L.append(
            f"- H-MC-SSVI vs MC-SSVI: {'identical' if same_hist else 'different'} -ELBO traces "
            f"({a['iterations']} vs {b['iterations']} iterations, NLL {a['nll']:.5f} vs {b['nll']:.5f}). "
            + (
                "As expected: the package's default H-MC-SSVI mean step is the covariance-preconditioned "
                "(natural) step, which coincides with MC-SSVI's in full batch; the paper's H-MC-SSVI is "
                'the "paper: Adagrad" row.'
                if same_hist
                else ""
            )
        )
    return L


# ============================================================================ main
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke test (N=2500, D=10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cold-cache",
        action="store_true",
        help="use a fresh, empty PyTensor compile cache (default: the normal one; a cold numba "
        "cache adds minutes of compilation per method on 2 cores)",
    )
    parser.add_argument("--no-docs", action="store_true", help="do not touch docs/benchmarks.md")
    parser.add_argument("--skip-nuts", action="store_true")
    parser.add_argument("--only", default=None, help="comma-separated method names to run (debug)")
    parser.add_argument(
        "--report-from",
        default=None,
        help="only re-render the docs section and plot from a results JSON",
    )
    args = parser.parse_args(argv)
    if args.report_from:
        import json

        results = json.loads(Path(args.report_from).read_text())
        results["findings"] = findings(results["runs"], None)
        results["findings_text"] = findings_text(
            results["runs"], results["findings"], results.get("nuts")
        )
        common.save_json(results, args.report_from)
        make_plot(results["runs"], PLOT, results["meta"])
        report(results, common.DOCS_PATH, "_static/gme_nll_vs_time.png")
        return results
    cfg = dict(QUICK if args.quick else FULL)
    if args.cold_cache:
        tmp = tempfile.mkdtemp(prefix="pytensor_gme_")
        flags = os.environ.get("PYTENSOR_FLAGS", "")
        os.environ["PYTENSOR_FLAGS"] = (flags + "," if flags else "") + f"base_compiledir={tmp}"
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    if "pytensor" in sys.modules:
        raise RuntimeError("pytensor must not be imported before the compile cache is set")
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("pymc").setLevel(logging.ERROR)
    logging.getLogger("pytensor").setLevel(logging.ERROR)
    return _main(args, cfg)


def _main(args, cfg):
    import pymc as pm

    import pymc_mcssvi

    seed = args.seed
    common.set_run_mode("quick" if args.quick else "full")
    record = common.run_record()
    data = gme_data(cfg["n"], cfg["d"], cfg["rho"], cfg["tau"], seed=seed)
    X, y = data["X"], data["y"]
    N, D = X.shape
    log(
        f"data: N_train={N}, N_test={len(data['y_test'])}, D={D}, w2_true={data['w2']:.3f}, "
        f"y mean {y.mean():.3f}, max {y.max()}, share of zeros {np.mean(y == 0):.3f}"
    )
    nll_truth = nll_exact(data["w1"], np.zeros((D, D)), data["w2"], data["X_test"], data["y_test"])
    log(f"held-out NLL at the true parameters: {nll_truth:.4f}")
    model = pymc_mcssvi.models.gme(X, y, prior_sd=data["prior_sd"], tau=cfg["tau"])
    with pm.Model() as glm:
        w1 = pm.Normal("w1", 0.0, data["prior_sd"], shape=D)
        pm.Poisson("y", pm.math.log1pexp(pm.math.dot(X, w1)), observed=y)
    describe = str(pymc_mcssvi.describe(model))
    log("recognized:\n" + describe)

    warmup_s = warm_up(pm, pymc_mcssvi, cfg)
    only = None if args.only is None else set(s.strip() for s in args.only.split(","))
    runs = []

    def want(name):
        return only is None or name in only

    specs = [
        ("H-MC-SSVI", "optimal", "C0", "-", pymc_mcssvi.HMCSSVI, {}, cfg["max_iter"]),
        (
            "H-MC-SSVI (paper: Adagrad)",
            "optimal",
            "C1",
            "-",
            pymc_mcssvi.HMCSSVI,
            {"mean_optimizer": ("adagrad", 1.0)},
            cfg["max_iter"],
        ),
        ("MC-SSVI", "optimal", "C2", "--", pymc_mcssvi.MCSSVI, {}, cfg["max_iter"]),
        ("S-DSVI", "optimal", "C3", "-", pymc_mcssvi.SDSVI, {}, cfg["sdsvi_max_iter"]),
        (
            PAPER_S,
            "optimal",
            "C6",
            "--",
            pymc_mcssvi.SDSVI,
            {"mean_optimizer": ADAGRAD, "factor_optimizer": ADAGRAD},
            cfg["sdsvi_max_iter"],
        ),
        (
            "H-MC-SSVI (Jensen bound)",
            "Jensen",
            "C4",
            "-",
            pymc_mcssvi.HMCSSVI,
            {"bound": "jensen"},
            cfg["max_iter"],
        ),
    ]
    for name, bound, color, style, cls, kw, mi in specs:
        if not want(name):
            continue
        run = Run(name, "structured", color, style)
        run.extra["bound"] = bound
        cap = cfg["sdsvi_max_seconds"] if cls is pymc_mcssvi.SDSVI else cfg["max_seconds"]
        run_structured(run, model, cls, cfg, seed, mi, kw, max_seconds=cap)
        runs.append(run)

    mb_model = None
    # Workarounds, to remove once the plugin handles them: (1) a chunked step (automatic
    # above 32 MB of intermediates) on a pm.Minibatch model fails to compile ("No update found
    # for at least one RNG used in Scan Op"), so the minibatch fits run unchunked; (2) the
    # full-data steps that end a minibatch fit fail when the model has a local per row
    # ("Incompatible Elemwise input shapes [(2000,), (20000,)]"), so they end on the iterate
    # average (polish=False), as the paper's minibatch runs do.
    mb_kw = {"chunk_size": 10**9, "polish": False}
    for name, color, kw in (
        (MB, "C5", dict(mb_kw)),
        (MB_PAPER, "C9", {**mb_kw, "mean_optimizer": ADAGRAD}),
    ):
        if not want(name):
            continue
        run = Run(name, "minibatch", color, ":")
        run.extra["bound"] = "optimal"
        try:
            if mb_model is None:
                Xm, ym = pm.Minibatch(X, y, batch_size=min(2000, N // 2))
                mb_model = pymc_mcssvi.models.gme(
                    Xm, ym, prior_sd=data["prior_sd"], tau=cfg["tau"], total_size=N
                )
            run_structured(
                run,
                mb_model,
                pymc_mcssvi.HMCSSVI,
                cfg,
                seed,
                cfg["mb_max_iter"],
                kw,
                max_seconds=cfg["max_seconds"],
            )
        except Exception as e:
            run.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            run.extra["traceback"] = traceback.format_exc(limit=-4)
            log(f"{run.name}: FAILED {run.error}")
        runs.append(run)

    if want("ADVI (mean field)"):
        run = Run("ADVI (mean field)", "advi", "C7", "-")
        run.extra["bound"] = "mean field (f latent)"
        run_advi(run, model, cfg, seed)
        runs.append(run)

    if want("GLM (H-MC-SSVI)"):
        run = Run("GLM (H-MC-SSVI)", "structured", "C8", "-.")
        run.extra["bound"] = "GLM (no noise term)"
        run_structured(
            run,
            glm,
            pymc_mcssvi.HMCSSVI,
            cfg,
            seed,
            cfg["max_iter"],
            max_seconds=cfg["max_seconds"],
        )
        runs.append(run)

    log("evaluating held-out NLL")
    res = []
    for run in runs:
        r = evaluate_run(run, data, cfg["n_draws"], seed + 1)
        r["color"], r["style"] = run.color, run.style
        if r.get("nll") is not None:
            log(
                f"{run.name}: NLL {r['nll']:.5f} (exact {r['nll_exact']:.5f}), E[w2] {r['w2_mean']:.3f}"
            )
        res.append(r)
    old = None
    out_path = RESULTS / ("gme_quick.json" if args.quick else "gme.json")
    if only is not None and out_path.exists():
        import json

        # keep the rows of an earlier run that this one did not repeat
        old = json.loads(out_path.read_text())
        legacy = common.legacy_record(old["meta"])
        mine = {r["name"] for r in res}
        kept = []
        for r in old["runs"]:
            if r["name"] not in mine:
                r.setdefault("run", legacy)
                kept.append(r)
        res = sorted(
            kept + res, key=lambda r: ORDER.index(r["name"]) if r["name"] in ORDER else len(ORDER)
        )
    fnd = findings(res, None)
    nuts = None
    if old is not None and args.skip_nuts:
        nuts = old.get("nuts")
    if not args.skip_nuts:
        try:
            nuts = nuts_check(cfg, seed)
        except Exception as e:
            nuts = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            log(f"NUTS check FAILED: {nuts['error']}")
    import subprocess

    meta = {
        "date": common.today(),
        "machine": common.machine_info(),
        "versions": common.library_versions(
            ("pymc", "pytensor", "numpy", "numba", "arviz", "pymc_mcssvi")
        ),
        "cfg": cfg,
        "quick": args.quick,
        "warm_cache": not args.cold_cache,
        "warmup_s": warmup_s,
        "data": data["config"],
        "w1_true": data["w1"],
        "w2_true": data["w2"],
        "y_mean": float(y.mean()),
        "y_max": int(y.max()),
        "nll_at_truth": nll_truth,
        "describe": describe,
    }
    try:
        root = common.REPO_ROOT
        meta["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        meta["plugin_dirty"] = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "pymc_mcssvi"],
                cwd=root,
                capture_output=True,
                text=True,
            ).stdout.strip()
        )
    except OSError:
        pass
    if old is not None:
        meta["rows_run"] = sorted(only)
        old["meta"].setdefault("later_runs", []).append(meta)
        meta = old["meta"]
        record = old.get("run") or common.legacy_record(meta)
    results = {"meta": meta, "run": record, "runs": res, "findings": fnd, "nuts": nuts}
    results["findings_text"] = findings_text(res, fnd, nuts)
    for line in results["findings_text"]:
        log(line)
    name = "gme_quick.json" if args.quick else "gme.json"
    common.save_json(results, RESULTS / name)
    log(f"wrote {RESULTS / name}")
    if args.quick or args.no_docs:
        p = make_plot(res, Path(tempfile.gettempdir()) / "gme_nll_vs_time_quick.png", meta)
        log(f"plot: {p}")
    else:
        make_plot(res, PLOT, meta)
        report(common._jsonable(results), common.DOCS_PATH, "_static/gme_nll_vs_time.png")
        log(f"wrote {PLOT} and the '{SECTION}' section of {common.DOCS_PATH}")
    return results


if __name__ == "__main__":
    main()
