"""Make ``pm.fit(method="mcssvi" | "hmcssvi" | "sdsvi")`` work.

PyMC's :func:`pymc.fit` looks methods up in a table local to the function, so
the least invasive extension is a thin wrapper installed in its place: it
handles the three names (and instances of our classes, so that ``n`` may be
left out to stop at convergence) and hands every other call to PyMC unchanged.
"""

from __future__ import annotations

import difflib
import functools
import inspect

import pymc as pm
import pymc.variational as pmv
import pymc.variational.inference as pmvi

from pymc_mcssvi.pymc.inference import HMCSSVI, MCSSVI, SDSVI, StructuredVI
from pymc_mcssvi.pymc.load import is_saved_fit, resumed_inference

__all__ = ["METHODS", "fit", "register"]

METHODS: dict[str, type] = {}

_original_fit = pmvi.fit


@functools.wraps(_original_fit)
def fit(
    n=None,
    method="advi",
    model=None,
    random_seed=None,
    start=None,
    start_sigma=None,
    inf_kwargs=None,
    **kwargs,
):
    """``pm.fit`` with ``"mcssvi"``, ``"hmcssvi"`` and ``"sdsvi"`` added.

    For these methods the fit runs until the bound has converged, ``n`` being
    the most iterations (``n=None``, the default here: ``max_iter``; PyMC's
    methods run a fixed 10,000; ``tol=None`` runs exactly ``n``), ``start`` may
    be a saved fit or a fitted approximation to resume, and the inference
    class's options may be passed directly as well as in ``inf_kwargs``
    (``pm.fit(method="hmcssvi", hyper="point")``). Other methods behave
    exactly as in PyMC.
    """

    name = method.lower() if isinstance(method, str) else None
    if name in METHODS or isinstance(method, StructuredVI):
        if isinstance(method, StructuredVI):
            inference = method
        else:
            inf_kwargs = dict(inf_kwargs or {})
            options = inspect.signature(METHODS[name].__init__).parameters
            for key in [k for k in kwargs if k in options and k != "model"]:
                if key in inf_kwargs:
                    raise TypeError(f"{key!r} given both directly and in inf_kwargs")
                inf_kwargs[key] = kwargs.pop(key)
            if random_seed is not None:
                inf_kwargs["random_seed"] = random_seed
            if start_sigma is not None:
                inf_kwargs["start_sigma"] = start_sigma
            model = pm.modelcontext(model)
            if is_saved_fit(start):  # resume a saved fit (a path) or a fitted approximation
                inference = resumed_inference(start, model, method=name, **inf_kwargs)
            else:
                if start is not None:
                    inf_kwargs["start"] = start
                inference = METHODS[name](model=model, **inf_kwargs)
        return inference.fit(n, **kwargs)
    if isinstance(method, type) and issubclass(method, StructuredVI):
        raise TypeError(
            f"method={method.__name__} is a class: pass an instance "
            f"(pm.fit(method=pymc_mcssvi.{method.__name__}(...))) or its name "
            f"(pm.fit(method={_name_of(method)!r}))"
        )
    if isinstance(method, str) and name not in _PYMC_METHODS:
        cleaned = name.strip().replace("-", "").replace(" ", "")
        close = difflib.get_close_matches(cleaned, [*METHODS, *_PYMC_METHODS], n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise KeyError(
            f"unknown method {method!r}{hint}: pm.fit takes {sorted(METHODS)} from "
            f"pymc_mcssvi and {sorted(_PYMC_METHODS)} from PyMC, or an Inference instance"
        )
    if n is None:
        n = 10_000
    return _original_fit(
        n=n,
        method=method,
        model=model,
        random_seed=random_seed,
        start=start,
        start_sigma=start_sigma,
        inf_kwargs=inf_kwargs,
        **kwargs,
    )


#: The names PyMC's own ``pm.fit`` takes.
_PYMC_METHODS = frozenset({"advi", "fullrank_advi", "svgd", "asvgd"})


def _name_of(cls) -> str:
    """The registered method name of an inference class."""
    return next((k for k, v in METHODS.items() if v is cls), cls.__name__.lower())


def register():
    """Install :func:`fit` as ``pm.fit`` (idempotent)."""

    METHODS.update({"mcssvi": MCSSVI, "hmcssvi": HMCSSVI, "sdsvi": SDSVI})
    for mod in (pm, pmv, pmvi):
        mod.fit = fit
