"""Test configuration.

Everything runs with Python-level PyTensor operations (``FAST_COMPILE``): the
models here are small, and compiling each graph with numba on a cold cache
would cost far more than running it.
"""

import warnings

import numpy as np
import pytensor
import pytest

pytensor.config.mode = "FAST_COMPILE"
warnings.filterwarnings("ignore", message=".*could not link to a BLAS.*")


@pytest.fixture
def rng():
    return np.random.default_rng(20261122)


_NUTS_CACHE: dict = {}


def nuts_draws(model, key, draws=1000, tune=1000, seed=1):
    """Posterior draws by NUTS, cached per test session under ``key``."""
    import pymc as pm

    if key not in _NUTS_CACHE:
        with model:
            idata = pm.sample(
                draws,
                tune=tune,
                chains=2,
                cores=1,
                random_seed=seed,
                progressbar=False,
                compute_convergence_checks=False,
            )
        _NUTS_CACHE[key] = idata
    return _NUTS_CACHE[key]
