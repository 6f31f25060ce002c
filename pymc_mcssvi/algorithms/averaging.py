r"""Iterate averaging for stochastic fits (``pm.Minibatch``, ``row_subsample``).

A stochastic natural-gradient step ``theta <- (1 - rho) theta + rho (theta_p +
G_batch)`` leaves the iterate with noise of order ``sqrt(rho)`` times the batch
estimate's: with batches of 200 of 4,000 rows and the default ``"power"``
schedule a logistic regression's last iterate was 0.5-1 posterior sds from
the full-batch optimum after 150-2,000 iterations. The average of the
iterates' natural parameters (precision ``P`` and ``P m`` of each Gaussian
block; the point of a point-estimated hyperparameter) has the same fixed point
and far less noise. Polynomial-decay averaging (Shamir & Zhang, 2013) weights
iteration ``t`` by ``(eta + 1) / (t + eta)``: a running average over roughly the
last ``1 / (eta + 1)`` of the run that forgets the start.
"""

from __future__ import annotations

import numpy as np

__all__ = ["IterateAverage"]

#: ``eta`` of the polynomial-decay weights.
DECAY = 3.0


def _natural(mean, factor, parameterization):
    """``(P, P m)`` of blocks given by means ``(R, K)`` and lower factors ``(R, K, K)``."""
    if parameterization == "precision":
        P = factor @ np.swapaxes(factor, -1, -2)
    else:  # lower Cholesky factor of the covariance
        eye = np.broadcast_to(np.eye(factor.shape[-1]), factor.shape)
        inv = np.linalg.solve(factor, eye)
        P = np.swapaxes(inv, -1, -2) @ inv
    return P, (P @ mean[..., None])[..., 0]


def _from_natural(P, Pm, parameterization):
    """Means and lower factors (of the precision or the covariance) from ``(P, P m)``."""
    P = 0.5 * (P + np.swapaxes(P, -1, -2))
    L = np.linalg.cholesky(P)
    mean = np.linalg.solve(P, Pm[..., None])[..., 0]
    if parameterization == "precision":
        return mean, L
    eye = np.broadcast_to(np.eye(P.shape[-1]), P.shape)
    return mean, np.linalg.cholesky(np.linalg.solve(P, eye))


class IterateAverage:
    """Polynomial-decay average of a stochastic fit's iterates, kept across ``fit`` calls.

    Parameters
    ----------
    parameterization : {"precision", "covariance"}
        How the kernel's factors are stored.

    Examples
    --------
    Noisy iterates around a fixed Gaussian block: the average is far closer.

    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> avg = IterateAverage("precision")
    >>> L = np.eye(2)[None]
    >>> for t in range(400):
    ...     avg.update([rng.normal(1.0, 0.5, (1, 2))], [L * rng.uniform(0.9, 1.1)], None)
    >>> (mean,), (factor,), _ = avg.result()
    >>> bool(np.all(np.abs(mean - 1.0) < 0.1))
    True
    """

    def __init__(self, parameterization: str):
        self.parameterization = parameterization
        self.t = 0
        self.blocks = None
        self.hyper = None

    def update(self, means, factors, hyper):
        """Add one iterate: per segment ``means`` ``(R, K)`` and ``factors`` ``(R, K, K)``;
        ``hyper`` is ``None``, ``("point", values)`` or ``("gaussian", mean, factor)``
        (a q(h) in the precision parameterization)."""
        self.t += 1
        w = (DECAY + 1.0) / (self.t + DECAY)
        new = [_natural(m, f, self.parameterization) for m, f in zip(means, factors, strict=True)]
        if hyper is not None and hyper[0] == "gaussian":
            hyper = ("gaussian", *_natural(hyper[1], hyper[2], "precision"))
        if self.blocks is None or w >= 1.0:
            self.blocks, self.hyper = new, hyper
            return
        self.blocks = [
            ((1 - w) * P0 + w * P1, (1 - w) * h0 + w * h1)
            for (P0, h0), (P1, h1) in zip(self.blocks, new, strict=True)
        ]
        if hyper is not None:
            kind, *old = self.hyper
            self.hyper = (kind, *((1 - w) * a + w * b for a, b in zip(old, hyper[1:], strict=True)))

    def location(self):
        """``(means, sds)``: the average's means and marginal sds, flat (the Gaussian
        blocks in segment order, then q(h)'s mean; a point hyperparameter's sd is 1)."""
        means, sds = [], []
        blocks = list(self.blocks)
        if self.hyper is not None and self.hyper[0] == "gaussian":
            blocks.append(self.hyper[1:])
        for P, Pm in blocks:
            P = 0.5 * (P + np.swapaxes(P, -1, -2))
            means.append(np.linalg.solve(P, Pm[..., None])[..., 0].ravel())
            eye = np.broadcast_to(np.eye(P.shape[-1]), P.shape)
            sds.append(np.sqrt(np.diagonal(np.linalg.solve(P, eye), axis1=-2, axis2=-1)).ravel())
        if self.hyper is not None and self.hyper[0] == "point":
            means.append(np.ravel(self.hyper[1]))
            sds.append(np.ones(np.size(self.hyper[1])))
        return np.concatenate(means), np.concatenate(sds)

    def result(self):
        """``(means, factors, hyper)`` of the average, in the kernel's forms; ``hyper`` as
        given to :meth:`update`. Raises ``numpy.linalg.LinAlgError`` if a block's averaged
        precision is not positive definite (it is an average of positive definite ones)."""
        pairs = [_from_natural(P, Pm, self.parameterization) for P, Pm in self.blocks]
        hyper = self.hyper
        if hyper is not None and hyper[0] == "gaussian":
            hyper = ("gaussian", *_from_natural(hyper[1], hyper[2], "precision"))
        return [m for m, _ in pairs], [f for _, f in pairs], hyper
