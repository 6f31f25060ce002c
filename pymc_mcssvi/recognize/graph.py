"""Small utilities on PyMC / PyTensor graphs used by the recognizer."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
from pymc.logprob.utils import CheckParameterValue
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Constant, Variable
from pytensor.graph.replace import clone_replace, graph_replace
from pytensor.graph.rewriting.utils import rewrite_graph
from pytensor.graph.traversal import ancestors, graph_inputs, io_toposort
from pytensor.scalar import basic as ps
from pytensor.tensor.basic import Alloc
from pytensor.tensor.elemwise import CAReduce, DimShuffle, Elemwise
from pytensor.tensor.math import Sum
from pytensor.tensor.shape import Shape, Shape_i, SpecifyShape
from pytensor.tensor.sharedvar import TensorSharedVariable
from pytensor.tensor.special import LogSumExp
from pytensor.tensor.subtensor import AdvancedSubtensor

__all__ = [
    "depends_on_any",
    "evaluate_static",
    "holds_row_positions",
    "is_separable",
    "lift_gathers",
    "observed_data",
    "checks_to_ninf",
    "remove_checks",
    "shape64",
    "check_static_data",
    "static_data_shapes",
    "static_data_twins",
    "static_shape",
]


def holds_row_positions(data) -> bool:
    """Whether an integer array holds its own row positions: ``data[i, ...] == i`` everywhere.

    That is ``arange(n)`` along axis 0, possibly as a column or broadcast along the
    other axes: the row index of a ``take_along_axis`` once folded to a constant.
    """
    data = np.asarray(data)
    if data.ndim == 0 or data.shape[0] == 0 or not np.issubdtype(data.dtype, np.integer):
        return False
    rows = np.arange(data.shape[0]).reshape((-1,) + (1,) * (data.ndim - 1))
    return bool(np.all(data == rows))


def remove_checks(var: Variable) -> Variable:
    """Drop PyMC's ``CheckParameterValue`` assertions from a log density graph.

    The engine never evaluates a log density outside the support it was built
    for; the assertions would otherwise raise inside the compiled step.
    """
    checks = [
        v
        for v in ancestors([var])
        if v.owner is not None and isinstance(v.owner.op, CheckParameterValue)
    ]
    if not checks:
        return var
    return graph_replace(var, {v: v.owner.inputs[0] for v in checks}, strict=False)


def checks_to_ninf(var: Variable) -> Variable:
    """Turn PyMC's ``CheckParameterValue`` assertions into ``-inf`` where they fail.

    What PyMC's own compiled functions do (``local_check_parameter_to_ninf_switch``),
    done on the graph itself: a rewrite registered on a compilation mode does not
    reach the inner graph of a scan (a chunked step), where a candidate q(h) with
    a scale at 0 would otherwise raise ``ParameterValueError`` instead of being
    rejected.

    Examples
    --------
    >>> import numpy as np, pymc as pm, pytensor.tensor as pt
    >>> s = pt.scalar("s")
    >>> lp = checks_to_ninf(pm.logp(pm.Normal.dist(0.0, s), 1.0))
    >>> lp.eval({s: -1.0}), bool(np.isfinite(lp.eval({s: 1.0})))
    (array(-inf), True)
    """
    checks = [
        v
        for v in ancestors([var])
        if v.owner is not None
        and isinstance(v.owner.op, CheckParameterValue)
        and v.owner.op.can_be_replaced_by_ninf
    ]
    if not checks:
        return var
    replace = {}
    for v in checks:
        value, *conds = v.owner.inputs
        ok = conds[0] if len(conds) == 1 else pt.all(conds)
        replace[v] = pt.cast(pt.switch(ok, value, -np.inf), v.dtype)
    return graph_replace(var, replace, strict=False)


#: Element-wise scalar ops that :func:`lift_gathers` does not move a gather below.
_AFFINE_SCALAR_OPS = (ps.Add, ps.Sub, ps.Mul, ps.Neg, ps.Identity, ps.Cast, ps.TrueDiv)


def gather_index(node):
    """The index of ``x[idx]`` (an integer vector along the leading axis only), else None."""

    # ``idx_list == (0,)``: the one index input, on the leading axis
    if isinstance(node.op, AdvancedSubtensor) and tuple(node.op.idx_list) == (0,):
        idx = node.inputs[1]
        if idx.ndim == 1 and str(idx.dtype).startswith(("int", "uint")):
            return idx
    return None


def lift_gathers(var: Variable, through_affine: bool = False) -> Variable:
    """``var`` with integer gathers moved below element-wise operations:
    ``f(a, b)[idx]`` becomes ``f(a[idx], b[idx])`` (entries broadcast along the
    gathered axis stay as they are), repeatedly.

    Users compute group-level quantities and index them per observation,
    ``invlogit(mu + sigma * z)[group]``; lifted, the predictor is the gather GLM's
    ``(mu + sigma * z)[group]``. Gathers stop at affine operations (sums,
    products, casts), which the linearizer reads through. The value is unchanged
    (each entry is the same function of the same inputs). With ``through_affine``
    the gathers move below affine operations too, down to the leaves: the general
    estimator's per-observation form reads every global through a gather.

    Examples
    --------
    >>> import numpy as np, pytensor.tensor as pt
    >>> z, g = pt.vector("z"), np.array([0, 2, 2, 1])
    >>> out = lift_gathers(pt.sigmoid(1.0 + 2.0 * z)[g])
    >>> type(out.owner.op.scalar_op).__name__
    'Sigmoid'
    >>> bool(np.allclose(out.eval({z: [0.1, 0.2, 0.3]}), pt.sigmoid(1.0 + 2.0 * z)[g].eval({z: [0.1, 0.2, 0.3]})))
    True
    """

    def push(v):
        """``v`` with its gather moved below the element-wise op it reads, recursively."""
        node = v.owner
        if node is None or gather_index(node) is None:
            return v
        x, rest = node.inputs[0], node.inputs[1:]
        if x.owner is None or not isinstance(x.owner.op, Elemwise) or len(x.owner.outputs) != 1:
            return v
        if not through_affine and isinstance(x.owner.op.scalar_op, _AFFINE_SCALAR_OPS):
            return v  # a gather of an affine expression is read as it is
        args = [a if a.type.broadcastable[0] else push(node.op(a, *rest)) for a in x.owner.inputs]
        return x.owner.op(*args)

    memo: dict = {}
    try:
        for node in io_toposort(graph_inputs([var]), [var]):
            inputs = [memo.get(i, i) for i in node.inputs]
            outs = (
                node.op.make_node(*inputs).outputs
                if any(a is not b for a, b in zip(inputs, node.inputs, strict=True))
                else node.outputs
            )
            for old, new in zip(node.outputs, outs, strict=True):
                memo[old] = push(new)
    except Exception:  # an op that cannot be rebuilt on the new inputs: leave it
        return var
    return memo.get(var, var)


def depends_on_any(var: Variable, targets) -> bool:
    targets = set(targets)
    return bool(targets) and any(a in targets for a in ancestors([var]))


def perform_constant_graph(exprs: list[Variable]) -> list[np.ndarray] | None:
    """Values of graphs of constants and shared values, node by node with each op's
    ``perform`` (no compilation), or ``None`` when a graph needs anything else or an op
    cannot run that way.

    Compiling a function costs its rewrites, which hash every constant: the flat
    positions of a gather by 800,000 row indices took 1.9-3 s to evaluate that way and
    0.1 s node by node.
    """
    values: dict = {}
    nodes = io_toposort([], list(exprs))
    for v in graph_inputs(exprs):
        if isinstance(v, Constant):
            values[v] = v.data
        elif isinstance(v, TensorSharedVariable):
            values[v] = v.get_value(borrow=True)
        else:
            return None
    try:
        for node in nodes:
            storage = [[None] for _ in node.outputs]
            node.op.perform(node, [values[i] for i in node.inputs], storage)
            for out, cell in zip(node.outputs, storage, strict=True):
                values[out] = cell[0]
    except Exception:  # an op without a Python implementation, or one that needs more
        return None
    return [np.asarray(values[e]) for e in exprs]


def evaluate_static(exprs: list[Variable], mode="FAST_COMPILE") -> list[np.ndarray]:
    """Values of graphs that do not depend on the model's free variables.

    Index arrays and sizes can still reach a value variable through a shape:
    with ``dims=``, ``z[group]`` carries ``Shape(sd * z)``. Shape inference
    removes such dependencies before the graphs are evaluated. ``mode`` is the
    compilation mode of the evaluation.

    Raises
    ------
    pytensor.graph.fg.MissingInputError
        A graph needs the value of a free variable.
    """

    values = perform_constant_graph(exprs)
    if values is not None:
        return values
    try:
        return pytensor.function([], exprs, mode=mode)()
    except pytensor.graph.fg.MissingInputError:
        pass
    exprs = rewrite_graph(exprs, include=("ShapeOpt", "canonicalize"))
    return pytensor.function([], exprs, mode=mode)()


def static_shape(var: Variable) -> tuple[int, ...]:
    """Numeric shape of a variable in a model (static, or by evaluating its shape)."""
    if None not in var.type.shape:
        return tuple(int(s) for s in var.type.shape)
    return tuple(int(s) for s in var.shape.eval())


_SEPARABLE_OPS = (Elemwise, DimShuffle, Alloc, SpecifyShape)


def static_data_shapes(graphs: list[Variable]) -> list[Variable]:
    """``graphs`` rebuilt on twins of their data of unknown static shape (``pm.Data``
    without ``shape=``) that have the current values' shapes.

    A twin is a shared variable of the static type over the same storage (container):
    it reads the same values, and ``pm.set_data`` reaches it, while every node built on
    it knows its shape. Recognition then sees ``n`` observations, not ``None``, and a
    likelihood too large for one evaluation is reduced chunk by chunk
    (:meth:`~pymc_mcssvi.bounds.structured.StructuredBound.chunk_sizes`) instead of
    materializing per-observation arrays of all its rows. A fit built this way
    assumes the data keep their shapes (:func:`check_static_data`); ``graphs`` are
    returned as they are when all their data have static shapes.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> x = pytensor.shared(np.zeros((5, 2)), name="x")
    >>> x.type.shape
    (None, None)
    >>> (y,) = static_data_shapes([(x * 2.0).sum(-1)])
    >>> y.type.shape
    (5,)
    """
    replace = {}
    for v in graph_inputs(graphs):
        if not isinstance(v, TensorSharedVariable) or None not in v.type.shape:
            continue
        shape = np.shape(v.get_value(borrow=True))
        if len(shape) != v.ndim:
            continue
        twin = TensorSharedVariable(
            type=v.type.clone(shape=shape),
            value=None,
            strict=None,
            container=v.container,
            name=v.name,
        )
        twin.tag.static_twin_of = v
        replace[v] = twin
    if not replace:
        return list(graphs)
    return list(clone_replace(list(graphs), replace=replace, rebuild_strict=False))


def static_data_twins(graphs) -> list[Variable]:
    """The twins made by :func:`static_data_shapes` among the inputs of ``graphs``."""
    return [v for v in graph_inputs(graphs) if hasattr(v.tag, "static_twin_of")]


def check_static_data(twins) -> None:
    """Raise ``ValueError`` when data that :func:`static_data_shapes` fixed to their
    shapes (``twins``) have changed shape since (``pm.set_data`` with a different
    length between the fit's construction and a continued fit)."""
    for v in twins:
        shape = np.shape(v.get_value(borrow=True))
        if shape != v.type.shape:
            raise ValueError(
                f"the data {v.name!r} changed shape from {v.type.shape} to {shape} after "
                "the fit was built, which fixed its shape; build a new fit (pm.fit, or a new "
                "inference object) for the new data"
            )


def is_separable(logp: Variable, placeholder: Variable) -> bool:
    """Whether each entry of ``logp`` depends on the matching entry of ``placeholder`` only.

    Structural check: every operation between ``placeholder`` and ``logp`` must be
    elementwise (or a broadcast). A trailing ``Sum`` is allowed when nothing
    nonlinear follows it (separable sums such as a whitened multivariate normal).
    """
    nodes = io_toposort([placeholder], [logp])
    dep = {placeholder}
    summed = False
    for node in nodes:
        if not any(i in dep for i in node.inputs):
            continue
        op = node.op
        if isinstance(op, Shape | Shape_i):
            continue  # a shape carries no values (minibatch scaling reads y.shape)
        dep.update(node.outputs)
        if _reduces_added_axis(node, placeholder):
            continue  # log-sum-exp over the nodes of a marginalized local
        if isinstance(op, Sum):
            summed = True
            continue
        if isinstance(op, DimShuffle):
            kept = [o for o in op.new_order if o != "x"]
            if kept != sorted(kept):
                return False  # a transpose: entry i reads another entry (checked numerically)
        if isinstance(op, _SEPARABLE_OPS):
            if summed and isinstance(op, Elemwise) and not _is_linear_elemwise(node, dep):
                return False
            continue
        return False
    return True


def _reduces_added_axis(node, placeholder) -> bool:
    """A reduction over the leading axis of a matrix built from a vector placeholder.

    With every operation before it elementwise or a broadcast (checked by the
    caller), that axis was added (quadrature nodes, enumerated values), so the
    reduction keeps entry ``i`` a function of entry ``i`` only.
    """
    axis = getattr(node.op, "axis", None)
    if isinstance(axis, int):
        axis = (axis,)
    return (
        placeholder.ndim == 1
        and len(node.inputs) == 1
        and node.inputs[0].ndim == 2
        and axis is not None
        and tuple(axis) == (0,)
        and (isinstance(node.op, LogSumExp | CAReduce))
    )


def is_entrywise(logp: Variable, var: Variable, point: dict, base=None, n_probe: int = 3) -> bool:
    """Numerical check that entry ``i`` of ``logp`` depends on entry ``i`` of ``var`` only.

    Used when :func:`is_separable` cannot decide from the graph (indexing by a
    discrete local, mixtures, ordered categories). ``point`` gives values for the
    other inputs (e.g. the model's initial point by value variable). Probes a
    few entries: changing ``var[j]`` must change ``logp[j]`` (or nothing) and no
    other entry.
    """

    inputs = [
        v
        for v in graph_inputs([logp])
        if v is not var and not isinstance(v, Constant | SharedVariable)
    ]
    try:
        fn = pytensor.function([var, *inputs], logp, mode="FAST_COMPILE", on_unused_input="ignore")
        vals = [np.asarray(point[v]) if v in point else np.asarray(point[v.name]) for v in inputs]
    except Exception:
        return False
    shape = tuple(
        int(s) for s in (var.type.shape if None not in var.type.shape else np.shape(base))
    )
    size = int(np.prod(shape))
    if logp.ndim == 0 or size < 2:
        return False
    rng = np.random.default_rng(0)
    if base is None:
        base = (
            rng.normal(size=shape)
            if var.dtype.startswith("float")
            else np.zeros(shape, dtype=var.dtype)
        )
    base = np.asarray(base, dtype=var.dtype)
    try:
        ref = np.asarray(fn(base, *vals))
    except Exception:
        return False
    if ref.size != size:
        return False
    for j in rng.choice(size, size=min(n_probe, size), replace=False):
        probe = base.copy().reshape(-1)
        probe[j] = (
            probe[j] + 0.37
            if var.dtype.startswith("float")
            else (1 - probe[j] if probe[j] in (0, 1) else 0)
        )
        out = np.asarray(fn(probe.reshape(shape), *vals)).reshape(-1)
        changed = ~np.isclose(out, ref.reshape(-1), rtol=1e-12, atol=1e-12, equal_nan=True)
        changed[j] = False
        if changed.any():
            return False
    return True


def _is_linear_elemwise(node, dep) -> bool:
    sop = node.op.scalar_op
    if isinstance(sop, ps.Add | ps.Sub | ps.Neg | ps.Identity):
        return True
    if isinstance(sop, ps.Mul):
        return sum(i in dep for i in node.inputs) == 1
    return False


def observed_data(model, obs) -> np.ndarray | None:
    """The numeric data of an observed variable, when it is stored in the graph."""
    value = model.rvs_to_values.get(obs)
    if value is None:
        return None
    if isinstance(value, Constant):
        return np.asarray(value.data)
    if isinstance(value, TensorSharedVariable):
        return np.asarray(value.get_value(borrow=True))
    try:
        inputs = list(graph_inputs([value]))
        if all(isinstance(i, Constant | TensorSharedVariable) for i in inputs):
            return np.asarray(value.eval())
    except Exception:
        return None
    return None


def float64_constants(var: Variable) -> Variable:
    """``var`` with its float32 constants as float64.

    PyTensor stores a Python float that float32 represents exactly (``sigma=1.5``)
    as a float32 constant, and the derivatives of a log density divide by it in
    float32: the Hessian ``-1 / 1.5**2`` of a Normal likelihood was 2.5e-8 off, and
    one natural step with rho = 1 missed the conjugate posterior by that much
    (``tests/robustness/test_properties.py``). The constants' values are unchanged.
    """
    low = {
        v: pt.constant(np.asarray(v.data, dtype="float64"), name=v.name)
        for v in ancestors([var])
        if isinstance(v, Constant) and getattr(v, "dtype", "") in ("float16", "float32")
    }
    # nodes rebuilt (not type-checked replacements): their outputs become float64
    return clone_replace(var, low, rebuild_strict=False) if low else var


def as_float(x):
    """``x`` as float64 (PyTensor stores constants such as 2.0 as float32)."""
    x = pt.as_tensor(x)
    return x if x.dtype == "float64" else pt.cast(x, "float64")


def shape64(shape):
    """A shape (Python ints or scalar tensors) as an int64 vector for ``pt.broadcast_to``.

    PyTensor stores small Python ints as int8/int16 constants, and its rewrite of a
    sum over a broadcast multiplies by the product of those constants in their own
    dtype: ``-pt.sum(pt.log(pt.broadcast_to(pt.exp(x), (60, 3))))`` compiled to
    ``76 * x`` instead of ``-180 * x`` (180 wraps around in int8).

    Examples
    --------
    >>> import pytensor, pytensor.tensor as pt
    >>> x = pt.scalar("x", dtype="float64")
    >>> f = pytensor.function([x], -pt.sum(pt.log(pt.broadcast_to(pt.exp(x), shape64((60, 3))))))
    >>> float(f(1.0))
    -180.0
    """
    shape = tuple(shape)
    if all(isinstance(s, int | np.integer) for s in shape):
        return pt.constant(np.asarray(shape, dtype="int64").reshape(-1))
    return pt.stack([pt.cast(pt.as_tensor(s), "int64") for s in shape])
