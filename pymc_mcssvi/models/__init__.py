"""Builders for the paper's model families as plain PyMC models, and offline data loaders."""

from pymc_mcssvi.models.gme import gme
from pymc_mcssvi.models.pmf import load_insteval, load_reuters_counts, pmf
from pymc_mcssvi.models.sparse_gp import sparse_gp

__all__ = ["gme", "load_insteval", "load_reuters_counts", "pmf", "sparse_gp"]
