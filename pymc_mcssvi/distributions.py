r"""Distributions shipped with the plugin.

:class:`Rayleigh` is the prior of the paper's GME noise scale (section 3.3):

.. math::

    p(w \mid \sigma) = \frac{w}{\sigma^2} \exp\left(-\frac{w^2}{2 \sigma^2}\right), \quad w > 0,

the paper's :math:`\mathrm{Rayl}(w \mid \tau^2)` with :math:`\tau = \sigma`. Its
natural parameter is :math:`-1 / (2\sigma^2)` and its expectation parameter
:math:`E[w^2] = 2\sigma^2`. ``pm.Weibull(alpha=2, beta=b)`` is the same
distribution with :math:`\sigma = b / \sqrt 2`, but only a :class:`Rayleigh`
variable gets the Rayleigh q (the paper's); a Weibull prior is a hyperparameter.
"""

from __future__ import annotations

import numpy as np
import pytensor.tensor as pt
from pymc.distributions.continuous import PositiveContinuous
from pymc.distributions.dist_math import check_icdf_parameters, check_icdf_value, check_parameters
from pymc.distributions.distribution import SymbolicRandomVariable
from pymc.distributions.shape_utils import implicit_size_from_params, rv_size_is_none
from pytensor.tensor.random.utils import normalize_size_param

try:  # PyMC >= 6
    from pymc.pytensorf import normalize_rng_param
except ImportError:  # pragma: no cover
    from pymc.distributions.distribution import normalize_rng_param

__all__ = ["Rayleigh", "RayleighRV"]


class RayleighRV(SymbolicRandomVariable):
    """Draws ``sigma * sqrt(2 E)``, ``E ~ Exponential(1)`` (a scaled ``Weibull(2)``)."""

    name = "rayleigh"
    extended_signature = "[rng],[size],()->[rng],()"
    _print_name = ("Rayleigh", "\\operatorname{Rayleigh}")

    @classmethod
    def rv_op(cls, sigma, *, rng=None, size=None):
        sigma = pt.as_tensor(sigma)
        rng = normalize_rng_param(rng)
        size = normalize_size_param(size)
        if rv_size_is_none(size):
            size = implicit_size_from_params(sigma, ndims_params=cls.ndims_params)
        next_rng, raw = pt.random.weibull(2.0, size=size, rng=rng, return_next_rng=True)
        draws = sigma * np.sqrt(2.0) * raw
        return cls(inputs=[rng, size, sigma], outputs=[next_rng, draws])(rng, size, sigma)


class Rayleigh(PositiveContinuous):
    r"""Rayleigh distribution with scale ``sigma``.

    ========  ==========================================
    Support   :math:`w \in (0, \infty)`
    Mean      :math:`\sigma \sqrt{\pi / 2}`
    Variance  :math:`(2 - \pi / 2) \sigma^2`
    ========  ==========================================

    Parameters
    ----------
    sigma : tensor_like of float
        Scale, ``sigma > 0`` (the paper's :math:`\tau` in :math:`\mathrm{Rayl}(\tau^2)`).

    Examples
    --------
    >>> import pymc as pm
    >>> import pymc_mcssvi
    >>> with pm.Model():
    ...     w2 = pymc_mcssvi.Rayleigh("w2", sigma=5.0)
    >>> float(pm.logp(pymc_mcssvi.Rayleigh.dist(sigma=2.0), 1.0).eval())  # log(1/4) - 1/8
    -1.511294361119890...
    """

    rv_type = RayleighRV
    rv_op = RayleighRV.rv_op

    @classmethod
    def dist(cls, sigma=None, *args, **kwargs):
        if sigma is None:
            raise TypeError("Rayleigh needs `sigma` (its scale)")
        sigma = pt.as_tensor_variable(sigma)
        if sigma.dtype != "float64":  # PyTensor stores 2.0 as float32; keep the log density exact
            sigma = pt.cast(sigma, "float64")
        return super().dist([sigma], *args, **kwargs)

    def support_point(rv, size, sigma):
        mean = sigma * np.sqrt(np.pi / 2.0)
        if not rv_size_is_none(size):
            mean = pt.full(size, mean)
        return mean

    def logp(value, sigma):
        res = pt.log(value) - 2.0 * pt.log(sigma) - value**2 / (2.0 * sigma**2)
        res = pt.switch(pt.gt(value, 0.0), res, -np.inf)
        return check_parameters(res, sigma > 0, msg="sigma > 0")

    def logcdf(value, sigma):
        res = pt.switch(pt.gt(value, 0.0), pt.log1mexp(-(value**2) / (2.0 * sigma**2)), -np.inf)
        return check_parameters(res, sigma > 0, msg="sigma > 0")

    def icdf(value, sigma):
        res = sigma * pt.sqrt(-2.0 * pt.log1p(-value))
        res = check_icdf_value(res, value)
        return check_icdf_parameters(res, sigma > 0, msg="sigma > 0")
