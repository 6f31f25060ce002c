"""The approximation's group of the predictive leaves (their draws and moments come
from :mod:`~pymc_mcssvi.posterior.leaves`)."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
from pymc.variational.opvi import Group, node_property

from pymc_mcssvi.pymc.locals import init_marginal_layout

__all__ = ["LeafGroup", "initial_leaf_params"]


class LeafGroup(Group):
    """Placeholders for the predictive leaves (see the module docstring): their
    marginal means and sds; ``approx.sample`` replaces the draws by exact ones."""

    __param_spec__ = {"leaf_marginals": ("d",)}
    short_name = "predictive_leaves"
    has_logq = False

    def __init_group__(self, group):
        self.group = group
        self.leaves = self._kwargs["leaves"]
        self._leaf_params = self._kwargs["leaf_params"]
        init_marginal_layout(self, self.leaves, self._leaf_params)

    @node_property
    def symbolic_random(self):
        return self.mean[None] + self.std[None] * self.symbolic_initial

    @node_property
    def mean(self):
        return pt.concatenate([self._leaf_params[leaf.name]["mean"] for leaf in self.leaves])

    @node_property
    def std(self):
        return pt.concatenate([self._leaf_params[leaf.name]["sd"] for leaf in self.leaves])

    @node_property
    def cov(self):
        return pt.diag(pt.square(self.std))


def initial_leaf_params(leaves) -> dict:
    """Shared containers for the leaves' marginal moments (filled after the fit)."""
    return {
        leaf.name: {
            "mean": pytensor.shared(np.zeros(leaf.size), f"{leaf.name}_leaf_mean"),
            "sd": pytensor.shared(np.zeros(leaf.size), f"{leaf.name}_leaf_sd"),
        }
        for leaf in leaves
    }
