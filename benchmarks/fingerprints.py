"""Fingerprints of small fits, to compare two checkouts of the plugin (behaviour preservation).

Run by hand while restructuring the core: twelve small models, one per path of the
engine (affine predictor with each algorithm, mean-field and point hyperparameters,
centered and non-centered effects, matrix factorization in full batch and with row
subsampling, a Rayleigh global, a marginalized local, the Monte Carlo + autodiff path,
two predictors, ``pm.Minibatch``, an LKJ covariance). Each line gives the iterations,
the last -ELBO, the first entries of ``approx.mean`` / ``approx.std`` and the sample
means of 200 seeded draws
two checkouts that behave the same print the same lines.

Usage::

    python benchmarks/fingerprints.py <checkout> [case ...] > fingerprints.txt
    git worktree add /tmp/before <commit>  # then compare with
    python benchmarks/fingerprints.py /tmp/before | diff - fingerprints.txt
"""

import sys
import time
import warnings
import zlib

import numpy as np
import pymc as pm

warnings.filterwarnings("ignore")

rng = np.random.default_rng(0)


def glm():
    X = rng.normal(size=(300, 4))
    y = (X @ [1, -1, 0.5, 0] + rng.logistic(size=300) > 0).astype(int)
    with pm.Model() as m:
        b0 = pm.Normal("b0", 0, 2)
        w = pm.Normal("w", 0, 1, shape=4)
        pm.Bernoulli("y", logit_p=b0 + X @ w, observed=y)
    return m, {}


def glmm_nc():
    g = np.repeat(np.arange(12), 15)
    x = rng.normal(size=g.size)
    y = rng.poisson(np.exp(0.3 + 0.5 * x + rng.normal(0, 0.6, 12)[g]))
    with pm.Model() as m:
        b = pm.Normal("b", 0, 2, shape=2)
        s = pm.HalfNormal("s", 1)
        z = pm.Normal("z", 0, 1, shape=12)
        pm.Poisson("y", pm.math.exp(b[0] + b[1] * x + s * z[g]), observed=y)
    return m, {}


def glmm_point():
    m, _ = glmm_nc()
    return m, {"hyper": "point"}


def glmm_centered():
    g = np.repeat(np.arange(10), 8)
    y = rng.normal(rng.normal(0, 1, 10)[g], 0.5)
    with pm.Model() as m:
        mu = pm.Normal("mu", 0, 2)
        s = pm.HalfNormal("s", 1)
        a = pm.Normal("a", mu, s, shape=10)
        sig = pm.HalfNormal("sig", 1)
        pm.Normal("y", a[g], sig, observed=y)
    return m, {}


def pmf_bern():
    from pymc_mcssvi.models import pmf

    r = rng.integers(0, 40, 800)
    c = rng.integers(0, 30, 800)
    y = rng.integers(0, 2, 800)
    return pmf(r, c, y, 40, 30, 3, likelihood="bernoulli"), {}


def pmf_ord_sub():
    from pymc_mcssvi.models import pmf

    r = rng.integers(0, 40, 800)
    c = rng.integers(0, 30, 800)
    y = rng.integers(0, 4, 800)
    return pmf(r, c, y, 40, 30, 4, likelihood="ordinal", cutpoints=[-1, 0, 1]), {"row_subsample": 5}


def gme():
    from pymc_mcssvi.models import gme as gme_model

    X = rng.normal(size=(200, 3))
    y = rng.poisson(np.log1p(np.exp(X @ [0.5, -0.3, 0.2] + rng.normal(0, 0.5, 200))))
    return gme_model(X, y), {}


def local_latent():
    x = rng.normal(size=120)
    y = rng.poisson(np.exp(0.5 + 0.4 * x + rng.normal(0, 0.5, 120)))
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1, shape=2)
        f = pm.Normal("f", b[0] + b[1] * x, 0.5, shape=120)
        pm.Poisson("y", pm.math.exp(f), observed=y)
    return m, {}


def general():
    t = np.linspace(0, 3, 60)
    y = 2.0 * np.exp(-0.7 * t) + rng.normal(0, 0.1, 60)
    with pm.Model() as m:
        a = pm.Normal("a", 1, 1)
        b = pm.Normal("b", 0.5, 0.5)
        pm.Normal("y", a * pm.math.exp(-b * t), 0.1, observed=y)
    return m, {}


def pair():
    x = rng.normal(size=150)
    y = rng.normal(0.5 * x, np.exp(0.3 * x))
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1, shape=2)
        c = pm.Normal("c", 0, 1, shape=2)
        pm.Normal("y", b[0] + b[1] * x, pm.math.exp(c[0] + c[1] * x), observed=y)
    return m, {}


def minibatch():
    X = rng.normal(size=(2000, 3))
    y = (X @ [1, -1, 0.5] + rng.logistic(size=2000) > 0).astype(int)
    Xm, ym = pm.Minibatch(X, y.astype("float64"), batch_size=200)
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=3)
        pm.Bernoulli("y", logit_p=Xm @ w, observed=ym, total_size=2000)
    return m, {"random_seed": 1}


def lkj():
    g = np.repeat(np.arange(8), 10)
    x = rng.normal(size=80)
    y = rng.normal(rng.normal(0, 1, 8)[g] + 0.5 * x, 0.5)
    with pm.Model() as m:
        chol, _, _ = pm.LKJCholeskyCov(
            "chol", n=2, eta=2, sd_dist=pm.HalfNormal.dist(1), compute_corr=True
        )
        z = pm.Normal("z", 0, 1, shape=(8, 2))
        ab = pm.Deterministic("ab", z @ chol.T)
        sig = pm.HalfNormal("sig", 1)
        pm.Normal("y", ab[g, 0] + ab[g, 1] * x, sig, observed=y)
    return m, {}


CASES = dict(
    glm=glm,
    glmm_nc=glmm_nc,
    glmm_point=glmm_point,
    glmm_centered=glmm_centered,
    pmf_bern=pmf_bern,
    pmf_ord_sub=pmf_ord_sub,
    gme=gme,
    local_latent=local_latent,
    general=general,
    pair=pair,
    minibatch=minibatch,
    lkj=lkj,
)
ALGOS = {"glm": ["mcssvi", "hmcssvi", "sdsvi"]}


def main():
    sys.path.insert(0, sys.argv[1])  # the checkout whose pymc_mcssvi is imported
    import pymc_mcssvi  # noqa: F401  (registers the methods)

    global rng
    for name in sys.argv[2:] or list(CASES):
        for alg in ALGOS.get(name, ["hmcssvi"]):
            rng = np.random.default_rng(zlib.crc32(name.encode()))  # each case its own data
            m, kw = CASES[name]()
            t = time.time()
            n = kw.pop("n", None)
            with m:
                n = n if n else (300 if name in ("minibatch", "pmf_ord_sub") else None)
                approx = pm.fit(
                    n=n,
                    method=alg,
                    progressbar=False,
                    # a given n: exactly n iterations (n is otherwise a cap)
                    **({"tol": None} if n else {}),
                    **kw,
                )
                dt = time.time() - t
                mean, std = approx.mean.eval(), approx.std.eval()
                s = approx.sample(200, random_seed=3)
            post = s.posterior
            sm = np.concatenate(
                [np.ravel(post[v].values.mean(axis=(0, 1))) for v in sorted(post.data_vars)]
            )
            print(
                f"{name:14s} {alg:8s} it={approx.n_iter:4d} elbo={approx.hist[-1]:.10g} "
                f"mean={np.round(mean[:3], 6).tolist()} std={np.round(std[:3], 6).tolist()} "
                f"smean={np.round(sm[:3], 5).tolist()} t={dt:.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
