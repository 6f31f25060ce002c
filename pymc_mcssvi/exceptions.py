"""Exceptions raised by pymc-mcssvi, each naming the variable at fault and a remedy."""

from __future__ import annotations

from pymc.variational.opvi import VariationalInferenceError

__all__ = ["DivergenceError", "UnsupportedModelError"]


class UnsupportedModelError(VariationalInferenceError, ValueError):
    """The model (or its data) falls outside what the structured bound can handle.

    Raised during recognition, before anything is compiled.

    Parameters
    ----------
    variable : str
        Name of the PyMC variable at fault.
    reason : str
        What is wrong with it.
    remedy : str
        What the user can do instead.

    Examples
    --------
    >>> err = UnsupportedModelError("y", "the observed data contain NaN", "drop those rows")
    >>> print(err)
    Variable 'y': the observed data contain NaN. What to do: drop those rows.
    """

    def __init__(self, variable: str, reason: str, remedy: str = ""):
        self.variable = variable
        self.reason = reason
        self.remedy = remedy
        msg = f"Variable {variable!r}: {reason}."
        if remedy:
            msg += f" What to do: {remedy}."
        super().__init__(msg)


class DivergenceError(FloatingPointError):
    """The bound became non-finite and step-size backoff could not recover.

    The approximation keeps the last state whose bound was finite; it is
    available as ``error.approx``.
    """

    def __init__(self, message: str, approx=None, iteration: int | None = None):
        super().__init__(message)
        self.approx = approx
        self.iteration = iteration
