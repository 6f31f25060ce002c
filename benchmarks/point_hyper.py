"""Point hyperparameters: the coupled Newton step against the separate (EM-like) steps.

Run by hand: ``python benchmarks/point_hyper.py [--checkout PATH] [--label TEXT]``.
Each case fits one model with ``pm.fit(method="hmcssvi", hyper="point")`` in its own
subprocess and records the iterations to the stopping rule, the wall time (recognition
and compilation included), the final -ELBO and the hyperparameters' estimates.
``--checkout`` imports ``pymc_mcssvi`` from another checkout (a ``git worktree`` of
the commit before the change) to measure before and after on the same machine. The
runs are appended to ``benchmarks/results/point_hyper.json``.

Cases
-----
``sparse_gp_vfe``
    ``models.sparse_gp(bound="titsias")``, n = 300, M = 12, learned lengthscale,
    amplitude and noise (3 hyperparameters).
``gaussian_glmm``
    Gaussian random intercepts, 60 groups x 8 rows, non-centered, learned group and
    residual scales.
``poisson_glmm``
    Poisson random intercepts and slopes, 100 groups x 6 rows, non-centered, two
    learned scales.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "point_hyper.json"
CASES = ["sparse_gp_vfe", "gaussian_glmm", "poisson_glmm"]


def build(case):
    import numpy as np
    import pymc as pm

    rng = np.random.default_rng(11)
    if case == "sparse_gp_vfe":
        from pymc_mcssvi.models import sparse_gp

        X = rng.uniform(0, 10, (300, 1))
        y = np.sin(X[:, 0]) + 0.5 * np.cos(2.5 * X[:, 0]) + 0.25 * rng.normal(size=300)

        def kernel():
            ls = pm.Gamma("ls", 2.0, 1.0)
            amp = pm.HalfNormal("amp", 2.0)
            return amp**2 * pm.gp.cov.ExpQuad(1, ls=ls)

        return sparse_gp(X, y, kernel, np.linspace(0, 10, 12)[:, None], bound="titsias")
    if case == "gaussian_glmm":
        g = np.repeat(np.arange(60), 8)
        y = 1.0 + 0.7 * rng.normal(size=60)[g] + 0.5 * rng.normal(size=g.size)
        with pm.Model() as model:
            b0 = pm.Normal("b0", 0, 5)
            tau = pm.HalfNormal("tau", 1)
            sigma = pm.HalfNormal("sigma", 1)
            z = pm.Normal("z", 0, 1, shape=60)
            pm.Normal("y", b0 + tau * z[g], sigma, observed=y)
        return model
    g = np.repeat(np.arange(100), 6)
    x = rng.normal(size=g.size)
    eta = 0.5 + 0.4 * rng.normal(size=100)[g] + (0.3 + 0.3 * rng.normal(size=100)[g]) * x
    y = rng.poisson(np.exp(eta))
    with pm.Model() as model:
        b = pm.Normal("b", 0, 2, shape=2)
        s = pm.HalfNormal("s", 1, shape=2)
        z = pm.Normal("z", 0, 1, shape=(100, 2))
        pm.Poisson(
            "y", pm.math.exp(b[0] + s[0] * z[g, 0] + (b[1] + s[1] * z[g, 1]) * x), observed=y
        )
    return model


def worker(case):
    import numpy as np
    import pymc as pm

    import pymc_mcssvi  # noqa: F401  (registers method="hmcssvi")

    model = build(case)
    start = time.perf_counter()
    approx = pm.fit(method="hmcssvi", model=model, hyper="point", progressbar=False, random_seed=1)
    seconds = time.perf_counter() - start
    post = approx.sample(10, random_seed=1).posterior
    names = {"sparse_gp_vfe": ["ls", "amp", "sigma"], "gaussian_glmm": ["tau", "sigma"]}
    hyper = {
        k: np.asarray(post[k].mean(("chain", "draw"))).tolist() for k in names.get(case, ["s"])
    }
    hist = np.asarray(approx.hist)
    print(
        json.dumps(
            {
                "iterations": int(hist.size),
                "seconds": seconds,
                "neg_elbo": float(hist[-1]),
                "hyper": hyper,
            }
        )
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker")
    parser.add_argument("--checkout")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    sys.path.insert(0, str(HERE))
    from common import run_record

    env = dict(os.environ)
    if args.checkout:
        env["PYTHONPATH"] = str(Path(args.checkout).resolve())
    rows = []
    for case in CASES:
        rec = run_record(checkout=args.checkout or "this", label=args.label)
        out = subprocess.run(
            [sys.executable, __file__, "--worker", case], env=env, capture_output=True, text=True
        )
        lines = out.stdout.strip().splitlines()
        try:
            result = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            result = {"error": out.stderr[-500:]}
        rows.append({"case": case, "run": rec, **result})
        print(case, result, flush=True)
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    RESULTS.write_text(json.dumps(old + rows, indent=1))


if __name__ == "__main__":
    main()
