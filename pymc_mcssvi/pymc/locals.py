"""The approximation's group of the marginalized local latents (their posteriors are
computed after the fit, :mod:`~pymc_mcssvi.posterior.locals`)."""

from __future__ import annotations

import collections

import numpy as np
import pytensor
import pytensor.tensor as pt
from pymc.variational.opvi import Group, node_property

__all__ = ["LocalGroup", "init_marginal_layout", "initial_local_params"]


def init_marginal_layout(group, members, params):
    """Lay out ``group``'s flat input over ``members`` (``name``, ``rv``, ``shape``) with
    the shared containers ``params[name]`` (a dict of them) as its parameters.

    :class:`~pymc.variational.opvi.Group`'s own ``__init_group__`` refuses
    discrete variables; locals and predictive leaves may be discrete.
    """
    group.input = pt.vector(type(group).__name__ + "_symbolic_input")
    group.replacements = collections.OrderedDict()
    group.ordering = collections.OrderedDict()
    start = 0
    for m in members:
        size = int(np.prod(m.shape, dtype=int))
        value = group.model.rvs_to_values[m.rv]
        vr = group.input[..., start : start + size].reshape(m.shape).astype(value.dtype)
        group.replacements[value] = vr
        group.ordering[value.name] = (value.name, slice(start, start + size), m.shape, value.dtype)
        start += size
    group.symbolic_initial = group._initial_type(type(group).__name__ + "_symbolic_initial_tensor")
    group.shared_params = {f"{m.name}_{k}": v for m in members for k, v in params[m.name].items()}
    group._finalize_init()


class LocalGroup(Group):
    """Independent marginal posteriors of the local latents (see the module docstring)."""

    __param_spec__ = {"local_marginals": ("d",)}
    short_name = "local_marginals"
    has_logq = False

    def __init_group__(self, group):
        self.group = group
        self.locals = self._kwargs["locals"]
        self._local_params = self._kwargs["local_params"]
        init_marginal_layout(self, self.locals, self._local_params)

    @node_property
    def symbolic_random(self):
        z = self.symbolic_initial
        parts, start = [], 0
        for lc in self.locals:
            size = int(np.prod(lc.shape, dtype=int))
            zi = z[:, start : start + size]
            p = self._local_params[lc.name]
            if lc.kind == "gaussian":
                parts.append(p["mean"].reshape((-1,))[None] + p["sd"].reshape((-1,))[None] * zi)
            else:
                u = 0.5 * pt.erfc(-zi / np.sqrt(2.0))  # uniform
                cdf = pt.cumsum(p["probs"].reshape((size, -1)), axis=-1)
                parts.append(pt.sum(pt.lt(cdf[None], u[..., None]), axis=-1).astype("float64"))
            start += size
        return pt.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]

    @node_property
    def mean(self):
        out = []
        for lc in self.locals:
            p = self._local_params[lc.name]
            if lc.kind == "gaussian":
                out.append(p["mean"].reshape((-1,)))
            else:
                probs = p["probs"].reshape((int(np.prod(lc.shape)), -1))
                out.append(probs @ pt.arange(probs.shape[-1]).astype("float64"))
        return pt.concatenate(out)

    @node_property
    def std(self):
        out = []
        for lc in self.locals:
            p = self._local_params[lc.name]
            if lc.kind == "gaussian":
                out.append(p["sd"].reshape((-1,)))
            else:
                probs = p["probs"].reshape((int(np.prod(lc.shape)), -1))
                k = pt.arange(probs.shape[-1]).astype("float64")
                m = probs @ k
                out.append(pt.sqrt(pt.maximum(probs @ pt.square(k) - pt.square(m), 0.0)))
        return pt.concatenate(out)

    @node_property
    def cov(self):
        return pt.diag(pt.square(self.std))


def initial_local_params(locals_):
    """Shared containers for the marginal posteriors (filled after the fit)."""
    out = {}
    for lc in locals_:
        n = int(np.prod(lc.shape, dtype=int))
        if lc.kind == "gaussian":
            out[lc.name] = {
                "mean": pytensor.shared(np.zeros(lc.shape), f"{lc.name}_post_mean"),
                "sd": pytensor.shared(np.ones(lc.shape), f"{lc.name}_post_sd"),
            }
        else:
            out[lc.name] = {
                "probs": pytensor.shared(
                    np.full((n, lc.support), 1.0 / lc.support), f"{lc.name}_post_probs"
                )
            }
    return out
