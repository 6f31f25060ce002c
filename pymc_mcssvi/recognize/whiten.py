"""An ``pm.MvNormal`` likelihood as whitened univariate residuals.

``y_n ~ MvNormal(mu_n, Sigma)`` has the log density
``sum_k log N(z_nk; 0, 1) - sum_k log L_kk`` with ``z_n = L^-1 (y_n - mu_n)`` and
``L L^T = Sigma``. When ``Sigma`` does not depend on the Gaussian globals (a fixed
covariance, or a learned ``pm.LKJCholeskyCov``, a hyperparameter), ``z`` is affine in
them wherever ``mu`` is: the likelihood is the Gaussian likelihood of an affine
predictor, whose expectations are closed form, with the normalizer a term of the
hyperparameters only. A multivariate regression ``MvNormal(alpha + X @ beta, chol=L)``
went through Monte Carlo + autodiff over all coordinates, with every draw of the
hyperparameters in the batch.
"""

from __future__ import annotations

import numpy as np
import pytensor.tensor as pt
from pymc.distributions.multivariate import MvNormalRV

from pymc_mcssvi.recognize.graph import depends_on_any
from pymc_mcssvi.recognize.roles import base_op, dist_params

__all__ = ["whitened_mvnormal"]


def whitened_mvnormal(model, obs, gvalues):
    """``(residual_logp, normalizer)`` of an observed ``pm.MvNormal`` whose covariance
    does not depend on the Gaussian globals, else None.

    ``residual_logp`` is the ``(N, K)`` array ``log N(z; 0, 1)``; ``normalizer`` the
    scalar ``-N sum_k log L_kk``.

    Examples
    --------
    >>> import numpy as np, pymc as pm
    >>> y = np.random.default_rng(0).normal(size=(5, 2))
    >>> with pm.Model() as m:
    ...     b = pm.Normal("b", 0, 1, shape=2)
    ...     obs = pm.MvNormal("y", mu=b, cov=[[1.0, 0.5], [0.5, 2.0]], observed=y)
    >>> resid, norm = whitened_mvnormal(m, obs, {m.rvs_to_values[b]: 0})
    >>> point = {m.rvs_to_values[b]: np.array([0.3, -0.2])}
    >>> total = (resid.sum() + norm).eval(point)
    >>> bool(np.isclose(total, m.compile_logp(vars=[obs])({"b": [0.3, -0.2]})))
    True
    """
    op, _ = base_op(obs)
    if not isinstance(op, MvNormalRV):
        return None
    mu, cov = model.replace_rvs_by_values(dist_params(obs))
    while cov.ndim > 2 and cov.type.broadcastable[0]:
        cov = cov[0]  # PyMC broadcasts the parameters to the batch shape
    if depends_on_any(cov, gvalues) or cov.ndim != 2:
        return None
    y = model.rvs_to_values[obs]
    if y.ndim not in (1, 2):
        return None
    chol = pt.linalg.cholesky(cov, lower=True)
    if mu.ndim > y.ndim or y.ndim == 2 and mu.ndim == 2 and mu.type.broadcastable[0]:
        mu = mu[0] if mu.ndim == 2 else mu  # a mean shared by every row
    flat = y - mu if y.ndim == 2 else (y - mu)[None, :]
    # one triangular solve for all rows: z_n = L^-1 (y_n - mu_n)
    z = pt.linalg.solve_triangular(chol, flat.T, lower=True).T
    resid = -0.5 * z**2 - 0.5 * np.log(2 * np.pi)
    n_rows = y.shape[0] if y.ndim == 2 else 1  # the data's, not the mean's shape
    normalizer = -n_rows * pt.sum(pt.log(pt.diagonal(chol)))
    return resid, normalizer
