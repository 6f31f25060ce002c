"""Matrix factorization at scale against NumPyro's AutoNormal and PyMC's ADVI (issue 52).

Data (``benchmarks/pmf.py``'s ``load_dataset``, K = 20, 80/20 random split of the
observed entries):

* ``synth_binary``, ``synth_count``, ``synth_ordinal``: 1000 x 1000 fully observed
  matrices from the model (800,000 training ratings);
* ``movielens_binary``, ``movielens_ordinal``: a MovieLens-1M-sized synthetic,
  6,040 x 3,706 with 1,000,209 observed entries at skewed positions (800,167 training
  ratings).

Methods, each in its own worker process (``pmf.run_worker``; held-out NLL curves at
log-spaced snapshots, evaluation time excluded from the clock; peak RSS is ``VmHWM``):

* **H-MC-SSVI (defaults)**: ``HMCSSVI(start=...)`` with every option at its default
  (full batch, ``bilinear_draws="auto"``, its own stopping rule), capped at ``CAP`` s;
* **NumPyro AutoNormal**: Adam 0.01, float32, ``CAP`` s (issue 52: "AutoNormal given 5
  minutes");
* **ADVI** (MovieLens only): ``pm.fit(method="advi")``, JAX backend, ``CAP`` s.

Every method starts from the same means (``pmf.start_values``). The issue's targets:
the plugin reaches AutoNormal's final held-out NLL sooner than AutoNormal does and
ends no worse, with peak RSS at most 2 GB in full batch.

Run ``python benchmarks/pmf_scale.py`` (``--only`` data sets, ``--reuse`` cached
workers, ``--report-only``); raw results ``benchmarks/results/pmf_scale.json``, the
section ``pmf_scale`` of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pmf  # noqa: E402
from common import fmt  # noqa: E402

SECTION = "pmf_scale"
RESULTS = pmf.RESULTS / "pmf_scale.json"
CAP = 300.0
DATASETS = ["synth_binary", "synth_count", "synth_ordinal", *pmf.MOVIELENS]
PLUGIN = "H-MC-SSVI"
AUTONORMAL = "NumPyro AutoNormal"
METHODS = {name: [PLUGIN, AUTONORMAL] for name in DATASETS}
for _name in pmf.MOVIELENS:
    METHODS[_name] = [PLUGIN, AUTONORMAL, "ADVI"]
RSS_LIMIT_MB = 2048.0


def config() -> dict:
    """``pmf.FULL`` with every method capped at :data:`CAP` seconds, full batch."""
    cfg = dict(pmf.FULL)
    caps = dict.fromkeys(DATASETS, CAP)
    cfg.update(
        max_seconds={"default": CAP, **caps},
        numpyro_max_seconds=CAP,
        advi_max_seconds={"default": CAP},
        advi_iters=10_000_000,
        numpyro_steps=10_000_000,
        worker_timeout=CAP + 900.0,
        subsample={"default": []},
        full_batch={"default": True},
    )
    return cfg


def plugin_key(rows: dict):
    """The newest plugin row of a data set: :data:`PLUGIN`, else any ``H-MC-SSVI ...`` row."""
    if PLUGIN in rows:
        return PLUGIN
    return next((m for m in rows if m.startswith(PLUGIN)), None)


def analyse(results: dict) -> dict:
    """Per data set: AutoNormal's final level (curve), each method's time to it and final NLL."""
    out = {}
    for name, rows in results.items():
        auto = rows.get(AUTONORMAL, {})
        level = pmf.curve_final(auto) if auto.get("curve") else None
        d = {"level": level, "rows": {}}
        for method, res in rows.items():
            t_level = pmf.time_to_level(res, level) if level is not None else np.nan
            d["rows"][method] = {
                "time_to_level": None if not np.isfinite(t_level) else float(t_level),
                "final_nll": pmf.final_nll(res),
                "curve_final": pmf.curve_final(res) if res.get("curve") else None,
                "peak_rss_mb": res.get("peak_rss_fit_mb"),
            }
        plug, ref = d["rows"].get(plugin_key(rows)), d["rows"].get(AUTONORMAL)
        if plug and ref and plug["time_to_level"] and ref["time_to_level"]:
            d["speedup"] = ref["time_to_level"] / plug["time_to_level"]
        if plug and ref and plug["final_nll"] is not None and ref["final_nll"] is not None:
            d["ends_no_worse"] = bool(plug["final_nll"] <= ref["final_nll"] * (1 + pmf.NLL_REL_TOL))
        out[name] = d
    return out


def _stop(res) -> str:
    if res.get("error"):
        return "error"
    if res.get("stopped_by_time"):
        return "cap"
    return "conv" if res.get("converged") else "iterations"


def render(results: dict, run_info: dict) -> str:
    derived = analyse(results)
    lines = [
        "## Matrix factorization at scale: default fits against AutoNormal and ADVI (issue 52)",
        "",
        f"Run {run_info['date']} on {run_info['machine']}; 1-minute load {run_info['load']}; "
        f"plugin commit {run_info['commit']}. Reproduce: `python benchmarks/pmf_scale.py`. "
        "Data, methods and evaluation as in the module docstring of `benchmarks/pmf_scale.py`: "
        f"every method capped at {CAP:.0f} s (set-up included); the plugin runs with its "
        'defaults (full batch, `bilinear_draws="auto"`, which takes 4 fixed draws per row '
        "of the other factor at this size, and its own stopping rule). *level* is "
        "AutoNormal's final held-out NLL (its curve's last snapshot: 50,000 test entries, "
        "32 draws); *time to level*: first snapshot from which a curve stays within 0.1% of "
        "it (or below); *final NLL*: all test entries, 256 draws.",
        "",
        "| data | method | stop | iterations | fit s | set-up s | s / it. | final NLL | "
        "time to level s | peak RSS MB | load start / end |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in results.items():
        d = derived[name]
        for method, res in rows.items():
            r = d["rows"][method]
            lines.append(
                f"| {name} | {method} | {_stop(res)} | {res.get('iterations', '-')} | "
                f"{fmt(res.get('wall'), '.1f')} | {fmt(res.get('setup_s'), '.1f')} | "
                f"{fmt(res.get('per_iter_s'), '.3g')} | {fmt(r['final_nll'], '.4f')} | "
                f"{fmt(r['time_to_level'], '.1f')} | {fmt(r['peak_rss_mb'], '.0f')} | "
                f"{fmt(res.get('load_start'), '.1f')} / {fmt(res.get('load_end'), '.1f')} |"
            )
    lines += [
        "",
        "| data | AutoNormal's level | plugin sooner by | plugin ends no worse | "
        "plugin peak RSS <= 2 GB (the target of the 1000 x 1000 data) |",
        "|---|---|---|---|---|",
    ]
    for name, d in derived.items():
        key = plugin_key(d["rows"])
        if key is None:
            continue
        plug = d["rows"][key]
        rss = plug.get("peak_rss_mb")
        lines.append(
            f"| {name} ({key}) | {fmt(d['level'], '.4f')} | "
            f"{'x' + fmt(d.get('speedup'), '.1f') if d.get('speedup') else 'never reached'} | "
            f"{'yes' if d.get('ends_no_worse') else 'no'} | "
            f"{'-' if rss is None else ('yes' if rss <= RSS_LIMIT_MB else 'no')} "
            f"({fmt(rss, '.0f')} MB) |"
        )
    for name, rows in results.items():
        for method, res in rows.items():
            if res.get("error"):
                lines.append(f"\n- {name} / {method}: {res['error']}")
    return "\n".join(lines) + "\n"


def main(argv=None):
    pmf.run_section(
        argv,
        __doc__.splitlines()[0],
        RESULTS,
        SECTION,
        DATASETS,
        METHODS.__getitem__,
        config,
        render,
    )


if __name__ == "__main__":
    main()
