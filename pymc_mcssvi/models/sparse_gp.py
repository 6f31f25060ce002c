r"""Sparse Gaussian processes on inducing points with the paper's bounds (section "sGP").

With inducing values :math:`u = f(X_u)`, :math:`h_i = K_{uu}^{-1} k_u(x_i)` and
:math:`\tilde k_i = K_{ii} - Q_{ii}` (:math:`Q = K_{fu} K_{uu}^{-1} K_{uf}`), the
bounds differ only in how each observation's term reads q(u):

=========== ============================================================ ===============
``bound``   observation term                                             paper
=========== ============================================================ ===============
titsias     :math:`\sum_i E_{q(u)} E_{p(f_i \mid u)}[\log p(y_i \mid f_i)]` eq. vlb (VFE)
v1          :math:`\sum_i E_{q(u)}[\log E_{p(f_i \mid u)} p(y_i \mid f_i)]` V1 (eq. vlbi)
v2          :math:`\sum_i \log E_{q(u)} E_{p(f_i \mid u)}[p(y_i \mid f_i)]` V2
optimal     :math:`E_{q(u)}[\log E_{p(f \mid u)} \prod_i p(y_i \mid f_i)]`  eq. vlbT
=========== ============================================================ ===============

each minus :math:`KL(q(u) \| p(u))`. V1 and V2 are not lower bounds on the
marginal likelihood (the paper's point: they are regularized losses); the optimal
bound couples all observations and is cubic in ``n``. With a Gaussian likelihood
and a fixed kernel, each has a closed-form q(u) that one natural step with step
size 1 reaches: Titsias' (the value is ``pm.gp.MarginalApprox(approx="VFE")``'s),
V1's (the value is FITC's marginal likelihood) and the optimal one (the exact
posterior of ``u``; the value is the full GP's marginal likelihood).

How each is written as a PyMC model (``u = L_uu v`` with ``v`` standard normal, the
whitened parameterization of ``pm.gp.Latent``):

- Gaussian likelihood: ``y ~ Normal(H u, sigma)`` plus the trace term
  ``-sum(k_i) / (2 sigma^2)`` as a ``pm.Potential`` (titsias); ``y ~ Normal(H u,
  sqrt(k_i + sigma^2))`` (v1; v2 the same, scored by its predictive density);
  ``y ~ MvNormal(H u, K_ff - Q_ff + sigma^2 I)`` (optimal).
- Other likelihoods: a local ``f ~ Normal(H u, sqrt(k_i))`` that the structured
  bound integrates out (v1; v2 scored predictively; titsias with the Jensen bound on
  ``f``), or non-centered ``f = H u + chol(K_ff - Q_ff) z`` with one joint q over
  ``(v, z)`` (optimal: the best Gaussian q of ``(u, f)``).

Under ``pm.sample`` or ADVI the models are plain PyMC models (V2 is then V1's model,
the FITC model; Titsias' non-Gaussian model V1's).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import pymc as pm
import pytensor.tensor as pt

from pymc_mcssvi.recognize.marks import mark_bound, mark_builder, predictive

__all__ = ["SPARSE_GP_BOUNDS", "SPARSE_GP_LIKELIHOODS", "sparse_gp"]

#: The bounds :func:`sparse_gp` builds.
SPARSE_GP_BOUNDS = ("optimal", "v1", "v2", "titsias")
#: The likelihoods :func:`sparse_gp` names; a callable ``(name, f, observed)`` is any other.
SPARSE_GP_LIKELIHOODS = ("gaussian", "bernoulli", "poisson", "studentt")
#: Above this many observations the optimal bound's ``n x n`` Cholesky warns.
OPTIMAL_MAX_N = 5000


def sparse_gp(
    X,
    y,
    cov_func,
    Xu,
    *,
    likelihood: str | Callable = "gaussian",
    bound: str = "optimal",
    sigma=None,
    nu: float = 4.0,
    X_new=None,
    jitter: float = 1e-6,
    name: str | None = None,
) -> pm.Model:
    r"""A sparse GP regression or classification model with one of the paper's bounds.

    Parameters
    ----------
    X : array_like, shape (n, d)
        Training inputs.
    y : array_like, shape (n,)
        Observations (0/1 for ``"bernoulli"``, counts for ``"poisson"``).
    cov_func : pm.gp.cov.Covariance or callable
        The kernel. A callable is called with no arguments inside the new model, so
        that the hyperparameters it creates (``pm.Gamma("ls", ...)``) are learned; a
        ``Covariance`` with numbers for its parameters keeps the kernel fixed.
    Xu : array_like, shape (M, d)
        Inducing inputs (fixed).
    likelihood : {"gaussian", "bernoulli", "poisson", "studentt"} or callable
        Bernoulli with a logit link, Poisson with a log link, Student-t with ``nu``
        degrees of freedom and scale ``sigma``. A callable ``(name, f, observed)``
        creates any other elementwise observed variable from the latent ``f``.
    bound : {"optimal", "v1", "v2", "titsias"}
        See the module docstring. ``"optimal"`` is cubic in ``n``.
    sigma : float or None
        Noise scale of the Gaussian and Student-t likelihoods; ``None`` learns it
        with a ``HalfNormal(sd(y))`` prior.
    nu : float
        Student-t degrees of freedom.
    X_new : array_like, shape (n_new, d), optional
        Inputs to predict at: adds ``f_new``, the latent GP there given ``u`` (a
        predictive variable, drawn by ``approx.sample()`` and by
        ``pm.sample_posterior_predictive``).
    jitter : float
        Added to the diagonals of ``K_uu`` and of the conditional covariance.
    name : str, optional
        Model name (prefixes the variables).

    Returns
    -------
    pm.Model
        With the whitened inducing values ``u_white``, ``u`` (Deterministic) and the
        observed ``y``.

    Examples
    --------
    >>> import numpy as np, pymc as pm, pymc_mcssvi
    >>> rng = np.random.default_rng(0)
    >>> X = rng.uniform(0, 5, (100, 1)); y = np.sin(X[:, 0]) + 0.2 * rng.normal(size=100)
    >>> def kernel():
    ...     ls = pm.Gamma("ls", 2.0, 1.0)
    ...     return pm.gp.cov.ExpQuad(1, ls=ls)
    >>> m = pymc_mcssvi.models.sparse_gp(X, y, kernel, np.linspace(0, 5, 8)[:, None],
    ...                                  bound="titsias")
    >>> pymc_mcssvi.describe(m).role("u_white")
    'gaussian global'
    """
    if bound not in SPARSE_GP_BOUNDS:
        raise ValueError(f"bound must be one of {SPARSE_GP_BOUNDS}, got {bound!r}")
    if not callable(likelihood) and likelihood not in SPARSE_GP_LIKELIHOODS:
        raise ValueError(
            f"likelihood must be one of {SPARSE_GP_LIKELIHOODS} or a callable, got {likelihood!r}"
        )
    X, Xu, y = _as_matrix(X, "X"), _as_matrix(Xu, "Xu"), np.asarray(y)
    n, d = X.shape
    if y.shape != (n,):
        raise ValueError(f"y must have shape ({n},) like the rows of X, got {y.shape}")
    if Xu.shape[1] != d:
        raise ValueError(f"Xu must have {d} columns like X, got {Xu.shape[1]}")
    if bound == "optimal" and n > OPTIMAL_MAX_N:
        warnings.warn(
            f"bound='optimal' factorizes an {n} x {n} matrix (cubic in n): use 'v1', 'v2' or "
            "'titsias' for this many observations",
            UserWarning,
            stacklevel=2,
        )
    gaussian = likelihood == "gaussian"
    with pm.Model(name=name or "") as model:
        cov = cov_func() if not isinstance(cov_func, pm.gp.cov.Covariance) else cov_func
        proj, resid_var, chol_uu = _projection(cov, X, Xu, jitter)
        v = pm.Normal("u_white", 0.0, 1.0, shape=Xu.shape[0])
        pm.Deterministic("u", chol_uu @ v)
        eta = proj @ v
        if sigma is None and likelihood in ("gaussian", "studentt"):
            sigma = pm.HalfNormal("sigma", float(np.std(y)) or 1.0)
        if gaussian:
            obs = _gaussian(bound, eta, resid_var, sigma, y, cov, X, proj, jitter)
        else:
            f = _latent(bound, eta, resid_var, cov, X, proj, jitter)
            obs = _observe(likelihood, f, y, sigma, nu)
        if bound == "v2":
            predictive(obs)
        mark_builder(obs, f"sparse_gp:{bound}")
        if X_new is not None:
            new_proj, new_var, _ = _projection(cov, _as_matrix(X_new, "X_new"), Xu, jitter)
            pm.Normal("f_new", new_proj @ v, pt.sqrt(new_var + jitter))
    return model


def _as_matrix(a, name):
    a = np.asarray(a, dtype="float64")
    if a.ndim == 1:
        a = a[:, None]
    if a.ndim != 2:
        raise ValueError(f"{name} must be a matrix (rows x input dimensions), got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} has non-finite entries")
    return a


def _projection(cov, X, Xu, jitter):
    """``(K_fu L_uu^-T, k_i - q_i, L_uu)``: the design of the whitened values
    ``v = L_uu^-1 u`` and the conditional variances ``K_ii - Q_ii`` (floored at 0:
    they round below it next to an inducing point)."""
    m = Xu.shape[0]
    chol = pt.linalg.cholesky(cov(Xu) + jitter * np.eye(m), lower=True)
    proj = pt.linalg.solve_triangular(chol, cov(Xu, X), lower=True).T
    resid = pt.maximum(cov(X, diag=True) - pt.sum(pt.square(proj), axis=1), 0.0)
    return proj, resid, chol


def _conditional_chol(cov, X, proj, jitter):
    """Cholesky factor of ``K_ff - Q_ff + jitter I``, the covariance of ``f`` given ``u``."""
    n = X.shape[0]
    return pt.linalg.cholesky(cov(X) - proj @ proj.T + jitter * np.eye(n), lower=True)


def _gaussian(bound, eta, resid_var, sigma, y, cov, X, proj, jitter):
    if bound == "titsias":
        obs = pm.Normal("y", eta, sigma, observed=y)
        pm.Potential("trace_term", -0.5 * pt.sum(resid_var) / pt.square(sigma))
        return obs
    if bound in ("v1", "v2"):
        return pm.Normal("y", eta, pt.sqrt(resid_var + pt.square(sigma)), observed=y)
    n = X.shape[0]
    c = cov(X) - proj @ proj.T + (pt.square(sigma) + jitter) * np.eye(n)
    return pm.MvNormal("y", eta, c, observed=y)


def _latent(bound, eta, resid_var, cov, X, proj, jitter):
    if bound == "optimal":
        z = pm.Normal("f_white", 0.0, 1.0, shape=X.shape[0])
        return pm.Deterministic("f", eta + _conditional_chol(cov, X, proj, jitter) @ z)
    f = pm.Normal("f", eta, pt.sqrt(resid_var + jitter))
    if bound == "titsias":
        mark_bound(f, "jensen")
    return f


def _observe(likelihood, f, y, sigma, nu):
    if callable(likelihood):
        return likelihood("y", f, y)
    if likelihood == "bernoulli":
        return pm.Bernoulli("y", logit_p=f, observed=y)
    if likelihood == "poisson":
        return pm.Poisson("y", pt.exp(f), observed=y)
    return pm.StudentT("y", nu=nu, mu=f, sigma=sigma, observed=y)
