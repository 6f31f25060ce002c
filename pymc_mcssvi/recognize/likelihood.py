"""How an observed log density depends on the Gaussian globals.

Forms (ARCHITECTURE.md §3): *dense affine* (``X @ w``), *gather*
(``a[group]``, random slopes), their sums, *bilinear* (``(U[s] * V[d]).sum(-1)``)
and *general* (anything else: Monte Carlo + autodiff).
"""

from __future__ import annotations

import numpy as np
import pytensor.tensor as pt
from pytensor.compile.builders import OpFromGraph
from pytensor.compile.rewriting import inline_ofg_node
from pytensor.graph.basic import Constant, Variable
from pytensor.graph.fg import MissingInputError
from pytensor.graph.replace import graph_replace
from pytensor.graph.traversal import ancestors, graph_inputs, io_toposort
from pytensor.scalar import basic as ps
from pytensor.scalar.basic import Cast
from pytensor.tensor.blockwise import Blockwise
from pytensor.tensor.elemwise import DimShuffle, Elemwise
from pytensor.tensor.math import Dot, Sum
from pytensor.tensor.shape import Shape, Shape_i
from pytensor.tensor.subtensor import AdvancedSubtensor

from pymc_mcssvi.exceptions import UnsupportedModelError
from pymc_mcssvi.recognize.affine import LinearTerm, _add_offsets, _Linearizer
from pymc_mcssvi.recognize.dense_product import flatten_dense_product
from pymc_mcssvi.recognize.graph import (
    depends_on_any,
    evaluate_static,
    is_entrywise,
    is_separable,
    shape64,
)
from pymc_mcssvi.recognize.ir import BilinearTerm, PairTerm, PredictorTerm
from pymc_mcssvi.recognize.stabilize import stable_logp

__all__ = [
    "bilinear_term",
    "check_whole",
    "find_bilinear",
    "flatten_terms",
    "float_to_int_casts",
    "form_name",
    "likelihood_term",
    "maximal_affine_nodes",
    "pair_term",
    "predictor_candidates",
    "split_broadcast_addends",
]


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
        if _is_float(v):
            form = lin(v)
            if form is not None and form.terms:
                if v not in cuts:
                    cuts.append(v)
                continue
        if v.owner is None:
            continue
        stack.extend(i for i in v.owner.inputs if lin.depends(i))
    return cuts


def predictor_candidates(logp: Variable, lin: _Linearizer, preferred=()):
    """Affine nodes through which all of ``logp``'s dependence on the globals flows.

    Yields the single maximal affine node first when there is one, then every
    other separating affine node from the output downwards (e.g. ``mu`` when a
    censored likelihood reads it through both ``(c - mu) / sigma`` and
    ``(y - mu) / sigma``, or ``eta`` when an ordered logistic reads it through
    ``eta[:, None] - cutpoints``). ``preferred`` nodes come right after the maximal one.
    """
    cuts = maximal_affine_nodes(logp, lin)
    tried = set()
    if len(cuts) == 1:
        tried.add(cuts[0])
        if _separates(logp, cuts[0], lin):
            yield cuts[0]
    for v in preferred:
        if v not in tried:
            tried.add(v)
            if _separates(logp, v, lin):
                yield v
    for node in reversed(io_toposort(list(lin.wrt), [logp])):
        for v in node.outputs:
            if v in tried or not _is_float(v) or not lin.depends(v):
                continue
            tried.add(v)
            form = lin(v)
            if form is not None and form.terms and _separates(logp, v, lin):
                yield v


def split_broadcast_addends(logp: Variable, lin: _Linearizer):
    """``(logp, cores)``: ``logp`` with each maximal affine sum split into its part in the
    globals (a core, kept at its own smaller shape) plus the rest.

    A local integrated out by quadrature (:func:`~pymc_mcssvi.recognize.marginalize.marginal_logp`)
    puts its nodes into the sum that forms the predictor: an observation-level random
    effect ``exp(X @ b + u[g] + e)`` becomes one flat ``add(b0, X @ b, u[g], s_e * nodes)``
    of shape ``(nodes, rows)``, whose entries are not separable (each row's log density
    reads all its nodes). The part in the globals, ``X @ b + u[g]`` of shape ``(rows,)``,
    is; it was not a node of the graph until this split.
    """
    replace, cores = {}, []
    for v in maximal_affine_nodes(logp, lin):
        node = v.owner
        if not (
            node is not None
            and isinstance(node.op, Elemwise)
            and isinstance(node.op.scalar_op, ps.Add)
        ):
            continue
        dep = [i for i in node.inputs if lin.depends(i)]
        rest = [i for i in node.inputs if not lin.depends(i)]
        if not dep or not rest:
            continue
        eta = dep[0] if len(dep) == 1 else pt.add(*dep)
        lead = 0  # leading axes that only the other addends fill
        while (
            lead < eta.ndim - 1 and eta.type.broadcastable[lead] and not v.type.broadcastable[lead]
        ):
            lead += 1
        if lead == 0:
            continue
        core = eta.dimshuffle(list(range(lead, eta.ndim)))
        replace[v] = pt.add(pt.shape_padleft(core, lead), *rest)
        cores.append(core)
    if not replace:
        return logp, []
    # the cores survive the replacement: they are built from v's inputs only
    return graph_replace(logp, replace, strict=False), cores


def _is_float(v) -> bool:
    """A floating-point tensor (random generators and other non-tensor types are not)."""
    return str(getattr(v.type, "dtype", "")).startswith("float")


def _separates(logp, v, lin) -> bool:
    placeholder = v.type()
    replaced = graph_replace(logp, {v: placeholder}, strict=False)
    return not depends_on_any(replaced, lin.wrt)


def likelihood_term(
    name: str, logp: Variable, gvalues: dict, gshapes: dict, point: dict | None = None
) -> PredictorTerm | None:
    """A :class:`PredictorTerm` when ``logp`` depends on the globals through one affine predictor.

    Returns None when there is no such predictor in which the log density is
    separable (each entry must depend on its own predictor entry only; checked
    on the graph, or numerically at ``point`` when the graph has indexing or
    mixture operations).
    """
    lin = _Linearizer(gvalues, gshapes)
    logp, cores = split_broadcast_addends(logp, lin)
    for eta in predictor_candidates(logp, lin, preferred=cores):
        placeholder = eta.type()
        placeholder.name = f"{name}_predictor"
        replaced = graph_replace(logp, {eta: placeholder}, strict=False)
        shape = lin.shape_of(eta)
        if not is_separable(replaced, placeholder):
            if point is None or not _entrywise_in_predictor(replaced, placeholder, shape, point):
                continue
        form = lin(eta)
        check_indices(name, lin)
        return PredictorTerm(
            name=name,
            eta_shape=shape,
            offset=form.offset,
            terms=flatten_terms(form.terms, shape),
            placeholder=placeholder,
            logp=stable_logp(replaced),
            form=_form_of(form.terms),
            smooth=is_smooth_in(replaced, placeholder),
        )
    return None


def pair_term(name: str, logp: Variable, gvalues: dict, gshapes: dict) -> PairTerm | None:
    """A :class:`PairTerm` when ``logp`` depends on the globals through two affine predictors.

    The two highest affine nodes on the paths from the globals (``mu`` and ``log_sigma``
    of ``Normal(mu, exp(log_sigma))``, both regressions) must have the same shape, the
    log density must be smooth in both and read, for each entry, that entry of each.
    Returns None otherwise (the term stays general: Monte Carlo + autodiff).

    Examples
    --------
    >>> import numpy as np, pymc as pm
    >>> from pymc_mcssvi.recognize.graph import remove_checks
    >>> x = np.linspace(-1, 1, 20)
    >>> with pm.Model() as m:
    ...     b = pm.Normal("b", 0, 1, shape=2)
    ...     c = pm.Normal("c", 0, 1, shape=2)
    ...     y = pm.Normal("y", b[0] + b[1] * x, pm.math.exp(c[0] + c[1] * x), observed=x)
    >>> logp = remove_checks(m.logp(vars=[y], sum=False)[0])
    >>> bv, cv = m.rvs_to_values[b], m.rvs_to_values[c]
    >>> term = pair_term("y", logp, {bv: 0, cv: 1}, {bv: (2,), cv: (2,)})
    >>> [sorted({t.source for t in part.terms}) for part in term.parts]  # (mu, sigma): order of the graph
    [[1], [0], [0, 1]]
    """
    lin = _Linearizer(gvalues, gshapes)
    logp, _ = split_broadcast_addends(logp, lin)
    cuts = maximal_affine_nodes(logp, lin)
    if len(cuts) != 2 or cuts[0].ndim != cuts[1].ndim:
        return None
    shapes = [lin.shape_of(v) for v in cuts]
    try:
        sizes = [np.asarray(evaluate_static([pt.as_tensor(s, dtype="int64")])[0]) for s in shapes]
    except Exception:
        return None
    if sizes[0].size and np.any((sizes[0] != sizes[1]) & (sizes[0] != 1) & (sizes[1] != 1)):
        return None
    # a predictor broadcast along the other's rows (a scalar `a` in `a * exp(-b[g] * t)`)
    # is read at every row: the placeholders have the full shape, the graph rebuilt on them
    full = tuple(int(max(a, b)) for a, b in zip(sizes[0], sizes[1], strict=True))
    shape = shapes[0] if tuple(int(a) for a in sizes[0]) == full else shapes[1]
    bcast = tuple(a and b for a, b in zip(*(v.type.broadcastable for v in cuts), strict=True))
    holders = tuple(
        pt.tensor(dtype=v.dtype, shape=tuple(1 if b else None for b in bcast)) for v in cuts
    )
    for i, ph in enumerate(holders):
        ph.name = f"{name}_predictor_{i + 1}"
    try:
        replaced = _rebuild(logp, dict(zip(cuts, holders, strict=True)))
    except Exception:  # an op that cannot take the broadcast predictor at full shape
        return None
    if depends_on_any(replaced, lin.wrt):
        return None
    if not all(is_separable(replaced, ph) and is_smooth_in(replaced, ph) for ph in holders):
        return None
    forms = [lin(v) for v in cuts]
    check_indices(name, lin)

    def part(terms, offset):
        return PredictorTerm(
            name=name,
            eta_shape=shape,
            offset=offset,
            terms=flatten_terms(terms, shape),
            placeholder=None,
            logp=None,
            form=_form_of(terms),
        )

    (f1, f2) = forms
    parts = (
        part(f1.terms, f1.offset),
        part(f2.terms, f2.offset),
        part(f1.terms + f2.terms, _add_offsets(f1.offset, f2.offset)),
    )
    return PairTerm(name=name, placeholders=holders, logp=stable_logp(replaced), parts=parts)


def _rebuild(out: Variable, replace: dict) -> Variable:
    """``out`` with the variables in ``replace`` replaced, every node above them made
    anew from its inputs (``graph_replace`` keeps each node's output type, pinning a
    broadcast input's length 1 with ``SpecifyShape``)."""
    memo = dict(replace)
    for node in io_toposort(list(graph_inputs([out])), [out]):
        if any(o in replace for o in node.outputs):
            continue  # replaced as a whole (``log_alpha[g] - eta`` reads ``log_alpha[g]``)
        if any(i in memo for i in node.inputs):
            new = node.op.make_node(*[memo.get(i, i) for i in node.inputs])
            memo.update(zip(node.outputs, new.outputs, strict=True))
    return memo.get(out, out)


#: Element-wise ops with a kink or a jump in their arguments.
_KINKED = ("Abs", "Sign", "Maximum", "Minimum", "Clip", "Floor", "Ceil", "Trunc")


def is_smooth_in(logp: Variable, x: Variable) -> bool:
    """Whether ``logp`` is smooth in ``x`` as written: no ``abs``, ``sign``,
    ``maximum``/``minimum`` or rounding of a quantity that depends on ``x``.

    Checked on PyMC's log density before :func:`stable_logp` (whose stable forms
    use ``abs`` and ``maximum`` of smooth functions). ``switch`` is not
    inspected: PyMC's log densities switch between branches of one smooth
    function (stable log cdfs) or on events of measure zero, which the
    second derivative handles.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> f = pt.vector("f")
    >>> is_smooth_in(-pt.abs(1.0 - f), f), is_smooth_in(-pt.softplus(-f), f)
    (False, True)
    >>> is_smooth_in(pt.sign(f) * f**2, f), is_smooth_in(f * pt.abs(f.shape[0] - 2), f)
    (False, True)
    >>> is_smooth_in(pt.log(pt.abs(pt.exp(f))), f)  # |exp(f)| is exp(f)
    True
    """

    depends = {x}
    for node in io_toposort([x], [logp]):
        if not any(i in depends for i in node.inputs) or isinstance(node.op, Shape | Shape_i):
            continue  # a shape is not a function of the values
        depends.update(node.outputs)
        if isinstance(node.op, Elemwise) and type(node.op.scalar_op).__name__ in _KINKED:
            if not _of_positive(node):
                return False
    return True


#: Element-wise ops whose output is positive wherever it is finite.
_POSITIVE = ("Exp", "Softplus", "Sigmoid")


def _of_positive(node) -> bool:
    """``sign`` or ``abs`` of a positive quantity (PyMC's StudentT reads ``sign(sigma)``
    of a ``sigma = exp(...)``): constant or the identity, no kink."""
    if type(node.op.scalar_op).__name__ not in ("Sign", "Abs") or len(node.inputs) != 1:
        return False
    owner = node.inputs[0].owner
    return (
        owner is not None
        and isinstance(owner.op, Elemwise)
        and type(owner.op.scalar_op).__name__ in _POSITIVE
    )


def check_indices(name: str, lin: _Linearizer) -> None:
    """Grouping indices found by the linearizer must be whole numbers in ``[0, n_groups)``.

    See :func:`validate_index`.
    """
    names = {i: v.name for v, i in lin.wrt.items()}
    for sources, idx, length in lin.gathers:
        validate_index(name, idx, length, [names[i] for i in sorted(sources)])


def check_gather_indices(name: str, logp: Variable, gvalues) -> None:
    """Every integer gather ``x[idx]`` of a Gaussian global in ``logp`` must stay in range.

    Runs before any recognition of the term, so that a bad index never reaches
    PyTensor's constant folding or the compiled step (matrix factorizations and
    general terms have no affine gathers for :func:`check_indices`).
    """

    values = list(gvalues)
    for node in io_toposort(graph_inputs([logp]), [logp]):
        if not isinstance(node.op, AdvancedSubtensor):
            continue
        x, *index_inputs = node.inputs
        upstream = set(ancestors([x]))
        indexed = [v.name for v in values if v in upstream]
        if not indexed:
            continue
        # idx_list: an int is the position of an index input, a slice a plain slice.
        for axis, entry in enumerate(node.op.idx_list):
            if isinstance(entry, int):
                idx = index_inputs[entry]
                if idx.dtype.startswith(("int", "uint")):
                    validate_index(name, idx, x.shape[axis], indexed)


def validate_index(name: str, idx, length, indexed: list[str]) -> None:
    """Raise :class:`UnsupportedModelError` for an index outside ``[0, length)`` or cast from non-whole floats.

    PyTensor would wrap negative indices around silently (``a[-1]`` is the last
    group), raise an opaque error for too large ones, and truncate a float
    index cast to integers (``g.astype("int64")`` of 1.5 is group 1); all are
    user errors. Indices that depend on free variables are not checked.
    """

    what = ", ".join(repr(v.removesuffix("_log__")) for v in indexed)
    for cast in float_to_int_casts(idx):
        try:
            (raw,) = evaluate_static([cast])
        except MissingInputError:
            continue
        check_whole(name, cast.name or idx.name or "a grouping index", raw, f"it indexes {what}")
    try:
        values, n = evaluate_static([idx, pt.as_tensor(length)])
    except MissingInputError:
        return  # an index computed from free variables: nothing to check here
    values, n = np.asarray(values), int(n)
    if values.size == 0:
        return
    bad = (values < 0) | (values >= n)
    if bad.any():
        label = idx.name or "a grouping index"
        fix = "encode groups as 0, 1, ..., n_groups - 1 (e.g. pd.factorize) and size the latent to match"
        if not (values >= n).any():  # pd.factorize codes a missing group as -1
            fix += (
                "; negative codes are refused because they usually mark missing groups; "
                f"to count from the end on purpose, write the index modulo {n} (idx % {n})"
            )
        raise UnsupportedModelError(
            name,
            f"{label} has values outside [0, {n}) (found {values[bad].min()} .. {values[bad].max()}); "
            f"it indexes {what}, which has {n} groups",
            fix,
        )


def check_whole(name: str, label: str, raw, what: str) -> None:
    """Raise :class:`UnsupportedModelError` when the floats ``raw``, cast to integers
    on the way to an index, are not all whole and finite (a cast truncates ``1.5`` to
    group 1 and turns NaN and inf into the most negative integer)."""
    raw = np.asarray(raw)
    bad = ~np.isfinite(raw) | (raw != np.round(raw))
    if np.any(bad):
        raise UnsupportedModelError(
            name,
            f"{label} is cast from floats that are not whole numbers (e.g. "
            f"{float(raw[bad].flat[0])}); {what}",
            "pass integer group codes (e.g. pd.factorize) instead of casting floats",
        )


def float_to_int_casts(idx):
    """Float inputs of integer casts on the way to an index (``g.astype("int64")``)."""

    found = []
    for v in ancestors([idx]):
        node = v.owner
        if (
            node is not None
            and isinstance(node.op, Elemwise)
            and isinstance(node.op.scalar_op, Cast)
            and node.inputs[0].dtype.startswith("float")
            and v.dtype.startswith(("int", "uint"))
        ):
            found.append(node.inputs[0])
    return found


def _entrywise_in_predictor(logp, placeholder, shape, point) -> bool:
    try:
        shp = tuple(
            int(s) if isinstance(s, int) else int(s.eval(mode="FAST_COMPILE")) for s in shape
        )
    except Exception:
        return False
    base = np.random.default_rng(1).normal(size=shp)
    return is_entrywise(logp, placeholder, point, base=base)


def _form_of(terms) -> str:
    """Dense when a term reads the same columns for every observation (first axis)."""
    kinds = {
        "dense affine" if (t.ndim == 0 or t.cols.type.broadcastable[0]) else "gather" for t in terms
    }
    if kinds == {"dense affine"}:
        return "dense affine"
    if kinds == {"gather"}:
        return "gather"
    return "dense affine + gather"


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
            k = t.cols.shape[-1]
            cols = t.cols.reshape((1, k), ndim=2)
            vals = None
            if t.vals is not None:
                kv = pt.maximum(k, t.vals.shape[-1])
                vals = pt.broadcast_to(t.vals, shape64((*shape, kv))).reshape((-1, kv), ndim=2)
            out.append(LinearTerm(t.source, cols, vals))
        else:
            k = pt.maximum(t.cols.shape[-1], 1 if t.vals is None else t.vals.shape[-1])
            full = (*shape, k)

            def flat(c, full=full):
                return pt.broadcast_to(c, shape64(full)).reshape((-1, full[-1]), ndim=2)

            out.append(t.map(flat))
    return out


def form_name(term: PredictorTerm) -> str:
    """Predictor form of a likelihood term, for :func:`~pymc_mcssvi.describe`."""
    return term.form or _form_of(term.terms)


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
        found = _product_operands(v)
        if found is not None:
            a, b, prod = found
            fa, fb = lin(a), lin(b)
            if (
                fa is not None
                and fb is not None
                and fa.terms
                and fb.terms
                and not (fa.sources & fb.sources)
            ):
                return prod, fa, fb
        stack.extend(i for i in v.owner.inputs if lin.depends(i))
    return None


def bilinear_term(
    name: str, logp: Variable, gvalues: dict, gshapes: dict, point: dict | None = None
):
    """A :class:`~pymc_mcssvi.recognize.ir.BilinearTerm` for ``l((U[s] * V[d]).sum(-1))``.

    Requires each factor to be a plain row gather of a matrix-shaped global
    (``U[s]`` with ``U`` of shape ``(rows, K)``) and the log density to depend
    on the globals only through the product, elementwise. Returns None
    otherwise (the caller then uses the general path).
    """

    if logp.ndim in (1, 2):  # a dense product, of all entries or of the observed ones
        flat = flatten_dense_product(logp, {v: gshapes[v] for v in gvalues})
        if flat is not None:
            logp = flat
    found = find_bilinear(logp, gvalues, gshapes)
    if found is None:
        return None
    eta, fa, fb = found
    rows, transposed = [], set()
    for form in (fa, fb):
        if form.offset is not None or len(form.terms) != 1:
            return None
        (t,) = form.terms
        shape = gshapes[next(v for v, i in gvalues.items() if i == t.source)]
        # A row gather U[s] has leading shape (n, K) and one column per entry;
        # einsum and batched matmul spellings read it as (n, 1, K) or (n, K, 1).
        if len(shape) != 2 or t.vals is not None or t.ndim not in (2, 3):
            return None
        try:
            cols = np.asarray(evaluate_static([t.cols])[0])
        except Exception:
            return None
        if cols.ndim != t.ndim + 1 or cols.shape[-1] != 1:
            return None
        if cols.ndim == 4 and 1 not in cols.shape[1:3]:
            return None
        by_column = _gathered_by_column(cols, shape)
        if by_column is None:
            return None
        if by_column:
            transposed.add(t.source)
        if all(isinstance(v, Constant) for v in graph_inputs([t.cols])):
            # fixed indices: the rows as a constant, not a gather of an (n, K, 1)
            # position array that every later evaluation and the step would repeat
            # (128 MB and 0.05-0.5 s each at 800,000 ratings, K = 20)
            first = cols.reshape((cols.shape[0], -1))[:, 0]
            rows.append((t.source, pt.constant(first if by_column else first // shape[1])))
            continue
        first = t.cols.reshape((t.cols.shape[0], -1))[:, 0]
        rows.append((t.source, first if by_column else first // shape[1]))
    (left, lrows), (right, rrows) = rows
    if eta.ndim > 1 and not all(eta.type.broadcastable[1:]):
        return None
    # One product per observation: a batched matmul's (n, 1, 1) is a vector (n,).
    placeholder = pt.vector(f"{name}_product", dtype=eta.dtype, shape=eta.type.shape[:1])
    expanded = placeholder.dimshuffle(0, *["x"] * (eta.ndim - 1)) if eta.ndim > 1 else placeholder
    replaced = graph_replace(logp, {eta: expanded}, strict=False)
    affine = None
    if depends_on_any(replaced, gvalues):
        if eta.ndim != 1:
            return None
        mixed = _plus_affine(name, replaced, placeholder, gvalues, gshapes, {left, right}, eta)
        if mixed is None:
            return None
        replaced, placeholder, affine = mixed
    if not is_separable(replaced, placeholder):
        lin = _Linearizer(gvalues, gshapes)
        if point is None or not _entrywise_in_predictor(
            replaced, placeholder, lin.shape_of(eta)[:1], point
        ):
            return None
    return BilinearTerm(
        name,
        left,
        right,
        lrows,
        rrows,
        placeholder,
        stable_logp(replaced),
        affine,
        frozenset(transposed),
    )


def _gathered_by_column(cols, shape) -> bool | None:
    """Whether the flat positions ``cols`` (one set of K per observation) read a row
    of a ``(rows, K)`` global (False: ``U[s]``), a column of a ``(K, rows)`` one
    (True: ``F.T[s]``), or neither (None)."""
    for by_column, K, step in ((False, shape[1], 1), (True, shape[0], shape[1])):
        if np.prod(cols.shape[1:]) != K:
            continue
        flat = cols.reshape(cols.shape[0], K)
        # column by column: no (n, K) temporaries (800,000 x 20 positions: 2.2 -> 0.1 s)
        first = flat[:, 0]
        if all(np.all(flat[:, k] - first == step * k) for k in range(1, K)):
            return by_column
    return None


def _flat_addends(v):
    """The addends of ``v`` through nested elementwise additions."""
    if (
        v.owner is not None
        and isinstance(v.owner.op, Elemwise)
        and isinstance(v.owner.op.scalar_op, ps.Add)
    ):
        return [a for i in v.owner.inputs for a in _flat_addends(i)]
    return [v]


def _leading(v, ndim):
    """``v`` (an addend of a sum of ``ndim`` dimensions whose trailing axes broadcast)
    without its trailing broadcast axes: one dimension, or 0 for a scalar; else None."""
    if v.ndim == 0:
        return v
    if v.ndim != ndim or not all(v.type.broadcastable[1:]):
        return None
    if v.owner is not None and isinstance(v.owner.op, DimShuffle):
        inner = v.owner.inputs[0]
        if tuple(v.owner.op.new_order) == (*range(inner.ndim), *["x"] * (ndim - inner.ndim)):
            if inner.ndim <= 1:
                return inner
    return v.dimshuffle(0) if ndim > 1 else v


def _plus_affine(name, logp, product, gvalues, gshapes, factor_sources, eta):
    """``(logp, placeholder, affine)`` for a log density of ``product + a(w)``.

    ``product`` stands for the bilinear product inside ``logp``; ``a`` must be
    affine in Gaussian globals other than the two factors (row and column
    biases, an intercept, fixed effects: ``mu + a[s] + b[d] + (U[s] * V[d]).sum(-1)``).
    The largest sum that holds ``product`` once becomes the new placeholder; the
    sum may be taken after a trailing axis was added to each addend (an
    ordered likelihood's ``eta[:, None]``, which PyMC's rewrites push through the
    addition). Returns None when there is no such sum.
    """
    best = None
    for node in io_toposort(list(graph_inputs([logp])), [logp]):
        if not (isinstance(node.op, Elemwise) and isinstance(node.op.scalar_op, ps.Add)):
            continue
        out = node.outputs[0]
        if out.ndim < 1 or not all(out.type.broadcastable[1:]):
            continue
        addends = _flat_addends(out)
        lead = [_leading(a, out.ndim) for a in addends]
        if any(x is None for x in lead) or sum(x is product for x in lead) != 1:
            continue
        if best is None or len(addends) > len(best[1]):
            best = (out, lead)
    if best is None:
        return None
    total, addends = best
    rest = [a for a in addends if a is not product]
    lin = _Linearizer(gvalues, gshapes)
    form = lin(rest[0] if len(rest) == 1 else pt.add(*rest))
    if form is None or not form.terms or (form.sources & factor_sources):
        return None
    placeholder = pt.vector(f"{name}_predictor", dtype=total.dtype, shape=total.type.shape[:1])
    expanded = placeholder.dimshuffle(0, *["x"] * (total.ndim - 1))
    out = graph_replace(logp, {total: expanded}, strict=False)
    if depends_on_any(out, gvalues) or depends_on_any(out, [product]):
        return None
    shape = (lin.shape_of(eta)[0],)
    check_indices(name, lin)
    affine = PredictorTerm(
        name=f"{name} (terms added to the product)",
        eta_shape=shape,
        offset=form.offset,
        terms=flatten_terms(form.terms, shape),
        placeholder=None,
        logp=None,
        form=_form_of(form.terms),
    )
    return out, placeholder, affine


def _product_operands(v):
    """``(a, b, product)`` if ``v`` is a contraction ``sum(a * b, axis=-1)`` or a dot.

    ``product`` is the variable to replace by the predictor: ``v`` itself, or the
    contraction inside a dimension shuffle of it (``eta[:, None]`` in an
    ordered-logistic likelihood must not become the predictor).
    """
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
                return ins[0], ins[1], v
    if (isinstance(op, Dot) or (isinstance(op, Blockwise) and isinstance(op.core_op, Dot))) and len(
        node.inputs
    ) == 2:
        return node.inputs[0], node.inputs[1], v
    if isinstance(op, OpFromGraph):  # einsum
        found = _product_operands(inline_ofg_node(node)[node.outputs.index(v)])
        return None if found is None else (found[0], found[1], v)
    if isinstance(op, DimShuffle):
        inner = node.inputs[0]
        if inner.owner is not None:
            return _product_operands(inner)
    return None
