"""PyMC model -> :class:`~pymc_mcssvi.recognize.ir.TwoLevelModel` (roles, predictors, layout)."""

from pymc_mcssvi.recognize.describe import ModelDescription, describe
from pymc_mcssvi.recognize.model import recognize

__all__ = ["ModelDescription", "describe", "recognize"]
