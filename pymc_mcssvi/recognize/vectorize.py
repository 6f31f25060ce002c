"""Batching of graphs over leading axes, with the plugin's own rules for two ops.

:func:`vectorize_graph` is PyTensor's ``vectorize_graph`` (the same traversal, node by
node, through PyTensor's ``_vectorize_node`` dispatch) except for the ops in
:data:`LOCAL_RULES`, which are batched by the plugin's rules instead. Nothing is
registered in PyTensor's dispatch table: other libraries in the process keep
PyTensor's own behaviour.

=====================  =====================================================
op                     batched as
=====================  =====================================================
``DisconnectedGrad``   itself (it is elementwise): PyTensor's fallback, a
                       ``Blockwise``, loops over the batch in Python and is
                       not removed by canonicalization
``IfElse``             an ``ifelse`` on the unbatched condition whose branches
                       are broadcast to the batch shape (lazy evaluation
                       kept); PyTensor's fallback, a ``Blockwise`` of the
                       lazy op, cannot run on the Python backend
=====================  =====================================================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.conditional import ifelse
from pytensor.conditional.op import IfElse
from pytensor.gradient import DisconnectedGrad
from pytensor.graph.basic import Apply, Variable
from pytensor.graph.replace import _vectorize_node, graph_replace
from pytensor.graph.traversal import graph_inputs, io_toposort, toposort, truncated_graph_inputs
from pytensor.tensor.blockwise import vectorize_node_fallback
from pytensor.tensor.shape import Shape, Shape_i

from pymc_mcssvi.recognize.graph import depends_on_any

__all__ = ["LOCAL_RULES", "jacobian", "shapes_at_fixed", "vectorize_graph"]


def _unchanged_op(op, node, *batched_inputs):
    """The same op on the batched inputs (for elementwise ops)."""
    return op.make_node(*batched_inputs).outputs


def _batched_ifelse(op, node, cond, *inputs):
    """An ``ifelse`` on an unbatched condition batched over its branches' leading axes.

    The phase switch of a matrix factorization's step is batched over q(h)'s sigma
    points when prior scales are hyperparameters. Both branches are broadcast to the
    batch shape inside the branch, so the lazy evaluation still computes only the
    chosen one. A batched condition (an elementwise choice) takes PyTensor's fallback.
    """
    if cond.type.ndim > node.inputs[0].type.ndim:
        return vectorize_node_fallback(op, node, cond, *inputs)
    n = op.n_outs
    old = node.inputs[1:]
    batch = max(new.ndim - o.ndim for new, o in zip(inputs, old, strict=True))
    if batch == 0:
        return op.make_node(cond, *inputs).outputs
    padded = [
        pt.shape_padleft(new, batch - (new.ndim - o.ndim))
        for new, o in zip(inputs, old, strict=True)
    ]
    then, other = [], []
    for t, e in zip(padded[:n], padded[n:], strict=True):
        t, e = pt.broadcast_arrays(t, e)
        then.append(t)
        other.append(e)
    outs = ifelse(cond, then, other, name=op.name)
    return outs if isinstance(outs, list) else [outs]


#: Op types batched by the plugin's own rule (see the module docstring).
LOCAL_RULES = {DisconnectedGrad: _unchanged_op, IfElse: _batched_ifelse}


def _vectorized_node(node, batched_inputs):
    for cls, rule in LOCAL_RULES.items():
        if isinstance(node.op, cls):
            return rule(node.op, node, *batched_inputs)
    out = _vectorize_node(node.op, node, *batched_inputs)
    return out.outputs if isinstance(out, Apply) else out


def vectorize_graph(
    outputs: Variable | Sequence[Variable], replace: Mapping[Variable, Variable]
) -> Variable | list[Variable]:
    """``outputs`` with the variables in ``replace`` given extra leading (batch) axes.

    PyTensor's ``vectorize_graph`` with :data:`LOCAL_RULES`.

    Examples
    --------
    >>> import numpy as np, pytensor.tensor as pt
    >>> from pytensor.gradient import disconnected_grad
    >>> x = pt.vector("x")
    >>> y = disconnected_grad(pt.exp(x)) + x
    >>> xs = pt.matrix("xs")
    >>> ys = vectorize_graph(y, {x: xs})
    >>> type(ys.owner.inputs[0].owner.op).__name__  # not a Blockwise
    'DisconnectedGrad'
    >>> ys.eval({xs: np.zeros((2, 3))}).tolist()
    [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    """
    seq = list(outputs) if isinstance(outputs, Sequence) else [outputs]
    if not all(isinstance(k, Variable) and isinstance(v, Variable) for k, v in replace.items()):
        raise ValueError(f"Some of the replaced items are not Variables: {replace}")
    inputs = truncated_graph_inputs(seq, ancestors_to_include=replace.keys())
    new = {inp: replace.get(inp, inp) for inp in inputs}
    for node in toposort(seq, blockers=inputs):
        batched = _vectorized_node(node, [new.get(i, i) for i in node.inputs])
        for out, vout in zip(node.outputs, batched, strict=True):
            new.setdefault(out, vout)
    result = [new[o] for o in seq]
    return result if isinstance(outputs, Sequence) else result[0]


def jacobian(y: Variable, x: Variable) -> Variable:
    """``d y / d x`` of a vector ``y`` of a vector ``x`` (static length): the gradients of
    ``y . e_i`` batched over the rows ``e_i`` of the identity (PyTensor's
    ``jacobian(vectorize=True)``, batched by :func:`vectorize_graph`).

    Examples
    --------
    >>> import numpy as np, pytensor.tensor as pt
    >>> x = pt.vector("x", shape=(2,))
    >>> jacobian(pt.stack([x[0] * x[1], x[0] ** 2]), x).eval({x: [2.0, 3.0]}).tolist()
    [[3.0, 2.0], [4.0, 0.0]]
    """
    n = x.type.shape[-1]
    if n is None:
        raise ValueError("jacobian needs a static length of x")
    e = pt.vector("jacobian_direction", shape=(n,), dtype=y.dtype)
    row = pt.grad(pt.sum(y * e), x, disconnected_inputs="ignore")
    return vectorize_graph(row, {e: pt.eye(n, dtype=y.dtype)})


def shapes_at_fixed(h, outputs):
    """``outputs`` with the shape of every tensor that depends on ``h`` (a variable or
    a list of them, of static shapes) read from the same tensor at ``h = 0``.

    Shapes do not depend on ``h``'s value, but ``vectorize_graph`` over draws of
    ``h`` batches them: ``Reshape`` and ``Alloc`` then get a batch of target shapes,
    become ``Blockwise`` ops whose outputs lose the static length-1 axes of the
    unbatched graph, and the rewrites drop the broadcasts that relied on them
    (an LKJ covariance read as ``z @ chol.T`` indexed a length-1 axis by the
    group index: ``IndexError`` in the step). Read at a fixed ``h`` they stay
    unbatched and the batched graph keeps native ops.
    """
    hs = [h] if isinstance(h, pytensor.graph.basic.Variable) else list(h)
    twins = {
        v: pt.constant(np.zeros(v.type.shape, dtype=v.dtype))
        for v in hs
        if None not in v.type.shape
    }
    nodes = [
        node
        for node in io_toposort(list(graph_inputs(outputs)), outputs)
        if isinstance(node.op, Shape | Shape_i) and depends_on_any(node.inputs[0], hs)
    ]
    if not nodes:
        return list(outputs)
    # one replacement for all of them: the fixed-h copies share their subgraphs
    fixed = graph_replace([node.inputs[0] for node in nodes], twins, strict=False)
    replace = {node.outputs[0]: node.op(x) for node, x in zip(nodes, fixed, strict=True)}
    return graph_replace(outputs, replace, strict=False)
