"""The ``"python"`` backend: PyTensor's Python VM with NumPy-level element-wise ops.

Small and medium steps are not compiled (a cold C, numba or JAX compilation
costs more than the whole fit); PyTensor's Python VM runs them, each node
calling NumPy. An ``Elemwise`` whose scalar op has no NumPy ufunc
(``nfunc_spec``) is evaluated there through ``np.frompyfunc``: one Python call
*per element*, about 100 ns each. The rewrites below replace every such op
that our steps produce with ufunc-backed equivalents: the same function,
computed by vectorized NumPy/SciPy calls.

Measured on 2 cores (step of the radon GLMM, 735 rows x 12 quadrature nodes x
5 sigma points): two ``fill`` (``Second``) nodes cost 8.6 of the 21 ms per
iteration before :func:`fill_as_alloc`.

The nodes run in PyTensor's C loop (:func:`python_linker`) when a C compiler is
there: the loop over the nodes is C, each node still NumPy's ``perform``.
"""

from __future__ import annotations

import functools

import numpy as np
import pytensor
import pytensor.tensor as pt
from pymc.logprob.utils import local_check_parameter_to_ninf_switch
from pytensor.compile import optdb
from pytensor.compile.mode import Mode, get_mode
from pytensor.graph.basic import Apply
from pytensor.graph.rewriting.basic import in2out, node_rewriter
from pytensor.graph.rewriting.db import RewriteDatabase, RewriteDatabaseQuery
from pytensor.link.vm import VMLinker
from pytensor.scalar.basic import Add, Cast, Clip, Identity, Mul, Second
from pytensor.scalar.math import Log1mexp, TriGamma
from pytensor.tensor.elemwise import Elemwise

from pymc_mcssvi.families.batched import blockwise_linalg_as_stacked
from pymc_mcssvi.recognize.stabilize import softplus_to_ufuncs

__all__ = [
    "HELPER_MODE",
    "UFUNC_REWRITES",
    "clip_as_ufuncs",
    "fill_as_alloc",
    "graph_building",
    "identity_as_input",
    "log1mexp_as_ufuncs",
    "per_element_ops",
    "split_wide_sums",
    "python_few_calls_mode",
    "python_linker",
    "python_step_mode",
    "structure_rewrites",
    "trigamma_as_polygamma",
    "without_structure_rewrites",
]

#: Mode for one-off helper functions (initial points, sampling): no compilation.
HELPER_MODE = "FAST_COMPILE"


def graph_building(mode=HELPER_MODE):
    """PyTensor flags while the plugin builds (and runs one-off) graphs.

    ``mode`` for helper functions, and no creation traceback on the variables and
    nodes built: PyTensor records one per node by walking the Python stack
    (``traceback__limit``, 8 frames by default), which cost 15% of a whole
    Contraception GLMM fit (2.9 -> 2.5 s; the step, the profile and their bounds
    build tens of thousands of nodes). Errors the plugin raises name the model's
    variables themselves; PyTensor's own compile-time rewriting already runs
    without tracebacks (``traceback__compile_limit``).

    Examples
    --------
    >>> import pytensor
    >>> with graph_building():
    ...     pytensor.config.traceback__limit, pytensor.config.mode
    (0, 'FAST_COMPILE')
    """
    return pytensor.config.change_flags(mode=mode, traceback__limit=0)


#: Rewrites outside PyTensor's linear-algebra modules that only fire on matrices
#: proven diagonal/orthogonal by the assumption system (never ours).
_ASSUMPTION_REWRITES = ("dot_diag_to_elemwise",)


@functools.cache
def structure_rewrites() -> tuple[str, ...]:
    """Names of the rewrites that look for matrix structure.

    Every rewrite defined in ``pytensor.tensor.rewriting.linalg`` (most are not
    tagged ``"linalg"``) plus :data:`_ASSUMPTION_REWRITES`. They ask PyTensor's
    assumption system whether a matrix is diagonal, orthogonal, triangular...;
    the step's matrices are dense by construction, so the answer is always no
    and asking costs a fifth of the step's set-up (Contraception GLMM:
    0.6 s of 3.2 s, with identical iterations).
    """

    names, seen = set(_ASSUMPTION_REWRITES), set()

    def walk(db):
        if id(db) in seen:
            return
        seen.add(id(db))
        for name in getattr(db, "_names", ()):
            for rewriter in list(db.__db__.get(name, ())):
                if isinstance(rewriter, RewriteDatabase):
                    walk(rewriter)
                    continue
                module = getattr(getattr(rewriter, "fn", None), "__module__", "") or ""
                if module.startswith("pytensor.tensor.rewriting.linalg"):
                    names.add(name)

    walk(optdb)
    return tuple(sorted(names))


def without_structure_rewrites(mode: Mode) -> Mode:
    """``mode`` without the ``"linalg"`` rewrites and :func:`structure_rewrites`."""
    return mode.excluding("linalg", *structure_rewrites())


def _scalar_op_is(node, cls) -> bool:
    return isinstance(node.op, Elemwise) and isinstance(node.op.scalar_op, cls)


def _as_output(new, node):
    """``new`` with the dtype of ``node``'s output."""
    out = node.outputs[0]
    return [new.astype(out.dtype) if new.dtype != out.dtype else new]


@node_rewriter([Elemwise])
def trigamma_as_polygamma(fgraph, node):
    """``tri_gamma(x) -> polygamma(1, x)``: the same function, but with a NumPy-level
    (SciPy ufunc) implementation. PyTensor's ``TriGamma`` has none, so the Python VM
    evaluates it one scalar at a time (a Beta regression with 600 rows spent 0.7 s per
    iteration there: the derivatives of ``digamma(mu * nu)``)."""
    if not _scalar_op_is(node, TriGamma):
        return None
    (x,) = node.inputs
    return _as_output(pt.polygamma(1, x), node)


@node_rewriter([Elemwise])
def fill_as_alloc(fgraph, node):
    """``fill(x, y)`` (``Second``: ``y`` broadcast to the shape of ``x``) -> ``alloc``.

    PyTensor's gradients and ``zeros_like``/``ones_like`` produce ``fill``; its
    Python implementation is per element. ``Alloc`` fills the array with one
    NumPy call. Dimensions known statically stay static (the output's type is
    unchanged). The node is built with that type directly: ``pt.alloc`` would
    infer the static shape by rewriting the shape graphs, which walks all of
    ``x``'s ancestors once per ``fill`` (a sparse GP's conditional draws spent
    13 s compiling there).
    """
    if not _scalar_op_is(node, Second):
        return None
    x, y = node.inputs
    out = node.outputs[0]
    shape = []
    for i, static in enumerate(out.type.shape):
        if static is not None:
            shape.append(pt.constant(static, dtype="int64"))
        elif x.type.shape[i] == 1:
            shape.append(pt.cast(y.shape[i], "int64"))
        else:
            shape.append(pt.cast(x.shape[i], "int64"))
    value = y.astype(out.dtype)
    return [Apply(pt.basic.alloc, [value, *shape], [out.type()]).outputs[0]]


@node_rewriter([Elemwise])
def log1mexp_as_ufuncs(fgraph, node):
    """``log1mexp(x) = log(1 - exp(x))`` with PyTensor's own two branches as ufuncs.

    ``log1p(-exp(x))`` below ``log(1/2)``, ``log(-expm1(x))`` above (Maechler's
    rule, as ``Log1mexp.impl``); both branches are computed and ``switch``
    picks one, so the unused branch may warn (the fit silences NumPy warnings).
    """
    if not _scalar_op_is(node, Log1mexp):
        return None
    (x,) = node.inputs
    new = pt.switch(pt.lt(x, np.log(0.5)), pt.log1p(-pt.exp(x)), pt.log(-pt.expm1(x)))
    return _as_output(new, node)


@node_rewriter([Elemwise])
def clip_as_ufuncs(fgraph, node):
    """``clip(x, lo, hi) -> minimum(maximum(x, lo), hi)`` (``pm.math.clip`` in user models)."""
    if not _scalar_op_is(node, Clip):
        return None
    x, lo, hi = node.inputs
    return _as_output(pt.minimum(pt.maximum(x, lo), hi), node)


@node_rewriter([Elemwise])
def identity_as_input(fgraph, node):
    """``identity(x) -> x``: PyTensor's canonicalization removes it, the cheaper modes
    (:func:`python_few_calls_mode`) keep it, and it has no NumPy implementation."""
    if not _scalar_op_is(node, Identity):
        return None
    return _as_output(node.inputs[0], node)


#: Most operands of one element-wise node in Python mode (``Elemwise.perform``'s limit).
MAX_PYTHON_OPERANDS = 32


@node_rewriter([Elemwise])
def split_wide_sums(fgraph, node):
    """A sum or product of more operands than ``Elemwise.perform`` takes (32) -> nested ones.

    Canonicalization merges nested additions into one node: the bound of a matrix
    factorization with row and column biases, averaged over q(h)'s sigma points,
    became one ``Add`` of 35 terms, which the Python VM refuses to evaluate.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> xs = [pt.scalar(f"x{i}") for i in range(40)]
    >>> fn = pytensor.function(xs, pt.add(*xs), mode=python_step_mode())
    >>> float(fn(*np.ones(40)))
    40.0
    """
    if not _scalar_op_is(node, Add | Mul) or len(node.inputs) < MAX_PYTHON_OPERANDS:
        return None
    op, size = node.op, MAX_PYTHON_OPERANDS - 1
    parts = [
        op(*node.inputs[i : i + size]) if len(node.inputs[i : i + size]) > 1 else node.inputs[i]
        for i in range(0, len(node.inputs), size)
    ]
    return _as_output(op(*parts), node)


def per_element_ops(fgraph) -> list[str]:
    """Element-wise nodes of ``fgraph`` the Python VM evaluates one element at a time.

    Those whose scalar op has no NumPy ufunc (``nfunc_spec``), except casts and
    variadic sums and products, which PyTensor evaluates with NumPy itself.

    Examples
    --------
    >>> import pytensor, pytensor.tensor as pt
    >>> x = pt.vector("x")
    >>> per_element_ops(pytensor.function([x], pt.exp(x), mode="FAST_COMPILE").maker.fgraph)
    []
    """
    bad = []
    for node in fgraph.apply_nodes:
        if not isinstance(node.op, Elemwise) or node.op.nfunc_spec is not None:
            continue
        if not isinstance(node.op.scalar_op, Cast | Add | Mul):
            bad.append(str(node))
    return bad


#: Rewrites of element-wise ops without a NumPy implementation.
UFUNC_REWRITES = (
    identity_as_input,
    trigamma_as_polygamma,
    fill_as_alloc,
    softplus_to_ufuncs,
    log1mexp_as_ufuncs,
    clip_as_ufuncs,
    split_wide_sums,
)


#: Position of :func:`~pymc_mcssvi.families.batched.blockwise_linalg_as_stacked` in the
#: Python backend's modes: before canonicalization, which could fold the identity
#: blocks the lower-triangular inverse is solved against.
STACKED_LINALG_POSITION = 0.5


def python_linker() -> VMLinker:
    """Linker of the ``"python"`` backend's functions: NumPy ``perform`` per node.

    The nodes are called from PyTensor's C loop (``use_cloop``; PyTensor's
    small, cached ``lazylinker_c`` module, the only C it compiles here, once
    per machine) instead of its Python ``Stack`` loop, which our lazy
    ``ifelse`` nodes would otherwise select. The loop costs about 11 us per
    node in Python: 6.4 of the 22.8 ms a call of the Contraception GLMM's
    profile re-fit (585 nodes) took, which now takes 12.7-18 ms (radon's
    478-node re-fit 11-20 -> 6-11 ms; same outputs to the last bit). Without a
    C compiler (``pytensor.config.cxx`` empty) PyTensor falls back to its
    Python loops by itself. No garbage collection between calls: the
    functions are called many times with arrays of the same shapes.

    Examples
    --------
    >>> python_linker().c_thunks, python_linker().allow_gc
    (False, False)
    """
    return VMLinker(use_cloop=True, c_thunks=False, allow_gc=False)


def python_step_mode() -> Mode:
    """Mode of the step function with the ``"python"`` backend.

    FAST_COMPILE's rewrites without the matrix-structure ones (see
    :func:`structure_rewrites`), run by :func:`python_linker`, plus
    :data:`UFUNC_REWRITES` (after the other rewrites, which could reintroduce
    the ops they remove; before the final merge), the stacked linear algebra of
    many small blocks, and PyTensor's memory rewrite of scans (the reduction of
    chunked statistics keeps one accumulator, not one per chunk).

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> x = pt.vector("x")
    >>> fn = pytensor.function([x], pt.softplus(x), mode=python_step_mode())
    >>> np.allclose(fn(np.array([-800.0, 0.0, 800.0])), [0.0, np.log(2.0), 800.0])
    True
    """
    return (
        Mode(
            linker=python_linker(),
            optimizer=without_structure_rewrites(get_mode("FAST_COMPILE")).provided_optimizer,
        )
        .register(
            (in2out(blockwise_linalg_as_stacked), STACKED_LINALG_POSITION),
            (in2out(*UFUNC_REWRITES, name="ufunc_rewrites"), 48.5),
        )
        # a scan that reduces chunked statistics keeps its last accumulator only (without
        # this rewrite it would hold one per chunk)
        .including("scan_save_mem")
    )


def python_few_calls_mode() -> Mode:
    """Mode of functions called a few dozen times with the ``"python"`` backend.

    Only merging and :data:`UFUNC_REWRITES`: PyTensor's canonicalization of a
    graph the size of a step (800-1,300 nodes) costs 0.2-0.5 s and saves a few
    milliseconds per call, which pays for itself only over a fit's iterations,
    not over the 40-90 calls of the skewed q(h)'s profile
    (:mod:`pymc_mcssvi.posterior.marginal`). Same :func:`python_linker` as
    :func:`python_step_mode`.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> x = pt.vector("x")
    >>> fn = pytensor.function([x], pt.softplus(x) + 0 * x, mode=python_few_calls_mode())
    >>> np.allclose(fn(np.array([-800.0, 0.0, 800.0])), [0.0, np.log(2.0), 800.0])
    True
    """
    return (
        Mode(linker=python_linker(), optimizer=RewriteDatabaseQuery(include=["merge"]))
        .register((in2out(blockwise_linalg_as_stacked), STACKED_LINALG_POSITION))
        .register((in2out(*UFUNC_REWRITES, name="ufunc_rewrites"), 48.5))
        # PyMC's parameter checks (``sigma > 0``) return -inf instead of raising, as in
        # every PyMC function (that rewrite lives in canonicalize, which is skipped here):
        # a step whose candidate q(h) puts a scale at 0 is then rejected, not fatal
        .register((in2out(local_check_parameter_to_ninf_switch), 1))
    )
