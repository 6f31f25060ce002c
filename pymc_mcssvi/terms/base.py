r"""The term protocol: one likelihood form, its expectations under q, its work.

The structured bound (:mod:`~pymc_mcssvi.bounds.structured`) is the sum of its
terms' expected log densities plus the entropy of q. A term's
:meth:`Term.expectations` gives, for the q of every segment (a :class:`QView`),
its part of everything the natural step needs, as a :class:`TermStats`:

.. math::

    T = E_q[\ell], \qquad g_s = E_q[\nabla_{w_s} \ell], \qquad
    H_s = E_q[\nabla^2_{w_s} \ell], \qquad X_s = E_q[\nabla_{w_s} \nabla_{w_h}^T \ell]

per segment ``s`` (``X_s``: the cross block with the arrow's head segment ``h``,
:mod:`~pymc_mcssvi.algorithms.arrow`). All of them are sums over observations, so
a term restricted to a :class:`Chunk` of its observations gives its part of each
sum, and the sums over the chunks are the term's (chunked statistics, see
:meth:`~pymc_mcssvi.bounds.structured.StructuredBound.evaluate`).

A new likelihood form is one :class:`Term` here and one rule in
:mod:`~pymc_mcssvi.recognize.rules`, joined by :data:`~pymc_mcssvi.bounds.structured.TERMS`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["Chunk", "EvalOptions", "QView", "Term", "TermStats", "add_to"]


class QView(NamedTuple):
    """q as the terms read it, per segment: the ``GaussianBlocks`` states, their means
    ``(R, K)`` and covariance blocks ``(R, K, K)``, and the parameterization."""

    states: list
    means: list
    covs: list
    parameterization: str


class EvalOptions(NamedTuple):
    """What an evaluation needs.

    Attributes
    ----------
    need_derivatives, need_hessian : bool
        ``g`` (and ``H``) besides the value.
    head : int or None
        The arrow's head segment, whose cross blocks with the others are wanted.
    phase : symbolic int or None
        Matrix factorization: the side whose derivatives are wanted (both if ``None``).
    step : symbolic int or None
        Matrix factorization with ``row_subsample``: which window of each row's
        observations the evaluation takes; with ``row_batch``: which window of rows
        the Monte Carlo terms take (modulo the windows).
    by_node : bool
        One-dimensional quadratures a node at a time (a JAX step).
    scans : bool
        Whether a term may build scans of its own (one product at a time), as in a
        chunked step whose graph is not batched over q(h)'s sigma points or Rayleigh
        nodes afterwards (a batched scan runs element by element, or not at all on JAX).
    scan_mode : Mode or None
        Compile mode of those scans (the backend's).
    n_phases : int
        Phases of the step (2 with a matrix factorization): every term's
        ``phase_values`` has this length.
    """

    need_derivatives: bool = True
    need_hessian: bool = True
    head: int | None = None
    phase: Any = None
    step: Any = None
    by_node: bool = False
    n_phases: int = 1
    scans: bool = False
    scan_mode: Any = None


class Chunk(NamedTuple):
    """A term restricted to some of its observations: ``index`` ``(C,)`` the positions
    along the term's observation axis and ``weight`` ``(C,)`` their weights (0 for
    padding, which repeats a real observation)."""

    index: Any
    weight: Any


class TermStats(NamedTuple):
    """A term's part of the bound and of its derivatives (see the module docstring).

    ``grads``, ``hessians`` and ``crosses`` hold one entry per segment, ``None`` where
    the term does not read the segment; ``phase_values`` holds the term's part of
    each phase's value (a matrix factorization's factors are judged by their own
    side's estimate), empty for terms that add ``value`` to every phase.
    """

    value: Any
    grads: list
    hessians: list
    crosses: list
    phase_values: tuple = ()

    @classmethod
    def zero(cls, nseg: int, value=None) -> TermStats:
        """No contribution yet (``value`` a scalar 0 graph)."""
        return cls(value, [None] * nseg, [None] * nseg, [None] * nseg, ())


def add_to(total, part):
    """``total + part`` where either may be ``None`` (absent)."""
    if total is None:
        return part
    if part is None:
        return total
    return total + part


class Term:
    """One likelihood form of the bound.

    Subclasses set :attr:`name` and :attr:`form` and implement :meth:`accumulate`;
    :attr:`n_obs` is the static length of the observation axis a :class:`Chunk`
    indexes (``None``: the term is not split into chunks).
    """

    #: The model variable (or variables) the term comes from.
    name: str = ""
    #: ``describe``'s name of the form.
    form: str = ""
    #: Observations along the axis chunks index, or ``None`` when not chunked.
    n_obs: int | None = None
    #: Whether the term reads the data (a likelihood) rather than q alone (a prior).
    data: bool = True
    #: Whether the term's expected Hessian may be indefinite (a likelihood that need
    #: not be log-concave in the globals, e.g. a mixture): the natural step then uses
    #: its projection onto the negative semi-definite cone (paper, CTM section).
    indefinite: bool = False

    def accumulate(self, q: QView, stats: TermStats, opts: EvalOptions, chunk=None) -> TermStats:
        """``stats`` plus this term's part (restricted to ``chunk`` when given)."""
        raise NotImplementedError

    def expectations(self, q: QView, opts: EvalOptions, chunk=None) -> TermStats:
        """This term's :class:`TermStats` alone."""
        return self.accumulate(q, TermStats.zero(len(q.states)), opts, chunk)

    def work(self, local_factor: float = 1.0) -> float:
        """Rough floating-point operations of one evaluation (backend choice)."""
        return 0.0

    def bytes_per_observation(self, scans: bool = True) -> float:
        """Rough bytes of intermediates per observation of one evaluation (chunk size);
        ``scans``: whether the term may take its own products one at a time."""
        return 0.0

    def describe(self) -> str:
        """One line: the term's name and form."""
        return f"{self.name}: {self.form}"
