"""Natural-gradient structured SVI for two-level PyMC models.

Importing the package registers ``"mcssvi"``, ``"hmcssvi"`` and ``"sdsvi"``
with :func:`pymc.fit`::

    import pymc as pm
    import pymc_mcssvi  # noqa: F401

    with model:
        approx = pm.fit(method="hmcssvi")
    idata = approx.sample(1000)
"""

from pymc_mcssvi import models
from pymc_mcssvi.distributions import Rayleigh
from pymc_mcssvi.exceptions import DivergenceError, UnsupportedModelError
from pymc_mcssvi.pymc.approximation import StructuredApproximation
from pymc_mcssvi.pymc.dask_data import dask_data
from pymc_mcssvi.pymc.diagnostics import Diagnosis, PSISWarning
from pymc_mcssvi.pymc.inference import HMCSSVI, MCSSVI, SDSVI, StructuredVI
from pymc_mcssvi.pymc.load import load
from pymc_mcssvi.pymc.persist import SavedFitError
from pymc_mcssvi.pymc.registration import register as _register
from pymc_mcssvi.recognize.describe import ModelDescription, describe

__all__ = [
    "HMCSSVI",
    "MCSSVI",
    "SDSVI",
    "Diagnosis",
    "DivergenceError",
    "ModelDescription",
    "PSISWarning",
    "Rayleigh",
    "SavedFitError",
    "StructuredApproximation",
    "StructuredVI",
    "UnsupportedModelError",
    "dask_data",
    "describe",
    "load",
    "models",
]

__version__ = "0.1.0.dev0"

_register()
