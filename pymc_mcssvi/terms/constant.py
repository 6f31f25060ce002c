"""Log densities that do not involve the Gaussian globals (priors of hyperparameters,
normalizers, likelihoods of data that only hyperparameters explain): added to the
bound as they are."""

from __future__ import annotations

import pytensor.tensor as pt

from pymc_mcssvi.recognize.ir import ConstantTerm as ConstantIR
from pymc_mcssvi.terms.base import EvalOptions, QView, Term, TermStats, add_to

__all__ = ["ConstantTerm"]


class ConstantTerm(Term):
    """A log density added to the bound as it is."""

    form = "constant (no Gaussian global)"
    data = False

    def __init__(self, term: ConstantIR):
        self.term = term
        self.name = term.name

    def accumulate(self, q: QView, stats: TermStats, opts: EvalOptions, chunk=None) -> TermStats:
        return stats._replace(value=add_to(stats.value, pt.sum(self.term.logp)))
