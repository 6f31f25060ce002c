"""Latent time series as Gaussian globals: ``pm.GaussianRandomWalk`` and ``pm.AR``.

Given their parameters both are Gaussian with a banded precision, and their log
density is a sum of standard-normal log densities of whitened residuals (the
innovations) that are affine in the path. The recognizer reads those residuals
as the prior's predictor term, like a Normal prior's ``(x - mu) / sigma``.
"""

from __future__ import annotations

import pytensor.tensor as pt

from pymc_mcssvi.recognize.graph import as_float
from pymc_mcssvi.recognize.roles import base_op, series_params

__all__ = ["series_residuals"]


def series_residuals(g, value, params):
    """Whitened residuals of a Gaussian time series and their log-sd normalizer.

    ``pm.GaussianRandomWalk``: ``(x_0 - m_0) / s_0`` and ``(x_t - x_{t-1} - m) / s``
    (PyMC holds the initial and innovation distributions time-first, ``(steps,
    *batch)``). ``pm.AR(p)``: ``(x_{:p} - m_0) / s_0`` and
    ``(x_t - c - sum_k rho_k x_{t-k}) / sigma`` (time last, as PyMC's log density
    reads it). Both are affine in ``x`` given the parameters: the series is a
    Gaussian global whose prior precision is banded, and with one full covariance
    q represents its posterior (the innovations written out as Normals give the
    same posterior in other coordinates).

    Examples
    --------
    >>> import numpy as np, pymc as pm, pytensor.tensor as pt
    >>> from pymc_mcssvi.recognize.model import recognize
    >>> with pm.Model() as m:
    ...     s = pm.HalfNormal("s", 0.5)
    ...     x = pm.GaussianRandomWalk("x", sigma=s, init_dist=pm.Normal.dist(1, 2), shape=(2, 6))
    ...     y = pm.Poisson("y", pt.exp(x), observed=np.ones((2, 6), int))
    >>> tlm = recognize(m)
    >>> [g.prior for g in tlm.gaussians], [h.name for h in tlm.hypers]
    (['randomwalk'], ['s'])
    """
    op, _ = base_op(g.rv)
    locs, others = ([as_float(v) for v in part] for part in series_params(op, params))
    # (residuals, their sd, their shape): shapes from the series' static shape, as
    # ``r.shape`` would read the value variable
    *batch, T = g.shape
    if g.prior == "randomwalk":
        (m0, m1), (s0, s1) = locs, others
        xt = pt.moveaxis(value, -1, 0)
        parts = [
            ((xt[:1] - m0) / s0, s0, (1, *batch)),
            ((xt[1:] - xt[:-1] - m1) / s1, s1, (T - 1, *batch)),
        ]
    else:
        order = op.ar_order
        (sigma, s0, rhos), m0 = others, locs[0]
        coef = rhos[..., 1:] if op.constant_term else rhos
        expectation = pt.add(
            *(coef[..., i, None] * value[..., order - (i + 1) : -(i + 1)] for i in range(order))
        )
        if op.constant_term:
            expectation = expectation + locs[1][..., None]
        sigma = sigma[..., None]
        parts = [
            ((value[..., :order] - m0) / s0, s0, (*batch, order)),
            ((value[..., order:] - expectation) / sigma, sigma, (*batch, T - order)),
        ]
    resid = pt.concatenate([pt.flatten(pt.specify_shape(r, shape)) for r, _, shape in parts])
    const = -pt.add(*(pt.sum(pt.log(pt.broadcast_to(sd, shape))) for _, sd, shape in parts))
    return resid, const
