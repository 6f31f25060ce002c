"""Bayesian logistic regression on the breast-cancer data: H-MC-SSVI vs FullRankADVI vs NUTS.

Run with ``make demo`` (or ``python -m pymc_mcssvi.demo``). The data ship with
scikit-learn (569 tumours, 30 features); features are standardized on the
training split and 20% of the rows are held out.

Printed for each method: wall time (compilation included), iterations, the
largest difference of posterior means from NUTS in units of the NUTS standard
deviation, the ratio of posterior standard deviations to NUTS, and the held-out
log predictive density.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import pymc as pm
from scipy.special import expit, logsumexp

import pymc_mcssvi  # noqa: F401  (registers the fit methods)


def load(seed: int = 0):
    """Standardized breast-cancer features with an 80/20 split."""
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    X, y = data.data, data.target
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(y))
    n_train = int(0.8 * len(y))
    tr, te = idx[:n_train], idx[n_train:]
    mu, sd = X[tr].mean(0), X[tr].std(0)
    Xs = (X - mu) / sd
    return Xs[tr], y[tr], Xs[te], y[te], list(data.feature_names)


def build_model(X, y, names):
    coords = {"feature": names}
    with pm.Model(coords=coords) as model:
        intercept = pm.Normal("intercept", 0.0, 2.5)
        beta = pm.Normal("beta", 0.0, 1.0, dims="feature")
        pm.Bernoulli("y", logit_p=intercept + pm.math.dot(X, beta), observed=y)
    return model


def heldout_lpd(idata, X, y) -> float:
    """Log pointwise predictive density of the held-out rows."""
    post = idata.posterior
    a = post["intercept"].values.reshape(-1)
    b = post["beta"].values.reshape(-1, X.shape[1])
    p = expit(a[:, None] + b @ X.T)
    lik = np.where(y[None, :] == 1, p, 1 - p)
    return float(np.sum(logsumexp(np.log(np.clip(lik, 1e-300, 1)), axis=0) - np.log(len(a))))


def draws(idata):
    post = idata.posterior
    a = post["intercept"].values.reshape(-1, 1)
    b = post["beta"].values.reshape(a.shape[0], -1)
    return np.hstack([a, b])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--advi-iters", type=int, default=20_000)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    Xtr, ytr, Xte, yte, names = load(args.seed)
    model = build_model(Xtr, ytr, names)
    print(
        f"Breast cancer: {len(ytr)} training rows, {len(yte)} held out, {Xtr.shape[1]} features + intercept\n"
    )

    results = {}
    with model:
        t = time.perf_counter()
        idata_nuts = pm.sample(1000, tune=1000, chains=2, random_seed=args.seed, progressbar=False)
        results["NUTS"] = (time.perf_counter() - t, "2 x 2000", idata_nuts)

        t = time.perf_counter()
        approx = pm.fit(method="hmcssvi", random_seed=args.seed, progressbar=False)
        idata = approx.sample(2000, random_seed=args.seed)
        results["H-MC-SSVI"] = (time.perf_counter() - t, f"{approx.n_iter}", idata)

        t = time.perf_counter()
        approx_fr = pm.fit(
            n=args.advi_iters, method="fullrank_advi", random_seed=args.seed, progressbar=False
        )
        idata_fr = approx_fr.sample(2000, random_seed=args.seed)
        results["FullRankADVI"] = (time.perf_counter() - t, f"{args.advi_iters}", idata_fr)

    ref = draws(idata_nuts)
    ref_mean, ref_sd = ref.mean(0), ref.std(0)
    header = f"{'method':<14}{'wall [s]':>10}{'iterations':>12}{'max |dmean|/sd':>16}{'sd ratio (min-max)':>21}{'held-out lpd':>14}"
    print(header)
    print("-" * len(header))
    for name, (secs, iters, idata) in results.items():
        d = draws(idata)
        z = np.abs(d.mean(0) - ref_mean) / ref_sd
        ratio = d.std(0) / ref_sd
        print(
            f"{name:<14}{secs:>10.1f}{iters:>12}{z.max():>16.3f}"
            f"{f'{ratio.min():.2f}-{ratio.max():.2f}':>21}{heldout_lpd(idata, Xte, yte):>14.2f}"
        )
    print(
        "\nWall times include compilation (PyTensor/numba caches on disk; a second run is faster)."
    )


if __name__ == "__main__":
    main()
