"""Predictive leaves in ``approx.sample``.

A free variable that nothing in the model reads (no observed variable, no
potential, no other free variable except such leaves) is a *predictive leaf*:
a prediction written into the model (``pm.Poisson("y_new", pm.math.exp(X_new @
b))``) or PyMC's ``<name>_unobserved`` for missing observations. Its factor of
the posterior is its prior given its parents, so the bound leaves it out (it
integrates to one) and ``approx.sample()`` draws it from that conditional at
each draw of the other variables (:func:`leaf_sampler`): exact for any
distribution, discrete ones included, and the draws carry the joint dependence
on the other variables.

The flat views (``approx.mean``, ``std``, ``cov``) and symbolic draws
(``approx.sample_node``) of the leaves use their marginal means and sds,
computed once after the fit from draws of the approximation
(:func:`leaf_moments`). Leaves are listed in
``posterior.attrs["predictive_leaves"]``.
"""

from __future__ import annotations

import numpy as np
import pytensor.tensor as pt
from pymc.distributions.shape_utils import change_dist_size
from pymc.logprob.utils import replace_rvs_by_values
from pymc.pytensorf import compile as pm_compile
from pymc.pytensorf import reseed_rngs
from pytensor.compile.mode import Mode
from pytensor.graph.traversal import ancestors
from pytensor.tensor.random.type import RandomType

from pymc_mcssvi.posterior.settings import SETTINGS
from pymc_mcssvi.recognize.vectorize import vectorize_graph

__all__ = ["leaf_moments", "leaf_sampler"]


def leaf_sampler(model, leaves):
    """``(samples, random_seed) -> {value name: draws}`` for the predictive leaves.

    ``samples`` holds the draws of every value variable (PyMC's unconstrained
    space) with a leading draws axis. The leaves are drawn jointly from their
    prior given those values (one vectorized, uncompiled function; leaves that
    read other leaves get their parents' new draws) and returned in their
    unconstrained space.
    """
    leaf_rvs = [leaf.rv for leaf in leaves]
    is_leaf = set(leaf_rvs)
    others = [rv for rv in model.free_RVs if rv not in is_leaf]
    values = [model.rvs_to_values[rv] for rv in others]
    draws = replace_rvs_by_values(
        leaf_rvs,
        rvs_to_values=dict(zip(others, values, strict=True)),
        rvs_to_transforms={rv: model.rvs_to_transforms.get(rv) for rv in others},
    )
    outputs = []
    for rv, x in zip(leaf_rvs, draws, strict=True):
        tr = model.rvs_to_transforms.get(rv)
        outputs.append(x if tr is None else tr.forward(x, *x.owner.inputs))
    batched = [pt.TensorType(v.dtype, shape=(None, *v.type.shape))(name=v.name) for v in values]
    replace = dict(zip(values, batched, strict=True))
    # A leaf that reads neither the other variables nor another leaf (an unused
    # prior) gets no draws axis from the vectorization: it is drawn with one.
    inputs = set(values) | set(draws)
    for d in draws:
        if not inputs.intersection(ancestors(d.owner.inputs)):
            replace[d] = change_dist_size(d, (batched[0].shape[0],), expand=True)
    outputs = vectorize_graph(outputs, replace)
    # no rewriting: a one-off function (some linear-algebra rewrites fail on the
    # batched Cholesky of a vectorized gp.conditional)
    mode = Mode(linker="py", optimizer=None)
    fn = pm_compile(batched, outputs, mode=mode, on_unused_input="ignore")
    rngs = [i.variable for i in fn.maker.inputs if isinstance(i.variable.type, RandomType)]
    names = [v.name for v in values]
    per_draw = sum(leaf.size for leaf in leaves)
    size = int(max(1, SETTINGS.leaf_batch_elements // max(per_draw, 1)))

    def draw(samples, random_seed=None):
        if isinstance(random_seed, np.random.SeedSequence):
            random_seed = random_seed.generate_state(4)
        reseed_rngs(rngs, random_seed)
        n = len(next(iter(samples.values())))
        parts = []
        for lo in range(0, n, size):
            parts.append(fn(*[np.asarray(samples[nm][lo : lo + size]) for nm in names]))
        return {
            leaf.value.name: np.concatenate([p[i] for p in parts]).astype(leaf.value.dtype)
            for i, leaf in enumerate(leaves)
        }

    return draw


def leaf_moments(approx, leaves, params, draws=None, random_seed=0):
    """Fill ``params`` with the leaves' marginal means and sds under ``approx``, from
    ``draws`` draws (default ``SETTINGS.leaf_moment_draws``)."""
    if draws is None:
        draws = SETTINGS.leaf_moment_draws
    samples = approx.sample_dict_fn(draws, random_seed=random_seed)
    for leaf in leaves:
        x = np.asarray(samples[leaf.value.name], dtype="float64").reshape(draws, -1)
        params[leaf.name]["mean"].set_value(x.mean(axis=0))
        params[leaf.name]["sd"].set_value(x.std(axis=0))
