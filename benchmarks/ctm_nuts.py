"""A small correlated topic model with learned topics against NUTS (issue 48).

Issue 48's target: on a CTM with 50 documents, V = 50 words and K = 3 learned topics,
the plugin's topic-word means are within 0.2 NUTS sd of NUTS's and the document
logits' means within 0.15.

Data: ``ctm_synthetic.make_data(D=50, V=50, K=3, doc_len=--doc-len)`` (topics
``Dirichlet(0.05)``, correlated logits), all documents for training. Model (the
collapsed counts, as a user writes it)::

    mu ~ Normal(0, 1), shape K-1
    eta ~ Normal(mu, 1), shape (D, K-1)
    logit_beta ~ Normal(0, 1), shape (K, V)
    w ~ Multinomial(n_d, softmax([eta, 0]) @ softmax(logit_beta))

NUTS: ``pm.sample`` (``--draws`` after as many tuning steps, ``--chains`` chains,
``target_accept=0.9``). The posterior has K! label-switched modes (and, on some
corpora, modes that split the words among the topics differently); each chain stays
in one. Each chain is a reference of its own mode; the chains are compared with each
other (aligned to chain 0) to say whether they found the same mode.

Plugin: ``pm.fit(method="hmcssvi")`` with its defaults and stopping rule, one fit per
``--seeds`` value (``random_seed``), and one with ``n_starts=4``; 2,000 draws of q.
Each fit's topics are aligned to each chain (the permutation of the K topics closest
in the topic-word probabilities ``beta = softmax(logit_beta)``; the document logits are
re-expressed against the aligned reference topic), and compared with the chain it is
closest to (the smallest largest topic-word z). Reported per fit: the -ELBO, that
chain, whether the fit is in its mode (the largest topic-word z below 1), and, in units
of that chain's posterior sd, the largest and the 95th-percentile absolute mean error of
``beta`` and of ``eta``, and the ratio of sds.

Run by hand::

    python benchmarks/ctm_nuts.py            # ~10 minutes on 2 cores
    python benchmarks/ctm_nuts.py --quick    # a smoke run

Writes ``benchmarks/results/ctm_nuts.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import itertools
import time
import warnings

import common
import ctm
import ctm_synthetic
import numpy as np
from scipy.special import softmax

RESULTS = common.REPO_ROOT / "benchmarks" / "results"
K = 3


def draws_of(idata):
    """(draws, K, V) topic-word probabilities and (draws, D, K) logits [eta, 0], per chain."""
    post = idata["posterior"] if not hasattr(idata, "posterior") else idata.posterior
    lb = np.asarray(post["logit_beta"].values)  # (chains, draws, K, V)
    eta = np.asarray(post["eta"].values)  # (chains, draws, D, K-1)
    beta = softmax(lb, axis=-1)
    logits = np.concatenate([eta, np.zeros(eta.shape[:-1] + (1,))], axis=-1)
    return beta, logits


def align(beta, logits, ref_beta_mean):
    """The topics permuted to match ``ref_beta_mean`` best; ``eta`` against the new last topic."""
    best = None
    for perm in itertools.permutations(range(K)):
        err = np.sum((beta[..., perm, :].mean(0) - ref_beta_mean) ** 2)
        if best is None or err < best[0]:
            best = (err, perm)
    perm = list(best[1])
    b = beta[..., perm, :]
    lg = logits[..., perm]
    eta = lg[..., :-1] - lg[..., -1:]
    return b, eta, perm


def errors(b, eta, ref_b, ref_eta):
    """Mean errors in reference sds (max, 95th percentile) and sd ratios."""
    out = {}
    for name, x, r in (("beta", b, ref_b), ("eta", eta, ref_eta)):
        sd = r.std(0)
        z = np.abs(x.mean(0) - r.mean(0)) / sd
        ratio = x.std(0) / sd
        out[name] = dict(
            z_max=float(z.max()),
            z_p95=float(np.quantile(z, 0.95)),
            sd_ratio_min=float(ratio.min()),
            sd_ratio_median=float(np.median(ratio)),
            sd_ratio_max=float(ratio.max()),
        )
    return out


def run(args):
    import pymc as pm

    import pymc_mcssvi  # noqa: F401

    data = ctm_synthetic.make_data(
        50, 50, K, doc_len=args.doc_len, seed=args.data_seed, test_frac=0.0, factors=K - 1
    )
    C = data["C"]
    model = ctm.build_model(C, topics=K)
    res = dict(run=common.run_record(), data=data["info"], fits=[])
    t0 = time.perf_counter()
    with model, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        idata = pm.sample(
            args.draws,
            tune=args.draws,
            chains=args.chains,
            cores=1,
            target_accept=0.9,
            random_seed=1,
            progressbar=False,
            compute_convergence_checks=False,
        )
    nuts_seconds = time.perf_counter() - t0
    beta_c, logits_c = draws_of(idata)
    refs = [align(beta_c[c], logits_c[c], beta_c[c].mean(0))[:2] for c in range(args.chains)]
    chains = []
    for c in range(1, args.chains):
        b, e, perm = align(beta_c[c], logits_c[c], refs[0][0].mean(0))
        err = errors(b, e, *refs[0])
        chains.append(dict(chain=c, perm=perm, agrees=err["beta"]["z_max"] < 1.0, **err))
    res["nuts"] = dict(
        seconds=nuts_seconds, draws=args.draws, chains=args.chains, chains_vs_chain0=chains
    )
    common.log(f"NUTS {nuts_seconds:.0f} s; chains vs chain 0: {chains}")
    configs = [dict(seed=s, n_starts=1) for s in args.seeds] + [
        dict(seed=args.seeds[0], n_starts=4)
    ]
    for cfg in configs:
        t0 = time.perf_counter()
        kw = {} if cfg["n_starts"] == 1 else dict(n_starts=cfg["n_starts"])
        with model, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            approx = pm.fit(method="hmcssvi", random_seed=cfg["seed"], progressbar=False, **kw)
        seconds = time.perf_counter() - t0
        post = approx.sample(2000, random_seed=cfg["seed"] + 100)
        beta, logits = draws_of(post)
        beta = beta.reshape((-1,) + beta.shape[2:])
        logits = logits.reshape((-1,) + logits.shape[2:])
        best = None
        for c, (ref_b, ref_eta) in enumerate(refs):
            b, e, perm = align(beta, logits, ref_b.mean(0))
            err = errors(b, e, ref_b, ref_eta)
            if best is None or err["beta"]["z_max"] < best[0]["beta"]["z_max"]:
                best = (err, perm, c)
        err, perm, chain = best
        row = dict(
            **cfg,
            seconds=seconds,
            iterations=len(approx.hist),
            neg_elbo=float(approx.hist[-1]),
            chain=chain,
            in_mode=err["beta"]["z_max"] < 1.0,
            perm=perm,
            warnings=sorted({str(w.message)[:120] for w in caught}),
            **err,
        )
        res["fits"].append(row)
        common.log(
            f"seed {cfg['seed']} starts {cfg['n_starts']}: {seconds:.0f} s, -ELBO {row['neg_elbo']:.2f}, "
            f"beta z max {err['beta']['z_max']:.2f} p95 {err['beta']['z_p95']:.2f}, "
            f"eta z max {err['eta']['z_max']:.2f} p95 {err['eta']['z_p95']:.2f}"
        )
    return res


def report(res):
    f = common.fmt
    rows = []
    for r in res["fits"]:
        rows.append(
            [
                r["seed"],
                r["n_starts"],
                f(r["seconds"], ".0f"),
                r["iterations"],
                f(r["neg_elbo"], ".2f"),
                r["chain"],
                "yes" if r["in_mode"] else "no",
                f(r["beta"]["z_max"], ".2f"),
                f(r["beta"]["z_p95"], ".2f"),
                f"{r['beta']['sd_ratio_min']:.2f}-{r['beta']['sd_ratio_max']:.2f}",
                f(r["eta"]["z_max"], ".2f"),
                f(r["eta"]["z_p95"], ".2f"),
                f"{r['eta']['sd_ratio_min']:.2f}-{r['eta']['sd_ratio_max']:.2f}",
            ]
        )
    table = common.markdown_table(
        [
            "seed",
            "starts",
            "s",
            "iterations",
            "-ELBO",
            "closest NUTS chain",
            "in its mode",
            "beta z max",
            "beta z p95",
            "beta sd ratio",
            "eta z max",
            "eta z p95",
            "eta sd ratio",
        ],
        rows,
    )
    run = res["run"]
    n = res["nuts"]
    chains = "; ".join(
        f"chain {c['chain']}: beta z max {c['beta']['z_max']:.2f} ({'same mode' if c['agrees'] else 'another mode'})"
        for c in n["chains_vs_chain0"]
    )
    return "\n".join(
        [
            f"Run {run.get('date')} (commit {run.get('commit')}), load {run.get('loadavg')}.",
            f"Data: {res['data']}.",
            f"NUTS: {n['chains']} chains x {n['draws']} draws, {n['seconds']:.0f} s; {chains}.",
            "",
            table,
        ]
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--draws", type=int, default=1000)
    p.add_argument("--chains", type=int, default=2)
    p.add_argument("--doc-len", type=int, default=100)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--seeds", default="0,1,2,3,4,5")
    args = p.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",")]
    if args.quick:
        args.draws, args.seeds = 100, [0]
    res = run(args)
    name = "ctm_nuts_quick" if args.quick else "ctm_nuts"
    common.save_json(res, RESULTS / f"{name}.json")
    md = report(res)
    (RESULTS / f"{name}.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
