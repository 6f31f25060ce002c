"""Numerically stable forms of elementwise log densities before differentiation.

The engine differentiates each likelihood twice in its predictor and evaluates
it at Gauss-Hermite nodes several standard deviations out, where naive forms
round to ``log(0)``. PyTensor's ``stabilize`` pass already rewrites
``log(sigmoid(x))`` to ``-softplus(-x)`` and ``log(erfc(x))`` to an asymptotic
series; the rewrites here expose the probit forms PyMC writes
(``log(0.5 * erfc(-x / sqrt(2)))`` and ``log1p(-0.5 * erfc(-x / sqrt(2)))``) to
that pass, and rewrite the ordered likelihoods, whose probabilities PyMC forms
as differences of cumulative probabilities before taking the log:

* ordered logistic, ``log(sigmoid(a) - sigmoid(b))`` with ``a = c_k - f``,
  ``b = c_{k-1} - f``: since ``sigmoid(a) - sigmoid(b) = sigmoid(a) sigmoid(-b)
  (1 - e^{b - a})``, it is ``-softplus(-a) - softplus(b) + log1mexp(b - a)``,
  finite for any ``f`` (``b - a = c_{k-1} - c_k`` does not depend on ``f``);
* ordered probit: PyMC already has the log probabilities and exponentiates
  them; ``log(take(exp(X)))`` becomes ``take(X)``;
* complementary log-log (``p = 1 - exp(-exp(x))``) and log-log links:
  PyTensor's pass leaves ``log1mexp(-exp(x))``, whose value is right but whose
  derivatives are ``0 / 0`` once ``exp(x)`` underflows (``x < -745``) and
  ``inf / inf`` once ``exp(exp(x))`` overflows (``x > 6.6``); it becomes a
  three-piece form with finite derivatives of every order
  (:func:`log1mexp_negexp`);
* censored survival times (``pm.Censored`` of an exponential or Weibull
  distribution): the log cdf ``log1mexp(-y)`` with ``y = c exp(f)`` or
  ``(c / exp(f))^a`` becomes ``log1mexp_negexp(log y)`` with ``log y`` formed
  without the round trip, and the log survival function, which PyMC writes as
  the double complement ``log1mexp(log1mexp(-y))``, becomes ``-exp(log y)``;
* ``log(erfc(x))`` (probit terms, ``pm.SkewNormal``) becomes :func:`log_erfc`,
  whose derivatives stay finite where ``erfc`` underflows;
* masks: a comparison passes no gradient to its inputs, and ``c * log(x)``
  with observed ``c`` (PyMC's ``logpow``) takes ``log(1)`` where ``c = 0``, so the
  derivative of a masked ``0 * log(0)`` (a Poisson rate of 0) is 0, not NaN.
"""

from __future__ import annotations

import numpy as np
import pytensor.tensor as pt
from pytensor import scalar as ps_scalar
from pytensor.gradient import DisconnectedGrad, disconnected_grad
from pytensor.graph.basic import Constant
from pytensor.graph.rewriting.basic import in2out, node_rewriter
from pytensor.graph.rewriting.utils import rewrite_graph
from pytensor.scalar import math as ps_math
from pytensor.tensor.basic import Join, get_underlying_scalar_constant_value
from pytensor.tensor.elemwise import DimShuffle, Elemwise
from pytensor.tensor.exceptions import NotScalarConstantError
from pytensor.tensor.math import erfc, exp, log, log1p, mul, neg, sub
from pytensor.tensor.subtensor import AdvancedSubtensor, Subtensor, get_idx_list

from pymc_mcssvi.recognize.graph import holds_row_positions

__all__ = ["log1mexp_negexp", "log_erfc", "softplus_to_ufuncs", "stable_logp"]


def _const_value(v):
    """The value of a one-element constant (through ``DimShuffle``s), else ``None``."""
    data = _constant_data(v)
    return float(data.reshape(-1)[0]) if data is not None and data.size == 1 else None


def _constant_data(v):
    """The array of a constant (through broadcasting ``DimShuffle``s), else ``None``."""
    while v.owner is not None and isinstance(v.owner.op, DimShuffle):
        v = v.owner.inputs[0]
    return np.asarray(v.data) if isinstance(v, Constant) else None


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


class _PlainErfc(ps_math.Erfc):
    """``erfc`` that PyTensor's ``log(erfc(x))`` stabilization does not match.

    :func:`log_erfc` evaluates ``log(erfc(x))`` directly only where it is exact, and
    must keep PyTensor from wrapping that piece in its own asymptotic ``switch``,
    whose unused branch has ``0 * inf`` derivatives at ``x = 0``. The backends'
    implementations of ``Erfc`` serve it unchanged.
    """


_plain_erfc = Elemwise(_PlainErfc(ps_math.upgrade_to_float_no_complex, name="erfc"))

#: Above this ``x``, :func:`log_erfc` uses the asymptotic series (float64, float32).
_ERFC_SERIES = {"float64": 12.0, "float32": 8.0}


def log_erfc(x):
    """``log(erfc(x))`` with finite derivatives of every order for every ``x``.

    The log probability of a probit-type term (``log Phi(z) = log(erfc(-z / sqrt 2) / 2)``),
    e.g. ``pm.SkewNormal``. PyTensor's own stabilization keeps the value finite,
    but the derivatives of ``log(erfc(x))`` are ``0 / 0`` once ``erfc(x)``
    underflows (``x > 26.5``), which the engine's Gauss-Hermite nodes reach. Above
    12 (8 in float32) the asymptotic series ``-x^2 - log(x) - log(pi) / 2 +
    log(1 - s + 3 s^2 - 15 s^3 + 105 s^4 - 945 s^5)``, ``s = 1 / (2 x^2)``, is exact
    to 2e-11 (its next term); below, ``erfc`` itself is. Each piece's input is
    clamped into its own range so the unused one has finite derivatives.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> x = pt.vector("x")
    >>> d2 = pytensor.grad(pytensor.grad(log_erfc(x).sum(), x).sum(), x)
    >>> np.isfinite(d2.eval({x: np.array([-40.0, 0.0, 12.0, 40.0, 1e4])})).all()
    np.True_
    """
    t = _ERFC_SERIES.get(x.dtype, _ERFC_SERIES["float32"])
    x_lo = pt.minimum(x, t)
    x_hi = pt.maximum(x, t)
    s = 0.5 / pt.sqr(x_hi)
    poly = 1.0 + s * (-1.0 + s * (3.0 + s * (-15.0 + s * (105.0 - 945.0 * s))))
    series = -pt.sqr(x_hi) - pt.log(x_hi) - 0.5 * np.log(np.pi) + pt.log(poly)
    return pt.switch(x > t, series, pt.log(_plain_erfc(x_lo)))


@node_rewriter([log])
def _log_erfc(fgraph, node):
    """``log(erfc(x)) -> log_erfc(x)`` (finite derivatives; see :func:`log_erfc`)."""
    (arg,) = node.inputs
    if arg.owner is None or arg.owner.op != erfc:
        return None
    return [log_erfc(arg.owner.inputs[0]).astype(node.outputs[0].dtype)]


#: Below this ``x``, ``log(1 - exp(-exp(x))) = x - exp(x) / 2`` to double precision.
_CLOGLOG_LOW = -20.0
#: Above this ``x``, ``log(1 - exp(-exp(x))) = -exp(-exp(x))`` to double precision.
_CLOGLOG_HIGH = 3.7


def log1mexp_negexp(x):
    """``log(1 - exp(-exp(x)))`` with finite first and second derivatives for every ``x``.

    The log probability of the complementary log-log link. Three pieces, each
    exact to double precision on its range: ``x - exp(x) / 2`` (series in
    ``t = exp(x)``; the next term is ``t^2 / 24 < 1e-18``), ``log(-expm1(-exp(x)))``,
    and ``-exp(-exp(x))`` (the next term is ``exp(-2 t) / 2 < 1e-18`` relative).
    The inputs of the pieces that are not selected are clamped into their own
    range, so their derivatives stay finite and ``switch`` drops them.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> x = pt.vector("x")
    >>> d2 = pytensor.grad(pytensor.grad(log1mexp_negexp(x).sum(), x).sum(), x)
    >>> np.isfinite(d2.eval({x: np.array([-900.0, 0.0, 40.0, 900.0])})).all()
    np.True_
    """
    low = x < _CLOGLOG_LOW
    high = x > _CLOGLOG_HIGH
    x_low = pt.minimum(x, _CLOGLOG_LOW)
    x_mid = pt.clip(x, _CLOGLOG_LOW, _CLOGLOG_HIGH)
    # above 700 the value and its derivatives are 0 to double precision; without the
    # cap, exp(x) overflows and the derivative exp(x) exp(-exp(x)) is inf * 0 = nan
    x_high = pt.clip(x, _CLOGLOG_HIGH, 700.0)
    return pt.switch(
        low,
        x_low - 0.5 * pt.exp(x_low),
        # log(-expm1(.)) rather than log1mexp(.): the rewrite must not match its own output
        pt.switch(high, -pt.exp(-pt.exp(x_high)), pt.log(-pt.expm1(-pt.exp(x_mid)))),
    )


def _negated_exp(v):
    """Match ``-exp(x)`` (as ``neg`` or a product with the constant -1); return ``x``."""
    if v.owner is None:
        return None
    if v.owner.op == neg:
        e = v.owner.inputs[0]
    elif v.owner.op == mul and len(v.owner.inputs) == 2:
        a, b = v.owner.inputs
        if _const_value(a) == -1.0:
            e = b
        elif _const_value(b) == -1.0:
            e = a
        else:
            return None
    else:
        return None
    if e.owner is not None and e.owner.op == exp:
        return e.owner.inputs[0]
    return None


def _positive_constant(v):
    """The value of a constant whose entries are all positive, else ``None``."""
    while v.owner is not None and isinstance(v.owner.op, DimShuffle):
        v = v.owner.inputs[0]
    if isinstance(v, Constant):
        data = np.asarray(v.data, dtype="float64")
        if data.size and np.all(data > 0) and np.all(np.isfinite(data)):
            return data
    return None


def _log_of_positive(y, depth=0):
    """``log(y)`` as a graph without ``exp``/``log`` round trips, for ``y`` built from
    ``exp(x)``, positive constants, products, quotients and powers; else ``None``.

    The survival and cumulative probabilities of the exponential and Weibull
    distributions are ``exp(-y)`` with ``y = c exp(x)`` or ``(c / exp(x))^a``.
    """
    if depth > 8 or y.owner is None:
        c = _positive_constant(y)
        return None if c is None else pt.as_tensor(np.log(c))
    op = y.owner.op
    ins = y.owner.inputs
    if op == exp:
        return ins[0]
    if isinstance(op, DimShuffle):
        inner = _log_of_positive(ins[0], depth + 1)
        return None if inner is None else op(inner) if inner.ndim == ins[0].ndim else None
    c = _positive_constant(y)
    if c is not None:
        return pt.as_tensor(np.log(c))
    if op == mul:
        parts = [_log_of_positive(v, depth + 1) for v in ins]
        return None if any(p is None for p in parts) else sum(parts[1:], parts[0])
    if op == pt.true_div:
        a, b = (_log_of_positive(v, depth + 1) for v in ins)
        return None if a is None or b is None else a - b
    if op == pt.pow:  # log(b^a) = a log(b) for b > 0, whatever a (a Weibull shape)
        base, power = ins
        lb = _log_of_positive(base, depth + 1)
        return None if lb is None else power * lb
    return None


def _negated(v):
    """``y`` for ``v = -y`` (``neg``, or a product with constants that are all negative)."""
    if v.owner is None:
        return None
    if v.owner.op == neg:
        return v.owner.inputs[0]
    if v.owner.op == mul:
        for i, c in enumerate(v.owner.inputs):
            data = None
            w = c
            while w.owner is not None and isinstance(w.owner.op, DimShuffle):
                w = w.owner.inputs[0]
            if isinstance(w, Constant):
                data = np.asarray(w.data, dtype="float64")
            if data is not None and data.size and np.all(data < 0):
                rest = [x for j, x in enumerate(v.owner.inputs) if j != i]
                return mul(_negated_constant(c), *rest) if rest else None
    return None


def _negated_constant(c):
    """``-c`` for a constant (possibly behind DimShuffles), as a constant with the same layout."""
    if c.owner is not None and isinstance(c.owner.op, DimShuffle):
        return c.owner.op(_negated_constant(c.owner.inputs[0]))
    return pt.constant(-np.asarray(c.data), dtype=c.dtype)


@node_rewriter([Elemwise])
def _log1mexp_of_negexp(fgraph, node):
    """``log1mexp(-exp(x)) -> log1mexp_negexp(x)`` (complementary log-log links), and
    ``log1mexp(-y) -> log1mexp_negexp(log y)`` for the ``y`` of :func:`_log_of_positive`
    (``c exp(x)``: the cumulative probability of an exponential survival time, left
    censoring; ``(c / exp(x))^a``: Weibull)."""
    if not isinstance(node.op.scalar_op, ps_math.Log1mexp):
        return None
    x = _negated_exp(node.inputs[0])
    if x is None:
        y = _negated(node.inputs[0])
        x = None if y is None else _log_of_positive(y)
    if x is None:
        return None
    out = log1mexp_negexp(x)
    if out.type.broadcastable != node.outputs[0].type.broadcastable:
        out = pt.broadcast_to(out, node.outputs[0].shape)
    return [out]


@node_rewriter([Elemwise])
def _log1mexp_of_log1mexp(fgraph, node):
    """``log1mexp(log1mexp(u)) -> u``: the log survival function PyMC writes for a
    right-censored observation, ``log(1 - exp(logcdf))`` with ``logcdf = log1mexp(u)``
    (exponential: ``u = -c exp(x)``). ``1 - (1 - e^u) = e^u``; the double complement
    rounds to ``log(0)`` once ``e^u`` underflows."""
    if not isinstance(node.op.scalar_op, ps_math.Log1mexp):
        return None
    (arg,) = node.inputs
    if (
        arg.owner is None
        or not isinstance(arg.owner.op, Elemwise)
        or not isinstance(arg.owner.op.scalar_op, ps_math.Log1mexp)
    ):
        return None
    u = arg.owner.inputs[0]
    y = _negated(u)
    log_y = None if y is None else _log_of_positive(y)
    if log_y is not None:  # u = -exp(log y): no overflowing intermediate (Weibull's (c / e^x)^a)
        u = -pt.exp(log_y)
    if u.type.broadcastable != node.outputs[0].type.broadcastable:
        u = pt.broadcast_to(u, node.outputs[0].shape)
    return [u]


@node_rewriter([Elemwise])
def softplus_to_ufuncs(fgraph, node):
    """``softplus(x) -> max(x, 0) + log1p(exp(-|x|))``.

    The same stable value (exact in floating point over the whole line: no
    overflow for large ``x``, full relative accuracy for very negative ``x``),
    written with operations that have NumPy ufuncs: PyTensor's scalar softplus
    has none and runs as a Python loop per element when the step is not
    compiled (also part of :data:`pymc_mcssvi.backend.modes.UFUNC_REWRITES`).
    """
    if not isinstance(node.op.scalar_op, ps_math.Softplus):
        return None
    (x,) = node.inputs
    out = pt.maximum(x, 0) + pt.log1p(pt.exp(-pt.abs(x)))
    dtype = node.outputs[0].dtype
    return [out if out.dtype == dtype else out.astype(dtype)]


@node_rewriter([mul])
def _zero_weighted_log(fgraph, node):
    """``c * log(x) -> c * log(switch(c == 0, 1, x))`` for data ``c`` with zeros.

    PyMC's ``logpow(x, c)`` (Poisson, binomial, ...: ``c`` the observed counts)
    masks ``0 * log(0)`` with a ``switch``, but the masked branch's derivative
    ``c / x = 0 / 0`` still reaches the gradient (the ``switch`` multiplies it by
    0) unless a later canonicalization happens to sink the ``switch``: a Poisson
    rate of 0 (a zero exposure) made every derivative NaN. Where ``c = 0`` the new
    form is exactly 0 with derivative 0; elsewhere it is unchanged.
    """
    if len(node.inputs) != 2:
        return None
    for c, lg in (node.inputs, node.inputs[::-1]):
        data = _constant_data(c)
        if data is None or lg.owner is None or lg.owner.op != log or not (data == 0).any():
            continue
        (x,) = lg.owner.inputs
        if (
            x.owner is not None
            and isinstance(x.owner.op, Elemwise)
            and isinstance(x.owner.op.scalar_op, ps_scalar.Switch)
        ):
            return None  # already guarded
        safe = pt.switch(pt.eq(c, 0), pt.ones((), dtype=x.dtype), x)
        out = mul(c, pt.log(safe))
        return [out if out.dtype == node.outputs[0].dtype else out.astype(node.outputs[0].dtype)]
    return None


@node_rewriter([Elemwise])
def _comparison_without_gradient(fgraph, node):
    """Comparisons pass no gradient to their inputs.

    A comparison's derivative is 0, but PyTensor multiplies that 0 by its
    input's derivative, which is infinite where masks are needed: PyMC's
    ``logpow`` tests ``log(x) == -inf``, and ``0 * (1 / x)`` at ``x = 0`` made
    every derivative of a Poisson with a zero rate (a zero exposure) NaN.
    """
    if not isinstance(node.op.scalar_op, ps_scalar.LogicalComparison):
        return None
    new = [
        x
        if isinstance(x, Constant)
        or (x.owner is not None and isinstance(x.owner.op, DisconnectedGrad))
        else disconnected_grad(x)
        for x in node.inputs
    ]
    if all(a is b for a, b in zip(new, node.inputs, strict=True)):
        return None
    return [node.op(*new)]


#: Stand-in for the infinite outer cutpoints of an ordered likelihood (``softplus``
#: of minus this is exactly 0 in double precision, and so is ``log1mexp`` of it).
_BIG = 1e10


def _squeezed_gather(v):
    """For ``squeeze?(x[idx])`` (an advanced index) return ``(x, idx, rebuild, kind)``, else ``None``.

    ``rebuild(y) = squeeze?(y[idx])`` applies the same index (and squeeze) to ``y``;
    ``kind`` is the ``(index op, squeeze op)`` pair, equal for gathers of the same form.
    """
    squeeze = None
    if v.owner is not None and isinstance(v.owner.op, DimShuffle) and v.owner.op.is_squeeze:
        squeeze, v = v.owner.op, v.owner.inputs[0]
    if v.owner is None or not isinstance(v.owner.op, AdvancedSubtensor):
        return None
    op, (x, *idx) = v.owner.op, v.owner.inputs

    def rebuild(y):
        out = op(y, *idx)
        return squeeze(out) if squeeze is not None else out

    return x, idx, rebuild, (op, squeeze)


def _indexed_log(node):
    """For ``log(squeeze?(x[idx]))`` return ``(x, rebuild)`` with ``rebuild(y) = squeeze?(y[idx])``."""
    found = _squeezed_gather(node.inputs[0])
    return None if found is None else (found[0], found[2])


def _last_axis_slice(v, start, stop) -> bool:
    """Whether ``v`` is ``x[..., start:stop]`` (``None`` for an open end)."""
    if v.owner is None or not isinstance(v.owner.op, Subtensor):
        return False
    idx = get_idx_list(v.owner.inputs, v.owner.op.idx_list)
    x = v.owner.inputs[0]
    if len(idx) != x.ndim or not all(i == slice(None) for i in idx[:-1]):
        return False
    last = idx[-1]
    if not isinstance(last, slice) or last.step is not None:
        return False

    def value(b):
        if b is None:
            return None
        try:
            return int(get_underlying_scalar_constant_value(b))
        except NotScalarConstantError:
            return "?"

    return value(last.start) == start and value(last.stop) == stop


def _constant_fill(v):
    try:
        return float(get_underlying_scalar_constant_value(v, elemwise=True))
    except NotScalarConstantError:
        return None


@node_rewriter([log])
def _log_indexed_exp(fgraph, node):
    """``log(exp(X)[idx]) -> X[idx]`` (PyMC's ordered probit)."""
    found = _indexed_log(node)
    if found is None:
        return None
    x, rebuild = found
    if x.owner is None or x.owner.op != exp:
        return None
    return [rebuild(x.owner.inputs[0])]


@node_rewriter([log])
def _log_ordered_logistic(fgraph, node):
    """``log(diff(concat([0, sigmoid(x), 1]))[idx])`` in closed, stable form (module docstring).

    Also matches the form canonicalization gives when the length is static, with
    the index pushed into both operands: ``log(P[:, 1:][idx] - P[:, :-1][idx])``.
    """
    found = _indexed_log(node)
    if found is not None:
        d, rebuild = found
        if d.owner is None or d.owner.op != sub:
            return None
        hi, lo = d.owner.inputs
        logged = node.inputs[0]
    else:
        found = _difference_of_gathers(node.inputs[0])
        if found is None:
            return None
        hi, lo, rebuild, logged = found
    if not (_last_axis_slice(hi, 1, None) and _last_axis_slice(lo, None, -1)):
        return None
    J = hi.owner.inputs[0]
    if J is not lo.owner.inputs[0] or J.owner is None or not isinstance(J.owner.op, Join):
        return None
    parts = J.owner.inputs
    axis = getattr(J.owner.op, "axis", None)
    if axis is None:  # older PyTensor: the axis is the first input
        axis, *parts = parts
        try:
            axis = int(get_underlying_scalar_constant_value(axis))
        except NotScalarConstantError:
            return None
    if axis not in (-1, J.ndim - 1) or len(parts) != 3:
        return None
    zero, mid, one = parts
    if _constant_fill(zero) != 0.0 or _constant_fill(one) != 1.0:
        return None
    if not (
        mid.owner is not None
        and isinstance(mid.owner.op, Elemwise)
        and isinstance(mid.owner.op.scalar_op, ps_math.Sigmoid)
    ):
        return None
    x = mid.owner.inputs[0]
    found = _cutpoints_minus_predictor(x, logged)
    if found is not None:
        # a = c_k - f, b = c_{k-1} - f with the cutpoints gathered first: the
        # density is then elementwise in f (no n x levels arrays to differentiate).
        (c_hi, c_lo), f = found
        a, b = c_hi - f, c_lo - f
    else:
        pad = pt.ones_like(x[..., :1]) * _BIG
        xp = pt.concatenate([-pad, x, pad], axis=-1)
        a, b = rebuild(xp[..., 1:]), rebuild(xp[..., :-1])
    # b - a = c_{k-1} - c_k. Clipped at -50 (log1mexp is -2e-22 there) because at the
    # padded ends it is about -1e10, where log1mexp's second derivative is 0 / 0.
    logp = -pt.softplus(-a) - pt.softplus(b) + pt.log1mexp(pt.maximum(b - a, -50.0))
    if logp.type.ndim != node.outputs[0].type.ndim:
        return None
    return [logp]


def _is_row_positions(v) -> bool:
    """Whether ``v`` is ``arange(n)`` (possibly reshaped to a column, or folded to a constant)."""
    while v.owner is not None and (
        isinstance(v.owner.op, DimShuffle) or v.owner.op.__class__.__name__ == "Reshape"
    ):
        v = v.owner.inputs[0]
    if isinstance(v, Constant):
        return holds_row_positions(v.data)
    if v.owner is None or v.owner.op.__class__.__name__ != "ARange":
        return False
    start, _, step = v.owner.inputs
    return _constant_fill(start) == 0.0 and _constant_fill(step) == 1.0


def _difference_of_gathers(v):
    """For ``squeeze?(A[idx]) - squeeze?(B[idx])`` (the same index), ``(A, B, rebuild, first)``."""
    if v.owner is None or v.owner.op != sub:
        return None
    first, second = v.owner.inputs
    ga, gb = _squeezed_gather(first), _squeezed_gather(second)
    if ga is None or gb is None:
        return None
    (A, idx_a, rebuild, kind_a), (B, idx_b, _, kind_b) = ga, gb
    if kind_a != kind_b or len(idx_a) != len(idx_b):
        return None
    if not all(
        i is j
        or (isinstance(i, Constant) and isinstance(j, Constant) and np.array_equal(i.data, j.data))
        for i, j in zip(idx_a, idx_b, strict=True)
    ):
        return None
    return A, B, rebuild, first


def _cutpoints_minus_predictor(x, logged):
    """For ``x = C - F`` (``n x (L - 1)``, ``F`` one column) indexed as ``[arange(n), k]``,
    return ``((C_pad[k + 1], C_pad[k]), F[:, 0])`` with ``C`` padded by -/+ infinity.

    ``logged`` is the argument of the ``log`` (``squeeze?(d[rows, k])``).
    """
    if x.ndim != 2 or x.owner is None or x.owner.op != sub:
        return None
    C, F = x.owner.inputs
    if not F.type.broadcastable[-1]:
        return None
    found = _squeezed_gather(logged)
    if found is None or len(found[1]) != 2:
        return None
    rows, k = found[1]
    if not _is_row_positions(rows):
        return None
    if k.ndim == 2 and k.type.broadcastable[1]:
        k = k[:, 0]
    if k.ndim != 1 or logged.ndim != 1:
        return None
    C = pt.broadcast_to(C, (C.shape[0], x.shape[1])) if C.ndim == 2 else C
    big = pt.full((C.shape[0], 1), _BIG, dtype=x.dtype)
    cp = pt.concatenate([-big, C, big], axis=-1)  # (1 or n, L + 1): c_{-1} .. c_{L-1}
    if C.type.broadcastable[0]:
        c_hi, c_lo = cp[0][k + 1], cp[0][k]
    else:
        pos = pt.arange(k.shape[0])
        c_hi, c_lo = cp[pos, k + 1], cp[pos, k]
    f = F[:, 0]
    return (c_hi, c_lo), f


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
        logp,
        custom_rewrite=in2out(
            _log_scaled_erfc, _log1p_minus_half_erfc, _log_indexed_exp, _log_ordered_logistic
        ),
        clone=True,
    )
    # canonicalize exposes ``log(erfc(.))`` (``1 + erf(x) -> erfc(-x)``) before PyTensor's
    # stabilize pass would take it
    logp = rewrite_graph(
        logp, include=("canonicalize",), custom_rewrite=in2out(_log_erfc), clone=True
    )
    logp = rewrite_graph(logp, include=("canonicalize", "stabilize"))
    logp = rewrite_graph(logp, include=(), custom_rewrite=in2out(_log1mexp_of_log1mexp), clone=True)
    return rewrite_graph(
        logp,
        include=(),
        custom_rewrite=in2out(
            softplus_to_ufuncs,
            _log1mexp_of_negexp,
            _zero_weighted_log,
            _comparison_without_gradient,
        ),
        clone=True,
    )
