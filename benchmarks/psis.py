"""PSIS diagnostics benchmark: what ``approx.diagnose()`` says, and costs, on real fits.

Every case is fitted with ``pm.fit(method="hmcssvi", diagnose=False,
random_seed=0)`` (the plugin's defaults otherwise) and then diagnosed with
``approx.diagnose(random_seed=0)`` (1,000 draws from q, the model's joint log
density and q's exact one, ArviZ's PSIS). Each case runs in a subprocess of its own,
so that its peak memory (``VmHWM`` of /proc/self/status, read after the fit and
again after the diagnosis) is its own. Reported per case: the fit's seconds
(recognition and compilation included) and iterations, the diagnosis' seconds,
Pareto k-hat, the ESS of the smoothed weights, the number of coordinates of q
(Gaussian and Rayleigh groups, as ``pm.fit(diagnose="auto")`` counts them), the
number of observed values and the peak memory. The plugin is imported from a copy of
the repository's ``pymc_mcssvi`` taken at the start (``--checkout PATH``: from
another directory), so that edits of the checkout during the run do not mix in.

Cases
-----
``glm_logistic``
    ``benchmarks/glm_logistic.py``'s model on its data (``FULL``: N = 50,000,
    D = 100, ``common.logistic_regression_data``).
``glmm_<data>_<parameterization>``
    ``benchmarks/glmm.py``'s contraception, grouseticks and radon models
    (``glmm.LOADERS``, ``glmm.build_model``), centered and non-centered, on their
    training rows. ``glmm_radon_centered_point``: radon with ``hyper="point"``, where
    q of the effects given the scales is their exact Gaussian posterior (``glmm.py``'s
    exactness check): its importance ratios must be nearly equal.
``pmf_synth``
    Binary matrix factorization (``pymc_mcssvi.models.pmf``), 200 x 150, K = 5,
    6,000 ratings drawn from the model (:func:`synthetic_pmf`).
``pmf_synth_V_fixed[_rows40|_rows8]``, ``pmf_small_K1[_V_fixed]``, ``pmf_small_K2``
    Where PMF's k-hat comes from: the same data with V fixed at the values it was
    drawn with (U's posterior is then 200 independent 5-dimensional logistic
    regressions; or those of its first 40 or 8 rows), and small factorizations
    (40 x 30 with K = 1: no rotations, only a sign flip; 20 x 15 with K = 2; 600
    and 300 ratings).
``insteval_binary``
    ``benchmarks/pmf.py``'s InstEval binary factorization (K = 10, 44,650 ratings,
    41,000 coordinates), full batch from ``pmf.start_values``, at most
    :data:`INSTEVAL_MAX_ITER` iterations.
``bimodal``, ``horseshoe``, ``horseshoe_regularized``, ``schools_*``
    Posteriors a Gaussian q fits poorly: a location under a StudentT(nu = 0.5)
    likelihood with data in two clusters (two modes); a horseshoe logistic
    regression, plain and regularized (100 x 20, 3 nonzero weights; heavy-tailed
    scales); Rubin's eight schools, centered (a funnel with few data) and
    non-centered. ``schools_centered`` and ``schools_noncentered`` write each
    school's estimate as two observations ``y_j -+ s_j / 2`` with sd ``s_j sqrt(2)``:
    the same likelihood of ``theta_j`` (so the same posterior) with the school
    effects read twice, Gaussian globals. With one observation a school
    (``schools_local``) the plugin integrates them out as locals, and ``diagnose``
    refuses the fit. For these cases the posterior mean and sd of key quantities are
    compared: NUTS (on the non-centered one-observation form for the schools; 8
    chains for the bimodal one, with the exact value from quadrature beside it), q
    (``approx.sample``, 4,000 draws, post-fit views included), q's Gaussian draws
    that the diagnosis used, and the same draws weighted by their smoothed PSIS
    weights.

Run ``python benchmarks/psis.py`` (about 15 minutes on 2 cores); ``--only
bimodal,horseshoe`` restricts the cases, ``--reuse-nuts`` reuses NUTS draws cached
in ``benchmarks/.cache/``, ``--no-docs`` leaves ``docs/benchmarks.md`` alone,
``--report-from FILE [--analysis FILE]`` re-renders the docs section from a saved
JSON (with a discussion paragraph from a markdown file). Writes
``benchmarks/results/psis.json`` and the ``psis`` section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy import stats
from scipy.special import expit, logsumexp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import glm_logistic  # noqa: E402
import glmm  # noqa: E402
import pmf as pmf_bench  # noqa: E402
from common import fmt, log  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
CACHE = HERE / ".cache"
SECTION = "psis"
SEED = 0
#: Draws of the diagnosis (``approx.diagnose``'s default).
DRAWS = 1000
#: Draws from q for its own posterior moments.
Q_DRAWS = 4000
#: InstEval in full batch: 0.45 s per iteration; the fit stops earlier at convergence.
INSTEVAL_MAX_ITER = 400
#: NUTS: chains, tuning steps, draws per chain, target acceptance.
NUTS = dict(chains=4, tune=2000, draws=2000, target_accept=0.99)
WORKER_TIMEOUT = 3600.0

GLMM_CASES = [
    *(f"glmm_{name}_{tag}" for name in glmm.LOADERS for tag in ("noncentered", "centered")),
    "glmm_radon_centered_point",
]
PMF_CASES = [
    "pmf_synth",
    "pmf_synth_V_fixed",
    "pmf_synth_V_fixed_rows40",
    "pmf_synth_V_fixed_rows8",
    "pmf_small_K1",
    "pmf_small_K1_V_fixed",
    "pmf_small_K2",
    "insteval_binary",
]
POOR_CASES = [
    "bimodal",
    "horseshoe",
    "horseshoe_regularized",
    "schools_centered",
    "schools_noncentered",
    "schools_local",
]
CASES = ["glm_logistic", *GLMM_CASES, *PMF_CASES, *POOR_CASES]

#: Rubin's eight schools: estimated effects and their standard errors.
SCHOOLS_Y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
SCHOOLS_SIGMA = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])


@dataclass
class Case:
    """A model to fit and diagnose, and what to compare for a poor fit.

    ``quantities`` maps a label to a function of an ArviZ posterior group that
    returns that quantity's draws (flat). ``reference`` builds the model NUTS
    samples (``None``: no NUTS run) and ``nuts`` overrides :data:`NUTS`'s settings;
    ``exact`` gives the exact ``{label: (mean, sd)}``.
    """

    model: object
    description: str
    fit_kwargs: dict = field(default_factory=dict)
    quantities: dict = field(default_factory=dict)
    reference: object = None
    nuts: dict = field(default_factory=dict)
    exact: object = None


# ============================================================================ data
def synthetic_pmf(n_rows: int, n_cols: int, rank: int, n: int, seed: int = SEED):
    """``n`` distinct cells of an ``n_rows x n_cols`` binary matrix drawn from the PMF model.

    ``U, V ~ N(0, I_rank)`` row by row, ``y ~ Bernoulli(sigmoid(u_r^T v_c))``.
    Returns ``rows, cols, y, U, V``.
    """
    rng = np.random.default_rng(seed)
    U, V = rng.standard_normal((n_rows, rank)), rng.standard_normal((n_cols, rank))
    cells = rng.choice(n_rows * n_cols, n, replace=False)
    rows, cols = cells // n_cols, cells % n_cols
    y = (rng.random(n) < expit(np.sum(U[rows] * V[cols], -1))).astype("int64")
    return rows, cols, y, U, V


def bimodal_data(seed: int = SEED) -> np.ndarray:
    """Five points near -3 and five near 3 (``tests/pymc/test_diagnostics.py``'s data)."""
    rng = np.random.default_rng(seed)
    return np.r_[rng.normal(-3, 0.3, 5), rng.normal(3, 0.3, 5)]


def horseshoe_data(n: int = 100, d: int = 20, seed: int = SEED):
    """Logistic regression, ``d`` standard normal features, weights (2, -1.5, 1, 0, ...)."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    w = np.zeros(d)
    w[:3] = [2.0, -1.5, 1.0]
    return X, rng.binomial(1, expit(X @ w)), w


# ============================================================================ models
def _draws(name, index=None):
    def get(post):
        v = np.asarray(post[name].values, dtype="float64")
        v = v.reshape(v.shape[0] * v.shape[1], -1)
        return v[:, 0] if index is None else v[:, index]

    return get


def case_glm_logistic() -> Case:
    import pymc as pm

    cfg = glm_logistic.FULL
    data = common.logistic_regression_data(cfg["n"], cfg["d"], cfg["n_test"], seed=SEED)
    with pm.Model() as model:
        w = pm.Normal("w", 0, 1, shape=cfg["d"])
        pm.Bernoulli("y", logit_p=data.X @ w, observed=data.y)
    return Case(model, f"Bernoulli-logit, N = {cfg['n']:,}, D = {cfg['d']} (glm_logistic.py)")


def case_glmm(name: str, centered: bool, point: bool = False) -> Case:
    data = glmm.LOADERS[name](SEED)
    tag = "centered" if centered else "non-centered"
    groups = " + ".join(f"{t.n_groups} {t.label}" for t in data.terms)
    text = f"{data.name}, {data.family}, {groups}, {tag} (glmm.py)"
    if not point:
        return Case(glmm.build_model(data, centered), text)
    # given the scales, q of the effects can be the exact Gaussian posterior: a check
    return Case(
        glmm.build_model(data, centered),
        f"{data.name}, {tag}, scales point-estimated (hyper='point', tol=1e-12)",
        {"hyper": "point", "tol": 1e-12, "max_iter": 2000},
    )


def case_pmf_synth(
    v_fixed: bool, n_rows=200, n_cols=150, rank=5, n=6000, keep_rows: int | None = None
) -> Case:
    """Binary PMF on :func:`synthetic_pmf`'s data; ``v_fixed``: U alone, V fixed at the
    values drawn, on the ratings of the first ``keep_rows`` rows (all by default)."""
    import pymc as pm

    import pymc_mcssvi

    rows, cols, y, _, V = synthetic_pmf(n_rows, n_cols, rank, n)
    shape = f"{n_rows} x {n_cols}, K = {rank}, {n:,} ratings"
    if not v_fixed:
        model = pymc_mcssvi.models.pmf(rows, cols, y, n_rows, n_cols, rank)
        return Case(model, f"binary PMF, {shape}")
    R = n_rows if keep_rows is None else keep_rows
    keep = rows < R
    # U's posterior given V: one K-dimensional logistic regression per row of U
    with pm.Model() as model:
        U = pm.Normal("U", 0.0, 1.0, shape=(R, rank))
        pm.Bernoulli("y", logit_p=(U[rows[keep]] * V[cols[keep]]).sum(-1), observed=y[keep])
    if keep_rows is None:
        return Case(model, f"the same, V fixed at the values drawn, {shape}")
    return Case(model, f"the same, V fixed, the first {R} rows of U ({keep.sum():,} ratings)")


def case_insteval() -> Case:
    ds = pmf_bench.load_dataset("insteval_binary", dict(pmf_bench.FULL), SEED)
    kw = {"start": pmf_bench.start_values(ds, SEED), "n": INSTEVAL_MAX_ITER}
    i = ds["info"]
    return Case(
        pmf_bench.build_pymc(ds),
        f"InstEval binary PMF, {i['n_rows']} x {i['n_cols']}, K = {i['K']}, "
        f"{i['n_train']:,} ratings, full batch (pmf.py)",
        kw,
    )


def case_bimodal() -> Case:
    import pymc as pm

    y = bimodal_data()
    with pm.Model() as model:
        mu = pm.Normal("mu", 0, 10)
        pm.StudentT("y", nu=0.5, mu=mu, sigma=0.3, observed=y)

    def exact():
        grid = np.linspace(-60, 60, 240_001)
        lp = stats.norm.logpdf(grid, 0, 10) + np.sum(
            stats.t.logpdf(y[:, None], df=0.5, loc=grid, scale=0.3), axis=0
        )
        w = np.exp(lp - logsumexp(lp))
        mean = float(np.sum(w * grid))
        return {"mu": (mean, float(np.sqrt(np.sum(w * (grid - mean) ** 2))))}

    return Case(
        model,
        "StudentT(nu = 0.5, sigma = 0.3) location, 5 + 5 points near -3 and 3",
        quantities={"mu": _draws("mu")},
        reference=lambda: model,
        nuts=dict(chains=8, target_accept=0.9),
        exact=exact,
    )


def horseshoe_model(regularized: bool):
    """Horseshoe logistic regression (Piironen & Vehtari 2017), non-centered weights.

    Global scale ``tau ~ HalfCauchy(tau0)``, ``tau0 = p0 / (D - p0) * 2 / sqrt(N)``
    (``p0 = 3``, pseudo-sd 2 of a logistic likelihood); local scales
    ``lambda ~ HalfCauchy(1)``; regularized: slab ``c^2 ~ InverseGamma(2, 8)`` (slab
    scale 2, 4 degrees of freedom).
    """
    import pymc as pm

    X, y, _ = horseshoe_data()
    N, D = X.shape
    with pm.Model() as model:
        tau = pm.HalfCauchy("tau", 3 / (D - 3) * 2 / np.sqrt(N))
        lam = pm.HalfCauchy("lam", 1.0, shape=D)
        z = pm.Normal("z", 0.0, 1.0, shape=D)
        if regularized:
            c2 = pm.InverseGamma("c2", 2.0, 8.0)
            lam = pm.math.sqrt(c2 * lam**2 / (c2 + tau**2 * lam**2))
        beta = pm.Deterministic("beta", z * tau * lam)
        pm.Bernoulli("y", logit_p=X @ beta, observed=y)
    return model


def case_horseshoe(regularized: bool) -> Case:
    model = horseshoe_model(regularized)
    kind = "regularized horseshoe" if regularized else "horseshoe"
    return Case(
        model,
        f"logistic regression, {kind} prior, 100 x 20, 3 nonzero weights",
        quantities={
            "tau": _draws("tau"),
            "beta[0] (true 2)": _draws("beta", 0),
            "beta[3] (true 0)": _draws("beta", 3),
        },
        reference=lambda: model,
    )


def schools_model(form: str):
    """Eight schools, ``"centered"`` or ``"noncentered"`` with each school's estimate
    written as two observations (see the module docstring); ``"local"``: centered with
    one observation a school, ``"reference"``: non-centered with one (NUTS's model)."""
    import pymc as pm

    with pm.Model() as model:
        mu = pm.Normal("mu", 0.0, 5.0)
        tau = pm.HalfCauchy("tau", 5.0)
        if form in ("noncentered", "reference"):
            eta = pm.Normal("eta", 0.0, 1.0, shape=8)
            theta = pm.Deterministic("theta", mu + tau * eta)
        else:
            theta = pm.Normal("theta", mu, tau, shape=8)
        if form in ("centered", "noncentered"):
            # y_j -+ s_j / 2 with sd s_j sqrt(2): the likelihood of theta_j of (y_j, s_j)
            half = 0.5 * SCHOOLS_SIGMA
            school = np.r_[np.arange(8), np.arange(8)]
            y = np.r_[SCHOOLS_Y - half, SCHOOLS_Y + half]
            sd = np.sqrt(2.0) * np.r_[SCHOOLS_SIGMA, SCHOOLS_SIGMA]
            pm.Normal("y", theta[school], sd, observed=y)
        else:
            pm.Normal("y", theta, SCHOOLS_SIGMA, observed=SCHOOLS_Y)
    return model


def case_schools(form: str) -> Case:
    text = {
        "centered": "eight schools, centered (each estimate as two observations)",
        "noncentered": "eight schools, non-centered (each estimate as two observations)",
        "local": "eight schools, centered, one observation a school (theta a local)",
    }[form]
    return Case(
        schools_model(form),
        text,
        quantities={"tau": _draws("tau"), "theta[0]": _draws("theta", 0)},
        reference=lambda: schools_model("reference"),
    )


def build_case(name: str) -> Case:
    if name == "glm_logistic":
        return case_glm_logistic()
    if name.startswith("glmm_"):
        _, data, tag, *point = name.split("_")
        return case_glmm(data, tag == "centered", point == ["point"])
    builders = {
        "pmf_synth": lambda: case_pmf_synth(False),
        "pmf_synth_V_fixed": lambda: case_pmf_synth(True),
        "pmf_synth_V_fixed_rows40": lambda: case_pmf_synth(True, keep_rows=40),
        "pmf_synth_V_fixed_rows8": lambda: case_pmf_synth(True, keep_rows=8),
        "pmf_small_K1": lambda: case_pmf_synth(False, 40, 30, 1, 600),
        "pmf_small_K1_V_fixed": lambda: case_pmf_synth(True, 40, 30, 1, 600),
        "pmf_small_K2": lambda: case_pmf_synth(False, 20, 15, 2, 300),
        "insteval_binary": case_insteval,
        "bimodal": case_bimodal,
        "horseshoe": lambda: case_horseshoe(False),
        "horseshoe_regularized": lambda: case_horseshoe(True),
        "schools_centered": lambda: case_schools("centered"),
        "schools_noncentered": lambda: case_schools("noncentered"),
        "schools_local": lambda: case_schools("local"),
    }
    return builders[name]()


# ============================================================================ worker
def vmhwm_mb() -> float:
    """Peak resident memory of this process so far (``VmHWM``, MB)."""
    return pmf_bench.rss_mb()


def observed_values(model) -> list:
    """The observed data arrays (constants or ``pm.Data``)."""
    out = []
    for obs in model.observed_RVs:
        value = model.rvs_to_values[obs]
        out.append(np.asarray(value.get_value() if hasattr(value, "get_value") else value.data))
    return out


def data_key(model, nuts: dict) -> str:
    """Hash of the observed data and the NUTS settings (the cache key of NUTS draws)."""
    h = hashlib.sha1()
    for values in observed_values(model):
        h.update(np.ascontiguousarray(values).tobytes())
    h.update(json.dumps(nuts, sort_keys=True).encode())
    h.update(str(sorted(v.name for v in model.free_RVs)).encode())
    return h.hexdigest()[:10]


def moments(x, log_weights=None) -> dict:
    if log_weights is None:
        return {"mean": float(np.mean(x)), "sd": float(np.std(x, ddof=1))}
    w = np.exp(log_weights - logsumexp(log_weights))
    mean = float(np.sum(w * x))
    return {"mean": mean, "sd": float(np.sqrt(np.sum(w * (x - mean) ** 2)))}


def run_nuts(case: Case, reuse: bool) -> dict:
    """NUTS draws of the case's quantities (cached), with divergences, r-hat and ESS."""
    import arviz as az
    import pymc as pm

    settings = NUTS | case.nuts
    model = case.reference()
    path = (
        CACHE / f"psis_nuts_{data_key(model, settings | {'quantities': list(case.quantities)})}.npz"
    )
    if reuse and path.exists():
        z = np.load(path)
        log(f"  NUTS: reusing {path.name}")
        out = {k[2:]: z[k] for k in z.files if k.startswith("q_")}
        return {"draws": out, "stats": json.loads(str(z["stats"])) | {"cached": True}}
    log(f"  NUTS: {settings}")
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with model:
            idata = pm.sample(
                settings["draws"],
                tune=settings["tune"],
                chains=settings["chains"],
                cores=2,
                target_accept=settings["target_accept"],
                random_seed=SEED,
                progressbar=False,
                compute_convergence_checks=False,
            )
    post = idata.posterior
    draws = {label: get(post) for label, get in case.quantities.items()}
    chains = {label: d.reshape(post.sizes["chain"], -1) for label, d in draws.items()}
    st = {
        "wall": time.perf_counter() - t0,
        "settings": settings,
        "divergences": int(np.asarray(idata.sample_stats["diverging"].values).sum()),
        "rhat": {k: float(az.rhat(v[:, :, None])[0]) for k, v in chains.items()},
        "ess": {k: float(az.ess(v[:, :, None])[0]) for k, v in chains.items()},
        "chain_means": {k: [float(m) for m in v.mean(1)] for k, v in chains.items()},
    }
    CACHE.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        path, **{"q_" + k: v for k, v in draws.items()}, stats=np.asarray(json.dumps(st))
    )
    return {"draws": draws, "stats": st | {"cached": False}}


def run_case(name: str, reuse_nuts: bool) -> dict:
    """Fit, diagnose and (for the poor cases) compare; one case, in this process."""
    import pymc as pm

    import pymc_mcssvi  # noqa: F401  (registers the methods)

    case = build_case(name)
    model = case.model
    out = {
        "case": name,
        "description": case.description,
        "observations": int(sum(v.size for v in observed_values(model))),
        "peak_mb_model": vmhwm_mb(),
        "plugin_path": str(Path(pymc_mcssvi.__file__).parent),
    }
    t0 = time.perf_counter()
    with model, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        approx = pm.fit(
            method="hmcssvi",
            progressbar=False,
            random_seed=SEED,
            diagnose=False,
            **case.fit_kwargs,
        )
    out["fit_s"] = time.perf_counter() - t0
    out["peak_mb_fit"] = vmhwm_mb()
    out["iterations"] = len(approx.hist)
    out["converged"] = approx.converged
    out["fit_warnings"] = sorted(
        {
            f"{w.category.__name__}: {str(w.message)[:200]}"
            for w in caught
            if not issubclass(w.category, DeprecationWarning | FutureWarning)
        }
    )
    out["groups"] = [[g.short_name, int(g.ddim)] for g in approx.groups]
    out["coordinates"] = sum(
        d for kind, d in out["groups"] if kind in ("structured_gaussian", "rayleigh")
    )
    t0 = time.perf_counter()
    try:
        diag = approx.diagnose(DRAWS, random_seed=SEED)
    except NotImplementedError as err:
        out["diagnose_error"] = str(err)
        out["peak_mb"] = vmhwm_mb()
        return out
    out["diagnose_s"] = time.perf_counter() - t0
    out["peak_mb"] = vmhwm_mb()
    out.update(
        khat=diag.khat,
        ess=diag.ess,
        draws=diag.draws,
        trustworthy=diag.trustworthy,
        log_evidence=diag.log_evidence,
        log_ratio_sd=float(np.std(diag.log_ratios)),
        log_ratio_iqr=float(np.subtract(*np.percentile(diag.log_ratios, [75, 25]))),
        conditional_on=diag.conditional_on,
        summary=diag.summary(),
    )
    if not case.quantities:
        return out
    with model, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q_post = approx.sample(Q_DRAWS, random_seed=SEED).posterior
        proposal = approx.trace_from_samples(diag.points).posterior
    exact = case.exact() if case.exact else {}
    nuts = run_nuts(case, reuse_nuts) if case.reference else None
    out["quantities"] = {}
    for label, get in case.quantities.items():
        x = get(proposal)
        row = {
            "q": moments(get(q_post)),
            "proposal": moments(x),
            "reweighted": moments(x, diag.log_weights),
        }
        if nuts is not None:
            row["nuts"] = moments(nuts["draws"][label])
        if label in exact:
            row["exact"] = dict(zip(("mean", "sd"), exact[label], strict=True))
        out["quantities"][label] = row
    if nuts is not None:
        out["nuts"] = nuts["stats"]
    return out


def worker_main(name: str, path: str, reuse_nuts: bool) -> None:
    import logging

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("pymc").setLevel(logging.ERROR)
    logging.getLogger("pytensor").setLevel(logging.ERROR)
    try:
        res = run_case(name, reuse_nuts)
    except Exception as e:  # recorded, the benchmark goes on
        traceback.print_exc()
        res = {"case": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    common.save_json(res, path)


def sources_sha1(root: Path) -> str:
    """Hash of ``root/pymc_mcssvi/**/*.py`` (as ``common.code_state`` hashes the repository's)."""
    h = hashlib.sha1()
    for f in sorted((Path(root) / "pymc_mcssvi").rglob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def run_worker(name: str, reuse_nuts: bool, checkout: str) -> dict:
    """The case in a subprocess of its own (its own ``VmHWM``), importing
    ``pymc_mcssvi`` from ``checkout``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (checkout, env.get("PYTHONPATH")) if p)
    args = [name, *(["--reuse-nuts"] if reuse_nuts else [])]
    # each case is a data set with its fit; the commit is the repository's at the start
    # of the case (the worker imports the plugin from ``checkout``)
    record = common.run_record("full", checkout=checkout)
    t0 = time.perf_counter()
    res = common.run_worker(__file__, args, {"case": name}, WORKER_TIMEOUT, env=env)
    res["worker_s"] = time.perf_counter() - t0
    res["run"] = record
    return res


def snapshot_sources(tmp: str) -> str:
    """A copy of the repository's ``pymc_mcssvi`` in ``tmp``: the sources of the whole run,
    whatever is edited in the checkout meanwhile."""
    shutil.copytree(
        common.REPO_ROOT / "pymc_mcssvi",
        Path(tmp) / "pymc_mcssvi",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return tmp


# ============================================================================ report
def _pm(m: dict | None) -> str:
    return "–" if not m else f"{m['mean']:.3g} ± {m['sd']:.3g}"


def _pm_z(m: dict, ref: dict | None) -> str:
    """``mean ± sd (z)``, z the mean's distance from the reference's in its sds."""
    if not ref:
        return _pm(m)
    return f"{_pm(m)} ({(m['mean'] - ref['mean']) / ref['sd']:+.2f})"


def render(results: dict) -> str:
    meta = results["meta"]
    mach = meta["machine"]
    code = meta.get("code_start", {})
    v = meta["versions"]
    L = ["(bench-psis)=", "## PSIS diagnostics (k-hat)", ""]
    L.append(
        f"Run {meta['date']} on {mach.get('cpu_model', mach.get('machine'))} "
        f"({mach.get('cpu_count')} logical CPUs, shared; {mach.get('mem_total_gb')} GB; load "
        f"average {meta.get('load_start')} at the start, {meta.get('load_end')} at the end), "
        f"PyMC {v.get('pymc')}, PyTensor {v.get('pytensor')}, NumPy {v.get('numpy')}, ArviZ "
        f"{v.get('arviz')}, commit {code.get('commit')}"
        + (" with uncommitted changes to the plugin" if code.get("plugin_dirty") else "")
        + f"; pymc_mcssvi from {meta.get('checkout')} (sources sha1 {meta.get('sources_sha1')})."
        + f" Total {meta.get('total_wall', 0) / 60:.0f} min."
        + "".join(
            f" {', '.join(later['cases'])}: run {later['date']} (load {later.get('load_start')}), "
            f"commit {later['code_start'].get('commit')}, sources sha1 {later['sources_sha1']}."
            for later in meta.get("later_runs", [])
        )
        + " Reproduce: "
        "`python benchmarks/psis.py` (`--only CASE,...`, `--reuse-nuts`); raw numbers in "
        "`benchmarks/results/psis.json`."
    )
    L.append("")
    L.append(
        f'Each case: `pm.fit(method="hmcssvi", diagnose=False, random_seed={SEED})` (defaults '
        f"otherwise), then `approx.diagnose(random_seed={SEED})` ({DRAWS} draws), in a process "
        "of its own. *fit s*: wall clock of `pm.fit` (recognition and compilation included, "
        "the user's compile cache); *diagnose s*: of `approx.diagnose`; *coordinates*: of q's "
        'Gaussian and Rayleigh groups (what `diagnose="auto"` counts, up to 100); *peak MB*: '
        "`VmHWM` after the fit / after the diagnosis. k-hat below 0.7 (below 0.5: very good) "
        "says q is a good match to the posterior."
    )
    L.append("")
    rows = []
    for name, r in results["cases"].items():
        if r.get("error"):
            rows.append([name, r["error"][:150], *[""] * 7])
            continue
        it = f"{r['iterations']}" + ("" if r.get("converged") is not False else ", cap")
        if r.get("diagnose_error"):
            khat, ess, ds = "refused: locals integrated out", "–", "–"
        else:
            khat, ess, ds = f"{r['khat']:.2f}", f"{r['ess']:.0f}", f"{r['diagnose_s']:.2f}"
        rows.append(
            [
                name,
                r["description"],
                f"{r['coordinates']:,}",
                f"{r['observations']:,}",
                f"{r['fit_s']:.1f} ({it})",
                ds,
                khat,
                ess,
                f"{r['peak_mb_fit']:.0f} / {r['peak_mb']:.0f}",
            ]
        )
    L.append(
        common.markdown_table(
            [
                "case",
                "model",
                "coordinates",
                "observations",
                "fit s (iterations)",
                "diagnose s",
                "k-hat",
                f"ESS of {DRAWS}",
                "peak MB fit / diagnosis",
            ],
            rows,
        )
    )
    L.append("")
    rows = []
    for name, r in results["cases"].items():
        for label, q in (r.get("quantities") or {}).items():
            ref = q.get("exact") or q.get("nuts")
            rows.append(
                [
                    name,
                    f"{r['khat']:.2f}",
                    label,
                    _pm(q.get("nuts")) + (f" (exact {_pm(q['exact'])})" if q.get("exact") else ""),
                    *(_pm_z(q[k], ref) for k in ("q", "proposal", "reweighted")),
                ]
            )
    if rows:
        L.append("### Poor fits: does reweighting help?\n")
        L.append(
            "Posterior mean ± sd; in brackets the mean's distance from the reference's in the "
            "reference's sds (the exact posterior where it is given, NUTS otherwise). "
            f"*q*: `approx.sample({Q_DRAWS})` (with the post-fit views of q(h)); *q's Gaussian "
            "draws*: the diagnosis' own draws from the Gaussian q the bound fitted; "
            "*reweighted*: the same draws weighted by their Pareto-smoothed weights (what "
            "`Diagnosis.sample()` resamples from)."
        )
        L.append("")
        L.append(
            common.markdown_table(
                ["case", "k-hat", "quantity", "NUTS", "q", "q's Gaussian draws", "reweighted"],
                rows,
            )
        )
        L.append("")
        nuts_notes = []
        for name, r in results["cases"].items():
            st = r.get("nuts")
            if st:
                s = st["settings"]
                nuts_notes.append(
                    f"{name}: {s['chains']} chains x {s['draws']} draws after {s['tune']} tuning "
                    f"steps, target_accept {s['target_accept']}, {st['divergences']} divergences, "
                    "r-hat "
                    + ", ".join(f"{k} {v:.3f}" for k, v in st["rhat"].items())
                    + "; ESS "
                    + ", ".join(f"{k} {v:.0f}" for k, v in st["ess"].items())
                )
        L.append("NUTS runs: " + "; ".join(nuts_notes) + ".")
        L.append("")
    if results.get("analysis"):
        L.append("### Discussion\n")
        L.append(results["analysis"])
        L.append("")
    notes = []
    for name, r in results["cases"].items():
        if r.get("converged") is False:
            notes.append(f"{name}: the fit stopped at its cap of {r['iterations']} iterations.")
        if r.get("diagnose_error"):
            notes.append(f"{name}: `diagnose` refused: {r['diagnose_error']}")
        for w in r.get("fit_warnings", []):
            notes.append(f"{name}, warning during the fit: {w}")
    if notes:
        L.append("### Notes\n")
        L.extend(f"- {n}" for n in notes)
        L.append("")
    return "\n".join(L)


# ============================================================================ main
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--only", default=None, help="comma-separated cases: " + ",".join(CASES))
    parser.add_argument("--reuse-nuts", action="store_true", help="reuse cached NUTS draws")
    parser.add_argument("--no-docs", action="store_true", help="do not touch docs/benchmarks.md")
    parser.add_argument(
        "--checkout",
        default=None,
        help="import pymc_mcssvi from this directory (default: a copy of the repository's "
        "pymc_mcssvi taken at the start)",
    )
    parser.add_argument(
        "--report-from", default=None, help="re-render the docs section from a results JSON"
    )
    parser.add_argument(
        "--analysis",
        default=None,
        help="with --report-from: a markdown file whose text becomes the Discussion (saved in the JSON)",
    )
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.out, args.reuse_nuts)
    out_path = RESULTS / "psis.json"
    if args.report_from:
        results = json.loads(Path(args.report_from).read_text())
        if args.analysis:
            results["analysis"] = Path(args.analysis).read_text().strip()
            common.save_json(results, args.report_from)
        common.write_section(SECTION, render(results), common.DOCS_PATH)
        log(f"wrote section '{SECTION}' of {common.DOCS_PATH}")
        return results
    names = CASES if not args.only else [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {CASES}")
    meta = {
        "date": common.today(),
        "machine": common.machine_info(),
        "versions": common.library_versions(
            ("pymc", "pytensor", "numpy", "arviz", "arviz_stats", "numba", "jax", "pymc_mcssvi")
        ),
        "seed": SEED,
        "draws": DRAWS,
        "nuts": NUTS,
        "load_start": common.loadavg(),
        "code_start": common.code_state(),
        "cases": names,
    }
    tmp = tempfile.TemporaryDirectory(prefix="psis_sources_")
    checkout = args.checkout or snapshot_sources(tmp.name)
    meta["checkout"] = args.checkout or "a copy of the repository's pymc_mcssvi taken at the start"
    meta["sources_sha1"] = sources_sha1(checkout)
    results = {"meta": meta, "cases": {}}
    run = meta
    if args.only and out_path.exists():
        # add to an earlier run: its meta stays, this run is recorded beside it
        old = json.loads(out_path.read_text())
        results = old | {"cases": {k: v for k, v in old["cases"].items() if k not in names}}
        results["meta"].setdefault("later_runs", []).append(meta)
    t_start = time.perf_counter()
    for name in names:
        log(f"{name}")
        r = run_worker(name, args.reuse_nuts, checkout)
        results["cases"][name] = r
        log(
            f"  fit {fmt(r.get('fit_s'), '.1f')} s, diagnose {fmt(r.get('diagnose_s'), '.2f')} s, "
            f"k-hat {fmt(r.get('khat'), '.2f')}, ESS {fmt(r.get('ess'), '.0f')}, coordinates "
            f"{r.get('coordinates')}, peak {fmt(r.get('peak_mb'), '.0f')} MB"
            + (f" -- {r['error']}" if r.get("error") else "")
            + (" -- diagnose refused" if r.get("diagnose_error") else "")
        )
        common.save_json(results, out_path)  # partial results survive an interruption
    results["cases"] = {k: results["cases"][k] for k in CASES if k in results["cases"]}
    run["load_end"] = common.loadavg()
    run["code_end"] = common.code_state()
    run["total_wall"] = time.perf_counter() - t_start
    tmp.cleanup()
    common.save_json(results, out_path)
    log(f"wrote {out_path}")
    if not args.no_docs:
        common.write_section(SECTION, render(results), common.DOCS_PATH)
        log(f"wrote section '{SECTION}' of {common.DOCS_PATH}")
    return results


if __name__ == "__main__":
    main()
