r"""Marginalize local latents out of an observed log density (paper section 2.2).

For an observed variable ``y`` with a local latent ``f`` (one per observation,
conditionally independent given the globals ``w``), the *optimal* bound (paper
eq. vlbi) uses

.. math::

    \log p(y_i \mid w) = \log \int p(f_i \mid w)\, p(y_i \mid f_i)\, df_i ,

and the *Jensen* bound (eq. vlb, :math:`q(f \mid w) = p(f \mid w)`) the smaller

.. math::

    E_{p(f_i \mid w)}[\log p(y_i \mid f_i)] .

* Gaussian local, ``f_i ~ N(a_i, s_i^2)``: the integral is adaptive
  Gauss-Hermite quadrature inside a log-sum-exp (``inner="quadrature"``, see
  :func:`laplace_nodes`), or the paper's Monte Carlo average over fresh draws
  from the prior (``inner="mc"``); exact in closed form when ``y_i ~ N(f_i, sigma)``.
* Discrete local with ``K`` values: exact enumeration,
  ``log sum_k p(z_i = k) p(y_i | z_i = k)``.

The result is an elementwise log density in which ``f`` no longer appears;
the recognizer then finds its affine predictor (usually ``a_i``) as for any
likelihood, so the cost per Gaussian-global step stays that of a GLM.
"""

from __future__ import annotations

import numpy as np
import pymc as pm
import pytensor.tensor as pt
from pymc.variational.minibatch_rv import MinibatchRandomVariable, get_scaling
from pytensor.compile.ops import ViewOp
from pytensor.gradient import disconnected_grad
from pytensor.graph.fg import MissingInputError
from pytensor.graph.replace import graph_replace
from pytensor.graph.rewriting.utils import rewrite_graph
from pytensor.graph.traversal import graph_inputs, io_toposort
from pytensor.scalar import basic as ps
from pytensor.tensor.elemwise import DimShuffle, Elemwise
from pytensor.tensor.random.basic import NormalRV
from pytensor.tensor.shape import Reshape, SpecifyShape

from pymc_mcssvi.exceptions import UnsupportedModelError
from pymc_mcssvi.quadrature_rules import gauss_hermite
from pymc_mcssvi.recognize.graph import (
    as_float,
    depends_on_any,
    evaluate_static,
    remove_checks,
    shape64,
)
from pymc_mcssvi.recognize.roles import base_op, dist_params
from pymc_mcssvi.recognize.vectorize import vectorize_graph

__all__ = [
    "MAX_NEWTON_STEP",
    "NEWTON_STEPS",
    "in_local_layout",
    "isolate_addend",
    "laplace_nodes",
    "marginal_logp",
]


def marginal_logp(
    model,
    local,
    bound: str = "optimal",
    inner: str = "quadrature",
    n_inner: int = 12,
    fixed=(),
):
    """Elementwise log density of ``local.observed`` with ``local`` integrated out.

    Parameters
    ----------
    model : pm.Model
    local : LocalLatent
    bound : {"optimal", "jensen"}
        Integral inside the log (paper eq. vlbi) or expectation of the log (eq. vlb).
    inner : {"quadrature", "mc"}
        Gauss-Hermite nodes or fresh standard normal draws for a Gaussian local.
    n_inner : int
        Number of inner nodes or draws.
    fixed : collection of TensorVariable
        Value variables (the Gaussian globals) that the scale ``b`` of a
        non-centred local, read as ``a + b * f`` (:func:`centre_local`), must not
        depend on.

    Returns
    -------
    TensorVariable
        Entry ``i`` is the marginal of observation ``i``, in the local's layout
        (the observed's unless the likelihood reads the local through a reshape,
        :func:`in_local_layout`); a graph in the value variables of the globals
        and hyperparameters (not of the local).
    """
    if bound not in ("optimal", "jensen"):
        raise ValueError(f"bound must be 'optimal' or 'jensen', got {bound!r}")
    obs = model[local.observed]
    logp_y, minibatch_scale = _unscaled_logp(model, obs)
    logp_y = isolate_addend(logp_y, local.value)
    params = model.replace_rvs_by_values(dist_params(local.rv))
    value = local.value
    shape = local.shape
    logp_y = in_local_layout(logp_y, shape)
    if local.kind == "discrete":
        return minibatch_scale * _enumerate(model, local, logp_y, bound, fixed)

    loc, scale = (pt.broadcast_to(as_float(p), shape64(shape)) for p in params)
    closed = _gaussian_closed_form(obs, value, shape, loc, scale, bound, model, fixed)
    if closed is not None:
        return minibatch_scale * closed
    centred = centre_local(logp_y, value, loc, scale, fixed)
    if centred is not None:
        logp_y, value, loc, scale = centred
    if inner not in ("quadrature", "mc"):
        raise ValueError(f"inner must be 'quadrature' or 'mc', got {inner!r}")
    if inner == "quadrature" and bound == "optimal":
        nodes, logv = laplace_nodes(logp_y, value, loc, scale, int(n_inner))
    else:
        if inner == "quadrature":  # a smooth expectation under the prior itself
            u, logv = _standard_nodes(int(n_inner), len(shape))
        else:
            u = pt.random.normal(size=(int(n_inner), *shape))
            logv = pt.constant(-np.log(n_inner))
        nodes = loc[None] + scale[None] * u
    per_node = vectorize_graph(logp_y, {value: nodes})
    if bound == "optimal":
        return minibatch_scale * pt.logsumexp(logv + per_node, axis=0)
    weights = pt.exp(logv) if inner == "quadrature" else 1.0 / n_inner
    return minibatch_scale * pt.sum(weights * per_node, axis=0)


def in_local_layout(logp_y, shape):
    """``logp_y`` (the observed's elementwise log density) in the layout of its local.

    A local is recognized when entry ``i`` of the observed's log density reads
    entry ``i`` of the local in flat (C) order, with equal sizes; the likelihood
    may read it through an added axis or a reshape (``f[:, None]`` for a column
    of observations, ``f.reshape((N, K))``). The quadrature nodes and the
    enumerated values live in the local's layout, so its marginal is computed
    (and kept) there. ``logp_y`` itself when the layouts agree.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> f = pt.vector("f", shape=(3,))
    >>> in_local_layout(-pt.square(f[:, None]), (3,)).type.shape
    (3,)
    """
    shape = tuple(shape)
    static = logp_y.type.shape
    if len(static) == len(shape) and all(
        s is None or s == d for s, d in zip(static, shape, strict=True)
    ):
        return logp_y
    return logp_y.reshape(shape64(shape))


#: Newton steps towards the mode of each local's integrand (:func:`laplace_nodes`).
NEWTON_STEPS = 6
#: Largest Newton step, in prior sds of the local.
MAX_NEWTON_STEP = 2.0


def laplace_nodes(logp_y, value, loc, scale, n: int):
    r"""Adaptive Gauss-Hermite nodes and log weights for :math:`\int p(y \mid f) N(f; a, s^2) df`.

    With ``(nodes, logw)`` of shape ``(n, *shape)``,
    ``log sum_k exp(logw_k + logp_y(nodes_k))`` is the log of the integral for
    every row. The nodes are centred on the mode ``c`` of the integrand and scaled
    by its curvature ``t`` (a Laplace approximation, found by
    :data:`NEWTON_STEPS` damped Newton steps from the prior mean), and the weights
    carry the ratio of the prior density to the standard normal one. Nodes placed
    on the prior instead miss a likelihood much narrower than it: a Poisson count
    of 80 pins ``f`` to +-0.11, which 12 nodes spread over a prior sd of 0.55 do
    not resolve, and the bound then favours a larger prior sd (grouseticks with
    an observation-level effect: its sd came out 0.95 where NUTS gives 0.55).

    The change of variables is exact for any ``c`` and ``t``, so they are held
    constant for gradients (``disconnected_grad``): derivatives are the quadrature
    of the derivatives, as with fixed nodes.

    Parameters
    ----------
    logp_y : TensorVariable
        Elementwise ``log p(y_i | f_i)``, a graph in ``value``.
    value : TensorVariable
        The local's value variable.
    loc, scale : TensorVariable
        The local's prior mean and sd, broadcast to its shape.
    n : int
        Number of nodes.

    Examples
    --------
    >>> import numpy as np, pytensor.tensor as pt
    >>> from scipy import integrate, special, stats
    >>> f = pt.vector("f")
    >>> logp = 80 * f - pt.exp(f) - special.gammaln(81.0)  # Poisson(80 | exp(f))
    >>> loc, scale = pt.as_tensor([3.0]), pt.as_tensor([0.55])
    >>> nodes, logw = laplace_nodes(logp, f, loc, scale, 12)
    >>> got = pt.logsumexp(logw + vectorize_graph(logp, {f: nodes}), axis=0).eval()[0]
    >>> lik = lambda x: stats.poisson(np.exp(x)).pmf(80) * stats.norm(3, 0.55).pdf(x)
    >>> exact = np.log(integrate.quad(lik, 2, 6, epsabs=0, epsrel=1e-12)[0])
    >>> bool(abs(got - exact) < 1e-8)
    True
    """
    u, logv = _standard_nodes(n, value.ndim)
    d1 = pt.grad(pt.sum(logp_y), value, disconnected_inputs="ignore")
    d2 = pt.grad(pt.sum(d1), value, disconnected_inputs="ignore")
    prior_prec = 1.0 / pt.square(scale)
    f = loc
    for _ in range(NEWTON_STEPS):
        g1, g2 = graph_replace([d1, d2], {value: f}, strict=False)
        curv = prior_prec + pt.maximum(-g2, 0.0)
        step = (g1 + (loc - f) * prior_prec) / curv
        step = pt.clip(step, -MAX_NEWTON_STEP * scale, MAX_NEWTON_STEP * scale)
        f = f + pt.switch(pt.isfinite(step), step, 0.0)
    g2 = graph_replace(d2, {value: f}, strict=False)
    t = 1.0 / pt.sqrt(prior_prec + pt.maximum(-g2, 0.0))
    c = disconnected_grad(pt.switch(pt.isfinite(f), f, loc))
    t = disconnected_grad(pt.switch(pt.isfinite(t) & (t > 0), t, scale))
    nodes = c[None] + t[None] * u
    z = (nodes - loc[None]) / scale[None]
    logw = logv + pt.log(t / scale)[None] - 0.5 * pt.square(z) + 0.5 * pt.square(u)
    return nodes, logw


def _standard_nodes(n: int, ndim: int):
    """Gauss-Hermite nodes of N(0, 1) and their log weights, shaped ``(n, 1, ..., 1)``."""
    u, v = gauss_hermite(n)
    lead = (-1,) + (1,) * ndim
    return pt.constant(u.reshape(lead)), pt.constant(np.log(v).reshape(lead))


def isolate_addend(logp, value):
    """``logp`` with every flat sum ``add(x_1, ..., x_k, value)`` rewritten as
    ``add(add(x_1, ..., x_k), value)``.

    The local ``e`` of an observation-level effect ``exp(X @ b + u[g] + e)`` is one
    input of PyTensor's flat sum; the rest of the sum, the predictor the local is
    added to, becomes a node of its own that the nodes of :func:`laplace_nodes`
    and their Newton steps all share, so the recognizer finds it as the one
    predictor through which the marginal reads the globals.
    """
    replace = {}
    for node in io_toposort(graph_inputs([logp]), [logp]):
        if not (isinstance(node.op, Elemwise) and isinstance(node.op.scalar_op, ps.Add)):
            continue
        others = [i for i in node.inputs if _strip_dimshuffle(i) is not value]
        if len(others) < 2 or len(others) == len(node.inputs):
            continue
        mine = [i for i in node.inputs if _strip_dimshuffle(i) is value]
        replace[node.outputs[0]] = pt.add(pt.add(*others), *mine)
    return graph_replace(logp, replace, strict=False) if replace else logp


def _strip_dimshuffle(v):
    while v.owner is not None and isinstance(v.owner.op, DimShuffle):
        v = v.owner.inputs[0]
    return v


def _unscaled_logp(model, obs):
    """Elementwise ``log p(y_i | f_i)`` and the minibatch factor ``N / |M|`` (1 without).

    PyMC multiplies the log density of a ``pm.Minibatch`` observation by
    ``N / |M|``; the marginal over a local must integrate the density of one
    observation, and only then be scaled (``log sum_k v_k p^c != c log sum_k v_k p``).
    """
    if not isinstance(obs.owner.op, MinibatchRandomVariable):
        return remove_checks(model.logp(vars=[obs], sum=False)[0]), 1.0
    inner, *total_size = obs.owner.inputs
    y = model.rvs_to_values[obs]
    logp_y = model.replace_rvs_by_values([pm.logp(inner, y)])[0]
    return remove_checks(logp_y), get_scaling(total_size, y.shape)


def _gaussian_closed_form(obs, value, shape, loc, scale, bound, model, fixed=()):
    """``y ~ N(f, sigma)``: the marginal is ``N(y; a, sqrt(sigma^2 + s^2))`` exactly
    (also for ``y ~ N(c + b f, sigma)``, through :func:`affine_in`)."""
    op, base = base_op(obs)
    if not isinstance(op, NormalRV):
        return None
    mu, sigma = model.replace_rvs_by_values(dist_params(obs))
    while (
        mu is not value
        and mu.owner is not None
        and isinstance(mu.owner.op, DimShuffle | Reshape | SpecifyShape | ViewOp)
    ):
        mu = mu.owner.inputs[0]  # a pm.Deterministic is a ViewOp
    if mu.ndim != loc.ndim:
        return None  # a layout change inside the affine map
    if mu is not value:
        found = affine_in(mu, value, fixed)
        if found is None or depends_on_any(sigma, [value]):
            return None
        a, b = found
        loc, scale = a + b * loc, pt.abs(b) * scale
    # y and sigma in the local's layout (entry i of y reads entry i of f in flat order)
    y = model.rvs_to_values[obs]
    sigma = pt.broadcast_to(as_float(sigma), y.shape)
    y, sigma = in_local_layout(y, shape), in_local_layout(sigma, shape)
    if bound == "optimal":
        var = pt.square(sigma) + pt.square(scale)
        return -0.5 * np.log(2 * np.pi) - 0.5 * pt.log(var) - 0.5 * pt.square(y - loc) / var
    # E_{N(f; a, s^2)} log N(y; f, sigma) = log N(y; a, sigma) - s^2 / (2 sigma^2)
    return (
        -0.5 * np.log(2 * np.pi)
        - pt.log(sigma)
        - 0.5 * (pt.square(y - loc) + pt.square(scale)) / pt.square(sigma)
    )


def centre_local(logp_y, value, loc, scale, fixed=()):
    r"""The density of a non-centred local in its centred variable.

    A local ``f ~ N(loc, scale)`` that ``logp_y`` reads only through one
    ``t = a + b * f`` (``mu + tau * z`` of a non-centred effect, one per
    observation) is the centred local ``t ~ N(a + b loc, |b| scale)``:
    :math:`\int p(y \mid a + b f) N(f; l, s) df = \int p(y \mid t) N(t; a + b l, |b| s) dt`.
    The marginal then reads the globals through the prior mean ``a + b loc`` as
    for a centred effect (one affine predictor per observation) instead of
    through every quadrature node (a general term).

    Returns ``(logp_t, t, loc_t, scale_t)``, or None when there is no such ``t``:
    ``f`` is read elsewhere too, ``b`` depends on ``fixed`` (the Gaussian
    globals), or ``t`` does not have ``f``'s shape. The change of variables is
    exact, and the adaptive nodes of :func:`laplace_nodes` are affine
    equivariant, so the marginal is unchanged up to rounding.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> z, mu, tau = pt.vector("z"), pt.scalar("mu"), pt.scalar("tau")
    >>> logp = -0.5 * pt.square(2.0 - (mu + tau * z))
    >>> loc, scale = pt.zeros(3), pt.ones(3)
    >>> logp_t, t, loc_t, scale_t = centre_local(logp, z, loc, scale)
    >>> loc_t.eval({mu: 1.0, tau: 2.0}), scale_t.eval({tau: -2.0})
    (array([1., 1., 1.]), array([2., 2., 2.]))
    """
    for node in io_toposort(graph_inputs([logp_y]), [logp_y]):
        if not (isinstance(node.op, Elemwise) and isinstance(node.op.scalar_op, ps.Add | ps.Sub)):
            continue
        (t,) = node.outputs
        found = affine_in(t, value, fixed)
        if found is None or t.type.broadcastable != value.type.broadcastable:
            continue
        a, b = found
        if _has_zeros(b):
            continue  # a data column with zeros: the local is absent from those rows
        centred = value.type()
        centred.name = f"{value.name or 'local'}_centred"
        logp_t = graph_replace(logp_y, {t: centred}, strict=False)
        if depends_on_any(logp_t, [value]):
            continue  # f is read elsewhere too
        loc_t = pt.broadcast_to(a + b * loc, loc.shape)
        scale_t = pt.broadcast_to(pt.abs(b) * scale, loc.shape)
        return logp_t, centred, loc_t, scale_t
    return None


def affine_in(t, value, fixed=()):
    """``(a, b)`` with ``t == a + b * value`` as written (``a + b * value``,
    ``a - b * value``, ``a + value``), ``a`` and ``b`` free of ``value`` and ``b``
    free of ``fixed``; None otherwise."""
    node = t.owner
    if node is None or not isinstance(node.op, Elemwise):
        return None
    op = node.op.scalar_op
    if not isinstance(op, ps.Add | ps.Sub):
        return None
    mine = [i for i, x in enumerate(node.inputs) if depends_on_any(x, [value])]
    if len(mine) != 1 or (isinstance(op, ps.Sub) and mine != [1]):
        return None
    b = _scale_of(node.inputs[mine[0]], value)
    if b is None or depends_on_any(b, [value, *fixed]):
        return None
    others = [x for i, x in enumerate(node.inputs) if i != mine[0]]
    if isinstance(op, ps.Sub):
        return others[0], -b
    return pt.add(*others), b


def _scale_of(x, value):
    """``b`` with ``x == b * value`` as written (``value`` itself: 1), else None."""
    while x.owner is not None and isinstance(x.owner.op, ViewOp):
        x = x.owner.inputs[0]  # a pm.Deterministic
    if x is value:
        return pt.constant(1.0, dtype=value.dtype)
    node = x.owner
    if (
        node is None
        or not isinstance(node.op, Elemwise)
        or not isinstance(node.op.scalar_op, ps.Mul)
    ):
        return None
    hits = [i for i, v in enumerate(node.inputs) if v is value]
    if len(hits) != 1:
        return None
    rest = [v for i, v in enumerate(node.inputs) if i != hits[0]]
    return rest[0] if len(rest) == 1 else pt.mul(*rest)


def _has_zeros(b) -> bool:
    """Whether a factor of the scale ``b`` that depends on no free variable (data,
    constants) has zeros (``sigma * x`` with a binary ``x``)."""

    factors, todo = [], [b]
    while todo:
        f = todo.pop()
        node = f.owner
        if node is not None and isinstance(node.op, DimShuffle | ViewOp):
            todo.append(node.inputs[0])
        elif (
            node is not None
            and isinstance(node.op, Elemwise)
            and isinstance(node.op.scalar_op, ps.Mul)
        ):
            todo.extend(node.inputs)
        else:
            factors.append(f)
    for f in factors:
        try:
            (val,) = evaluate_static([f])
        except MissingInputError:
            continue  # a hyperparameter: zero on a set of measure zero
        if np.any(np.asarray(val) == 0):
            return True
    return False


def _enumerate(model, local, logp_y, bound, fixed=()):
    """Exact sum over the values of a discrete local (log-sum-exp).

    A value at which the likelihood does not depend on the Gaussian globals ``fixed``
    (zero inflation written ``pm.Poisson("y", exp(b) * (1 - z))``: at ``z = 1`` the rate
    is 0 whatever ``b``) gets a row built without them (:func:`_rows_free_of`), so that
    its derivatives are exactly 0; through ``exp(b) * 0`` they were ``0 * inf``, NaN,
    and the fit stopped at its start.
    """
    K = int(local.support)
    if K > 64:
        raise UnsupportedModelError(
            local.name,
            f"it has {K} values; enumeration is limited to 64",
            "marginalize it analytically in the model",
        )
    value = local.value
    logp_z = remove_checks(model.logp(vars=[local.rv], sum=False)[0])
    ks = pt.constant(np.arange(K).reshape((K,) + (1,) * len(local.shape)).astype(value.dtype))
    ks = pt.broadcast_to(ks, shape64((K, *local.shape)))
    prior = vectorize_graph(logp_z, {value: ks})
    free = _rows_free_of(logp_y, value, local.shape, K, fixed)
    if not free:
        lik = vectorize_graph(logp_y, {value: ks})
    else:
        live = [k for k in range(K) if k not in free]
        at_live = vectorize_graph(logp_y, {value: ks[live]}) if live else None
        rows = [free[k][None] if k in free else at_live[live.index(k)][None] for k in range(K)]
        lik = pt.concatenate(rows, axis=0)
    if bound == "optimal":
        return pt.logsumexp(prior + lik, axis=0)
    return pt.sum(pt.exp(prior) * lik, axis=0)


def _rows_free_of(logp_y, value, shape, K: int, fixed) -> dict:
    """The values ``k`` of a discrete local at which ``logp_y`` does not depend on the
    variables ``fixed`` once the local is set to ``k`` and the graph is simplified
    (PyTensor's canonical rewrites fold ``exp(b) * (1 - 1)`` to 0), with those rows:
    ``{k: log p(y | z = k)}``, each a graph free of ``fixed``."""
    fixed = list(fixed)
    if not fixed or not depends_on_any(logp_y, fixed):
        return {}
    out = {}
    for k in range(K):
        at_k = pt.constant(np.full(shape, k, dtype=value.dtype))
        row = graph_replace(logp_y, {value: at_k}, strict=False)
        row = rewrite_graph(row, include=("canonicalize",))
        if not depends_on_any(row, fixed):
            out[k] = pt.broadcast_to(as_float(row), shape64(shape))
    return out
