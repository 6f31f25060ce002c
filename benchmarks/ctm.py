"""Correlated topic model (CTM) on the Reuters corpus: held-out per-word NLL (issue 48).

Data: ``lda.datasets.load_reuters()`` (395 documents x 4,258 words, counts). The
documents are split 80/20 with ``numpy.random.default_rng(0).permutation``; the
vocabulary is the words seen in the training documents (test tokens of other words
are dropped). Each test document's tokens are shuffled (``default_rng(1)``); the
first half (``n // 2`` tokens) is *observed*, the rest is *scored*.

Model (K = 10 unless ``--K``), as a PyMC user writes it, with collapsed counts::

    mu ~ Normal(0, 1), shape K-1
    eta ~ Normal(mu, 1), shape (D, K-1)
    logit_beta ~ Normal(0, 1), shape (K, V)
    theta = softmax([eta, 0])
    w ~ Multinomial(n = C.sum(1), p = theta @ softmax(logit_beta))

Methods, each in a worker process of its own (its own peak memory, VmHWM), each
stopped by a wall-clock cap (``--max-seconds``, default 300 s; the clock includes
compilation):

* ``hmcssvi``: ``pm.fit(method="hmcssvi")`` (the plugin's defaults) with an
  iteration cap ``--hmcssvi-n``.
* ``hmcssvi_meanfield``: the same with ``cov="diag"``: a diagonal q per document
  (the paper's mean-field baseline), the topics' diagonal q as in the default.
* ``hmcssvi_adagrad``: the same with ``mean_optimizer="adagrad"`` (the paper's
  H-MC-SSVI variant: AdaGrad steps for the means).
* ``sdsvi``: ``pm.fit(method="sdsvi")`` (S-DSVI, the plugin's defaults), iteration cap
  ``--sdsvi-n``.
* ``hmcssvi_token``: the token-level spelling (one ``z ~ Categorical(theta_d)`` per
  training token, which the plugin sums out; :func:`build_model`) with the default,
  optimal structured bound (z summed inside the log: the same bound as the counts).
* ``hmcssvi_jensen``: the same with ``bound="jensen"``, the paper's simple structured
  bound (z summed outside the log).
* ``hmcssvi_jensen_counts``: that simple structured bound written over the nonzero counts
  (``pm.Potential``, :func:`build_model`): the same objective at the counts' cost.
* ``advi``: ``pm.fit(method="advi")`` on the same model, ``--advi-n`` iterations.
* ``tomotopy``: ``tomotopy.CTModel(k=10, seed=0)`` (Gibbs sampling), trained in
  chunks of ``--tomotopy-chunk`` iterations, one worker thread.

Held-out score (the same code for every method, :func:`score`): given topics ``beta``
(K x V) and a Gaussian prior ``N(m, S)`` over the document's logits, each test
document's E[theta | observed half] is estimated by two-round importance sampling,
vectorized over draws (one Python loop per document, none per token): 4,000 draws
from the prior, a Gaussian fitted to the weighted draws (covariance doubled), then
4,000 draws from that Gaussian weighted by prior x likelihood / proposal. The draws use
the same seeds for every method. NLL = -sum_d sum_v n_dv log (theta_d @ beta)_v /
(scored tokens).

* VI methods: ``beta = softmax(posterior mean of logit_beta)``, prior
  ``N(posterior mean of mu, I)`` on the K-1 free logits (the last logit is 0).
  The final fit is also scored with ``beta`` averaged over 200 posterior draws of
  ``softmax(logit_beta)`` and ``mu`` averaged over the same draws (``nll_draws``).
* tomotopy: its topic-word distributions (``get_topic_word_dist``) and its fitted
  logistic-normal prior (``prior_mean``, ``prior_cov``, K logits). Also reported:
  ``nll_own_infer``, tomotopy's own ``infer`` on the observed halves (its topic
  proportions, same NLL formula).

Snapshots of the means (of ``beta`` and the prior for tomotopy) are taken along each
run (every few iterations, at least ``max_seconds / 50`` apart) (their time is excluded from the clock) and scored after the fit, which gives the
held-out NLL curve and the time to reach within 0.01 nats of each method's final NLL.

``--corpus lee``: gensim's Lee background corpus (shipped in gensim's wheel, nothing is
downloaded; :func:`lee_counts`) instead of Reuters, file names with ``_lee``;
``--max-docs N``: N documents drawn at random before the split (``_docs<N>``).
``--every`` / ``--min-gap``: snapshot spacing of the plugin methods.

Run ``python benchmarks/ctm.py`` (about 20 minutes on 2 cores; ``--methods advi``
runs one method into ``benchmarks/.cache/`` and ``--report`` merges the cached
methods). Writes ``benchmarks/results/ctm.json`` and ``benchmarks/results/ctm.md``
(also printed). ``--quick`` is a smoke test (short caps, ``_quick`` file names).

``--K 5`` (any K other than 10) puts ``_K5`` into the cache and result file names
(``benchmarks/results/ctm_K5.json``/``.md``), so the K sweep's rows are kept apart;
``python benchmarks/ctm.py --report`` (K = 10) also writes the K-sweep table from
whatever ``ctm_K*`` caches exist (K = 10 rows from the main caches, with their NLL at
the sweep's cap read from the snapshot curve). Every run records the load averages
(1, 5, 15 min) just before and just after its worker (``load_before``,
``load_after``). Perplexity = exp(per-word NLL).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
from scipy.special import logsumexp, softmax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

RESULTS = common.REPO_ROOT / "benchmarks" / "results"
CACHE = common.REPO_ROOT / "benchmarks" / ".cache"

PLUGIN = (
    "hmcssvi",
    "hmcssvi_meanfield",
    "hmcssvi_adagrad",
    "sdsvi",
    "hmcssvi_token",
    "hmcssvi_jensen",
    "hmcssvi_jensen_counts",
)
METHODS = (*PLUGIN, "advi", "tomotopy")
#: methods fitted on the token-level spelling (:func:`build_model`)
TOKEN = ("hmcssvi_token", "hmcssvi_jensen")
SWEEP_K = (5, 10, 20, 50)
#: pm.fit arguments per method: the plugin's default (a full block per document, a diagonal
#: q over the topic logits) and the paper's mean-field baseline (every q diagonal)
FIT_KW = {
    "hmcssvi_meanfield": dict(method="hmcssvi", cov="diag"),
    "hmcssvi_adagrad": dict(method="hmcssvi", mean_optimizer="adagrad"),
    "sdsvi": dict(method="sdsvi"),
    "hmcssvi_token": dict(method="hmcssvi"),
    # (as hmcssvi_jensen_counts below: cov="auto" gave it 5 GB and no iteration in 12 min
    # on 100 Lee documents; with the diagonal, 30 documents: first iteration at 157 s)
    "hmcssvi_jensen": dict(method="hmcssvi", bound="jensen", cov={"logit_beta": "diag"}),
    # cov="auto" gives this Potential a dense q over the K x V topic logits (Lee, 30
    # documents: past 6 GB before the first iteration); the counts model's default is diagonal
    "hmcssvi_jensen_counts": dict(method="hmcssvi", cov={"logit_beta": "diag"}),
}
K = 10
TARGET_NLL = 7.60
OUTSIDE = {"PyMC ADVI": 7.633, "tomotopy": 7.799}
IS_DRAWS = 4000
SCORE_SEED = 123
TOL = 0.01


# --------------------------------------------------------------------------- data
def lee_counts():
    """The Lee background corpus shipped inside gensim's wheel (no download): 300 news
    documents, one a line; ``simple_preprocess`` (lowercased tokens of 2-15 letters), gensim's
    ``STOPWORDS`` dropped, then the words seen in fewer than 2 documents (of all 300).
    Returns the (documents x words) count matrix and the words."""
    from gensim.parsing.preprocessing import STOPWORDS
    from gensim.test.utils import datapath
    from gensim.utils import simple_preprocess

    with open(datapath("lee_background.cor"), encoding="utf-8") as fh:
        docs = [[w for w in simple_preprocess(line) if w not in STOPWORDS] for line in fh]
    df = {}
    for doc in docs:
        for w in set(doc):
            df[w] = df.get(w, 0) + 1
    words = sorted(w for w, c in df.items() if c >= 2)
    col = {w: i for i, w in enumerate(words)}
    X = np.zeros((len(docs), len(words)), dtype="int64")
    for j, doc in enumerate(docs):
        for w in doc:
            if w in col:
                X[j, col[w]] += 1
    return X, words


def load_data(seed=0, corpus="reuters", max_docs=None):
    """Train counts, test observed / scored halves, all over the training vocabulary.

    ``corpus``: ``"reuters"`` (``lda.datasets.load_reuters()``) or ``"lee"``
    (:func:`lee_counts`). ``max_docs``: keep that many documents, drawn with
    ``default_rng(seed + 2)`` (kept in corpus order), before the split."""
    if corpus == "lee":
        X, _ = lee_counts()
    else:
        import lda.datasets

        X = np.asarray(lda.datasets.load_reuters(), dtype="int64")
    docs_corpus = X.shape[0]
    if max_docs is not None and max_docs < X.shape[0]:
        keep = np.sort(np.random.default_rng(seed + 2).permutation(X.shape[0])[:max_docs])
        X = X[keep]
    n_docs = X.shape[0]
    perm = np.random.default_rng(seed).permutation(n_docs)
    n_train = int(round(0.8 * n_docs))
    tr, te = perm[:n_train], perm[n_train:]
    vocab = np.flatnonzero(X[tr].sum(0) > 0)
    C = X[tr][:, vocab]
    Xt = X[te][:, vocab]
    rng = np.random.default_rng(seed + 1)
    obs = np.zeros_like(Xt)
    scr = np.zeros_like(Xt)
    for j in range(Xt.shape[0]):  # one loop per document (token lists built by np.repeat)
        tokens = np.repeat(np.arange(Xt.shape[1]), Xt[j])
        rng.shuffle(tokens)
        h = len(tokens) // 2
        obs[j] = np.bincount(tokens[:h], minlength=Xt.shape[1])
        scr[j] = np.bincount(tokens[h:], minlength=Xt.shape[1])
    info = dict(
        corpus=corpus,
        docs_corpus=int(docs_corpus),
        max_docs=max_docs,
        docs=int(n_docs),
        words_all=int(X.shape[1]),
        tokens_all=int(X.sum()),
        n_train=int(len(tr)),
        n_test=int(len(te)),
        vocab=int(len(vocab)),
        train_tokens=int(C.sum()),
        test_tokens_dropped_oov=int(X[te].sum() - Xt.sum()),
        observed_tokens=int(obs.sum()),
        scored_tokens=int(scr.sum()),
        split_seed=seed,
        shuffle_seed=seed + 1,
    )
    return dict(C=C, obs=obs, scr=scr, info=info)


# ------------------------------------------------------------------------ scoring
def infer_theta(beta, m, cov, pad, obs, draws=IS_DRAWS, seed=SCORE_SEED, inflate=None, scr=None):
    """E[theta_d | observed half] for every test document (two-round importance sampling).

    ``beta`` (K, V) topics; prior ``N(m, cov)`` over ``d`` logits; ``pad``: append a
    zero logit (d = K - 1). Returns ``theta`` (D, K), the effective sample size of
    the second round per document, and (``scr`` given) each document's predictive
    ``log p(scored half | observed half)`` (None otherwise). The second round's proposal
    is the Gaussian fitted to the first round's weighted draws with its covariance
    doubled, or (``inflate`` given) that covariance plus ``inflate * I`` (the paper's
    appendix: the fitted q inflated by 0.1 I).
    """
    m = np.asarray(m, dtype="float64")
    cov = np.asarray(cov, dtype="float64")
    d = m.size
    cov = 0.5 * (cov + cov.T) + 1e-9 * np.eye(d)
    Lp = np.linalg.cholesky(cov)
    Pinv = np.linalg.inv(cov)
    rng = np.random.default_rng(seed)
    z1 = rng.standard_normal((obs.shape[0], draws, d))
    z2 = rng.standard_normal((obs.shape[0], draws, d))

    def th(e):
        if pad:
            e = np.concatenate([e, np.zeros((e.shape[0], 1))], axis=1)
        return softmax(e, axis=1)

    def logprior(e):
        r = e - m
        return -0.5 * np.einsum("si,ij,sj->s", r, Pinv, r)

    theta = np.empty((obs.shape[0], beta.shape[0]))
    ess = np.empty(obs.shape[0])
    pred = None if scr is None else np.empty(obs.shape[0])
    for j in range(obs.shape[0]):
        idx = np.flatnonzero(obs[j])
        n = obs[j, idx].astype("float64")
        B = beta[:, idx]
        e1 = m + z1[j] @ Lp.T
        t1 = th(e1)
        if idx.size == 0:
            theta[j], ess[j] = t1.mean(0), draws
            if scr is not None:
                s_idx = np.flatnonzero(scr[j])
                lls = np.log(t1 @ beta[:, s_idx]) @ scr[j, s_idx].astype("float64")
                pred[j] = logsumexp(lls) - np.log(draws)
            continue
        ll1 = np.log(t1 @ B) @ n
        w1 = softmax(ll1)
        mu1 = w1 @ e1
        r = e1 - mu1
        if inflate is None:
            c1 = 2.0 * (r.T * w1) @ r + 1e-6 * np.eye(d)
        else:
            c1 = (r.T * w1) @ r + inflate * np.eye(d)
        L1 = np.linalg.cholesky(c1)
        e2 = mu1 + z2[j] @ L1.T
        t2 = th(e2)
        half_logdet = np.sum(np.log(np.diag(L1)))
        logq = -0.5 * np.sum(z2[j] ** 2, axis=1) - half_logdet
        logp = logprior(e2) - np.sum(np.log(np.diag(Lp)))
        lw = np.log(t2 @ B) @ n + logp - logq
        w2 = np.exp(lw - logsumexp(lw))
        theta[j] = w2 @ t2
        ess[j] = 1.0 / np.sum(w2**2)
        if scr is not None:
            s_idx = np.flatnonzero(scr[j])
            lls = np.log(t2 @ beta[:, s_idx]) @ scr[j, s_idx].astype("float64")
            pred[j] = logsumexp(lw + lls) - logsumexp(lw)
    return theta, ess, pred


def nll_of(theta, beta, scr):
    """Per-word NLL of the scored halves given per-document topic proportions."""
    p = theta @ beta
    return float(-np.sum(scr * np.log(p)) / scr.sum())


def score(beta, m, cov, pad, data):
    beta = np.asarray(beta, dtype="float64")
    beta = beta / beta.sum(1, keepdims=True)
    theta, ess, _ = infer_theta(beta, m, cov, pad, data["obs"])
    return {
        "nll": nll_of(theta, beta, data["scr"]),
        "ess_median": float(np.median(ess)),
        "ess_min": float(np.min(ess)),
    }


def score_paper_is(beta, m, cov, pad, data, inflate=0.1):
    """The paper appendix's variant: second-round proposal = fitted q + ``inflate`` I.

    ``nll``: the plug-in NLL with E[theta | observed half] from that proposal;
    ``nll_pred``: the predictive ``-sum_d log p(scored half_d | observed half_d) /
    tokens`` (multinomial coefficients left out) with the same draws and weights.
    """
    beta = np.asarray(beta, dtype="float64")
    beta = beta / beta.sum(1, keepdims=True)
    theta, ess, pred = infer_theta(beta, m, cov, pad, data["obs"], inflate=inflate, scr=data["scr"])
    return {
        "inflate": inflate,
        "nll": nll_of(theta, beta, data["scr"]),
        "nll_pred": float(-pred.sum() / data["scr"].sum()),
        "ess_median": float(np.median(ess)),
        "ess_min": float(np.min(ess)),
    }


def unigram_nll(data):
    """Reference: training word frequencies (add-0.5 smoothing), no topics."""
    f = data["C"].sum(0) + 0.5
    return float(-np.sum(data["scr"] * np.log(f / f.sum())) / data["scr"].sum())


# ------------------------------------------------------------------------ methods
def quiet():
    warnings.filterwarnings("ignore")
    for name in ("pymc", "pytensor", "pymc_mcssvi"):
        logging.getLogger(name).setLevel(logging.ERROR)


def build_model(C, spelling="counts", topics=None):
    """The CTM over the training counts ``C`` with ``topics`` topics (default :data:`K`).

    * ``"counts"``: the collapsed ``pm.Multinomial``.
    * ``"token"``: one ``z ~ Categorical(theta_d)`` per training token, which the plugin
      sums out (inside the log by default, outside it with ``bound="jensen"``), and the
      token's word read as ``pm.Bernoulli("w", p=beta[z, word], observed=1)``: its log
      likelihood is ``log beta[z, word]``, that of ``Categorical(beta[z])`` at the word.
    * ``"jensen_counts"``: the simple structured (Jensen) bound of the token-level model in
      counts form, ``pm.Potential("w", sum_dv n_dv sum_k theta_dk log beta_kv)`` over the
      nonzero counts: ``E_p(z | eta)[log p(w | z)]`` summed over a document's tokens of
      one word. Fitted with the default bound it is the same objective as ``"token"`` with
      ``bound="jensen"`` (the same -ELBO trace to 1e-8 on tests/models/test_ctm.py's
      corpus, D = 10, V = 8, K = 3), at the cost of the counts spelling.
    * ``"token_categorical"``: the same with ``pm.Categorical("w", p=beta[z],
      observed=word)``, the spelling of tests/models/test_ctm.py. The same bound (the same
      -ELBO trace to 1e-9 on 5 Reuters documents), but ``beta[z]`` is a (tokens x V) matrix
      per value of z (Reuters, 5 documents, 1,048 tokens: 30 s an iteration against 1.5 s
      for ``"token"``).
    """
    import pymc as pm
    import pytensor.tensor as pt

    D, V = C.shape
    k = K if topics is None else topics
    with pm.Model() as m:
        mu = pm.Normal("mu", 0, 1, shape=k - 1)
        eta = pm.Normal("eta", mu, 1, shape=(D, k - 1))
        logit_beta = pm.Normal("logit_beta", 0, 1, shape=(k, V))
        theta = pm.math.softmax(pt.concatenate([eta, pt.zeros((D, 1))], axis=1), axis=-1)
        beta = pm.math.softmax(logit_beta, axis=-1)
        if spelling == "jensen_counts":
            d, v = np.nonzero(C)
            pm.Potential("w", (C[d, v] * (theta[d] * pt.log(beta[:, v].T)).sum(-1)).sum())
        elif spelling in ("token", "token_categorical"):
            d, v = np.nonzero(C)
            n = C[d, v]
            words = np.repeat(v, n)
            z = pm.Categorical("z", p=theta[np.repeat(d, n)])
            if spelling == "token":
                pm.Bernoulli("w", p=beta[z, words], observed=np.ones(words.size, dtype="int64"))
            else:
                pm.Categorical("w", p=beta[z], observed=words)
        else:
            pm.Multinomial("w", n=C.sum(1), p=theta @ beta, observed=C)
    return m


def read_means(approx):
    """``{name: posterior mean}`` (unconstrained space) for the plugin or a PyMC approximation."""
    ordering = getattr(approx, "ordering", None)
    if ordering is None:
        ordering = approx.groups[0].ordering
    flat = np.asarray(approx.mean.eval())
    return {name: flat[slc].reshape(shape).copy() for name, (_, slc, shape, _) in ordering.items()}


class Clock:
    """Fit callback: wall clock per iteration, snapshots of the means, a time cap."""

    def __init__(self, every, max_seconds, min_gap=None):
        self.every, self.max_seconds = every, max_seconds
        self.min_gap = max_seconds / 50.0 if min_gap is None else min_gap
        self.t0 = time.perf_counter()
        self.excluded = 0.0
        self.times, self.snaps = [], []

    def now(self):
        return time.perf_counter() - self.t0 - self.excluded

    def __call__(self, approx, losses, i):
        t = self.now()
        self.times.append(t)
        k = len(self.times)
        if k == 1 or (k % self.every == 0 and t - self.snaps[-1][1] >= self.min_gap):
            s0 = time.perf_counter()
            mm = read_means(approx)
            self.snaps.append((k, t, mm["logit_beta"], mm["mu"]))
            self.excluded += time.perf_counter() - s0
        if t > self.max_seconds:
            raise StopIteration(f"time cap {self.max_seconds:.0f} s")


def run_pymc(method, data, cfg):
    import pymc as pm

    import pymc_mcssvi  # noqa: F401  (registers method="hmcssvi")

    spelling = "counts"
    if method == "hmcssvi_jensen_counts":
        spelling = "jensen_counts"
    elif method in TOKEN:
        spelling = cfg.get("token_spelling", "token")
    model = build_model(data["C"], spelling)
    plugin = method in PLUGIN
    n = cfg["sdsvi_n"] if method == "sdsvi" else cfg["hmcssvi_n"] if plugin else cfg["advi_n"]
    every = cfg["hmcssvi_every"] if plugin else cfg["advi_every"]
    clock = Clock(every, cfg["max_seconds"], cfg.get("min_gap"))
    kw = dict(random_seed=0, **FIT_KW.get(method, dict(method=method)))
    approx = pm.fit(n=n, model=model, progressbar=False, callbacks=[clock], **kw)
    seconds = clock.now()
    cpu_seconds = time.process_time()  # the worker's CPU time up to the end of the fit
    hist = np.asarray(approx.hist, dtype="float64")
    iters = len(clock.times)
    mm = read_means(approx)
    if not clock.snaps or clock.snaps[-1][0] != iters:
        clock.snaps.append((iters, seconds, mm["logit_beta"], mm["mu"]))
    vm = common.vmhwm_mb()
    if cfg.get("suffix") is not None:  # the final means, for re-scoring without a re-run
        np.savez(
            CACHE / f"ctm{cfg['suffix']}_{method}_final.npz",
            logit_beta=mm["logit_beta"],
            mu=mm["mu"],
        )
    curve = []
    for k, t, lb, mu in clock.snaps:
        s = score(softmax(lb, axis=1), mu, np.eye(K - 1), True, data)
        curve.append(dict(iteration=k, seconds=t, **s))
        common.log(f"  {method} it {k} t {t:.1f} s: NLL {s['nll']:.4f}")
    final = curve[-1]
    post = approx.sample(200, random_seed=1)
    post = post["posterior"] if not hasattr(post, "posterior") else post.posterior
    lb = np.asarray(post["logit_beta"].values).reshape(-1, K, data["C"].shape[1])
    mu_d = np.asarray(post["mu"].values).reshape(-1, K - 1)
    beta_d = softmax(lb, axis=2).mean(0)
    sd = score(beta_d, mu_d.mean(0), np.eye(K - 1), True, data)
    return dict(
        iterations=iters,
        iteration_cap=n,
        seconds=seconds,
        cpu_seconds=cpu_seconds,
        seconds_per_iteration=float(np.median(np.diff(clock.times))) if iters > 1 else None,
        neg_elbo_last=float(np.mean(hist[-max(1, len(hist) // 20) :])) if len(hist) else None,
        hist_every=max(1, len(hist) // 500),
        hist=hist[:: max(1, len(hist) // 500)].tolist(),
        nll=final["nll"],
        ess_median=final["ess_median"],
        nll_draws=sd["nll"],
        curve=curve,
        vmhwm_mb=vm,
        stopped_by="time cap"
        if seconds > cfg["max_seconds"]
        else "iteration cap"
        if iters >= n
        else "the fit's convergence stop",
    )


def run_tomotopy(data, cfg):
    import tomotopy as tp

    C = data["C"]
    V = C.shape[1]
    words = [f"w{v}" for v in range(V)]
    t0 = time.perf_counter()
    mdl = tp.CTModel(k=K, seed=0)
    for row in C:
        toks = [words[v] for v in np.repeat(np.arange(V), row)]
        if toks:
            mdl.add_doc(toks)
    excluded = 0.0
    snaps = []
    it = 0
    chunk = cfg["tomotopy_chunk"]

    def read():
        pos = {w: i for i, w in enumerate(mdl.used_vocabs)}
        order = np.array([pos[w] for w in words])
        beta = np.array([mdl.get_topic_word_dist(k) for k in range(K)])[:, order]
        return beta, np.array(mdl.prior_mean), np.array(mdl.prior_cov)

    while it < cfg["tomotopy_max_iter"]:
        mdl.train(chunk, workers=1)
        it += chunk
        t = time.perf_counter() - t0 - excluded
        s0 = time.perf_counter()
        snaps.append((it, t, *read()))
        excluded += time.perf_counter() - s0
        if t > cfg["max_seconds"]:
            break
    seconds = time.perf_counter() - t0 - excluded
    vm = common.vmhwm_mb()
    curve = []
    for k, t, beta, m, S in snaps:
        s = score(beta, m.ravel(), S.reshape(K, K), False, data)
        curve.append(dict(iteration=k, seconds=t, **s))
        common.log(f"  tomotopy it {k} t {t:.1f} s: NLL {s['nll']:.4f}")
    out = dict(
        iterations=it,
        seconds=seconds,
        ll_per_word_train=float(mdl.ll_per_word),
        nll=curve[-1]["nll"],
        ess_median=curve[-1]["ess_median"],
        curve=curve,
        vmhwm_mb=vm,
        stopped_by="time cap" if seconds > cfg["max_seconds"] else "iteration cap",
    )
    try:  # tomotopy's own per-document inference on the observed halves
        beta = snaps[-1][2]
        beta = beta / beta.sum(1, keepdims=True)
        docs, keep = [], []
        for j, row in enumerate(data["obs"]):
            toks = [words[v] for v in np.repeat(np.arange(V), row)]
            if toks:
                docs.append(mdl.make_doc(toks))
                keep.append(j)
        res = mdl.infer(docs, iterations=100, workers=1)
        dists = res[0] if isinstance(res, tuple) else res
        theta = np.full((data["obs"].shape[0], K), 1.0 / K)
        for j, doc in zip(keep, dists, strict=True):
            theta[j] = np.asarray(doc.get_topic_dist() if hasattr(doc, "get_topic_dist") else doc)
        out["nll_own_infer"] = nll_of(theta, beta, data["scr"])
    except Exception as e:  # noqa: BLE001
        out["nll_own_infer_error"] = repr(e)
    return out


def add_paper_is(data, quick, corpus_part=""):
    """Write ``paper_is`` (:func:`score_paper_is` of the final means; ``nll_pred_doubled``:
    the predictive NLL with the default doubled proposal) into every cached plugin result
    with a ``*_final.npz`` (all K and tags; runs before that file was written have none)
    of this corpus / document subset (``corpus_part``: ``""`` for all of Reuters, else the
    file-name part such as ``"_lee"``)."""
    for npz in sorted(CACHE.glob(f"ctm{quick}_*_final.npz")):
        if not quick and npz.name.startswith("ctm_quick_"):
            continue
        if npz.name.startswith("ctm_synthetic"):
            continue
        if corpus_part and f"{corpus_part}_" not in npz.name:
            continue
        if not corpus_part and ("_lee_" in npz.name or "_docs" in npz.name):
            continue
        js = npz.with_name(npz.name[: -len("_final.npz")] + ".json")
        if not js.exists():
            continue
        r = json.loads(js.read_text())
        z = np.load(npz)
        mu = z["mu"]
        beta = softmax(z["logit_beta"], axis=1)
        s = score_paper_is(beta, mu, np.eye(mu.size), True, data)
        _, _, pred = infer_theta(beta, mu, np.eye(mu.size), True, data["obs"], scr=data["scr"])
        s["nll_pred_doubled"] = float(-pred.sum() / data["scr"].sum())
        r["paper_is"] = s
        common.save_json(r, js)
        common.log(f"  paper IS {js.stem}: {s}")


def worker(method, data, cfg):
    quiet()
    res = {"method": method, "run": common.run_record()}
    if method == "tomotopy":
        try:
            import tomotopy

            res["version"] = tomotopy.__version__
        except ImportError as e:
            res["error"] = f"tomotopy not installable/importable: {e}"
            return res
        res.update(run_tomotopy(data, cfg))
    else:
        try:
            res.update(run_pymc(method, data, cfg))
        except Exception as e:  # noqa: BLE001  (a refused model: its message in the row)
            res["error"] = f"{type(e).__name__}: {e}"
    res["vmhwm_mb_end"] = common.vmhwm_mb()
    return res


# ------------------------------------------------------------------------ report
def time_to_final(curve):
    if not curve:
        return None
    t = [c["seconds"] for c in curve]
    v = [c["nll"] for c in curve]
    tt, _ = common.time_to_within(t, v, v[-1], atol=TOL)
    return tt


def perplexity(nll):
    return None if nll is None else float(np.exp(nll))


def nll_at(curve, seconds):
    """The last snapshot NLL at or before ``seconds`` (None if none)."""
    pts = [c for c in curve or [] if c["seconds"] <= seconds]
    return pts[-1]["nll"] if pts else None


def first_within(curve, target, tol=0.0):
    """``(seconds, iteration)`` of the first snapshot with NLL <= ``target + tol`` (None, None
    if none). Snapshots are taken every few iterations, so this is an upper bound on the
    time the run first got there."""
    for c in curve or []:
        if c["nll"] <= target + tol:
            return c["seconds"], c["iteration"]
    return None, None


def advi_target(advi, plugin):
    """Issue 48's speed target: the plugin's time to ADVI's final held-out NLL against
    ADVI's own time to (within ``TOL`` of) it and against ADVI's whole run."""
    fin = advi["nll"]
    t_adv, it_adv = first_within(advi.get("curve"), fin, TOL)
    t_plug, it_plug = first_within(plugin.get("curve"), fin)
    return dict(
        advi_final_nll=fin,
        advi_seconds=advi.get("seconds"),
        advi_iterations=advi.get("iterations"),
        advi_cap=cap_of(advi),
        advi_first_within_tol=t_adv,
        advi_first_within_tol_iteration=it_adv,
        advi_stays_within_tol=time_to_final(advi.get("curve")),
        plugin_final_nll=plugin.get("nll"),
        plugin_first_reach=t_plug,
        plugin_first_reach_iteration=it_plug,
        ratio=t_adv / t_plug if t_adv and t_plug else None,
        ratio_cap=advi["seconds"] / t_plug if t_plug else None,
    )


def advi_target_table(groups):
    """Rows of :func:`advi_target` for every ``{label: {method: result}}`` group holding
    ADVI and plugin runs."""
    f = common.fmt
    rows = []
    for label, res in groups.items():
        advi = res.get("advi")
        if not advi or "error" in advi or not advi.get("curve"):
            continue
        for name in PLUGIN:
            r = res.get(name)
            if not r or "error" in r or not r.get("curve"):
                continue
            a = advi_target(advi, r)
            rows.append(
                [
                    label,
                    name,
                    f(a["advi_cap"], ".0f"),
                    a["advi_iterations"],
                    f(a["advi_final_nll"], ".3f"),
                    f(a["advi_first_within_tol"], ".0f"),
                    f(a["advi_stays_within_tol"], ".0f"),
                    f(a["plugin_first_reach"], ".0f")
                    + (
                        f" (it {a['plugin_first_reach_iteration']})"
                        if a["plugin_first_reach_iteration"]
                        else ""
                    ),
                    f(a["plugin_final_nll"], ".3f"),
                    f(a["ratio"], ".1f"),
                    f(a["ratio_cap"], ".1f"),
                ]
            )
    if not rows:
        return []
    return [
        "",
        "### ADVI's final NLL as the target (issue 48: the plugin at least 10x sooner)",
        "",
        f"*ADVI within {TOL}*: first snapshot within {TOL} nats of ADVI's final NLL (*stays*: "
        "from which on it stays within); *plugin reaches*: first snapshot of the plugin run at "
        "or below ADVI's final NLL; *ratio* = ADVI within / plugin reaches; *ratio to cap* = "
        "ADVI's whole run / plugin reaches. Times include compilation (snapshot scoring "
        "excluded) and are snapshot times, i.e. upper bounds for both methods.",
        "",
        common.markdown_table(
            [
                "run",
                "plugin method",
                "ADVI cap (s)",
                "ADVI iterations",
                "ADVI final NLL",
                f"ADVI within {TOL} (s)",
                "stays (s)",
                "plugin reaches (s)",
                "plugin final NLL",
                "ratio",
                "ratio to cap",
            ],
            rows,
        ),
    ]


def cap_of(r):
    """The run's time cap (older caches did not store it: the largest of the caps used,
    240, 300 or 540 s, that the run's clock passed)."""
    if r.get("max_seconds"):
        return r["max_seconds"]
    if r.get("stopped_by") == "time cap":
        caps = [c for c in (240.0, 300.0, 540.0) if c <= r["seconds"]]
        return caps[-1] if caps else None
    return None


def cpu_cell(r):
    """The worker's CPU seconds to the end of the fit (compilation included) per iteration."""
    c, n = r.get("cpu_seconds"), r.get("iterations")
    return common.fmt(c / n, ".2f") if c and n else "–"


def paper_cell(r):
    s = r.get("paper_is")
    return f"{s['nll']:.3f} / {s['nll_pred']:.3f}" if s else "–"


def fmt_load(x):
    return "/".join(f"{v:.1f}" for v in x) if x else "?"


def sweep_rows(cap):
    """K-sweep rows from the caches: (K, method, cached result)."""
    rows = []
    for k in SWEEP_K:
        for name in PLUGIN:
            path = CACHE / f"ctm{'' if k == 10 else f'_K{k}'}_{name}.json"
            if path.exists():
                rows.append((k, name, json.loads(path.read_text())))
    return rows


def tagged_rows():
    """Cached K = 10 Reuters re-runs with a ``--tag``: ``{"tag/method": result}`` (not the
    other corpora, document subsets, K or the synthetic benchmark's caches)."""
    out = {}
    for path in sorted(CACHE.glob("ctm_*_*.json")):
        tag, _, name = path.stem[len("ctm_") :].partition("_")
        other = tag in ("quick", "lee", "cat", "synthetic") or tag.startswith(("K", "docs"))
        if name in METHODS and not other:
            out[f"{tag}/{name}"] = json.loads(path.read_text())
    return out


def tagged_table(tagged):
    f = common.fmt
    rows = []
    for key, r in tagged.items():
        if "error" in r:
            rows.append([key, r["error"][:200]] + [""] * 10)
            continue
        rows.append(
            [
                key,
                f(r["nll"], ".3f"),
                f(perplexity(r["nll"]), ".0f"),
                paper_cell(r),
                f(cap_of(r), ".0f"),
                r["iterations"],
                f(r.get("seconds_per_iteration"), ".2f"),
                cpu_cell(r),
                f(r["vmhwm_mb"], ".0f"),
                fmt_load(r.get("load_before")),
                fmt_load(r.get("load_after")),
            ]
        )
    pts = []
    for key, r in tagged.items():
        if "curve" in r:
            c = ", ".join(
                f"it {x['iteration']} {x['seconds']:.0f} s: {x['nll']:.3f}" for x in r["curve"]
            )
            pts += ["", f"*{key}* NLL along the run: {c}."]
    return [
        "",
        "### Re-runs kept apart (`--tag`, K = 10)",
        "",
        common.markdown_table(
            [
                "tag/method",
                "held-out NLL",
                "perplexity",
                "IS q+0.1I: NLL / pred.",
                "cap (s)",
                "iterations",
                "s/it",
                "CPU s/it",
                "peak RSS (MB)",
                "load before",
                "load after",
            ],
            rows,
        ),
        *pts,
    ]


def sweep_table(cap):
    f = common.fmt
    rows = []
    for k, name, r in sweep_rows(cap):
        if "error" in r:
            rows.append([k, name, r["error"][:200]] + [""] * 11)
            continue
        at = nll_at(r.get("curve"), cap)
        rows.append(
            [
                k,
                name,
                f(r["nll"], ".3f"),
                f(perplexity(r["nll"]), ".0f"),
                f(at, ".3f"),
                f(perplexity(at), ".0f"),
                paper_cell(r),
                f(r["seconds"], ".0f"),
                r["iterations"],
                f(r.get("seconds_per_iteration"), ".2f"),
                cpu_cell(r),
                f(r["vmhwm_mb"], ".0f"),
                fmt_load(r.get("load_before") or (r.get("run") or {}).get("loadavg")),
                fmt_load(r.get("load_after")),
            ]
        )
    if not rows:
        return []
    return [
        "",
        f"### K sweep (structured vs mean field, {cap:.0f} s caps)",
        "",
        "Held-out per-word NLL of the final fit and at the last snapshot within "
        f"{cap:.0f} s (the K = 10 rows come from the longer main runs, so *NLL at "
        f"{cap:.0f} s* is their comparable column). Load: 1/5/15-min averages before and "
        "after the worker.",
        "",
        common.markdown_table(
            [
                "K",
                "method",
                "final NLL",
                "perplexity",
                f"NLL at {cap:.0f} s",
                f"perplexity at {cap:.0f} s",
                "IS q+0.1I: NLL / pred.",
                "seconds",
                "iterations",
                "s/it",
                "CPU s/it",
                "peak RSS (MB)",
                "load before",
                "load after",
            ],
            rows,
        ),
    ]


def first_iteration_seconds(r):
    """Seconds to the end of the first iteration (compilation included)."""
    c = (r.get("curve") or [{}])[0]
    return c.get("seconds") if c.get("iteration") == 1 else None


def corpus_words(d):
    """The data sentence of the report for ``results["data"]``."""
    corpus = d.get("corpus", "reuters")
    if corpus == "lee":
        src = (
            "the Lee background corpus shipped with gensim "
            "(`gensim.test.utils.datapath('lee_background.cor')`, "
            f"{d['docs_corpus']} news documents; `simple_preprocess`, gensim's `STOPWORDS` "
            "dropped, words in fewer than 2 documents dropped: "
            f"{d['words_all']} words, {d['tokens_all']} tokens)"
        )
    else:
        src = "`lda.datasets.load_reuters()`"
    sub = (
        f", a subset of {d['docs']} of its {d['docs_corpus']} documents (`--max-docs`, "
        "`default_rng(seed + 2)`)"
        if d.get("max_docs") and d["docs"] < d["docs_corpus"]
        else ""
    )
    return (
        f"Data: {src}{sub}, {d['n_train']} training / {d['n_test']} test "
        f"documents (`default_rng(0)` permutation), vocabulary {d['vocab']} words seen in "
        f"training ({d['train_tokens']} training tokens). Each test document's tokens are "
        f"shuffled; the first half ({d['observed_tokens']} tokens in all) is observed, the "
        f"second half ({d['scored_tokens']} tokens) is scored."
    )


def report(results):
    f = common.fmt
    rows = []
    full_reuters = results["data"].get("corpus", "reuters") == "reuters" and not results[
        "data"
    ].get("max_docs")
    for name in METHODS:
        r = results["methods"].get(name)
        if r is None:
            continue
        if "error" in r:
            rows.append([name, r["error"][:300]] + [""] * 15)
            continue
        rows.append(
            [
                name,
                f(r["nll"], ".3f"),
                f(perplexity(r["nll"]), ".0f"),
                f(r.get("nll_draws", r.get("nll_own_infer")), ".3f"),
                paper_cell(r),
                f(cap_of(r), ".0f"),
                f(r["seconds"], ".0f"),
                r["iterations"],
                f(first_iteration_seconds(r), ".0f"),
                f(r.get("seconds_per_iteration"), ".2f"),
                cpu_cell(r),
                f(time_to_final(r["curve"]), ".0f"),
                f(r["vmhwm_mb"], ".0f"),
                fmt_load(r.get("load_before") or (r.get("run") or {}).get("loadavg")),
                fmt_load(r.get("load_after")),
                ("yes" if r["nll"] <= TARGET_NLL else "no") if full_reuters else "–",
            ]
        )
    d = results["data"]
    run = results["run"]
    lines = [
        f"## Correlated topic model ({results['data'].get('corpus', 'reuters').capitalize()}"
        f"{', ' + str(results['data']['docs']) + ' documents' if not full_reuters and results['data'].get('max_docs') else ''}"
        f", K = {results['k']})",
        "",
        f"Measured {run['date']} on {run['machine'].get('cpu_model', '?')} "
        f"({run['machine'].get('cpu_count')} logical CPUs), commit {run['commit']}"
        f"{' (plugin sources modified)' if run.get('plugin_dirty') else ''}. "
        f"Reproduce: `{results['command']}`.",
        "",
        corpus_words(d),
        "",
        "Held-out score: per-word NLL of the scored halves, "
        "`-sum n_dv log (theta_d @ beta)_v / tokens`, with `theta_d` = E[theta | observed half] "
        "by two-round importance sampling (4,000 + 4,000 draws, same seeds for every method). "
        "VI methods: `beta = softmax(posterior mean of logit_beta)` and prior "
        "`N(mean of mu, I)`; column *alt* uses `beta` averaged over 200 posterior draws of "
        "`softmax(logit_beta)`. tomotopy: its topic-word distributions and fitted prior "
        "(mean, covariance); *alt* uses tomotopy's own `infer` on the observed halves. "
        "Time cap per method in column *cap* (the clock includes "
        "compilation; snapshot scoring is excluded). *to final*: time after which the "
        f"snapshot NLL stays within {TOL} of the method's final NLL. Perplexity = "
        "exp(held-out NLL). *IS q+0.1I*: the paper appendix's variant on the final means "
        "(second-round proposal = the Gaussian fitted to the first round plus 0.1 I instead "
        "of doubled): plug-in NLL and the predictive -log p(scored half | observed half) "
        "per token; – where the run stored no final means. *s/it*: median wall seconds per "
        "iteration; *CPU s/it*: the worker's CPU seconds up to the end of the fit "
        "(compilation included) over the iterations, less sensitive to the load (– for runs "
        "before it was recorded); *1st it*: seconds to the end of the first iteration "
        "(compilation included). *hmcssvi_jensen_counts*: the simple structured bound over "
        "the nonzero counts (a `pm.Potential`, the same objective as *hmcssvi_jensen*). "
        "*hmcssvi_token* / *hmcssvi_jensen*: the token-level "
        "spelling (one `z ~ Categorical(theta_d)` per training token, summed out by the "
        'plugin) with the optimal bound (the default) / `bound="jensen"` (the paper\'s '
        "simple structured bound). Load: 1/5/15-min load "
        "averages just before and just after the method's worker (runs before the load was "
        "recorded this way show the 1-min load at the start).",
        "",
        common.markdown_table(
            [
                "method",
                "held-out NLL",
                "perplexity",
                "alt NLL",
                "IS q+0.1I: NLL / pred.",
                "cap (s)",
                "seconds",
                "iterations",
                "1st it (s)",
                "s/it",
                "CPU s/it",
                "to final (s)",
                "peak RSS (MB)",
                "load before",
                "load after",
                f"<= {TARGET_NLL}",
            ],
            rows,
        ),
        "",
        (
            f"Target: held-out per-word NLL {TARGET_NLL} or less. Outside runs measured "
            f"PyMC ADVI {OUTSIDE['PyMC ADVI']} and tomotopy {OUTSIDE['tomotopy']} "
            "(their protocol details may differ from this one). "
            if full_reuters
            else ""
        )
        + f"Reference without topics (training unigram, add-0.5): {results['unigram_nll']:.3f}.",
    ]
    prov = []
    for name in METHODS:
        r = results["methods"].get(name)
        if r and r.get("run"):
            rr = r["run"]
            load = rr.get("loadavg") or [None]
            prov.append(
                f"{name}: {rr.get('date')}, commit {rr.get('commit')}"
                f"{' (plugin sources modified)' if rr.get('plugin_dirty') else ''}, "
                f"load {load[0]} at start"
            )
    if prov:
        lines += ["", "Runs (each method in a worker process of its own): " + "; ".join(prov) + "."]
    for name in METHODS:
        r = results["methods"].get(name)
        if r and "curve" in r:
            pts = ", ".join(f"{c['seconds']:.0f} s: {c['nll']:.3f}" for c in r["curve"])
            lines += ["", f"*{name}* NLL along the run ({r['stopped_by']}): {pts}."]
    if results["k"] == 10 and results.get("sweep_cap"):
        lines += sweep_table(results["sweep_cap"])
    if results.get("tagged"):
        lines += tagged_table(results["tagged"])
        groups = {}
        for key, r in results["tagged"].items():
            tag, _, name = key.partition("/")
            groups.setdefault(tag, {})[name] = r
        lines += advi_target_table(groups)
    elif results.get("tag"):  # a tagged run's own report
        lines += advi_target_table({results["tag"]: results["methods"]})
    if results.get("notes"):
        lines += ["", results["notes"]]
    return "\n".join(lines) + "\n"


def plot_tag(tag, path=None):
    """Held-out NLL against seconds for the cached ``--tag`` runs (K = 10 Reuters), with
    ADVI's final NLL as a line: ``docs/_static/ctm_<tag>_nll_vs_time.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path or common.REPO_ROOT / "docs" / "_static" / f"ctm_{tag}_nll_vs_time.png")
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    advi_final = None
    for name in METHODS:
        js = CACHE / f"ctm_{tag}_{name}.json"
        if not js.exists():
            continue
        r = json.loads(js.read_text())
        if not r.get("curve"):
            continue
        t = [c["seconds"] for c in r["curve"]]
        v = [c["nll"] for c in r["curve"]]
        ax.plot(t, v, marker=".", label=f"{name} ({r['iterations']} it.)")
        if name == "advi":
            advi_final = r["nll"]
    if advi_final is not None:
        ax.axhline(advi_final, color="grey", ls="--", lw=0.8, label=f"ADVI final {advi_final:.3f}")
    ax.set_xscale("log")
    ax.set_xlabel("seconds (compilation included)")
    ax.set_ylabel("held-out per-word NLL")
    ax.set_title(f"CTM, Reuters, K = 10 (--tag {tag})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    common.log(f"wrote {path}")
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--report", action="store_true", help="only merge the cached methods")
    p.add_argument("--max-seconds", type=float, default=None)
    p.add_argument("--K", type=int, default=10, help="number of topics")
    p.add_argument(
        "--corpus",
        choices=("reuters", "lee"),
        default="reuters",
        help="lee: gensim's Lee background corpus (shipped in its wheel); file names get _lee",
    )
    p.add_argument(
        "--max-docs",
        type=int,
        default=None,
        help="keep this many documents (random, default_rng(seed + 2)) before the split; "
        "file names get _docs<N>",
    )
    p.add_argument(
        "--tag",
        default="",
        help="cache names ctm_<tag>_<method>.json, for re-runs kept apart from the main "
        "rows (K = 10 only; the main report lists them in a table of their own)",
    )
    p.add_argument("--sweep-cap", type=float, default=240.0, help="K-sweep table's time cap")
    p.add_argument(
        "--paper-is",
        action="store_true",
        help="score the stored final means of every cached plugin run (all K) with the "
        "paper's importance-sampling variant (proposal q + 0.1 I) into its cache file",
    )
    p.add_argument(
        "--token-categorical",
        action="store_true",
        help="hmcssvi_token / hmcssvi_jensen with the tests' Categorical(beta[z]) spelling "
        "(slow: a tokens x V matrix per topic; file names get _cat)",
    )
    p.add_argument(
        "--every", type=int, default=None, help="plugin snapshots every this many iterations"
    )
    p.add_argument(
        "--min-gap",
        type=float,
        default=None,
        help="seconds between snapshots at least (default max_seconds / 50)",
    )
    p.add_argument("--hmcssvi-n", type=int, default=None)
    p.add_argument("--sdsvi-n", type=int, default=None)
    p.add_argument("--advi-n", type=int, default=None)
    p.add_argument("--notes", default="")
    p.add_argument(
        "--plot-tag",
        default=None,
        help="only plot the cached runs of this --tag (NLL against seconds) into docs/_static",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--task", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cfg", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    global K
    K = args.K
    common.set_run_mode("quick" if args.quick else "full")
    if args.plot_tag:
        plot_tag(args.plot_tag)
        return
    if args.worker:
        cfg = json.loads(args.cfg)
        K = cfg["K"]
        data = load_data(cfg["seed"], cfg.get("corpus", "reuters"), cfg.get("max_docs"))
        common.save_json(worker(args.task, data, cfg), args.out)
        return
    cfg = dict(
        seed=args.seed,
        K=K,
        corpus=args.corpus,
        max_docs=args.max_docs,
        max_seconds=args.max_seconds or (30.0 if args.quick else 300.0),
        hmcssvi_n=args.hmcssvi_n or (3 if args.quick else 1000),
        hmcssvi_every=args.every or (1 if args.quick else 4),
        min_gap=args.min_gap,
        token_spelling="token_categorical" if args.token_categorical else "token",
        sdsvi_n=args.sdsvi_n or (3 if args.quick else 100000),
        advi_n=args.advi_n or (300 if args.quick else 20000),
        advi_every=100 if args.quick else 250,
        tomotopy_chunk=10 if args.quick else 100,
        tomotopy_max_iter=20 if args.quick else 3000,
    )
    suffix = ("_quick" if args.quick else "") + ("" if K == 10 else f"_K{K}")
    corpus_part = ("" if args.corpus == "reuters" else f"_{args.corpus}") + (
        f"_docs{args.max_docs}" if args.max_docs else ""
    )
    suffix += corpus_part + ("_cat" if args.token_categorical else "")
    full_reuters = not corpus_part
    if args.tag:
        suffix += f"_{args.tag}"
    cfg["suffix"] = suffix
    CACHE.mkdir(parents=True, exist_ok=True)
    todo = [] if args.report else [m for m in args.methods.split(",") if m]
    for method in todo:
        common.log(f"worker {method} K={K}")
        load_before = [round(x, 2) for x in os.getloadavg()]
        res = common.run_worker(
            __file__,
            ["--task", method, "--cfg", json.dumps(cfg)],
            {"method": method, "run": common.run_record()},
            timeout=cfg["max_seconds"] + 420,
        )
        res["load_before"] = load_before
        res["load_after"] = [round(x, 2) for x in os.getloadavg()]
        res["k"] = K
        res["max_seconds"] = cfg["max_seconds"]
        common.log(
            f"  -> NLL {res.get('nll')} error {res.get('error')} "
            f"load {load_before} -> {res['load_after']}"
        )
        common.save_json(res, CACHE / f"ctm{suffix}_{method}.json")
    data = load_data(cfg["seed"], args.corpus, args.max_docs)
    if args.paper_is:
        add_paper_is(data, "_quick" if args.quick else "", corpus_part)
    methods = {}
    for method in METHODS:
        path = CACHE / f"ctm{suffix}_{method}.json"
        if path.exists():
            methods[method] = json.loads(path.read_text())
    results = {
        "run": common.run_record(),
        "command": "python benchmarks/ctm.py"
        + (" --quick" if args.quick else "")
        + ("" if K == 10 else f" --K {K}")
        + ("" if args.corpus == "reuters" else f" --corpus {args.corpus}")
        + (f" --max-docs {args.max_docs}" if args.max_docs else "")
        + (f" --tag {args.tag}" if args.tag else ""),
        "config": cfg,
        "k": K,
        "data": data["info"],
        "scoring": dict(is_draws=IS_DRAWS, seed=SCORE_SEED, rounds=2, tol_to_final=TOL),
        "unigram_nll": unigram_nll(data),
        "target_nll": TARGET_NLL,
        "outside": OUTSIDE,
        "versions": common.library_versions(
            ("pymc", "pytensor", "numpy", "pymc_mcssvi", "tomotopy")
        ),
        "methods": methods,
        "notes": args.notes,
        "tag": args.tag,
        "sweep_cap": None if args.quick or not full_reuters else args.sweep_cap,
        "tagged": tagged_rows()
        if K == 10 and not args.quick and not args.tag and full_reuters
        else {},
    }
    for r in methods.values():
        if "curve" in r:
            r["time_to_final"] = time_to_final(r["curve"])
    md = report(results)
    out_dir = CACHE if args.tag else RESULTS  # tagged re-runs: listed in the main report
    common.save_json(results, out_dir / f"ctm{suffix}.json")
    if results["sweep_cap"] and K == 10:
        results["k_sweep"] = [
            dict(
                k=k,
                method=name,
                nll=r.get("nll"),
                perplexity=perplexity(r.get("nll")),
                nll_at_cap=nll_at(r.get("curve"), args.sweep_cap),
                iterations=r.get("iterations"),
                seconds=r.get("seconds"),
                seconds_per_iteration=r.get("seconds_per_iteration"),
                vmhwm_mb=r.get("vmhwm_mb"),
                load_before=r.get("load_before"),
                load_after=r.get("load_after"),
                cpu_seconds=r.get("cpu_seconds"),
                paper_is=r.get("paper_is"),
                error=r.get("error"),
            )
            for k, name, r in sweep_rows(args.sweep_cap)
        ]
    out_md = (out_dir if not args.quick else CACHE) / f"ctm{suffix}.md"
    out_md.write_text(md)
    print(md)


if __name__ == "__main__":
    main()
