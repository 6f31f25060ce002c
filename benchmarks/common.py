"""Shared helpers for the hand-run benchmarks in ``benchmarks/``.

Every benchmark script (``glm_logistic.py`` now; GLMM, GME, PMF later) uses the
same conventions, implemented here:

* **Data**: :func:`logistic_regression_data` draws a synthetic Bayesian logistic
  regression (intercept plus correlated Toeplitz features, weights from the prior).
* **Timing**: :class:`IterationRecorder` is a PyMC fit callback
  (``cb(approx, losses, i)``) that stores the wall clock after every iteration,
  the loss history and, on a schedule, copies of the approximation's parameters,
  so that accuracy can be evaluated *after* the run without slowing it down.
  :func:`time_to_within` and :func:`plateau` turn those into "time to reach X".
* **Accuracy**: :func:`heldout_nll` (posterior predictive from draws),
  :func:`gaussian_draws`, :func:`moment_errors` (against a reference posterior,
  usually NUTS).
* **Reporting**: :func:`machine_info`, :func:`library_versions`,
  :func:`markdown_table`, :func:`write_section` (replace one marked section of
  ``docs/benchmarks.md``) and :func:`save_json`.
* **Provenance**: :func:`run_record` (commit, date, machine, load average and
  mode), stored under the key ``"run"`` with every data set and every method /
  run entry of a results file, so that entries merged from different runs
  still say where they come from (``docs/scripts/paper_reproduction.py`` prints
  it on the paper-reproduction page).

Times are ``time.perf_counter()`` seconds. Nothing here imports PyMC, so the
helpers work for NumPyro runs as well.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.linalg import toeplitz
from scipy.special import log_expit, logsumexp

__all__ = [
    "DOCS_PATH",
    "REPO_ROOT",
    "IterationRecorder",
    "LogisticData",
    "gaussian_draws",
    "heldout_nll",
    "legacy_record",
    "library_versions",
    "loadavg",
    "log",
    "log_spaced",
    "logistic_regression_data",
    "machine_info",
    "markdown_table",
    "moment_errors",
    "moving_average",
    "plateau",
    "run_record",
    "save_json",
    "set_run_mode",
    "time_to_within",
    "write_section",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS_PATH = REPO_ROOT / "docs" / "benchmarks.md"

DOCS_HEADER = """# Benchmarks

Measured speed and accuracy of MC-SSVI / H-MC-SSVI / S-DSVI against NUTS, PyMC
ADVI / FullRankADVI and NumPyro. The scripts in `benchmarks/` are run by hand
(not in CI); each one rewrites only its own section below (between its marker
comments) and saves its raw numbers under `benchmarks/results/`.

How to reproduce everything: `make bench` (several hours on 2 cores; runs
each script below in turn). One script: `python benchmarks/glm_logistic.py` (add `--reuse-nuts` to
reuse cached NUTS draws from `benchmarks/.cache/`, `--quick` for a scaled-down
smoke test that does not touch this file).
"""


# --------------------------------------------------------------------------- data
@dataclass
class LogisticData:
    """A synthetic logistic-regression data set with a held-out test split.

    Attributes
    ----------
    X, y : np.ndarray
        Training design ``(n, d)`` (first column is the intercept) and 0/1 labels.
    X_test, y_test : np.ndarray
        Held-out rows drawn from the same model.
    w_true : np.ndarray
        The weights the labels were drawn with (a draw from the prior).
    config : dict
        The arguments of :func:`logistic_regression_data`.
    """

    X: np.ndarray
    y: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray
    w_true: np.ndarray
    config: dict = field(default_factory=dict)


def logistic_regression_data(
    n: int, d: int, n_test: int, rho: float = 0.8, seed: int = 0
) -> LogisticData:
    """Bayesian logistic regression with correlated features.

    Column 0 is an intercept; columns ``1..d-1`` are Gaussian with Toeplitz
    covariance ``rho**|i - j|``. The true weights are drawn from the prior
    ``N(0, I_d)`` and ``y ~ Bernoulli(sigmoid(X w))``. The test rows are drawn
    from the same model with the same weights.

    Parameters
    ----------
    n, n_test : int
        Training and held-out rows.
    d : int
        Number of weights including the intercept.
    rho : float
        Correlation between neighbouring features.
    seed : int
    """
    rng = np.random.default_rng(seed)
    chol = np.linalg.cholesky(toeplitz(rho ** np.arange(d - 1)))
    w = rng.normal(size=d)

    def draw(rows):
        X = np.empty((rows, d))
        X[:, 0] = 1.0
        X[:, 1:] = rng.normal(size=(rows, d - 1)) @ chol.T
        y = (rng.random(rows) < np.exp(log_expit(X @ w))).astype("int64")
        return X, y

    X, y = draw(n)
    X_test, y_test = draw(n_test)
    return LogisticData(X, y, X_test, y_test, w, dict(n=n, d=d, n_test=n_test, rho=rho, seed=seed))


# ------------------------------------------------------------------------ timing
class IterationRecorder:
    """Fit callback that records wall clock, losses and parameter snapshots.

    Use as ``pm.fit(..., callbacks=[rec])``; PyMC calls ``rec(approx, losses, i)``
    after every iteration. Call :meth:`start` immediately before the fit so that
    ``times`` (seconds since the start) include compilation.

    Parameters
    ----------
    snapshot : callable, optional
        ``snapshot(approx) -> object`` returning a *copy* of whatever is needed
        to evaluate the approximation later (e.g. its shared parameter values).
    every : int
        Take a snapshot every ``every`` iterations (and always at iteration 1).
    first : int
        Additionally snapshot each of the first ``first`` iterations.

    Attributes
    ----------
    times : list of float
        Seconds since :meth:`start`, one per iteration.
    losses : list of float
        The loss the fit reported for the iteration (``losses[-1]``).
    snapshots : list of (iteration, time, object)
    """

    def __init__(self, snapshot=None, every: int = 1, first: int = 0):
        self.snapshot = snapshot
        self.every = max(1, int(every))
        self.first = int(first)
        self.t0 = None
        self.times: list[float] = []
        self.losses: list[float] = []
        self.snapshots: list[tuple[int, float, object]] = []
        self._snap_time = 0.0

    def start(self):
        """Set the time origin (call right before the fit)."""
        import time

        self.t0 = time.perf_counter()
        return self

    def __call__(self, approx, losses, i):
        import time

        now = time.perf_counter()
        if self.t0 is None:
            self.t0 = now
        # Time spent taking snapshots is excluded from the clock.
        t = now - self.t0 - self._snap_time
        self.times.append(t)
        self.losses.append(float(losses[-1]) if losses is not None and len(losses) else np.nan)
        k = len(self.times)
        if self.snapshot is not None and (k == 1 or k <= self.first or k % self.every == 0):
            s0 = time.perf_counter()
            self.snapshots.append((k, t, self.snapshot(approx)))
            self._snap_time += time.perf_counter() - s0

    @property
    def overhead(self) -> float:
        """Seconds spent in snapshots (already subtracted from ``times``)."""
        return self._snap_time

    def setup_time(self) -> float:
        """Time before the first iteration started: first time minus a typical iteration."""
        t = np.asarray(self.times)
        if len(t) < 2:
            return float(t[0]) if len(t) else np.nan
        return float(t[0] - np.median(np.diff(t)))

    def per_iteration(self) -> float:
        """Median seconds per iteration (excluding the first)."""
        t = np.asarray(self.times)
        return float(np.median(np.diff(t))) if len(t) > 1 else np.nan


def moving_average(x, window: int) -> np.ndarray:
    """Trailing moving average (the first ``window - 1`` entries average what exists)."""
    x = np.asarray(x, dtype="float64")
    window = max(1, int(window))
    if window == 1:
        return x.copy()
    c = np.cumsum(np.insert(x, 0, 0.0))
    out = np.empty_like(x)
    idx = np.arange(1, len(x) + 1)
    lo = np.maximum(0, idx - window)
    out[:] = (c[idx] - c[lo]) / (idx - lo)
    return out


def time_to_within(times, values, target: float, rel: float | None = None, atol: float = 0.0):
    """First time after which ``values`` stays within a tolerance of ``target``.

    ``values`` are losses (lower is better): the condition is
    ``value - target <= rel * |target| + atol``. Returns ``(time, index)`` of the
    first entry from which the condition holds for every later entry, or
    ``(nan, None)`` if it never does.
    """
    v = np.asarray(values, dtype="float64")
    tol = (0.0 if rel is None else rel * abs(target)) + atol
    ok = np.isfinite(v) & (v - target <= tol)
    return first_sustained(times, ok)


def first_sustained(times, ok):
    """``(time, index)`` of the first True of ``ok`` after which it stays True."""
    ok = np.asarray(ok, dtype=bool)
    if not len(ok) or not ok[-1]:
        return np.nan, None
    bad = np.flatnonzero(~ok)
    i = 0 if not len(bad) else int(bad[-1]) + 1
    return float(np.asarray(times)[i]), i


def plateau(times, losses, rel: float = 0.01, smooth: int | None = None, tail: float = 0.05):
    """When a loss curve reaches its plateau.

    The final loss is the mean of the last ``tail`` fraction of the raw losses;
    the plateau is the first time after which the trailing moving average
    (window ``smooth``, default 1% of the run) stays within ``rel`` of it.

    Returns
    -------
    dict
        ``time``, ``iteration`` (1-based), ``final`` and ``drift``: the relative
        decrease of the smoothed loss over the last 20% of the run (a curve that
        has really plateaued has ``drift`` near 0).
    """
    losses = np.asarray(losses, dtype="float64")
    n = len(losses)
    if smooth is None:
        smooth = max(1, n // 100)
    k = max(1, int(round(tail * n)))
    final = float(np.mean(losses[-k:]))
    sm = moving_average(losses, smooth)
    t, i = time_to_within(times, sm, final, rel=rel)
    j = max(0, int(0.8 * n) - 1)
    drift = float((sm[j] - sm[-1]) / abs(sm[-1])) if n > 5 else np.nan
    return {
        "time": t,
        "iteration": None if i is None else i + 1,
        "final": final,
        "drift": drift,
        "smooth": smooth,
    }


# ---------------------------------------------------------------------- accuracy
def gaussian_draws(mean, cov, n_draws: int, seed: int = 0, z=None) -> np.ndarray:
    """Draws ``(n_draws, d)`` from ``N(mean, cov)``.

    Pass the same standard-normal matrix ``z`` (``(n_draws, d)``) for every
    method to use common random numbers.
    """
    mean = np.asarray(mean, dtype="float64")
    if z is None:
        z = np.random.default_rng(seed).standard_normal((n_draws, mean.size))
    cov = 0.5 * (cov + cov.T)
    try:
        L = np.linalg.cholesky(cov)
    except np.linalg.LinAlgError:
        lam, V = np.linalg.eigh(cov)
        L = V * np.sqrt(np.maximum(lam, 0.0))
    return mean + z @ L.T


def heldout_nll(draws, X, y, chunk: int = 200) -> float:
    """Held-out negative log predictive density per observation (logistic link).

    ``-mean_i log( mean_s p(y_i | w_s) )`` with ``p(y = 1 | w) = sigmoid(x^T w)``,
    computed in log space (``logsumexp`` over draws) in chunks of draws.

    Parameters
    ----------
    draws : np.ndarray
        Posterior draws ``(S, d)``.
    X, y : np.ndarray
        Held-out design and labels.
    """
    draws = np.asarray(draws, dtype="float64")
    sign = np.where(np.asarray(y) == 1, 1.0, -1.0)
    acc = None
    for s in range(0, draws.shape[0], chunk):
        eta = draws[s : s + chunk] @ X.T  # (c, n)
        ll = log_expit(sign[None, :] * eta)
        part = logsumexp(ll, axis=0)
        acc = part if acc is None else np.logaddexp(acc, part)
    lpd = acc - np.log(draws.shape[0])
    return float(-np.mean(lpd))


def moment_errors(mean, sd, ref_mean, ref_sd) -> dict:
    """Posterior-moment errors against a reference (usually NUTS).

    Returns ``rms_z`` (RMS over coordinates of ``(mean - ref_mean) / ref_sd``),
    ``max_z`` and the median / min / max of ``sd / ref_sd``.
    """
    z = (np.asarray(mean) - ref_mean) / ref_sd
    r = np.asarray(sd) / ref_sd
    return {
        "rms_z": float(np.sqrt(np.mean(z**2))),
        "max_z": float(np.max(np.abs(z))),
        "sd_ratio_median": float(np.median(r)),
        "sd_ratio_min": float(np.min(r)),
        "sd_ratio_max": float(np.max(r)),
    }


# --------------------------------------------------------------------- reporting
def machine_info() -> dict:
    """Platform, CPU model, logical CPUs, total memory and current load average."""
    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "processor": platform.processor() or "",
        "cpu_count": os.cpu_count(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    kb = float(line.split()[1])
                    info["mem_total_gb"] = round(kb / 1024**2, 1)
                    break
    except OSError:
        pass
    try:
        info["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return info


def library_versions(names=("pymc", "pytensor", "numpy", "numba", "numpyro", "jax", "pymc_mcssvi")):
    """``{name: version}`` for the importable packages (``"not installed"`` otherwise)."""
    out = {}
    for name in names:
        try:
            mod = importlib.import_module(name)
            out[name] = str(getattr(mod, "__version__", "?"))
        except Exception:
            out[name] = "not installed"
    return out


def today() -> str:
    """The date (ISO, local time) for reports."""
    return _dt.datetime.now().strftime("%Y-%m-%d %H:%M")


def markdown_table(headers, rows) -> str:
    """A GitHub-flavoured markdown table (cells are converted with ``str``)."""
    lines = ["| " + " | ".join(map(str, headers)) + " |"]
    lines.append("|" + "|".join("---" for _ in headers) + "|")
    for r in rows:
        lines.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(lines)


def write_section(name: str, body: str, path: Path | str = DOCS_PATH, header: str = DOCS_HEADER):
    """Replace (or append) the section ``name`` of the benchmarks document.

    The section is delimited by ``<!-- name:start -->`` and ``<!-- name:end -->``;
    everything outside the markers is left alone, so several benchmarks can own
    one section each. A missing file is created with ``header`` first.
    """
    path = Path(path)
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.strip()}\n{end}\n"
    text = path.read_text() if path.exists() else header.rstrip() + "\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end) + r"\n?", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip() + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating | float):
        x = float(x)
        return x if np.isfinite(x) else None
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def save_json(obj, path: Path | str) -> Path:
    """Write ``obj`` as indented JSON (NumPy types converted, NaN/inf as null)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(obj), indent=1) + "\n")
    return path


def fmt(x, spec: str = ".3g", na: str = "–") -> str:
    """Format a number for a table (``na`` for None / NaN)."""
    if x is None:
        return na
    try:
        if not np.isfinite(x):
            return na
    except TypeError:
        return str(x)
    return format(x, spec)


def code_state() -> dict:
    """Git commit of the repository and a hash of the plugin sources on disk.

    ``plugin_sources_sha1`` hashes every ``pymc_mcssvi/**/*.py``; call it at the
    start and the end of a long run to detect sources edited meanwhile.
    """
    import hashlib
    import subprocess

    root = REPO_ROOT / "pymc_mcssvi"
    h = hashlib.sha1()
    for f in sorted(root.rglob("*.py")):
        h.update(f.read_bytes())
    out = {"plugin_sources_sha1": h.hexdigest()[:12]}
    try:
        out["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "pymc_mcssvi"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
        out["plugin_dirty"] = bool(dirty)
    except OSError:
        pass
    return out


_RUN_MODE: str | None = None


def set_run_mode(mode: str | None) -> None:
    """The mode :func:`run_record` stores from now on (``"full"`` or ``"quick"``)."""
    global _RUN_MODE
    _RUN_MODE = mode


def run_record(mode: str | None = None, **extra) -> dict:
    """Where and when a result was measured, for the ``"run"`` key of a results entry.

    ``commit`` (short hash of HEAD), ``plugin_dirty`` (uncommitted changes under
    ``pymc_mcssvi/``) and ``plugin_sources_sha1`` from :func:`code_state`;
    ``date`` (local time, :func:`today`); ``machine`` (:func:`machine_info`
    without its load); ``loadavg`` (1, 5 and 15 minutes, now); ``mode``
    (``"full"`` or ``"quick"``: the argument, else the one set with
    :func:`set_run_mode`); and any ``extra`` keys. Call it when the entry's
    measurement starts: every data set and every method / run entry of a
    results file carries one, so that entries merged from several runs keep
    their own provenance.
    """
    code = code_state()
    machine = machine_info()
    load = machine.pop("loadavg", None)
    rec = {
        "commit": code.get("commit"),
        "plugin_dirty": code.get("plugin_dirty"),
        "plugin_sources_sha1": code.get("plugin_sources_sha1"),
        "date": today(),
        "machine": machine,
        "loadavg": load,
    }
    mode = mode if mode is not None else _RUN_MODE
    if mode is not None:
        rec["mode"] = mode
    rec.update(extra)
    return rec


def legacy_record(meta: dict, **extra) -> dict:
    """A ``run`` record for an entry written before entries carried their own, from the
    results file's ``meta`` (its commit, date, machine and load at the start): used when a
    later run merges new entries into the file and keeps the old ones."""
    code = meta.get("code") or meta.get("code_start") or {}
    machine = dict(meta.get("machine") or {})
    load = meta.get("load_start", machine.pop("loadavg", None))
    machine.pop("loadavg", None)
    rec = {
        "commit": code.get("commit") or meta.get("commit"),
        "plugin_dirty": code.get("plugin_dirty", meta.get("plugin_dirty")),
        "plugin_sources_sha1": code.get("plugin_sources_sha1"),
        "date": meta.get("date"),
        "machine": machine,
        "loadavg": load,
        "mode": "quick" if meta.get("quick") else "full",
        "source": "the file's meta (entry written before per-entry run records)",
    }
    rec.update(extra)
    return rec


def loadavg():
    """1-minute load average (NaN where unavailable)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return np.nan


def log(msg):
    """Print ``msg`` with the time and the load average (benchmark progress lines)."""
    load = ""
    try:
        load = f" (load {os.getloadavg()[0]:.2f})"
    except OSError:
        pass
    print(f"[{time.strftime('%H:%M:%S')}{load}] {msg}", flush=True)


def log_spaced(n_max, k):
    """About ``k`` distinct integers from 1 to ``n_max``, spaced geometrically."""
    return np.unique(np.round(np.geomspace(1, max(2, n_max), k)).astype(int))


def _status_mb(key: str) -> float:
    """A memory field of ``/proc/self/status`` in MB (NaN where unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def vmhwm_mb() -> float:
    """Peak resident memory of this process so far (``VmHWM``, MB; NaN where unavailable)."""
    return _status_mb("VmHWM")


def vmrss_mb() -> float:
    """Current resident memory of this process (``VmRSS``, MB; NaN where unavailable)."""
    return _status_mb("VmRSS")


def run_worker(script, args, label: dict, timeout: float, env=None) -> dict:
    """``python script --worker ARGS --out <json>`` in a process of its own (its own
    ``VmHWM``): the JSON it wrote, or ``label`` with the error when it timed out or
    wrote nothing."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.json"
        cmd = [sys.executable, str(Path(script).resolve()), "--worker", *args, "--out", str(path)]
        try:
            subprocess.run(cmd, check=False, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {**label, "error": f"timed out after {timeout:.0f} s"}
        if not path.exists():
            return {**label, "error": "the worker wrote no result (killed?)"}
        return json.loads(path.read_text())
