"""Numerically stable forms of elementwise log densities before differentiation.

The engine differentiates each likelihood twice in its predictor and evaluates
it at Gauss-Hermite nodes several standard deviations out, where naive forms
round to ``log(0)``. PyTensor's ``stabilize`` pass already rewrites
``log(sigmoid(x))`` to ``-softplus(-x)`` and ``log(erfc(x))`` to an asymptotic
series; the rewrites here expose the probit forms PyMC writes
(``log(0.5 * erfc(-x / sqrt(2)))`` and ``log1p(-0.5 * erfc(-x / sqrt(2)))``) to
that pass.
"""

from __future__ import annotations

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Constant
from pytensor.graph.rewriting.basic import in2out, node_rewriter
from pytensor.graph.rewriting.utils import rewrite_graph
from pytensor.scalar import math as ps_math
from pytensor.tensor.elemwise import Elemwise
from pytensor.tensor.math import erfc, log, log1p, mul, neg, sub

__all__ = ["stable_logp"]


def _const_value(v):
    if isinstance(v, Constant):
        data = np.asarray(v.data)
        if data.size == 1:
            return float(data.reshape(-1)[0])
    if v.owner is not None and v.owner.op.__class__.__name__ == "DimShuffle":
        return _const_value(v.owner.inputs[0])
    return None


def _scaled_erfc(v):
    """Match ``c * erfc(x)`` with a positive constant ``c``; return ``(c, x)``."""
    if v.owner is None:
        return None
    if v.owner.op == erfc:
        return 1.0, v.owner.inputs[0]
    if v.owner.op == mul and len(v.owner.inputs) == 2:
        a, b = v.owner.inputs
        for c, e in ((a, b), (b, a)):
            cv = _const_value(c)
            if cv is not None and cv > 0 and e.owner is not None and e.owner.op == erfc:
                return cv, e.owner.inputs[0]
    return None


@node_rewriter([log])
def _log_scaled_erfc(fgraph, node):
    """``log(c * erfc(x)) -> log(c) + log(erfc(x))`` and
    ``log(1 - 0.5 * erfc(x)) -> log(0.5) + log(erfc(-x))``."""
    (arg,) = node.inputs
    if arg.owner is None or arg.owner.op == erfc:
        return None
    if arg.owner.op == sub:
        one, rest = arg.owner.inputs
        match = _scaled_erfc(rest)
        if _const_value(one) == 1.0 and match is not None and np.isclose(match[0], 0.5):
            return [np.log(0.5) + pt.log(pt.erfc(-match[1]))]
        return None
    match = _scaled_erfc(arg)
    if match is None:
        return None
    c, x = match
    return [np.log(c) + pt.log(pt.erfc(x))]


@node_rewriter([log1p])
def _log1p_minus_half_erfc(fgraph, node):
    """``log1p(-0.5 * erfc(x)) -> log(0.5) + log(erfc(-x))`` since ``2 - erfc(x) = erfc(-x)``."""
    (arg,) = node.inputs
    if arg.owner is None or arg.owner.op != neg:
        return None
    match = _scaled_erfc(arg.owner.inputs[0])
    if match is None or not np.isclose(match[0], 0.5):
        return None
    return [np.log(0.5) + pt.log(pt.erfc(-match[1]))]


@node_rewriter([Elemwise])
def _softplus_to_ufuncs(fgraph, node):
    """``softplus(x) -> max(x, 0) + log1p(exp(-|x|))``.

    The same stable value, written with operations that have NumPy ufuncs:
    PyTensor's scalar softplus has none and runs as a Python loop per element
    when the step is not compiled.
    """
    if not isinstance(node.op.scalar_op, ps_math.Softplus):
        return None
    (x,) = node.inputs
    return [pt.maximum(x, 0.0) + pt.log1p(pt.exp(-pt.abs(x)))]


def stable_logp(logp):
    """Rewrite a log density graph into numerically stable form.

    Examples
    --------
    >>> import numpy as np, pymc as pm, pytensor.tensor as pt
    >>> f = pt.vector("f")
    >>> lp = pm.logp(pm.Bernoulli.dist(p=pm.math.invprobit(f)), np.array([1, 0]))
    >>> np.isfinite(stable_logp(lp).eval({f: np.array([-40.0, 40.0])})).all()
    np.True_
    """
    logp = rewrite_graph(logp, include=("canonicalize",))
    logp = rewrite_graph(
        logp, custom_rewrite=in2out(_log_scaled_erfc, _log1p_minus_half_erfc), clone=True
    )
    logp = rewrite_graph(logp, include=("canonicalize", "stabilize"))
    return rewrite_graph(logp, include=(), custom_rewrite=in2out(_softplus_to_ufuncs), clone=True)
