"""Builders for the paper's model families as plain PyMC models."""

from pymc_mcssvi.models.gme import gme

__all__ = ["gme"]
