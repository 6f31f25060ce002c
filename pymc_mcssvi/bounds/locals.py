r"""Marginalize local latents out of an observed log density (paper section 2.2).

For an observed variable ``y`` with a local latent ``f`` (one per observation,
conditionally independent given the globals ``w``), the *optimal* bound (paper
eq. vlbi) uses

.. math::

    \log p(y_i \mid w) = \log \int p(f_i \mid w)\, p(y_i \mid f_i)\, df_i ,

and the *Jensen* bound (eq. vlb, :math:`q(f \mid w) = p(f \mid w)`) the smaller

.. math::

    E_{p(f_i \mid w)}[\log p(y_i \mid f_i)] .

* Gaussian local, ``f_i ~ N(a_i, s_i^2)``: the integral is Gauss-Hermite
  quadrature inside a log-sum-exp, ``log sum_k v_k p(y_i | a_i + s_i u_k)``
  (``inner="quadrature"``), or the paper's Monte Carlo average over fresh draws
  (``inner="mc"``); exact in closed form when ``y_i ~ N(f_i, sigma)``.
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
from pytensor.graph.replace import vectorize_graph
from pytensor.tensor.elemwise import DimShuffle
from pytensor.tensor.random.basic import NormalRV
from pytensor.tensor.shape import SpecifyShape

from pymc_mcssvi.estimators.quadrature import gauss_hermite
from pymc_mcssvi.exceptions import UnsupportedModelError
from pymc_mcssvi.recognize.graph import as_float, remove_checks
from pymc_mcssvi.recognize.roles import base_op, dist_params

__all__ = ["marginal_logp"]


def marginal_logp(
    model, local, bound: str = "optimal", inner: str = "quadrature", n_inner: int = 12
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

    Returns
    -------
    TensorVariable
        Shape of the observed variable; a graph in the value variables of the
        globals and hyperparameters (not of the local).
    """
    if bound not in ("optimal", "jensen"):
        raise ValueError(f"bound must be 'optimal' or 'jensen', got {bound!r}")
    obs = model[local.observed]
    logp_y, minibatch_scale = _unscaled_logp(model, obs)
    params = model.replace_rvs_by_values(dist_params(local.rv))
    value = local.value
    shape = local.shape
    if local.kind == "discrete":
        return minibatch_scale * _enumerate(model, local, logp_y, bound)

    loc, scale = (pt.broadcast_to(as_float(p), shape) for p in params)
    closed = _gaussian_closed_form(obs, value, logp_y, loc, scale, bound, model)
    if closed is not None:
        return minibatch_scale * closed
    if inner == "quadrature":
        u, v = gauss_hermite(int(n_inner))
        u = pt.constant(u.reshape((-1,) + (1,) * len(shape)))
        logv = pt.constant(np.log(v).reshape((-1,) + (1,) * len(shape)))
    elif inner == "mc":
        u = pt.random.normal(size=(int(n_inner), *shape))
        logv = pt.constant(-np.log(n_inner))
    else:
        raise ValueError(f"inner must be 'quadrature' or 'mc', got {inner!r}")
    nodes = loc[None] + scale[None] * u
    per_node = vectorize_graph(logp_y, {value: nodes})
    if bound == "optimal":
        return minibatch_scale * pt.logsumexp(logv + per_node, axis=0)
    weights = pt.exp(logv) if inner == "quadrature" else 1.0 / n_inner
    return minibatch_scale * pt.sum(weights * per_node, axis=0)


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


def _gaussian_closed_form(obs, value, logp_y, loc, scale, bound, model):
    """``y ~ N(f, sigma)``: the marginal is ``N(y; a, sqrt(sigma^2 + s^2))`` exactly."""
    op, base = base_op(obs)
    if not isinstance(op, NormalRV):
        return None
    mu, sigma = model.replace_rvs_by_values(dist_params(obs))
    while (
        mu is not value
        and mu.owner is not None
        and isinstance(mu.owner.op, DimShuffle | SpecifyShape)
    ):
        mu = mu.owner.inputs[0]
    if mu is not value:
        return None
    y = model.rvs_to_values[obs]
    sigma = pt.broadcast_to(as_float(sigma), loc.shape)
    if bound == "optimal":
        var = pt.square(sigma) + pt.square(scale)
        return -0.5 * np.log(2 * np.pi) - 0.5 * pt.log(var) - 0.5 * pt.square(y - loc) / var
    # E_{N(f; a, s^2)} log N(y; f, sigma) = log N(y; a, sigma) - s^2 / (2 sigma^2)
    return (
        -0.5 * np.log(2 * np.pi)
        - pt.log(sigma)
        - 0.5 * (pt.square(y - loc) + pt.square(scale)) / pt.square(sigma)
    )


def _enumerate(model, local, logp_y, bound):
    """Exact sum over the values of a discrete local (log-sum-exp)."""
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
    ks = pt.broadcast_to(ks, (K, *local.shape))
    prior = vectorize_graph(logp_z, {value: ks})
    lik = vectorize_graph(logp_y, {value: ks})
    if bound == "optimal":
        return pt.logsumexp(prior + lik, axis=0)
    return pt.sum(pt.exp(prior) * lik, axis=0)
