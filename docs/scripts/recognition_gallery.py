"""Regenerate the generated part of ``docs/recognition.md``.

Run from the repository root::

    .venv/bin/python docs/scripts/recognition_gallery.py

It rewrites only the text between ``<!-- gallery:start -->`` and
``<!-- gallery:end -->`` in ``docs/recognition.md``; the prose around the
markers is hand-written. Two things are generated:

1. **Gallery.** Each ``gallery_*`` function below is one example. Its body is
   run as is, with its standard output captured, and shown on the page as a
   code block followed by that output. What the page shows is therefore
   exactly the code that produced the output. (Trailing spaces of the
   ``describe`` table lines are stripped; nothing else is changed.)
2. **Timing.** Every model of the recognition zoo
   (``tests/recognize/zoo_models.py``) that is recognized without error is
   recognized three times through :func:`pymc_mcssvi.describe` and three times
   through :func:`pymc_mcssvi.recognize.model.recognize` (the entry point the
   fit calls), and the best of three is kept. The largest model (observations
   x Gaussian dimension) is then fitted once with
   ``pm.fit(method="hmcssvi", progressbar=False)`` and its wall time
   (compilation included) is compared with its recognition time.

The whole run takes about two minutes on two cores: timing the zoo and one fit.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import io
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pymc as pm
import pytensor

import pymc_mcssvi
from pymc_mcssvi.recognize.model import recognize

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "recognition.md"
START, END = "<!-- gallery:start -->", "<!-- gallery:end -->"

sys.path.insert(0, str(ROOT))
from tests.recognize import zoo_models  # noqa: E402

# ============================================================== gallery models
# The body of each function is shown on the page verbatim (without the `def`
# line): keep it self-contained, small, seeded, and ending with the print.


def gallery_glm():
    rng = np.random.default_rng(0)
    n = 200
    features = ["age", "income", "score"]
    X = rng.normal(size=(n, len(features)))
    y = rng.binomial(1, 1 / (1 + np.exp(-(0.5 + X @ [1.0, -0.5, 0.25]))))

    coords = {"feature": features, "obs_id": np.arange(n)}
    with pm.Model(coords=coords) as model:
        X_data = pm.Data("X", X, dims=("obs_id", "feature"))
        intercept = pm.Normal("intercept", 0.0, 2.5)
        beta = pm.Normal("beta", 0.0, 1.0, dims="feature")
        logit_p = pm.Deterministic("logit_p", intercept + X_data @ beta, dims="obs_id")
        pm.Bernoulli("y", logit_p=logit_p, observed=y, dims="obs_id")

    print(pymc_mcssvi.describe(model))


def gallery_glmm():
    # 600 groups: 1202 Gaussian dimensions, above the 1000 of a single full covariance
    rng = np.random.default_rng(1)
    n_groups, n = 600, 1800
    group = np.concatenate([np.arange(n_groups), rng.integers(0, n_groups, n - n_groups)])
    x = rng.normal(size=n)
    a_true = rng.normal(0.0, 0.5, n_groups)
    b_true = rng.normal(0.0, 0.3, n_groups)
    y = rng.poisson(np.exp(0.5 + a_true[group] + (0.3 + b_true[group]) * x))

    with pm.Model(coords={"group": np.arange(n_groups)}) as model:
        b0 = pm.Normal("b0", 0.0, 5.0)
        b1 = pm.Normal("b1", 0.0, 2.5)
        sd_a = pm.HalfNormal("sd_a", 1.0)
        sd_b = pm.HalfNormal("sd_b", 1.0)
        z_a = pm.Normal("z_a", 0.0, 1.0, dims="group")  # non-centered intercepts
        z_b = pm.Normal("z_b", 0.0, 1.0, dims="group")  # non-centered slopes
        a = pm.Deterministic("a", sd_a * z_a, dims="group")
        b = pm.Deterministic("b", sd_b * z_b, dims="group")
        pm.Poisson("y", pm.math.exp(b0 + a[group] + (b1 + b[group]) * x), observed=y)

    print(pymc_mcssvi.describe(model))


def gallery_gme():
    rng = np.random.default_rng(2)
    n, d = 300, 3
    X = rng.normal(size=(n, d)) / np.sqrt(d)
    counts = rng.poisson(np.log1p(np.exp(X @ [1.0, -0.5, 0.5] + rng.normal(0.0, 0.7, n))))

    with pm.Model() as model:
        w1 = pm.Normal("w1", 0.0, 1.0, shape=d)
        w2 = pymc_mcssvi.Rayleigh("w2", sigma=5.0)  # the variance of f
        f = pm.Normal("f", X @ w1, pm.math.sqrt(w2), shape=n)
        pm.Poisson("y", pm.math.log1pexp(f), observed=counts)

    print(pymc_mcssvi.describe(model))


def gallery_pmf():
    rng = np.random.default_rng(3)
    n_users, n_items, rank, n = 30, 20, 3, 400
    user = rng.integers(0, n_users, n)
    item = rng.integers(0, n_items, n)
    rating = rng.normal(size=n)

    coords = {"user": np.arange(n_users), "item": np.arange(n_items), "factor": np.arange(rank)}
    with pm.Model(coords=coords) as model:
        U = pm.Normal("U", 0.0, 1.0, dims=("user", "factor"))
        V = pm.Normal("V", 0.0, 1.0, dims=("item", "factor"))
        sigma = pm.HalfNormal("sigma", 1.0)
        pm.Normal("rating", (U[user] * V[item]).sum(-1), sigma, observed=rating)

    print(pymc_mcssvi.describe(model))


def gallery_decay():
    rng = np.random.default_rng(4)
    t = np.linspace(0.0, 5.0, 60)
    y = 3.0 * np.exp(-0.7 * t) + 0.1 * rng.normal(size=t.size)

    with pm.Model() as model:
        a = pm.Normal("a", 0.0, 5.0)
        b = pm.Normal("b", 0.0, 1.0)
        sigma = pm.HalfNormal("sigma", 1.0)
        pm.Normal("y", a * pm.math.exp(-b * t), sigma, observed=y)

    print(pymc_mcssvi.describe(model))


def gallery_missing():
    rng = np.random.default_rng(5)
    X = rng.normal(size=(50, 3))
    y = X @ [1.0, -0.5, 0.25] + rng.normal(size=50)
    y[[3, 17]] = np.nan  # PyMC imputes these two values: 'y_unobserved'
    X_new = rng.normal(size=(4, 3))

    with pm.Model() as model:
        w = pm.Normal("w", 0.0, 1.0, shape=3)
        sigma = pm.HalfNormal("sigma", 1.0)
        pm.Normal("y", X @ w, sigma, observed=y)
        pm.StudentT("y_new", nu=4, mu=X_new @ w, sigma=sigma)  # a prediction

    print(pymc_mcssvi.describe(model))


def gallery_switchpoint():
    rng = np.random.default_rng(6)
    counts = np.concatenate([rng.poisson(3.0, 40), rng.poisson(1.0, 60)])

    with pm.Model() as model:
        switch = pm.DiscreteUniform("switch", 0, 100)
        early = pm.Normal("early", 0.0, 2.0)
        late = pm.Normal("late", 0.0, 2.0)
        log_rate = pm.math.switch(np.arange(100) < switch, early, late)
        pm.Poisson("counts", pm.math.exp(log_rate), observed=counts)

    try:
        pymc_mcssvi.describe(model)
    except pymc_mcssvi.UnsupportedModelError as err:
        print(err)


GALLERY = [
    (
        gallery_glm,
        "A GLM: logistic regression with an intercept, `pm.Data` and coords/dims",
        "The intercept and the coefficients share one full covariance; the "
        "predictor is recognized through `pm.Data` and the `pm.Deterministic`.",
    ),
    (
        gallery_glmm,
        "A non-centered GLMM: random intercepts and slopes",
        "The effects are gathered by the grouping index; above 1000 Gaussian "
        "dimensions the intercept and slope of each group share a 2 x 2 block "
        "(row-block covariance), the fixed effects keep a full one, and the "
        "group-level scales are hyperparameters. The fixed effects and the group "
        "blocks stay coupled through the curvature (the note under the tables): "
        "the steps and the returned draws use the arrow-shaped precision with "
        "their cross blocks, so the fixed effects' posterior sds are not those "
        "of independent blocks.",
    ),
    (
        gallery_gme,
        "The paper's GME: a Gaussian local with a Rayleigh variance",
        "`f` has one entry per observation: it is integrated out by quadrature. "
        "`w2` gets a Rayleigh q.",
    ),
    (
        gallery_pmf,
        "Matrix factorization: a bilinear predictor",
        "The factors of a bilinear predictor get one K x K block per row (user or "
        "item), whatever their size.",
        "Row and column biases, an intercept or fixed effects added to the product,\n"
        "`mu + a[user] + b[item] + (U[user] * V[item]).sum(-1)`, keep the bilinear\n"
        "estimator: the predictor reads `bilinear + affine`, and the added variables\n"
        "share one covariance block as in a GLMM. Anything else done to the product\n"
        "(scaling it by another variable, say) sends the likelihood to the general path,\n"
        "`general (bilinear + other terms)`. A fully observed matrix written densely,\n"
        "`pm.math.dot(Z, W.T) + mu` (probabilistic PCA) or `W @ F` with `F` stored\n"
        "`(K, n)` (factor analysis), is the same factorization of its entries.",
    ),
    (
        gallery_decay,
        "A non-affine model: exponential decay",
        "`a * exp(-b * t)` is not affine in `(a, b)`, but it is affine in `a` given "
        "the scalar `b`: `b` becomes a hyperparameter and the predictor is affine. "
        "With a vector of rates (`exp(-b[group] * t)`) `a` and `-b[group] * t` are "
        "two affine predictors (2-D quadrature); with a third non-linear parameter "
        "the likelihood would go through the general (Monte Carlo + autodiff) path.",
    ),
    (
        gallery_missing,
        "Missing observations and predictions written into the model",
        "Nothing in the model reads `y_unobserved` (PyMC's imputation of the "
        "`NaN`s) or `y_new`: their factor of the posterior is their prior given "
        "`w` and `sigma`. They are left out of the fit, and `approx.sample()` draws "
        "them from that prior at each draw of the other variables (exact, for any "
        "distribution; named in `posterior.attrs['predictive_leaves']`). A matrix "
        "with missing entries observed densely (`U @ V.T`) is fitted at its "
        "observed entries as matrix factorization.",
    ),
    (
        gallery_switchpoint,
        "A rejected model: a discrete switchpoint",
        "Recognition fails before anything is compiled, with a message naming the "
        "variable and what to do instead.",
    ),
]


def snippet(fn) -> str:
    """The body of ``fn``, dedented, as it appears on the page."""
    lines = inspect.getsource(fn).splitlines()
    assert lines[0].startswith("def "), lines[0]
    return textwrap.dedent("\n".join(lines[1:])).strip("\n")


def run_snippet(fn) -> str:
    out = io.StringIO()
    with warnings.catch_warnings():
        # PyMC announces the imputation in gallery_missing
        warnings.simplefilter("ignore", pm.exceptions.ImputationWarning)
        with contextlib.redirect_stdout(out):
            fn()
    return "\n".join(line.rstrip() for line in out.getvalue().strip("\n").splitlines())


# ====================================================================== timing
def best_of(k, f, *args):
    best = float("inf")
    for _ in range(k):
        t0 = time.perf_counter()
        f(*args)
        best = min(best, time.perf_counter() - t0)
    return best


def n_observations(model) -> int:
    """Number of observed values (for minibatched data: one minibatch)."""
    total = 0
    for obs in model.observed_RVs:
        data = model.rvs_to_values[obs]
        total += int(np.prod(data.shape.eval(mode="FAST_COMPILE")))
    return total


def zoo_builders():
    fns = [
        f
        for name, f in inspect.getmembers(zoo_models, inspect.isfunction)
        if f.__module__ == zoo_models.__name__ and not name.startswith("_")
    ]
    return sorted(fns, key=lambda f: inspect.getsourcelines(f)[1])


def time_zoo(repeats=3):
    rows, rejected = [], []
    for build in zoo_builders():
        with warnings.catch_warnings():
            # PyMC's imputation / minibatch notices, the plugin's missing total_size warning
            warnings.simplefilter("ignore")
            model = build()
            try:
                d = pymc_mcssvi.describe(model)
            except pymc_mcssvi.UnsupportedModelError:
                rejected.append(build.__name__)
                continue
            t_describe = best_of(repeats, pymc_mcssvi.describe, model)
            t_recognize = best_of(repeats, recognize, model)
        rows.append(
            dict(
                model=build.__name__,
                free=len(model.free_RVs),
                dim=sum(g.size for g in d.tlm.gaussians),
                obs=n_observations(model),
                describe=t_describe,
                recognize=t_recognize,
            )
        )
    return rows, rejected


def time_fit(build):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build()
        t0 = time.perf_counter()
        with model:
            approx = pm.fit(method="hmcssvi", progressbar=False, random_seed=0)
        seconds = time.perf_counter() - t0
    return seconds, approx.n_iter, bool(approx.converged)


# ====================================================================== stamp
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_state() -> str:
    def git(*args):
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=False
        ).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "pymc_mcssvi")
    return head + (" (with uncommitted changes in pymc_mcssvi/)" if dirty else "")


def stamp() -> str:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"Generated on {datetime.date.today().isoformat()} by "
        "`docs/scripts/recognition_gallery.py` on "
        f"{cpu_model()} ({os.cpu_count()} cores, load average {load} at the start), "
        f"Python {platform.python_version()}, PyMC {pm.__version__}, "
        f"PyTensor {pytensor.__version__}, NumPy {np.__version__}, "
        f"pymc-mcssvi {pymc_mcssvi.__version__} at commit {git_state()}."
    )


# ===================================================================== output
def gallery_markdown() -> str:
    parts = [
        "## Five models and one rejection",
        "",
        "Every snippet starts from",
        "",
        "```python",
        "import numpy as np",
        "import pymc as pm",
        "import pymc_mcssvi",
        "```",
    ]
    for k, (fn, title, blurb, *after) in enumerate(GALLERY, start=1):
        parts += [
            "",
            f"### {k}. {title}",
            "",
            blurb,
            "",
            "```python",
            snippet(fn),
            "```",
            "",
            "```text",
            run_snippet(fn),
            "```",
        ]
        parts += [line for text in after for line in ("", text)]  # prose after the output
    return "\n".join(parts)


def ms(s: float) -> str:
    return f"{1e3 * s:.0f}"


def timing_markdown(rows, rejected, fit) -> str:
    largest = max(rows, key=lambda r: (r["obs"] * r["dim"], r["describe"]))
    slowest = max(rows, key=lambda r: r["describe"])
    by_size = sorted(rows, key=lambda r: r["obs"] * r["dim"], reverse=True)
    by_time = sorted(rows, key=lambda r: r["describe"], reverse=True)
    shown = by_size[:4] + [r for r in by_time[:3] if r not in by_size[:4]]
    times = [r["describe"] for r in rows]

    lines = [
        "## Recognition time of the zoo",
        "",
        f"The {len(rows) + len(rejected)} models of the recognition zoo "
        "(`tests/recognize/zoo_models.py`) were built and recognized: "
        f"{len(rows)} were recognized and {len(rejected)} rejected with "
        "`UnsupportedModelError`, as the zoo's tests expect. Times are the best of "
        "three runs of `pymc_mcssvi.describe(model)` and of "
        "`pymc_mcssvi.recognize.model.recognize(model)` (what `pm.fit` calls). "
        "The largest models (observations x Gaussian dimension) and the slowest "
        "ones to recognize:",
        "",
        "| model | free variables | Gaussian dimension | observations | `describe` (ms) | `recognize` (ms) |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for r in shown:
        lines.append(
            f"| `{r['model']}` | {r['free']} | {r['dim']} | {r['obs']} | "
            f"{ms(r['describe'])} | {ms(r['recognize'])} |"
        )
    fit_s, n_iter, converged = fit
    ratio = fit_s / largest["describe"]
    lines += [
        "",
        f"Over all {len(rows)} recognized models `describe` took {ms(min(times))} to "
        f"{ms(max(times))} ms (median {ms(statistics.median(times))} ms); the slowest was "
        f"`{slowest['model']}`.",
        "",
        f"**Against a fit:** the largest model, `{largest['model']}` "
        f"({largest['obs']} observations, {largest['dim']} Gaussian dimensions), is "
        f"recognized in {ms(largest['describe'])} ms; "
        f'`pm.fit(method="hmcssvi", progressbar=False)` on it took {fit_s:.1f} s '
        f"(compilation included, {n_iter} iterations, "
        f"{'converged' if converged else 'stopped without converging'}), "
        f"{ratio:.0f} times the recognition time.",
    ]
    return "\n".join(lines)


def main():
    text = PAGE.read_text()
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise SystemExit(f"{PAGE}: expected one {START} ... {END} pair")
    head = stamp()
    gallery = gallery_markdown()
    rows, rejected = time_zoo()
    largest = max(rows, key=lambda r: (r["obs"] * r["dim"], r["describe"]))
    fit = time_fit(getattr(zoo_models, largest["model"]))
    generated = "\n\n".join([head, gallery, timing_markdown(rows, rejected, fit)])
    before, rest = text.split(START, 1)
    _, after = rest.split(END, 1)
    PAGE.write_text(f"{before}{START}\n\n{generated}\n\n{END}{after}")
    print(f"wrote {PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
