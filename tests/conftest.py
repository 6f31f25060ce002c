"""Test configuration.

Everything runs with Python-level PyTensor operations (``FAST_COMPILE``): the
models here are small, and compiling each graph with numba on a cold cache
would cost far more than running it. NUTS references are the exception (see
:func:`nuts_draws`).
"""

import warnings

import numpy as np
import pytensor
import pytest

pytensor.config.mode = "FAST_COMPILE"
warnings.filterwarnings("ignore", message=".*could not link to a BLAS.*")

#: Chains of every NUTS reference (draws are per chain).
NUTS_CHAINS = 4


@pytest.fixture
def rng():
    return np.random.default_rng(20261122)


_NUTS_CACHE: dict = {}


def nuts_draws(model, key, draws=2500, tune=1000, seed=1):
    """Posterior draws by NUTS (``NUTS_CHAINS`` chains of ``draws``), cached per session.

    PyMC's sampler on the numba backend, not the suite's ``FAST_COMPILE``: on a
    42-dimensional logistic GLMM 2 x 1000 draws took 188 s under ``FAST_COMPILE``
    and 4 x 2500 take 25-37 s compiled (cold or warm cache). The draws matter as
    much as the time: there two runs of 2 x 1000 draws put the intercept's
    posterior sd at 0.177 and 0.198 where runs of 10,000 give 0.189-0.193, so a
    reference of 2000 draws spent most of a 10% tolerance on sds. (NumPyro's
    sampler is not used: PyTensor's JAX gradient of a censored Weibull likelihood
    is NaN where PyTensor's own is finite, and three of four chains stuck silently.)
    """
    import pymc as pm

    if key not in _NUTS_CACHE:
        with model:
            idata = pm.sample(
                draws,
                tune=tune,
                chains=NUTS_CHAINS,
                cores=1,
                random_seed=seed,
                progressbar=False,
                compute_convergence_checks=False,
                compile_kwargs={"mode": "NUMBA"},
            )
        _NUTS_CACHE[key] = idata
    return _NUTS_CACHE[key]
