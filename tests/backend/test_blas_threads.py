"""BLAS threads of ``blas_threads=None``: one thread unless a single call is large and a
core is idle (:func:`~pymc_mcssvi.backend.compile.blas_threads_for`)."""

import numpy as np
import pymc as pm
import pytensor.tensor as pt
from threadpoolctl import threadpool_info

import pymc_mcssvi
from pymc_mcssvi.backend.compile import BLAS_THREADS_WORK, blas_threads_for


def test_rule():
    assert blas_threads_for(BLAS_THREADS_WORK / 2, 5000, load=0.0, cpus=8) == 1
    assert blas_threads_for(BLAS_THREADS_WORK * 10, 8, load=0.0, cpus=8) == 1
    assert blas_threads_for(BLAS_THREADS_WORK * 10, 512, load=0.0, cpus=8) is None
    assert blas_threads_for(BLAS_THREADS_WORK * 10, 512, load=7.5, cpus=8) == 1
    assert blas_threads_for(BLAS_THREADS_WORK * 10, 512, load=1.0, cpus=1) == 1


def _blas_threads():
    return [d["num_threads"] for d in threadpool_info() if d["user_api"] == "blas"]


def test_small_blocks_with_much_work_use_one_thread():
    """A topic model of 252 coordinates whose Monte Carlo step is estimated above
    BLAS_THREADS_WORK (64 draws): its many small products ran 3-10x slower on two
    OpenBLAS threads than on one."""
    rng = np.random.default_rng(0)
    D, V, K = 50, 50, 3
    C = rng.multinomial(60, np.full(V, 1 / V), size=D)
    with pm.Model():
        eta = pm.Normal("eta", 0, 1, shape=(D, K - 1))
        lb = pm.Normal("logit_beta", 0, 1, shape=(K, V))
        theta = pm.math.softmax(pt.concatenate([eta, pt.zeros((D, 1))], axis=1), axis=-1)
        pm.Multinomial("w", n=C.sum(1), p=theta @ pm.math.softmax(lb, axis=-1), observed=C)
        inf = pymc_mcssvi.HMCSSVI(n_draws=64)
    assert inf.work_estimate() >= BLAS_THREADS_WORK
    with inf._blas_limits(None):
        assert set(_blas_threads()) <= {1}
