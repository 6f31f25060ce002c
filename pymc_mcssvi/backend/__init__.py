"""Compile modes, rewrites and the choice of PyTensor backend for the plugin's functions.

Nothing here is registered globally: the rewrites live in the plugin's own modes
(:mod:`~pymc_mcssvi.backend.modes`).
"""
