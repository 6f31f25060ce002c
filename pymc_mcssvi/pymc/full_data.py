"""The model of a ``pm.Minibatch`` fit on all of its rows (the full-data steps that end
such a fit, see ``StructuredVI._polish``)."""

from __future__ import annotations

from pymc.model.core import MODEL_MANAGER
from pymc.model.fgraph import fgraph_from_model, model_from_fgraph
from pymc.model.transform import remove_minibatched_nodes
from pymc.variational.minibatch_rv import MinibatchRandomVariable

__all__ = ["full_data_model"]


def full_data_model(model):
    """The model on all rows of its ``pm.Minibatch`` data: each minibatch replaced by
    the arrays it slices, and the observed variables' ``total_size`` scaling dropped.

    Examples
    --------
    >>> import numpy as np, pymc as pm
    >>> x = np.arange(100.0)
    >>> xb = pm.Minibatch(x, batch_size=10)
    >>> with pm.Model() as m:
    ...     mu = pm.Normal("mu")
    ...     _ = pm.Normal("y", mu, 1, observed=xb, total_size=100)
    >>> full = full_data_model(m)
    >>> full["y"].owner.op.__class__.__name__, full.rvs_to_values[full["y"]].eval().shape
    ('NormalRV', (100,))
    """
    # a model built inside another model's context would be its sub-model
    saved = list(MODEL_MANAGER.active_contexts)
    MODEL_MANAGER.active_contexts.clear()
    try:
        return _rebuilt(model)
    finally:
        MODEL_MANAGER.active_contexts[:] = saved


def _rebuilt(model):
    # PyMC swaps the minibatches for the arrays; the total_size wrappers go here
    fgraph, _ = fgraph_from_model(remove_minibatched_nodes(model))
    pairs = [
        (node.outputs[0], node.inputs[0])
        for node in fgraph.apply_nodes
        if isinstance(node.op, MinibatchRandomVariable)
    ]
    fgraph.replace_all(pairs, import_missing=True)
    return model_from_fgraph(fgraph, mutate_fgraph=True)
