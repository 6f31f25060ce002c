"""Post-fit cost: issue 50, item 4.

What a fit costs after its iterations, and what ``approx.sample`` costs, on three
small models, each in a subprocess of its own (its own ``VmHWM``):

``ordinal``
    500-row ordinal regression: ``pm.OrderedLogistic`` with ``eta = X @ b`` (3
    covariates), 3 cutpoints with ``transform=ordered`` and ``initval=[-1, 0, 1]``,
    priors Normal(0, 3). ``pm.fit`` time, then ``approx.sample(n)`` for ``n`` in
    :data:`SAMPLE_SIZES`, each twice (the first call of a size may compile).
``glmm``
    Binomial GLMM, 400 groups of 5 rows, ``n = 10`` trials, an observation-level
    random effect ``e ~ Normal(0, se, shape=2000)`` (per-observation locals):
    ``logit_p = b0 + b1 * x + sg * z[g] + e``. ``pm.fit`` time, the time spent in
    ``local_posteriors`` (``pymc_mcssvi.pymc.inference.local_posteriors`` wrapped by a
    timer with ``unittest.mock.patch``), in ``StructuredVI.finish`` (all the work after
    the iterations but the diagnosis: q(h)'s profile, the locals', the leaves') and in
    ``diagnostics.after_fit`` (the ``diagnose="auto"`` PSIS check), and
    ``approx.sample(1000)`` twice. ``glmm_nuts``: NUTS on the same model.
``mixture``
    ``pm.NormalMixture`` with 2 components and no ordering transform (500 rows, means
    -3 and 3, weights 0.3 / 0.7, sd 1; ``w ~ Dirichlet(1, 1)``, ``mu ~ Normal(0, 5,
    shape=2)``, ``sigma ~ HalfNormal(2)``): the plugin's fit time and result, with
    its warnings and log messages. ``mixture_nuts``: NUTS on the same model. Both
    summarized with the components relabelled by the order of ``mu`` in each draw.

NUTS: :data:`NUTS`. The wrappers add a ``perf_counter`` call each; no profiler runs.
Targets (issue 50): ``local_posteriors`` + ``approx.sample(1000)`` at most
``max(25% of the fit, 0.3 s)``; ``sample(1000)`` not slower than ``sample(2000)``;
the mixture faster than NUTS, or the plugin says why.

Run ``python benchmarks/postfit.py`` (about 10 minutes on 2 cores; ``--only
ordinal,glmm`` restricts the cases, ``--no-docs`` leaves the docs alone). Writes
``benchmarks/results/postfit.json`` and the ``postfit`` section of
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
import time
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
from scipy.special import expit

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import fmt, log, vmhwm_mb  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SECTION = "postfit"
SEED = 0
SAMPLE_SIZES = (500, 1000, 2000, 3000)
NUTS = dict(chains=2, tune=1000, draws=1000, cores=2)
CASES = ("ordinal", "glmm", "glmm_nuts", "mixture", "mixture_nuts")
WORKER_TIMEOUT = 1800.0
N_GROUPS, PER_GROUP, TRIALS = 400, 5, 10


# ============================================================================ models
def ordinal_model():
    import pymc as pm

    rng = np.random.default_rng(SEED)
    X = rng.normal(size=(500, 3))
    b_true, c_true = np.array([1.0, -0.5, 0.3]), np.array([-1.0, 0.0, 1.2])
    eta = X @ b_true
    # P(y <= k) = sigmoid(c_k - eta)
    cum = expit(c_true[None, :] - eta[:, None])
    y = (rng.random(500)[:, None] > cum).sum(1)
    with pm.Model() as model:
        b = pm.Normal("b", 0.0, 3.0, shape=3)
        c = pm.Normal(
            "c",
            0.0,
            3.0,
            shape=3,
            transform=pm.distributions.transforms.ordered,
            initval=[-1.0, 0.0, 1.0],
        )
        pm.OrderedLogistic("y", eta=X @ b, cutpoints=c, observed=y)
    return model


def glmm_model():
    import pymc as pm

    rng = np.random.default_rng(SEED)
    n_rows = N_GROUPS * PER_GROUP
    g = np.repeat(np.arange(N_GROUPS), PER_GROUP)
    x = rng.normal(size=n_rows)
    eta = -0.5 + 0.8 * x + 0.7 * rng.normal(size=N_GROUPS)[g] + 0.5 * rng.normal(size=n_rows)
    y = rng.binomial(TRIALS, expit(eta))
    with pm.Model() as model:
        b0 = pm.Normal("b0", 0.0, 2.0)
        b1 = pm.Normal("b1", 0.0, 2.0)
        sg = pm.HalfNormal("sg", 1.0)
        se = pm.HalfNormal("se", 1.0)
        z = pm.Normal("z", 0.0, 1.0, shape=N_GROUPS)
        e = pm.Normal("e", 0.0, se, shape=n_rows)
        pm.Binomial("y", n=TRIALS, logit_p=b0 + b1 * x + sg * z[g] + e, observed=y)
    return model


def mixture_model():
    import pymc as pm

    rng = np.random.default_rng(SEED)
    comp = rng.random(500) < 0.3
    y = np.where(comp, rng.normal(-3.0, 1.0, 500), rng.normal(3.0, 1.0, 500))
    with pm.Model() as model:
        w = pm.Dirichlet("w", a=np.ones(2))
        mu = pm.Normal("mu", 0.0, 5.0, shape=2)
        sigma = pm.HalfNormal("sigma", 2.0)
        pm.NormalMixture("y", w=w, mu=mu, sigma=sigma, observed=y)
    return model


# ============================================================================ timing
class Timer:
    """Wraps a function; accumulates its calls' wall clock."""

    def __init__(self, fn):
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1

    def method(self):
        """The timer as a method (``self`` passed on)."""

        @functools.wraps(self.fn)
        def wrapped(obj, *args, **kwargs):
            return self(obj, *args, **kwargs)

        return wrapped


def timed_fit(model, **kwargs) -> tuple[object, dict]:
    """``pm.fit(method="hmcssvi")`` with the post-fit pieces timed."""
    import pymc as pm

    import pymc_mcssvi
    from pymc_mcssvi.pymc import diagnostics, inference

    lp = Timer(inference.local_posteriors)
    finish = Timer(inference.StructuredVI.finish)
    after = Timer(diagnostics.after_fit)
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage()[:300])

    handler = Keep(logging.INFO)
    logger = logging.getLogger("pymc_mcssvi")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with (
            mock.patch.object(inference, "local_posteriors", lp),
            mock.patch.object(inference.StructuredVI, "finish", finish.method()),
            mock.patch.object(diagnostics, "after_fit", after),
            warnings.catch_warnings(record=True) as caught,
            model,
        ):
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            approx = pm.fit(method="hmcssvi", random_seed=SEED, progressbar=False, **kwargs)
            fit_s = time.perf_counter() - t0
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    out = {
        "fit_s": fit_s,
        "iterations": int(approx.n_iter),
        "converged": approx.converged,
        "finish_s": finish.seconds,
        "local_posteriors_s": lp.seconds,
        "local_posteriors_calls": lp.calls,
        "after_fit_s": after.seconds,
        "diagnosed": approx.diagnosis is not None,
        "khat": None if approx.diagnosis is None else float(approx.diagnosis.khat),
        "groups": [[g.short_name, int(g.ddim)] for g in approx.groups],
        "warnings": sorted(
            {
                f"{w.category.__name__}: {str(w.message)[:300]}"
                for w in caught
                if not issubclass(w.category, DeprecationWarning | FutureWarning)
            }
        ),
        "log": records,
        "version": pymc_mcssvi.__version__ if hasattr(pymc_mcssvi, "__version__") else "?",
    }
    return approx, out


def time_sample(approx, n: int) -> float:
    t0 = time.perf_counter()
    approx.sample(n, random_seed=SEED)
    return time.perf_counter() - t0


def summarize(post, names) -> dict:
    """Mean and sd of each coordinate of ``names``; components relabelled by ``mu``'s order."""
    draws = {k: np.asarray(post[k].values, dtype="float64") for k in names}
    draws = {k: v.reshape(v.shape[0] * v.shape[1], -1) for k, v in draws.items()}
    if "mu" in draws and "w" in draws:
        order = np.argsort(draws["mu"], axis=1)
        draws["mu"] = np.take_along_axis(draws["mu"], order, 1)
        draws["w"] = np.take_along_axis(draws["w"], order, 1)
    return {k: {"mean": v.mean(0).tolist(), "sd": v.std(0).tolist()} for k, v in draws.items()}


def run_nuts(model, names) -> dict:
    import arviz as az
    import pymc as pm

    with model:
        t0 = time.perf_counter()
        idata = pm.sample(
            **NUTS, random_seed=SEED, progressbar=False, compute_convergence_checks=False
        )
        seconds = time.perf_counter() - t0
    rhat = az.rhat(idata, var_names=list(names))
    return {
        "nuts_s": seconds,
        "divergences": int(idata.sample_stats["diverging"].sum()),
        "rhat_max": {k: float(rhat[k].max()) for k in names},
        "summary": summarize(idata.posterior, names),
    }


# ============================================================================ cases
def case_ordinal() -> dict:
    approx, out = timed_fit(ordinal_model())
    out["sample_s"] = {n: [time_sample(approx, n), time_sample(approx, n)] for n in SAMPLE_SIZES}
    out["summary"] = summarize(approx.sample(2000, random_seed=SEED).posterior, ("b", "c"))
    return out


def case_glmm() -> dict:
    approx, out = timed_fit(glmm_model())
    out["sample_s"] = {1000: [time_sample(approx, 1000), time_sample(approx, 1000)]}
    out["summary"] = summarize(
        approx.sample(1000, random_seed=SEED).posterior, ("b0", "b1", "sg", "se")
    )
    return out


def case_mixture() -> dict:
    approx, out = timed_fit(mixture_model())
    out["sample_s"] = {1000: [time_sample(approx, 1000), time_sample(approx, 1000)]}
    out["summary"] = summarize(
        approx.sample(2000, random_seed=SEED).posterior, ("w", "mu", "sigma")
    )
    return out


def run_case(name: str) -> dict:
    if name == "ordinal":
        out = case_ordinal()
    elif name == "glmm":
        out = case_glmm()
    elif name == "glmm_nuts":
        out = run_nuts(glmm_model(), ("b0", "b1", "sg", "se"))
    elif name == "mixture":
        out = case_mixture()
    elif name == "mixture_nuts":
        out = run_nuts(mixture_model(), ("w", "mu", "sigma"))
    else:
        raise ValueError(name)
    out["peak_mb"] = vmhwm_mb()
    return out


def worker_main(name: str, path: str) -> None:
    import traceback

    import pymc_mcssvi  # noqa: F401  (registers method="hmcssvi")

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("pymc").setLevel(logging.ERROR)
    try:
        res = run_case(name)
    except Exception as e:  # recorded, the benchmark goes on
        res = {"error": f"{type(e).__name__}: {str(e)[:500]}", "traceback": traceback.format_exc()}
        traceback.print_exc()
    res["case"] = name
    common.save_json(res, path)


# ============================================================================ report
def _ms(v) -> str:
    return "–" if v is None else f"{v:.3f}" if v < 1 else f"{v:.2f}"


def _pm(s: dict, k: str) -> str:
    return ", ".join(f"{m:.2f} ± {d:.2f}" for m, d in zip(s[k]["mean"], s[k]["sd"], strict=True))


def checks(results: dict) -> dict:
    """The issue's targets, evaluated on the results."""
    cases = results["cases"]
    out = {}
    g = cases.get("glmm", {})
    if not g.get("error"):
        post = g["local_posteriors_s"] + g["sample_s"]["1000"][1]
        budget = max(0.25 * g["fit_s"], 0.3)
        out["glmm_postfit"] = {
            "local_posteriors_plus_sample_s": post,
            "budget_s": budget,
            "met": post <= budget,
        }
    o = cases.get("ordinal", {})
    if not o.get("error"):
        s = o["sample_s"]
        out["ordinal_sample"] = {
            "sample1000_s": s["1000"][1],
            "sample2000_s": s["2000"][1],
            "met": s["1000"][1] <= s["2000"][1],
        }
    m, mn = cases.get("mixture", {}), cases.get("mixture_nuts", {})
    if not m.get("error") and not mn.get("error"):
        out["mixture_vs_nuts"] = {
            "plugin_s": m["fit_s"],
            "nuts_s": mn["nuts_s"],
            "faster": m["fit_s"] < mn["nuts_s"],
            "says_why": bool(m["warnings"]),
        }
    return out


def render(results: dict) -> str:
    meta = results["meta"]
    mach, v, code = meta["machine"], meta["versions"], meta["code_start"]
    cases = results["cases"]
    L = ["(bench-postfit)=", "## Post-fit cost", ""]
    L.append(
        f"Run {meta['date']} on {mach.get('cpu_model', mach.get('machine'))} "
        f"({mach.get('cpu_count')} logical CPUs, shared with other jobs: load average "
        f"{meta['load_start']} at the start, {meta['load_end']} at the end; "
        f"{mach.get('mem_total_gb')} GB), PyMC {v.get('pymc')}, PyTensor {v.get('pytensor')}, "
        f"NumPy {v.get('numpy')}, commit {code.get('commit')}"
        + (" with uncommitted changes to the plugin" if code.get("plugin_dirty") else "")
        + f" (plugin sources sha1 {code.get('plugin_sources_sha1')}). Total "
        f"{meta['total_wall'] / 60:.1f} min. Reproduce: `python benchmarks/postfit.py`; raw "
        "numbers in `benchmarks/results/postfit.json`."
    )
    L.append("")
    L.append(
        'Issue 50, item 4. Every fit is `pm.fit(method="hmcssvi", random_seed=0)` with the '
        'defaults (`diagnose="auto"` included), each case in a subprocess of its own (*peak '
        "MB*: its `VmHWM`). *fit s*: wall clock of `pm.fit` (recognition and compilation "
        "included); *finish s*: of `StructuredVI.finish` inside it (q(h)'s profile, the "
        "locals' and leaves' posteriors); *local_posteriors s*: of "
        "`posterior.locals.local_posteriors` inside that; *diagnose s*: of the "
        '`diagnose="auto"` PSIS check at the end of the fit. Timed by wrapping these '
        "functions (`unittest.mock.patch`), no profiler. `approx.sample(n)` is called twice "
        f"per size (first / second call). NUTS: {NUTS['chains']} chains x {NUTS['draws']} draws "
        f"after {NUTS['tune']} tuning steps, chains in parallel on the 2 cores."
    )
    L.append("")
    rows = []
    for name, label in (
        ("ordinal", "ordinal regression, 500 rows"),
        ("glmm", f"Binomial GLMM, {N_GROUPS} groups x {PER_GROUP}, obs.-level effect"),
        ("mixture", "NormalMixture, 2 components, 500 rows"),
    ):
        r = cases.get(name, {})
        if r.get("error"):
            rows.append([label, r["error"][:200], *[""] * 8])
            continue
        s1000 = r["sample_s"].get("1000", [None, None])
        rows.append(
            [
                label,
                f"{r['fit_s']:.2f} ({r['iterations']}, {r['converged']})",
                _ms(r["finish_s"]),
                _ms(r["local_posteriors_s"]) if r["local_posteriors_calls"] else "–",
                _ms(r["after_fit_s"]) + (f" (k-hat {r['khat']:.2f})" if r["diagnosed"] else ""),
                f"{_ms(s1000[0])} / {_ms(s1000[1])}",
                fmt(cases.get(f"{name}_nuts", {}).get("nuts_s"), ".1f"),
                fmt(r["peak_mb"], ".0f"),
            ]
        )
    L.append(
        common.markdown_table(
            [
                "case",
                "fit s (iterations, converged)",
                "finish s",
                "local_posteriors s",
                "diagnose s",
                "sample(1000) s, 1st / 2nd",
                "NUTS s",
                "peak MB",
            ],
            rows,
        )
    )
    L.append("")
    o = cases.get("ordinal", {})
    if not o.get("error"):
        L.append(
            "`approx.sample(n)` on the ordinal regression, seconds (first call / second call):\n"
        )
        L.append(
            common.markdown_table(
                ["n", *SAMPLE_SIZES],
                [["s", *(" / ".join(_ms(t) for t in o["sample_s"][str(n)]) for n in SAMPLE_SIZES)]],
            )
        )
        L.append("")
    # posterior summaries
    rows = []
    for name, names in (("glmm", ("b0", "b1", "sg", "se")), ("mixture", ("w", "mu", "sigma"))):
        r, rn = cases.get(name, {}), cases.get(f"{name}_nuts", {})
        for k in names:
            rows.append(
                [
                    name,
                    k,
                    "–" if r.get("error") else _pm(r["summary"], k),
                    "–" if rn.get("error") or not rn else _pm(rn["summary"], k),
                    "–" if rn.get("error") or not rn else f"{rn['rhat_max'][k]:.3f}",
                ]
            )
    L.append(
        "Posterior mean ± sd, plugin (`approx.sample`) and NUTS (mixture: components "
        "relabelled by the order of `mu` in each draw):\n"
    )
    L.append(common.markdown_table(["case", "variable", "plugin", "NUTS", "NUTS r-hat"], rows))
    L.append("")
    nd = [
        f"{n}: {cases[n]['divergences']} divergences"
        for n in ("glmm_nuts", "mixture_nuts")
        if n in cases and not cases[n].get("error")
    ]
    if nd:
        L.append("NUTS: " + "; ".join(nd) + ".")
        L.append("")
    c = results.get("checks", {})
    L.append("### Targets\n")
    if "glmm_postfit" in c:
        x = c["glmm_postfit"]
        L.append(
            f"- GLMM: `local_posteriors` + `sample(1000)` (second call) = "
            f"{x['local_posteriors_plus_sample_s']:.3f} s against max(25% of the fit, 0.3 s) = "
            f"{x['budget_s']:.2f} s: {'met' if x['met'] else 'missed'}."
        )
    if "ordinal_sample" in c:
        x = c["ordinal_sample"]
        L.append(
            f"- Ordinal: `sample(1000)` {x['sample1000_s']:.3f} s, `sample(2000)` "
            f"{x['sample2000_s']:.3f} s (second calls): "
            f"{'met' if x['met'] else 'missed'} (sample(1000) not slower)."
        )
    if "mixture_vs_nuts" in c:
        x = c["mixture_vs_nuts"]
        L.append(
            f"- NormalMixture: plugin {x['plugin_s']:.1f} s, NUTS {x['nuts_s']:.1f} s: the plugin "
            f"is {'faster' if x['faster'] else 'slower'}"
            + (
                ""
                if x["faster"]
                else (", and it says why" if x["says_why"] else ", and it does not say why")
            )
            + "."
        )
    L.append("")
    if results.get("analysis"):
        L.append(results["analysis"])
        L.append("")
    notes = [
        f"{name}: {w}"
        for name, r in cases.items()
        for w in [*r.get("warnings", []), *(f"log: {m}" for m in r.get("log", []))]
    ]
    if notes:
        L.append("Warnings and log messages of the plugin during the fits:\n")
        L.extend(f"- {n}" for n in notes)
        L.append("")
    return "\n".join(L)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--only", default=None, help="comma-separated cases: " + ",".join(CASES))
    parser.add_argument("--no-docs", action="store_true", help="do not touch docs/benchmarks.md")
    parser.add_argument(
        "--report-from", default=None, help="re-render the docs section from a JSON"
    )
    parser.add_argument(
        "--analysis", default=None, help="with --report-from: markdown file added as discussion"
    )
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.out)
    out_path = RESULTS / "postfit.json"
    if args.report_from:
        results = json.loads(Path(args.report_from).read_text())
        if args.analysis:
            results["analysis"] = Path(args.analysis).read_text().strip()
            common.save_json(results, args.report_from)
    else:
        names = CASES if not args.only else [s.strip() for s in args.only.split(",")]
        results = {
            "meta": {
                "date": common.today(),
                "machine": common.machine_info(),
                "versions": common.library_versions(("pymc", "pytensor", "numpy", "pymc_mcssvi")),
                "load_start": common.loadavg(),
                "code_start": common.code_state(),
                "nuts": NUTS,
                "seed": SEED,
            },
            "cases": {},
        }
        if args.only and out_path.exists():
            old = json.loads(out_path.read_text())
            results["cases"] = {k: v for k, v in old["cases"].items() if k not in names}
        t0 = time.perf_counter()
        for name in names:
            log(name)
            record = common.run_record("full")  # each case is a data set with its method
            results["cases"][name] = r = common.run_worker(
                __file__, [name], {"case": name}, WORKER_TIMEOUT
            )
            r["run"] = record
            log(
                f"  fit {fmt(r.get('fit_s'), '.2f')} s, nuts {fmt(r.get('nuts_s'), '.1f')} s, "
                f"peak {fmt(r.get('peak_mb'), '.0f')} MB"
                + (f" -- {r['error']}" if r.get("error") else "")
            )
            common.save_json(results, out_path)
        results["meta"]["load_end"] = common.loadavg()
        results["meta"]["code_end"] = common.code_state()
        results["meta"]["total_wall"] = time.perf_counter() - t0
        results["cases"] = {k: results["cases"][k] for k in CASES if k in results["cases"]}
        results["checks"] = checks(results)
        common.save_json(results, out_path)
        log(f"wrote {out_path}")
    print(render(results))
    if not args.no_docs:
        common.write_section(SECTION, render(results), common.DOCS_PATH)
        log(f"wrote section '{SECTION}' of {common.DOCS_PATH}")
    return results


if __name__ == "__main__":
    main()
