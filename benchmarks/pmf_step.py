"""Cost of one matrix-factorization step: compilation and iterations, per factor moved.

Run by hand, e.g. ``python benchmarks/pmf_step.py insteval_binary 5`` (data set from
``benchmarks/pmf.py``, then ``row_subsample``; ``full`` for full batch; a third
argument names the method class, default ``HMCSSVI``). Prints the recognition time,
PyTensor's compilation of the JAX step, its first call (tracing and XLA), and the
median time of the iterations that move V (phase 0) and U (phase 1), which
alternate. The numbers of the CHANGELOG's JAX-step entries come from this script.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pmf  # noqa: E402


def main(argv):
    name = argv[0] if argv else "insteval_binary"
    B = argv[1] if len(argv) > 1 else "5"
    method = argv[2] if len(argv) > 2 else "HMCSSVI"
    warnings.filterwarnings("ignore")
    import pymc_mcssvi

    ds = pmf.load_dataset(name, dict(pmf.FULL), 0)
    model = pmf.build_pymc(ds)
    kw = {} if B == "full" else {"row_subsample": int(B)}
    with model:
        t0 = time.perf_counter()
        inf = getattr(pymc_mcssvi, method)(random_seed=0, start=pmf.start_values(ds, 0), **kw)
        t1 = time.perf_counter()
        step = inf._compile("jax", {})
        t2 = time.perf_counter()
        step()
        t3 = time.perf_counter()
        times = {0: [], 1: []}
        for _ in range(20):
            moving = (int(inf.store.symbolic.phase.get_value()) + 1) % 2  # 0: V moves, 1: U
            a = time.perf_counter()
            step()
            times[moving].append(time.perf_counter() - a)
    print(
        f"{name} B={B} {method}: recognition {t1 - t0:.2f} s, PyTensor compilation "
        f"{t2 - t1:.2f} s, first call (trace + XLA) {t3 - t2:.2f} s; iterations moving "
        f"V {1e3 * np.median(times[0]):.1f} ms, U {1e3 * np.median(times[1]):.1f} ms"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
