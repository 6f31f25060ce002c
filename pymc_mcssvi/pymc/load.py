"""Load a saved fit, and resume one (``pm.fit(..., start=path_or_approx)``).

See :mod:`pymc_mcssvi.pymc.persist` for what a saved fit holds.
"""

from __future__ import annotations

import os

import pymc as pm

from pymc_mcssvi.pymc import persist
from pymc_mcssvi.pymc.approximation import StructuredApproximation
from pymc_mcssvi.pymc.inference import HMCSSVI, MCSSVI, SDSVI

__all__ = ["load", "resumed_inference", "is_saved_fit"]

_CLASSES = {cls.__name__: cls for cls in (MCSSVI, HMCSSVI, SDSVI)}


def is_saved_fit(start) -> bool:
    """Whether ``start`` (``pm.fit``'s argument) names a saved fit or is a fitted
    approximation to resume, rather than an initial point."""
    return isinstance(start, str | os.PathLike | StructuredApproximation)


def _dataset(start):
    if isinstance(start, StructuredApproximation):
        if start.inference is None:
            raise ValueError(
                "start= is an approximation without its fit (unpickled?): save the fit with "
                "approx.save(path) and pass the path"
            )
        return persist.snapshot(start.inference)
    return persist.read(start)


def resumed_inference(start, model=None, method=None, **options):
    """An inference in the state of a saved fit (a path) or of a fitted approximation,
    ready to go on with ``fit``.

    Parameters
    ----------
    start : str, os.PathLike or StructuredApproximation
    model : pm.Model, optional
        The model it was fitted to (the context's by default): the same variables
        and data, checked against the saved fingerprint.
    method : str, optional
        ``pm.fit``'s method name; must be the saved fit's if given.
    **options
        Only ``random_seed`` is accepted (the other options are the saved fit's).
    """
    model = pm.modelcontext(model)
    ds = _dataset(start)
    name, saved = persist.options_from(ds, model)
    cls = _CLASSES[name]
    if method is not None and method.lower() != name.lower():
        raise ValueError(
            f"the saved fit was made with method={name.lower()!r}; resume it with that "
            f"method, or start a {method!r} fit from scratch"
        )
    extra = sorted(k for k in options if k != "random_seed")
    if extra:
        raise TypeError(
            f"a resumed fit keeps the saved fit's options; drop {', '.join(extra)} (to change "
            "them, start a new fit)"
        )
    saved.update(options)
    inference = cls(model=model, **saved)
    persist.apply(ds, inference)
    return inference


def load(path, model=None) -> StructuredApproximation:
    """The approximation of a fit saved with ``approx.save(path)``.

    Parameters
    ----------
    path : str or os.PathLike
    model : pm.Model, optional
        The model it was fitted to, built again (the context's by default). Its
        variables and data must be those of the saved fit.

    Returns
    -------
    StructuredApproximation
        Ready to sample; ``pm.fit(method=..., start=approx)`` or ``start=path`` goes
        on fitting.

    Examples
    --------
    >>> import os, tempfile, numpy as np, pymc as pm, pymc_mcssvi
    >>> y = np.random.default_rng(0).normal(1.0, 1.0, size=50)
    >>> def build():
    ...     with pm.Model() as m:
    ...         mu = pm.Normal("mu", 0, 10)
    ...         _ = pm.Normal("y", mu, 1.0, observed=y)
    ...     return m
    >>> with build():
    ...     approx = pm.fit(method="mcssvi", progressbar=False)
    >>> path = os.path.join(tempfile.mkdtemp(), "fit.nc")
    >>> approx.save(path)
    >>> again = pymc_mcssvi.load(path, build())  # e.g. in another session
    >>> float(again.mean.eval()[0]) == float(approx.mean.eval()[0])
    True
    """
    model = pm.modelcontext(model)
    inference = resumed_inference(path, model)
    return inference.finish()
