"""Where a GLMM fit's wall time goes: recognition, compilation, iterations, q(h) work.

Run by hand, e.g. ``python benchmarks/glmm_phases.py grouseticks nc 2`` (data set
from ``benchmarks/glmm.py``; ``nc`` / ``c`` for the non-centered / centered model;
the number of fits in one process: the first is cold, the rest warm). Each line
gives the whole ``pm.fit`` wall time and, in seconds, the phases timed around the
inference's methods (the iterations are the rest: wall minus the phases listed
outside ``compute`` (the hyperparameters' posterior), whose sub-phases are listed after it).
"""

from __future__ import annotations

import functools
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import glmm  # noqa: E402

PHASES = {}


def timed(owner, name):
    """Wrap ``owner.name`` to add its wall time to ``PHASES[name]``."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            PHASES[name] = PHASES.get(name, 0.0) + time.perf_counter() - t0

    setattr(owner, name, wrapper)


def main(argv):
    import pymc as pm

    from pymc_mcssvi.posterior import hyper_marginal, marginal
    from pymc_mcssvi.pymc import inference

    warnings.simplefilter("ignore")
    data_name, param = argv[0], argv[1]
    fits = int(argv[2]) if len(argv) > 2 else 2
    for name in ("__init__", "_step_function"):
        timed(inference.StructuredVI, name)
    for name in ("compute", "_profile_grid"):
        timed(hyper_marginal.HyperMarginal, name)
    timed(marginal.ConditionalProfile, "along_axes")
    timed(marginal.ConditionalProfile, "hessian")
    timed(hyper_marginal, "_node_moments")
    model = glmm.build_model(glmm.LOADERS[data_name](0), param == "c")
    glmm.process_warmup()
    for i in range(fits):
        PHASES.clear()
        t0 = time.perf_counter()
        with model:
            approx = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
        wall = time.perf_counter() - t0
        outside = sum(PHASES.get(k, 0.0) for k in ("__init__", "_step_function", "compute"))
        phases = " ".join(f"{k}={v:.2f}" for k, v in PHASES.items())
        print(
            f"{data_name} {param} fit {i} ({'cold' if i == 0 else 'warm'}): wall {wall:.2f} s, "
            f"{approx.n_iter} iterations ~{wall - outside:.2f} s; {phases}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
