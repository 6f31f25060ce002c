"""The likelihood forms of the structured bound, one :class:`~pymc_mcssvi.terms.base.Term`
each (:mod:`~pymc_mcssvi.terms.base` states the protocol)."""
