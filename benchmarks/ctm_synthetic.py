"""Correlated topic model (CTM) at the paper's NIPS scale on a synthetic corpus (issue 48).

Issue 48's target: *peak memory 4 GB or less, and a fit that converges within 30 minutes
on 2 cores*, at the NIPS corpus's size (D = 1,500 documents, V = 10,000 words, K = 50
topics). The corpus is drawn from a CTM (seeded NumPy, ``--seed``):

* topics ``beta_k ~ Dirichlet(0.05)`` over the V words;
* a correlated covariance over the K - 1 free logits: ``W W^T + diag(psi)`` with ``W``
  a ``(K - 1) x 5`` standard-normal factor loading and ``psi ~ U(0.2, 1)``, scaled to
  unit variances (a correlation matrix); ``mu ~ N(0, 0.5^2)``;
* document logits ``eta_d ~ N(mu, Sigma)``, ``theta_d = softmax([eta_d, 0])``;
* document lengths ``Poisson(--doc-len)`` (400), counts
  ``Multinomial(n_d, theta_d @ beta)`` (one NumPy draw per document).

10% of the documents are held out for document completion, as in ``benchmarks/ctm.py``:
each held-out document's tokens are shuffled, the first half (``n // 2``) is observed,
the second half scored. The vocabulary is all V words.

Model: the nonzero-count ``pm.Potential`` spelling (memory scales with the nonzero
(document, word) pairs, not D x V)::

    d, v = np.nonzero(C)
    mu ~ Normal(0, 1), shape K-1
    eta ~ Normal(mu, 1), shape (D, K-1)
    logit_beta ~ Normal(0, 1), shape (K, V)
    theta = softmax([eta, 0]); beta = softmax(logit_beta)
    Potential(sum C[d, v] log (theta[d] * beta[:, v].T).sum(-1))

Methods, each in a worker process of its own (its own peak memory, ``VmHWM``):
``hmcssvi`` (``pm.fit(method="hmcssvi")`` with the plugin's defaults and stopping rule)
``hmcssvi_rows`` (the same with ``row_batch=D / 10``, ``--row-batch``: the documents
a tenth at a time, round robin, as in the paper's CTM algorithm)
and ``advi`` (``pm.fit(method="advi")``), all with ``n`` large and a wall-clock cap
(``--max-seconds``, default 1800 s; ``--advi-max-seconds`` for ADVI) enforced by a
callback raising ``StopIteration``. The clock starts right before ``pm.fit`` (so it
includes compilation); the time spent scoring snapshots is excluded from it. Per
iteration the wall time and the -ELBO are recorded; every ``--every`` iterations (at
least ``max_seconds / 15`` apart) the held-out NLL of the current means is computed and
logged (and a progress file written to ``benchmarks/.cache/``, so a killed run leaves
its numbers).

Held-out score: the per-word NLL of the scored halves with ``theta_d`` = E[theta |
observed half] (``ctm.nll_of``). E[theta | observed half] comes from importance
sampling with a Laplace proposal (:func:`laplace_theta`: the mode of the document's
log posterior over its K - 1 logits, 2,000 draws from ``N(mode, 1.2 x inverse negative
Hessian)``). ``benchmarks/ctm.py``'s two-round estimator (:func:`ctm.infer_theta`, whose
second round doubles the covariance of a Gaussian fitted to prior draws) degenerates at
K = 50: with the generating topics its median effective sample size was 2 of 4,000
(doubling a covariance in 49 dimensions alone costs a factor of about 1,000), against
about 800 of 2,000 for the Laplace proposal. It is still reported for the final means
(``nll_ctm_is``), called per chunk of 10 documents with seed ``123 + chunk`` so that
its draws stay small (all 150 test documents at once allocate about 0.5 GB at K = 50,
which would inflate the worker's peak memory). Fitted means: topics ``softmax(mean of logit_beta)``, prior
``N(mean of mu, I)`` (the model's). References: the training unigram (add-0.5) and the
*oracle*, the generating topics and prior ``N(mu, Sigma)``.

``python benchmarks/ctm_synthetic.py`` runs the full scale (about 1 h with ADVI);
``--quick`` (D = 150, V = 1,000, K = 10, 120 s caps) is a smoke test that writes only to
``benchmarks/.cache/``. ``--methods hmcssvi`` runs one method (cached in
``benchmarks/.cache/``), ``--report`` merges the cached methods into
``benchmarks/results/ctm_synthetic.json`` and the section "CTM at NIPS scale
(synthetic)" of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from scipy.special import logsumexp, softmax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import ctm  # noqa: E402

RESULTS = common.REPO_ROOT / "benchmarks" / "results"
CACHE = common.REPO_ROOT / "benchmarks" / ".cache"
SECTION = "ctm_synthetic"
METHODS = ("hmcssvi", "hmcssvi_rows", "advi")
TARGET_MB = 4096.0  # 4 GB (GiB: VmHWM is read in KiB)
TARGET_SECONDS = 1800.0
SCORE_CHUNK = 10
LAPLACE_DRAWS = 2000
FULL = dict(D=1500, V=10000, K=50, max_seconds=1800.0)
QUICK = dict(D=150, V=1000, K=10, max_seconds=120.0)


# --------------------------------------------------------------------------- data
def make_data(D, V, K, doc_len=400, seed=0, test_frac=0.1, factors=5):
    """A CTM corpus: training counts, test observed / scored halves, the truth."""
    rng = np.random.default_rng(seed)
    beta = rng.dirichlet(np.full(V, 0.05), size=K)
    W = rng.standard_normal((K - 1, min(factors, K - 1)))
    S = W @ W.T + np.diag(rng.uniform(0.2, 1.0, K - 1))
    s = np.sqrt(np.diag(S))
    Sigma = S / np.outer(s, s)
    mu = rng.normal(0.0, 0.5, K - 1)
    eta = mu + rng.standard_normal((D, K - 1)) @ np.linalg.cholesky(Sigma).T
    theta = softmax(np.c_[eta, np.zeros(D)], axis=1)
    n = rng.poisson(doc_len, D)
    X = np.zeros((D, V), dtype="int64")
    for j in range(D):  # one multinomial per document
        p = theta[j] @ beta
        X[j] = rng.multinomial(n[j], p / p.sum())
    perm = rng.permutation(D)
    n_test = int(round(test_frac * D))
    te, tr = perm[:n_test], perm[n_test:]
    C, Xt = X[tr], X[te]
    rng2 = np.random.default_rng(seed + 1)
    obs = np.zeros_like(Xt)
    scr = np.zeros_like(Xt)
    for j in range(Xt.shape[0]):  # the protocol of ctm.load_data
        tokens = np.repeat(np.arange(V), Xt[j])
        rng2.shuffle(tokens)
        h = len(tokens) // 2
        obs[j] = np.bincount(tokens[:h], minlength=V)
        scr[j] = np.bincount(tokens[h:], minlength=V)
    info = dict(
        D=int(D),
        V=int(V),
        K=int(K),
        doc_len=doc_len,
        seed=seed,
        n_train=int(len(tr)),
        n_test=int(n_test),
        train_tokens=int(C.sum()),
        train_nonzero=int(np.count_nonzero(C)),
        train_words_seen=int(np.count_nonzero(C.sum(0))),
        observed_tokens=int(obs.sum()),
        scored_tokens=int(scr.sum()),
        sigma_offdiag_abs_mean=float(np.abs(Sigma[np.triu_indices(K - 1, 1)]).mean()),
    )
    truth = dict(beta=beta, mu=mu, Sigma=Sigma)
    return dict(C=C, obs=obs, scr=scr, info=info, truth=truth)


# ------------------------------------------------------------------------ scoring
def laplace_theta(beta, m, cov, obs, draws=LAPLACE_DRAWS, seed=ctm.SCORE_SEED, scale=1.2):
    """E[theta_d | observed half] by importance sampling from a Laplace proposal.

    Per document: the mode of ``log p(observed | eta) + log N(eta; m, cov)`` over the
    K - 1 free logits (``scipy.optimize.minimize``, trust region with the exact gradient
    and Hessian), then ``draws`` draws from ``N(mode, scale * (-Hessian)^-1)`` weighted by
    prior x likelihood / proposal (seed ``seed + document``). Returns ``theta`` (D, K)
    and the effective sample size per document.
    """
    from scipy.optimize import minimize

    m = np.asarray(m, dtype="float64")
    cov = np.asarray(cov, dtype="float64")
    d = m.size
    cov = 0.5 * (cov + cov.T) + 1e-9 * np.eye(d)
    P = np.linalg.inv(cov)
    P = 0.5 * (P + P.T)
    theta = np.empty((obs.shape[0], beta.shape[0]))
    ess = np.empty(obs.shape[0])

    def th(e):
        return softmax(np.concatenate([e, np.zeros(e.shape[:-1] + (1,))], axis=-1), axis=-1)

    for j in range(obs.shape[0]):
        idx = np.flatnonzero(obs[j])
        n = obs[j, idx].astype("float64")
        N = n.sum()
        B = beta[:, idx]

        def f(e, B=B, n=n):
            t = th(e)
            p = t @ B
            r = e - m
            return -(n @ np.log(p) - 0.5 * r @ P @ r)

        def g(e, B=B, n=n, N=N):
            t = th(e)
            p = t @ B
            R = t * ((B / p) @ n)  # sum_w n_w r_kw
            return -((R - N * t)[:d] - P @ (e - m))

        def h(e, B=B, n=n, N=N):
            t = th(e)
            p = t @ B
            rw = t[:, None] * B / p  # (K, W) responsibilities
            R = rw @ n
            H = np.diag(R) - (rw * n) @ rw.T - N * (np.diag(t) - np.outer(t, t))
            return -(H[:d, :d] - P)

        res = minimize(f, m.copy(), jac=g, hess=h, method="trust-exact")
        mode = res.x
        A = h(mode)
        lam, U = np.linalg.eigh(0.5 * (A + A.T))
        lam = np.maximum(lam, 1e-6)
        Lq = U * np.sqrt(scale / lam)  # proposal covariance scale * A^-1
        z = np.random.default_rng(seed + j).standard_normal((draws, d))
        e = mode + z @ Lq.T
        t = th(e)
        logq = -0.5 * np.sum(z**2, axis=1)  # log|Lq| is a constant of the document
        r = e - m
        logp = -0.5 * np.einsum("si,ij,sj->s", r, P, r)
        lw = np.log(t @ B) @ n + logp - logq
        w = np.exp(lw - logsumexp(lw))
        theta[j] = w @ t
        ess[j] = 1.0 / np.sum(w**2)
    return theta, ess


def score(beta, m, cov, data, estimator="laplace"):
    """Held-out per-word NLL of the scored halves given topics and a prior over the logits.

    ``estimator="laplace"``: :func:`laplace_theta`; ``"ctm"``: ``benchmarks/ctm.py``'s
    :func:`ctm.infer_theta` (two rounds, the second's covariance doubled) per chunk of
    documents (seed ``123 + chunk``).
    """
    beta = np.asarray(beta, dtype="float64")
    beta = beta / beta.sum(1, keepdims=True)
    obs = data["obs"]
    if estimator == "laplace":
        theta, ess = laplace_theta(beta, m, cov, obs)
    else:
        theta = np.empty((obs.shape[0], beta.shape[0]))
        ess = np.empty(obs.shape[0])
        for c, j in enumerate(range(0, obs.shape[0], SCORE_CHUNK)):
            sl = slice(j, j + SCORE_CHUNK)
            theta[sl], ess[sl], _ = ctm.infer_theta(
                beta, m, cov, True, obs[sl], seed=ctm.SCORE_SEED + c
            )
    return {
        "nll": ctm.nll_of(theta, beta, data["scr"]),
        "ess_median": float(np.median(ess)),
        "ess_min": float(np.min(ess)),
    }


# ------------------------------------------------------------------------ methods
def build_model(C):
    import pymc as pm
    import pytensor.tensor as pt

    D, V = C.shape
    K = CFG["K"]
    d, v = np.nonzero(C)
    with pm.Model() as m:
        mu = pm.Normal("mu", 0, 1, shape=K - 1)
        eta = pm.Normal("eta", mu, 1, shape=(D, K - 1))
        logit_beta = pm.Normal("logit_beta", 0, 1, shape=(K, V))
        theta = pm.math.softmax(pt.concatenate([eta, pt.zeros((D, 1))], axis=1), axis=-1)
        beta = pm.math.softmax(logit_beta, axis=-1)
        p = (theta[d] * beta[:, v].T).sum(-1)
        pm.Potential("w", (C[d, v] * pt.log(p)).sum())
    return m


CFG: dict = {}


class Clock:
    """Fit callback: wall clock and -ELBO per iteration, scored snapshots, a time cap."""

    def __init__(self, method, data, every, max_seconds, progress):
        self.method, self.data = method, data
        self.every, self.max_seconds = every, max_seconds
        self.min_gap = max_seconds / 15.0
        self.progress = progress
        self.excluded = 0.0
        self.times, self.losses, self.curve = [], [], []
        self.t0 = time.perf_counter()

    def now(self):
        return time.perf_counter() - self.t0 - self.excluded

    def snapshot(self, approx, k, t):
        s0 = time.perf_counter()
        mm = ctm.read_means(approx)
        K = CFG["K"]
        s = score(softmax(mm["logit_beta"], axis=1), mm["mu"], np.eye(K - 1), self.data)
        self.curve.append(dict(iteration=k, seconds=t, **s))
        common.log(
            f"  {self.method} it {k} t {t:.1f} s -ELBO {self.losses[-1]:.6g}: NLL {s['nll']:.4f} "
            f"(VmHWM {common.vmhwm_mb():.0f} MB, scoring {time.perf_counter() - s0:.1f} s)"
        )
        common.save_json(self.partial(), self.progress)
        self.excluded += time.perf_counter() - s0

    def partial(self):
        t = np.asarray(self.times)
        return dict(
            method=self.method,
            iterations=len(t),
            seconds=float(t[-1]) if len(t) else None,
            first_iteration_seconds=float(t[0]) if len(t) else None,
            seconds_per_iteration=float(np.median(np.diff(t))) if len(t) > 1 else None,
            vmhwm_mb=common.vmhwm_mb(),
            curve=self.curve,
            times=self.times,
            neg_elbo=self.losses,
            partial=True,
        )

    def __call__(self, approx, losses, i):
        t = self.now()
        self.times.append(t)
        loss = float(losses[-1]) if losses is not None and len(losses) else float("nan")
        self.losses.append(loss)
        k = len(self.times)
        if self.method.startswith("hmcssvi") or k % 100 == 0:
            common.log(f"  {self.method} it {k} t {t:.1f} s -ELBO {loss:.8g}")
        if k == 1 or (k % self.every == 0 and t - self.curve[-1]["seconds"] >= self.min_gap):
            self.snapshot(approx, k, t)
        if t > self.max_seconds:
            raise StopIteration(f"time cap {self.max_seconds:.0f} s")


def run_fit(method, data, cfg):
    import pymc as pm

    import pymc_mcssvi  # noqa: F401  (registers method="hmcssvi")

    t_build = time.perf_counter()
    model = build_model(data["C"])
    build_seconds = time.perf_counter() - t_build
    plugin = method.startswith("hmcssvi")
    cap = cfg["max_seconds"] if plugin else cfg["advi_max_seconds"]
    # hmcssvi_rows: the documents a window at a time (the paper's round robin)
    extra = {"row_batch": cfg["row_batch"]} if method == "hmcssvi_rows" else {}
    every = cfg["every"] if plugin else cfg["advi_every"]
    progress = CACHE / f"ctm_synthetic{cfg['suffix']}_{method}_progress.json"
    clock = Clock(method, data, every, cap, progress)
    common.log(f"{method}: model built in {build_seconds:.1f} s, VmHWM {common.vmhwm_mb():.0f} MB")
    clock.t0 = time.perf_counter()
    approx = pm.fit(
        n=cfg["n"] if plugin else cfg["advi_n"],
        method="hmcssvi" if plugin else method,
        model=model,
        random_seed=0,
        progressbar=False,
        callbacks=[clock],
        **extra,
    )
    fit_seconds = clock.now()  # pm.fit's whole call (post-fit work included)
    cpu_seconds = time.process_time()
    vm = common.vmhwm_mb()
    t = np.asarray(clock.times)
    iters = len(t)
    seconds = float(t[-1]) if iters else None
    stopped_time = seconds is not None and seconds > cap
    converged = getattr(approx, "converged", None)
    if stopped_time:
        stopped_by = "time cap"
    elif converged:
        stopped_by = "convergence rule"
    else:
        stopped_by = "iteration cap"
    if not clock.curve or clock.curve[-1]["iteration"] != iters:
        clock.times.append(clock.now())  # keep `seconds` of the final snapshot honest
        clock.losses.append(clock.losses[-1] if clock.losses else float("nan"))
        clock.snapshot(approx, iters, seconds)
        clock.times.pop()
        clock.losses.pop()
    hist = np.asarray(approx.hist, dtype="float64")
    mm = ctm.read_means(approx)
    K = cfg["K"]
    alt = score(softmax(mm["logit_beta"], axis=1), mm["mu"], np.eye(K - 1), data, "ctm")
    med = float(np.median(np.diff(t))) if iters > 1 else None
    return dict(
        method=method,
        build_seconds=build_seconds,
        first_iteration_seconds=float(t[0]) if iters else None,
        setup_seconds=float(t[0] - med) if med is not None else None,
        seconds_per_iteration=med,
        iterations=iters,
        seconds=seconds,
        fit_call_seconds=fit_seconds,
        post_loop_seconds=fit_seconds - seconds if seconds is not None else None,
        cpu_seconds=cpu_seconds,
        cap_seconds=cap,
        converged=converged,
        stopped_by=stopped_by,
        vmhwm_mb=vm,
        nll=clock.curve[-1]["nll"],
        ess_median=clock.curve[-1]["ess_median"],
        nll_ctm_is=alt["nll"],
        ess_median_ctm_is=alt["ess_median"],
        curve=clock.curve,
        times=clock.times,
        neg_elbo=clock.losses,
        neg_elbo_last=float(hist[-1]) if len(hist) else None,
    )


def memory_watch(path, limit_mb, every=5.0):
    """A daemon thread: every ``every`` s write the peak and current memory to ``path``;
    above ``limit_mb`` resident MB write that and end the process (exit code 3)."""
    import threading

    t0 = time.perf_counter()

    def loop():
        while True:
            rss = common.vmrss_mb()
            rec = dict(
                vmhwm_mb=common.vmhwm_mb(),
                vmrss_mb=rss,
                seconds_since_start=time.perf_counter() - t0,
                limit_mb=limit_mb,
            )
            if rss > limit_mb:
                rec["stopped"] = f"resident memory {rss:,.0f} MB over the {limit_mb:,.0f} MB limit"
                common.save_json(rec, path)
                common.log(f"memory watch: {rec['stopped']}: ending the worker")
                os._exit(3)
            common.save_json(rec, path)
            time.sleep(every)

    threading.Thread(target=loop, daemon=True).start()


def worker(method, cfg):
    ctm.quiet()
    CFG.update(cfg)
    memory_watch(CACHE / f"ctm_synthetic{cfg['suffix']}_{method}_memory.json", cfg["max_rss_mb"])
    data = make_data(cfg["D"], cfg["V"], cfg["K"], cfg["doc_len"], cfg["seed"])
    res = {"method": method, "run": common.run_record()}
    try:
        res.update(run_fit(method, data, cfg))
    except Exception as e:  # noqa: BLE001  (the report says what failed)
        import traceback

        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-4000:]
        res["vmhwm_mb"] = common.vmhwm_mb()
    res["vmhwm_mb_end"] = common.vmhwm_mb()
    return res


# ------------------------------------------------------------------------ report
def killed_row(res, cap):
    """Table fields of a worker that wrote no result, from its progress / memory files."""
    prog, mem = res.get("progress") or {}, res.get("memory") or {}
    why = mem.get("stopped") or res.get("error", "killed")
    out = dict(
        stopped_by=f"killed ({why})",
        cap_seconds=cap,
        converged=False,
        vmhwm_mb=max(prog.get("vmhwm_mb") or 0.0, mem.get("vmhwm_mb") or 0.0) or None,
        iterations=prog.get("iterations", 0),
        seconds=prog.get("seconds"),
        first_iteration_seconds=prog.get("first_iteration_seconds"),
        seconds_per_iteration=prog.get("seconds_per_iteration"),
        curve=prog.get("curve", []),
        neg_elbo_last=(prog.get("neg_elbo") or [None])[-1],
        nll=(prog.get("curve") or [{}])[-1].get("nll"),
        worker_seconds_before_kill=mem.get("seconds_since_start"),
    )
    return out


def verdict(r):
    if r is None or "error" in r or r.get("iterations") is None:
        return "no result"
    conv_ok = bool(r.get("converged")) and r["fit_call_seconds"] <= TARGET_SECONDS
    if r.get("vmhwm_mb") is None:
        mem = "peak memory not recorded"
    else:
        ok = "meets" if r["vmhwm_mb"] <= TARGET_MB else "misses"
        mem = f"peak memory {r['vmhwm_mb']:,.0f} MB: {ok} the 4 GB target"
    if conv_ok:
        conv = f"converged by its own rule in {r['fit_call_seconds']:.0f} s: meets the 30-minute target"
    elif r.get("converged"):
        conv = (
            f"converged by its own rule, but in {r['fit_call_seconds']:.0f} s: misses the "
            "30-minute target"
        )
    else:
        secs = r.get("seconds") or r.get("worker_seconds_before_kill") or float("nan")
        how = r["stopped_by"]
        how = how if how.startswith("killed") else f"stopped by the {how}"
        conv = (
            f"did not converge: {how} after {r['iterations']} iterations and {secs:.0f} s: "
            "misses the 30-minute target"
        )
    return f"{mem}; {conv}"


def report(results):
    f = common.fmt
    d = results["data"]
    rows = []
    for name in METHODS:
        r = results["methods"].get(name)
        if r is None:
            continue
        if "error" in r:
            rows.append(
                [name, f"error: {r['error'][:300]}"]
                + [""] * 6
                + [f(r.get("vmhwm_mb"), ",.0f")]
                + [""] * 5
            )
            continue
        rows.append(
            [
                name,
                f(r["nll"], ".3f"),
                f(r.get("nll_ctm_is"), ".3f"),
                f(r.get("first_iteration_seconds"), ".0f"),
                f(r.get("seconds_per_iteration"), ".3g"),
                r["iterations"],
                f(r["seconds"], ".0f"),
                f(r.get("post_loop_seconds"), ".0f"),
                f(r["vmhwm_mb"], ",.0f"),
                f(r["cap_seconds"], ".0f"),
                r["stopped_by"],
                f(r.get("neg_elbo_last"), ",.0f"),
                ctm.fmt_load(r.get("load_before")),
                ctm.fmt_load(r.get("load_after")),
            ]
        )
    rows.append(["unigram (training, add-0.5)", f(results["unigram_nll"], ".3f")] + [""] * 12)
    rows.append(
        [
            "oracle (true topics, N(mu, Sigma))",
            f(results["oracle_nll"], ".3f"),
            f(results.get("oracle_nll_ctm_is"), ".3f"),
        ]
        + [""] * 11
    )
    run = results["run"]
    lines = [
        "## CTM at NIPS scale (synthetic)",
        "",
        f"Measured {run['date']} on {run['machine'].get('cpu_model', '?')} "
        f"({run['machine'].get('cpu_count')} logical CPUs, "
        f"{run['machine'].get('mem_total_gb')} GB), commit {run['commit']}"
        f"{' (plugin sources modified)' if run.get('plugin_dirty') else ''}, shared with "
        "other work (load averages 1/5/15 min before and after each worker in the table). "
        f"Reproduce: `{results['command']}`.",
        "",
        f"Data (`make_data`, seed {d['seed']}): a CTM corpus of D = {d['D']:,} documents, "
        f"V = {d['V']:,} words, K = {d['K']} topics; topics Dirichlet(0.05), document logits "
        "N(mu, Sigma) over K - 1 free logits with a random 5-factor correlation matrix "
        f"(mean |off-diagonal| {d['sigma_offdiag_abs_mean']:.2f}), lengths "
        f"Poisson({d['doc_len']}). {d['n_train']:,} training documents "
        f"({d['train_tokens']:,} tokens, {d['train_nonzero']:,} nonzero (document, word) "
        f"pairs, {d['train_words_seen']:,} distinct words); {d['n_test']} held-out "
        f"documents, shuffled and split into an observed half ({d['observed_tokens']:,} "
        f"tokens) and a scored half ({d['scored_tokens']:,} tokens). Model: the "
        "nonzero-count `pm.Potential` spelling (`benchmarks/ctm_synthetic.py`'s docstring), "
        "`eta ~ N(mu, I)`. Score: held-out per-word NLL of the scored halves with the fit's "
        "mean topics and prior `N(mean of mu, I)`; the oracle uses the generating topics "
        "and `N(mu, Sigma)`. E[theta | observed half] by importance sampling from a Laplace "
        "proposal per document (2,000 draws from `N(mode, 1.2 x inverse negative Hessian)`; "
        f"median ESS {results['oracle_ess_median']:.0f} for the oracle). Column *ctm.py IS*: "
        "the Reuters section's two-round estimator (4,000 + 4,000 draws, second round's "
        "covariance doubled) on the same means; at K = 50 it degenerates (median ESS "
        f"{results['oracle_ess_median_ctm_is']:.0f} of 4,000 for the oracle), so the first "
        "column is the one to read.",
        "",
        "*first it*: seconds from the `pm.fit` call to the end of the first iteration "
        "(compilation included); *s/it*: median wall seconds per iteration; *seconds*: "
        "the clock at the last iteration (snapshot scoring excluded); *post*: `pm.fit`'s "
        "work after the last iteration; *peak RSS*: the worker's VmHWM (MB, the data and "
        "model included).",
        "",
        common.markdown_table(
            [
                "method",
                "held-out NLL",
                "ctm.py IS",
                "first it (s)",
                "s/it",
                "iterations",
                "seconds",
                "post (s)",
                "peak RSS (MB)",
                "cap (s)",
                "stopped by",
                "-ELBO",
                "load before",
                "load after",
            ],
            rows,
        ),
    ]
    for name in METHODS:
        r = results["methods"].get(name)
        if r and r.get("curve"):
            pts = ", ".join(
                f"it {c['iteration']} {c['seconds']:.0f} s: {c['nll']:.3f}" for c in r["curve"]
            )
            lines += ["", f"*{name}* held-out NLL along the run: {pts}."]
    r = results["methods"].get("hmcssvi")
    lines += [
        "",
        "**Verdict against issue 48's target** (peak memory 4 GB or less, and a fit that "
        f"converges within 30 minutes on 2 cores): H-MC-SSVI {verdict(r)}.",
    ]
    if results.get("notes"):
        lines += ["", results["notes"]]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--D", type=int, default=None)
    p.add_argument("--V", type=int, default=None)
    p.add_argument("--K", type=int, default=None)
    p.add_argument("--doc-len", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=None)
    p.add_argument("--advi-max-seconds", type=float, default=None)
    p.add_argument("--every", type=int, default=None, help="score every N plugin iterations")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument(
        "--row-batch", type=int, default=None, help="hmcssvi_rows: documents a step (D / 10)"
    )
    p.add_argument(
        "--max-rss-mb", type=float, default=12000.0, help="end a worker above this resident MB"
    )
    p.add_argument("--report", action="store_true", help="only merge the cached methods")
    p.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    p.add_argument("--notes", default="")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--task", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cfg", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        cfg = json.loads(args.cfg)
        common.set_run_mode(cfg["mode"])
        common.save_json(worker(args.task, cfg), args.out)
        return
    base = QUICK if args.quick else FULL
    D, V, K = (args.D or base["D"]), (args.V or base["V"]), (args.K or base["K"])
    max_seconds = args.max_seconds or base["max_seconds"]
    scaled = (D, V, K) != (FULL["D"], FULL["V"], FULL["K"])
    mode = "quick" if args.quick else ("scaled" if scaled else "full")
    common.set_run_mode(mode)
    cfg = dict(
        D=D,
        V=V,
        K=K,
        doc_len=args.doc_len,
        seed=args.seed,
        mode=mode,
        max_seconds=max_seconds,
        advi_max_seconds=args.advi_max_seconds or max_seconds,
        n=100000,
        advi_n=10_000_000,
        every=args.every or (1 if args.quick else 2),
        advi_every=100,
        max_rss_mb=args.max_rss_mb,
        row_batch=args.row_batch or max(D // 10, 1),
    )
    suffix = "" if mode == "full" else f"_{mode}_D{D}_V{V}_K{K}"
    cfg["suffix"] = suffix
    CACHE.mkdir(parents=True, exist_ok=True)
    todo = [] if args.report else [m for m in args.methods.split(",") if m]
    for method in todo:
        cap = cfg["max_seconds"] if method.startswith("hmcssvi") else cfg["advi_max_seconds"]
        common.log(f"worker {method} D={D} V={V} K={K} cap {cap:.0f} s")
        load_before = [round(x, 2) for x in os.getloadavg()]
        for kind in ("progress", "memory"):
            (CACHE / f"ctm_synthetic{suffix}_{method}_{kind}.json").unlink(missing_ok=True)
        res = common.run_worker(
            __file__,
            ["--task", method, "--cfg", json.dumps(cfg)],
            {"method": method, "run": common.run_record()},
            timeout=cap + 1800,
        )
        res["load_before"] = load_before
        res["load_after"] = [round(x, 2) for x in os.getloadavg()]
        if "iterations" not in res:  # killed: what its progress and memory files say
            for kind in ("progress", "memory"):
                path = CACHE / f"ctm_synthetic{suffix}_{method}_{kind}.json"
                if path.exists():
                    res[kind] = json.loads(path.read_text())
            row = killed_row(res, cap)
            res["worker_error"] = res.pop("error", None)
            res.update(row)
        common.log(
            f"  -> {method}: NLL {res.get('nll')} iterations {res.get('iterations')} "
            f"VmHWM {res.get('vmhwm_mb')} error {res.get('error')}"
        )
        common.save_json(res, CACHE / f"ctm_synthetic{suffix}_{method}.json")
    CFG.update(cfg)
    data = make_data(D, V, K, args.doc_len, args.seed)
    tr = data["truth"]
    s0 = time.perf_counter()
    oracle = score(tr["beta"], tr["mu"], tr["Sigma"], data)
    oracle_ctm = score(tr["beta"], tr["mu"], tr["Sigma"], data, "ctm")
    common.log(
        f"oracle NLL {oracle['nll']:.4f}, ctm.py's estimator {oracle_ctm['nll']:.4f} "
        f"({time.perf_counter() - s0:.1f} s)"
    )
    methods = {}
    for method in METHODS:
        path = CACHE / f"ctm_synthetic{suffix}_{method}.json"
        if path.exists():
            methods[method] = json.loads(path.read_text())
    command = "python benchmarks/ctm_synthetic.py" + (" --quick" if args.quick else "")
    if scaled and not args.quick:
        command += f" --D {D} --V {V} --K {K}"
    if max_seconds != base["max_seconds"]:
        command += f" --max-seconds {max_seconds:.0f}"
    if cfg["advi_max_seconds"] != max_seconds:
        command += f" --advi-max-seconds {cfg['advi_max_seconds']:.0f}"
    results = {
        "run": common.run_record(),
        "command": command,
        "config": cfg,
        "data": data["info"],
        "scoring": dict(
            primary="laplace",
            laplace_draws=LAPLACE_DRAWS,
            laplace_scale=1.2,
            ctm_is_draws=ctm.IS_DRAWS,
            seed=ctm.SCORE_SEED,
            ctm_chunk=SCORE_CHUNK,
        ),
        "unigram_nll": ctm.unigram_nll(data),
        "oracle_nll": oracle["nll"],
        "oracle_ess_median": oracle["ess_median"],
        "oracle_nll_ctm_is": oracle_ctm["nll"],
        "oracle_ess_median_ctm_is": oracle_ctm["ess_median"],
        "unigram_nll_note": "training word frequencies + 0.5",
        "target": dict(vmhwm_mb=TARGET_MB, seconds=TARGET_SECONDS, cores=2),
        "versions": common.library_versions(("pymc", "pytensor", "numpy", "pymc_mcssvi")),
        "methods": methods,
        "notes": args.notes,
    }
    r = methods.get("hmcssvi")
    results["verdict"] = verdict(r)
    md = report(results)
    if mode == "full":
        common.save_json(results, RESULTS / "ctm_synthetic.json")
        if not args.no_docs:
            common.write_section(SECTION, md)
    else:
        common.save_json(results, CACHE / f"ctm_synthetic{suffix}.json")
        (CACHE / f"ctm_synthetic{suffix}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
