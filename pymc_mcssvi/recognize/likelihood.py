"""How an observed log density depends on the Gaussian globals.

Forms (ARCHITECTURE.md §3): *dense affine* (``X @ w``), *gather*
(``a[group]``, random slopes), their sums, *bilinear* (``(U[s] * V[d]).sum(-1)``)
and *general* (anything else: Monte Carlo + autodiff).
"""

from __future__ import annotations

import pytensor.tensor as pt
from pytensor.compile.builders import OpFromGraph
from pytensor.compile.rewriting import inline_ofg_node
from pytensor.graph.basic import Variable
from pytensor.graph.replace import graph_replace
from pytensor.scalar import basic as ps
from pytensor.tensor.blockwise import Blockwise
from pytensor.tensor.elemwise import DimShuffle, Elemwise
from pytensor.tensor.math import Dot, Sum

from pymc_mcssvi.recognize.affine import LinearTerm, _Linearizer
from pymc_mcssvi.recognize.graph import depends_on_any, is_separable
from pymc_mcssvi.recognize.ir import PredictorTerm
from pymc_mcssvi.recognize.stabilize import stable_logp

__all__ = ["find_bilinear", "flatten_terms", "form_name", "likelihood_term", "maximal_affine_nodes"]


def maximal_affine_nodes(logp: Variable, lin: _Linearizer) -> list[Variable]:
    """Highest nodes on every path from the globals to ``logp`` that are affine in them."""
    cuts: list[Variable] = []
    seen = set()
    stack = [logp]
    while stack:
        v = stack.pop()
        if v in seen or not lin.depends(v):
            continue
        seen.add(v)
        if v.dtype.startswith("float"):
            form = lin(v)
            if form is not None and form.terms:
                if v not in cuts:
                    cuts.append(v)
                continue
        if v.owner is None:
            continue
        stack.extend(i for i in v.owner.inputs if lin.depends(i))
    return cuts


def likelihood_term(
    name: str, logp: Variable, gvalues: dict, gshapes: dict
) -> PredictorTerm | None:
    """A :class:`PredictorTerm` when ``logp`` depends on the globals through one affine predictor.

    Returns None when there is no single affine predictor, or when the log
    density is not separable in it (each entry must depend on its own
    predictor entry only).
    """
    lin = _Linearizer(gvalues, gshapes)
    cuts = maximal_affine_nodes(logp, lin)
    if len(cuts) != 1:
        return None
    (eta,) = cuts
    placeholder = eta.type()
    placeholder.name = f"{name}_predictor"
    replaced = graph_replace(logp, {eta: placeholder}, strict=False)
    if depends_on_any(replaced, gvalues) or not is_separable(replaced, placeholder):
        return None
    form = lin(eta)
    shape = lin.shape_of(eta)
    return PredictorTerm(
        name=name,
        eta_shape=shape,
        offset=form.offset,
        terms=flatten_terms(form.terms, shape),
        placeholder=placeholder,
        logp=stable_logp(replaced),
    )


def flatten_terms(terms: list[LinearTerm], shape) -> list[LinearTerm]:
    """Give every term exactly one leading (row) axis."""
    out = []
    nd = len(shape)
    for t in terms:
        if t.ndim < nd:
            t = t.map(lambda c, d=nd - t.ndim: pt.shape_padleft(c, d))
        if nd == 0:
            out.append(t.map(lambda c: c[None]))
        elif nd == 1:
            out.append(t)
        elif t.is_dense:
            out.append(t.map(lambda c: c.reshape((1, c.shape[-1]), ndim=2)))
        else:
            k = pt.maximum(t.cols.shape[-1], 1 if t.vals is None else t.vals.shape[-1])
            full = (*shape, k)

            def flat(c, full=full):
                return pt.broadcast_to(c, full).reshape((-1, full[-1]), ndim=2)

            out.append(t.map(flat))
    return out


def form_name(term: PredictorTerm) -> str:
    kinds = {"dense affine" if t.is_dense else "gather" for t in term.terms}
    if kinds == {"dense affine"}:
        return "dense affine"
    if kinds == {"gather"}:
        return "gather"
    return "dense affine + gather"


def find_bilinear(logp: Variable, gvalues: dict, gshapes: dict):
    """Detect a bilinear predictor ``sum_k A_k(w_a) B_k(w_b)`` with disjoint globals.

    Recognizes ``(U[s] * V[d]).sum(-1)``, ``pm.math.sum(..., axis=1)``, einsum and
    batched-dot spellings. Returns ``(eta, left_form, right_form)`` or None.
    """
    lin = _Linearizer(gvalues, gshapes)
    stack, seen = [logp], set()
    while stack:
        v = stack.pop()
        if v in seen or not lin.depends(v) or v.owner is None:
            continue
        seen.add(v)
        pair = _product_operands(v)
        if pair is not None:
            a, b = pair
            fa, fb = lin(a), lin(b)
            if (
                fa is not None
                and fb is not None
                and fa.terms
                and fb.terms
                and not (fa.sources & fb.sources)
            ):
                return v, fa, fb
        stack.extend(i for i in v.owner.inputs if lin.depends(i))
    return None


def _product_operands(v):
    """Operands of a contraction ``sum(a * b, axis=-1)`` or a batched dot, if ``v`` is one."""
    node = v.owner
    op = node.op
    if isinstance(op, Sum):
        inner = node.inputs[0]
        if (
            inner.owner is not None
            and isinstance(inner.owner.op, Elemwise)
            and isinstance(inner.owner.op.scalar_op, ps.Mul)
        ):
            ins = inner.owner.inputs
            if len(ins) == 2:
                return ins[0], ins[1]
    if (isinstance(op, Dot) or (isinstance(op, Blockwise) and isinstance(op.core_op, Dot))) and len(
        node.inputs
    ) == 2:
        return node.inputs[0], node.inputs[1]
    if isinstance(op, OpFromGraph):  # einsum
        return _product_operands(inline_ofg_node(node)[node.outputs.index(v)])
    if isinstance(op, DimShuffle):
        inner = node.inputs[0]
        if inner.owner is not None:
            return _product_operands(inner)
    return None
