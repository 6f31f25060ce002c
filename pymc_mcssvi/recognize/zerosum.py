r"""``pm.ZeroSumNormal`` effects as Gaussian globals.

A ``ZeroSumNormal(sigma)`` vector of length ``n`` lives in PyMC's unconstrained
space as ``v`` of length ``n - 1``, mapped to the constrained effects by the
zero-sum transform's backward map, an isometry onto the zero-sum subspace:

.. math::

    a = \begin{pmatrix} v \\ 0 \end{pmatrix} + c \sum_j v_j, \qquad
    c_i = -\frac{1}{\sqrt n + n} \ (i < n), \quad c_n = -\frac{1}{\sqrt n},

with ``log p(v) = sum log N(v_j; 0, sigma^2)`` (``sum a^2 = sum v^2`` and the
transform's Jacobian is 1). So ``v`` is a Gaussian global with a zero-mean
isotropic prior, and ``a`` is linear in it. PyMC writes the map with the
length read from ``v.shape`` at run time, which is not affine for
:func:`~pymc_mcssvi.recognize.affine.linearize`; :func:`zerosum_as_linear`
swaps in :class:`LinearZeroSumTransform`, the same map with static sizes and
the constant ``c``, while the model is recognized. Along several zero-sum axes
(``n_zerosum_axes=2``) the map is applied along each in turn.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytensor.tensor as pt
from pymc.distributions.transforms import ZeroSumTransform

from pymc_mcssvi.recognize.graph import static_shape

__all__ = ["LinearZeroSumTransform", "zerosum_as_linear"]


def _extend_axis(value, axis: int, shape: list[int]):
    """PyMC's ``ZeroSumTransform.extend_axis`` as ``concat(v, 0) + c * sum(v)`` along ``axis``."""
    n = shape[axis] + 1
    c = np.full(n, -1.0 / (np.sqrt(n) + n))
    c[-1] = -1.0 / np.sqrt(n)
    pad = list(shape)
    pad[axis] = 1
    c_shape = [1] * len(shape)
    c_shape[axis] = n
    out = pt.concatenate([value, pt.zeros(pad, dtype=value.dtype)], axis=axis)
    out = out + pt.constant(c.reshape(c_shape)) * pt.sum(value, axis=axis, keepdims=True)
    shape[axis] = n
    return out


class LinearZeroSumTransform(ZeroSumTransform):
    """PyMC's zero-sum transform with a backward map the recognizer reads as affine.

    Same forward map and Jacobian as :class:`pymc.distributions.transforms.ZeroSumTransform`;
    the backward map is the same function of the value written with the static
    ``value_shape`` (see the module docstring).

    Examples
    --------
    >>> import numpy as np, pytensor.tensor as pt
    >>> v = np.random.default_rng(0).normal(size=(3, 4))
    >>> pymc_map = ZeroSumTransform((-1,)).backward(pt.as_tensor(v)).eval()
    >>> ours = LinearZeroSumTransform((-1,), (3, 4)).backward(pt.as_tensor(v)).eval()
    >>> bool(np.allclose(ours, pymc_map)), bool(np.allclose(ours.sum(-1), 0.0))
    (True, True)
    """

    def __init__(self, zerosum_axes, value_shape):
        super().__init__(zerosum_axes)
        self.value_shape = tuple(int(s) for s in value_shape)

    def backward(self, value, *rv_inputs):
        shape = list(self.value_shape)
        for axis in self.zerosum_axes:
            value = _extend_axis(value, axis, shape)
        return value


@contextmanager
def zerosum_as_linear(model):
    """Within the block, ``model``'s zero-sum transforms are :class:`LinearZeroSumTransform`.

    The model is restored on exit: graphs built inside (the recognized bound)
    read the unconstrained values through the linear map, which computes the
    same numbers as PyMC's.
    """
    swapped = {rv: tr for rv, tr in model.rvs_to_transforms.items() if type(tr) is ZeroSumTransform}
    for rv, tr in swapped.items():
        shape = list(static_shape(rv))  # the value has one entry fewer along each zero-sum axis
        for axis in tr.zerosum_axes:
            shape[axis] -= 1
        model.rvs_to_transforms[rv] = LinearZeroSumTransform(tr.zerosum_axes, shape)
    try:
        yield
    finally:
        model.rvs_to_transforms.update(swapped)
