"""Step-size schedules on the GLM workload: -ELBO gap to the optimum bound after 10, 30, 60 iterations.

The workload is `glm_logistic.py`'s (N = 50,000, D = 100 Toeplitz 0.8, seed 0);
the optimum 6356.9706 is that script's (best final -ELBO of long MC-SSVI /
H-MC-SSVI runs). Run by hand: ``python benchmarks/schedules.py`` (about two
minutes on 2 cores); prints a markdown table.
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

OPTIMUM = 6356.9706
RUNS = [
    ("MC-SSVI, adaptive (default)", "MCSSVI", {}),
    ("MC-SSVI, 1/t (paper)", "MCSSVI", {"schedule": "inverse"}),
    (
        "H-MC-SSVI, 1/t + Adagrad 1.0 (paper)",
        "HMCSSVI",
        {"schedule": "inverse", "mean_optimizer": ("adagrad", 1.0)},
    ),
]


def main():
    import pymc as pm

    import pymc_mcssvi

    data = common.logistic_regression_data(50_000, 100, 10_000, seed=0)
    with pm.Model() as model:
        w = pm.Normal("w", 0, 1, shape=100)
        pm.Bernoulli("y", logit_p=data.X @ w, observed=data.y)
    print("| method | gap after 10 | after 30 | after 60 (nats) |")
    print("|---|---|---|---|")
    for label, cls, kw in RUNS:
        with model:
            hist = np.asarray(
                getattr(pymc_mcssvi, cls)(random_seed=0, **kw)
                .fit(n=60, tol=None, progressbar=False)
                .hist
            )
        gaps = [hist[k] - OPTIMUM for k in (9, 29, 59)]
        print(f"| {label} | " + " | ".join(f"{g:,.1f}" for g in gaps) + " |", flush=True)


if __name__ == "__main__":
    main()
