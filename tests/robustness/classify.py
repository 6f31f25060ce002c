"""Run one bad input and classify what happened.

Good outcomes:

``clean error``
    An exception raised by pymc_mcssvi's own code (the innermost frame of its
    traceback is in the package; :class:`~pymc_mcssvi.UnsupportedModelError`,
    :class:`~pymc_mcssvi.DivergenceError`, ``ValueError``, ``TypeError`` or
    ``KeyError``) whose message names the culprit (:attr:`Case.names`).
``fit``
    ``pm.fit`` returned, and the approximation's means, sds, draws and last bound
    are finite (with or without a warning).
``refused by PyMC``
    The model cannot be built: PyMC or PyTensor refuses it before ``pm.fit`` is
    called (a float index into a vector), which is not the plugin's to handle.

Bad outcomes:

``raw traceback``
    An exception raised inside PyTensor, NumPy, SciPy or PyMC during ``pm.fit``, or
    an exception type that is not a user error (``IndexError``, ``LinAlgError``,
    ``AssertionError`` ...) even from the package's own code.
``silent NaN``
    A fit that returned with a NaN or infinite mean, sd, draw or bound.
``no name``
    A clean exception whose message names none of the culprits.
``accepted``
    A bad keyword argument or a data array that cannot be right (an infinite
    covariate, an index out of range) that the fit accepted without an error.
``missing warning``
    A fit of a posterior that does not exist (a Flat prior under complete
    separation) that returned without saying so (:attr:`Case.must_warn`).
``false warning``
    A fit that warned of a problem it does not have (an improper posterior for
    overlapping classes, :attr:`Case.must_not_warn`).
"""

from __future__ import annotations

import re
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pymc as pm

import pymc_mcssvi
from pymc_mcssvi import DivergenceError, UnsupportedModelError

__all__ = [
    "BAD",
    "GOOD",
    "KINDS",
    "Outcome",
    "classify_error",
    "names_culprit",
    "raised_by_us",
    "results_problem",
    "run",
]

PACKAGE_DIR = str(Path(pymc_mcssvi.__file__).resolve().parent)

GOOD = ("clean error", "fit", "refused by PyMC")
BAD = ("raw traceback", "silent NaN", "no name", "accepted", "missing warning", "false warning")
KINDS = GOOD + BAD

#: Exception types that report a user error when our own code raises them.
USER_ERRORS = (UnsupportedModelError, DivergenceError, ValueError, TypeError, KeyError)
#: ...but not these subclasses, which are failures of the code itself.
NOT_USER_ERRORS = (IndexError, np.linalg.LinAlgError, AssertionError, FloatingPointError)


@dataclass
class Outcome:
    """What one case gave: its kind (one of :data:`KINDS`), the exception's type and
    message (or the warnings of a fit), and where the exception was raised."""

    case: str
    kind: str
    detail: str = ""
    where: str = ""
    warned: bool = False

    @property
    def bad(self) -> bool:
        return self.kind in BAD

    def __str__(self) -> str:
        where = f" [raised in {self.where}]" if self.where else ""
        return f"{self.case}: {self.kind}{where}: {self.detail}"


def innermost_frame(err: BaseException) -> str:
    """File of the frame that raised ``err``."""
    frames = traceback.extract_tb(err.__traceback__)
    return frames[-1].filename if frames else ""


def raised_by_us(err: BaseException) -> bool:
    """Whether ``err`` is a user error raised by pymc_mcssvi's own code."""
    ours = isinstance(err, DivergenceError | UnsupportedModelError)
    if not ours and (isinstance(err, NOT_USER_ERRORS) or not isinstance(err, USER_ERRORS)):
        return False
    return str(Path(innermost_frame(err)).resolve()).startswith(PACKAGE_DIR)


def names_culprit(message: str, names, keyword: bool = False) -> bool:
    """Whether ``message`` names one of ``names``: quoted (``'y'``, ``"y"``, `` `y` ``,
    also ``'y_observed'`` for PyMC's imputed split of ``y``), or for keywords of
    ``pm.fit`` as a separate word (``n must be ...``, ``chunk_size=0``)."""
    for name in names:
        n = re.escape(name)
        if re.search(rf"['\"`]{n}(?:_\w+)?['\"`]", message):
            return True
        if keyword and re.search(rf"(?:^|[\s(,])({n})(?=[\s=:,.)]|$)", message):
            return True
    return False


def _finite(x) -> bool:
    return bool(np.all(np.isfinite(np.asarray(x, dtype="float64"))))


def results_problem(approx) -> str:
    """``""`` if the approximation's results are finite, else what is not."""
    if not _finite(approx.mean.eval()):
        return "approx.mean is not finite"
    if not _finite(approx.std.eval()):
        return "approx.std is not finite"
    hist = np.asarray(approx.hist)
    if hist.size and not np.isfinite(hist[-1]):
        return f"the last -ELBO in approx.hist is {hist[-1]}"
    idata = approx.sample(20, random_seed=0)
    for name, arr in idata.posterior.data_vars.items():
        values = np.asarray(arr.values)
        if values.dtype.kind in "fc" and not _finite(values):
            return f"draws of {name!r} are not finite"
    return ""


def run(case) -> Outcome:
    """Build the case's model, fit it, and classify the result."""
    try:
        model = case.build()
    except Exception as err:  # noqa: BLE001  (refused before the plugin is involved)
        return Outcome(case.id, "refused by PyMC", f"{type(err).__name__}: {_first(err)}")
    with warnings.catch_warnings(record=True) as caught, np.errstate(all="ignore"):
        warnings.simplefilter("always")
        try:
            with model:
                approx = pm.fit(**case.fit_kwargs)
            problem = results_problem(approx)
        except Exception as err:  # noqa: BLE001  (classified below)
            return classify_error(case, err)
    user = [w for w in caught if issubclass(w.category, UserWarning)]
    detail = "; ".join(sorted({_first_line(str(w.message)) for w in user}))
    if problem:
        return Outcome(case.id, "silent NaN", problem, warned=bool(user))
    if case.must_raise:
        return Outcome(
            case.id, "accepted", f"gave a fit ({detail or 'no warning'})", warned=bool(user)
        )
    if case.must_warn and not any(re.search(case.must_warn, str(w.message)) for w in user):
        return Outcome(
            case.id, "missing warning", f"no warning matched {case.must_warn!r} ({detail})"
        )
    if case.must_not_warn and any(re.search(case.must_not_warn, str(w.message)) for w in user):
        return Outcome(
            case.id, "false warning", f"a warning matched {case.must_not_warn!r} ({detail})"
        )
    return Outcome(case.id, "fit", detail, warned=bool(user))


def classify_error(case, err: BaseException) -> Outcome:
    """The outcome of a case whose fit raised ``err``."""
    where = innermost_frame(err)
    msg = f"{type(err).__name__}: {_first(err)}"
    if not raised_by_us(err):
        return Outcome(case.id, "raw traceback", msg, where=_short(where))
    if not names_culprit(str(err), case.names, case.keyword):
        return Outcome(case.id, "no name", f"{msg} (should name one of {case.names})")
    return Outcome(case.id, "clean error", msg)


def _first(err) -> str:
    return _first_line(str(err))


def _first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."


def _short(path: str) -> str:
    parts = Path(path).parts
    for anchor in ("site-packages", "pymc_mcssvi"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + (anchor == "site-packages") :])
    return path
