r"""The step of a fit: evaluate a candidate, accept or back off, step.

One iteration is the pure function :meth:`StepKernel.step` of the explicit
:class:`~pymc_mcssvi.algorithms.state.KernelState`::

    evaluate bound, g, H (and the hyperparameter gradient) at the candidate
    accept  = bound is finite  and  (schedule not monotone  or  bound did not decrease)
    base    = candidate if accept else base           (last good state)
    g, H    = those of the new base (cached when rejected)
    scale   = grow / shrink the step-size multiplier
    candidate = algorithm.step(base, g, H, rho_t)     (and a hyperparameter step)

compiled once into one PyTensor function that updates the state's shared
variables in place (:class:`~pymc_mcssvi.algorithms.state.SharedState`) and
returns a :class:`~pymc_mcssvi.algorithms.state.StepInfo`. Each iteration costs
one bound evaluation and one step, a rejected candidate costs one iteration, and
the base always holds the best accepted state. Because ``g`` and ``H`` of the base
are cached, backing off needs no re-evaluation: the next candidate is the same
natural step with a smaller ``rho``. A run of rejections that drives the step size
to zero means the bound cannot be evaluated near the current state: the fit loop
raises :class:`~pymc_mcssvi.exceptions.DivergenceError` and the base is kept.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.graph.replace import graph_replace

from pymc_mcssvi.algorithms.arrow import Arrow, arrow_solve, arrow_view, schur_factor
from pymc_mcssvi.algorithms.state import ArrowState, KernelState, QState, StepInfo, tree_map
from pymc_mcssvi.estimators.chunks import chunk_layout
from pymc_mcssvi.families.gaussian import (
    GaussianBlocks,
    bmv,
    cholesky,
    precision,
    projected_hessian,
)
from pymc_mcssvi.terms.base import Chunk, add_to

__all__ = ["MAX_COUPLED_HYPERS", "ExternalPart", "StepKernel"]

#: Largest number of mean-field hyperparameter coordinates whose step is coupled with
#: q(w)'s mean step (one extra blockwise solve per coordinate).
MAX_COUPLED_HYPERS = 32
#: Bytes of intermediates one term's evaluation may hold before it is reduced chunk
#: by chunk: the step's peak memory is then a few of these plus q, whatever the data.
CHUNK_BYTES = 2**25


class Part(NamedTuple):
    """A part of an evaluation: the outputs (bound values, ``g``, ``H``, the arrow's
    cross blocks), whether they are finite, the hyperparameters' derivatives and the
    Rayleigh scales' gradients; parts add up (:func:`_sum_parts`)."""

    outs: list
    finite: object
    haux: object
    rgrads: object
    n_values: int


class ExternalPart(NamedTuple):
    """The :class:`Part` of the terms ``terms`` (indices into the bound's terms),
    computed outside the step: :meth:`StepKernel.step`'s ``external``."""

    terms: tuple
    part: Part


def _flatten_part(part: Part):
    """The tensors of a part as a flat list (the finiteness as int8), and the function
    that rebuilds a :class:`Part` from such a list."""
    flat = list(part.outs) + [pt.cast(part.finite, "int8")]
    haux = part.haux
    layout = None
    if haux is not None:
        first = [x for x in haux[:2]]
        crosses = list(haux[2]) if len(haux) > 2 else None
        layout = (
            [x is not None for x in first],
            None if crosses is None else [c is not None for c in crosses],
        )
        flat += [x for x in first if x is not None]
        if crosses is not None:
            flat += [c for c in crosses if c is not None]
    rg = list(part.rgrads) if part.rgrads is not None else None
    if rg is not None:
        flat += rg
    n_outs = len(part.outs)

    def rebuild(values):
        values = list(values)
        outs, finite = values[:n_outs], pt.gt(values[n_outs], 0)
        rest = values[n_outs + 1 :]
        new_haux = None
        if layout is not None:
            present, cross_present = layout
            first = [rest.pop(0) if p else None for p in present]
            if cross_present is None:
                new_haux = tuple(first)
            else:
                new_haux = (*first, [rest.pop(0) if p else None for p in cross_present])
        new_rg = rest if rg is not None else None
        return Part(outs, finite, new_haux, new_rg, part.n_values)

    return flat, rebuild


def _sum_parts(parts):
    """The sum of the parts of an evaluation (finite where every part is)."""
    first, *others = parts
    outs, finite, haux, rgrads = list(first.outs), first.finite, first.haux, first.rgrads
    for p in others:
        outs = [add_to(a, b) for a, b in zip(outs, p.outs, strict=True)]
        finite = finite & p.finite
        if haux is not None:
            head = [add_to(a, b) for a, b in zip(haux[:2], p.haux[:2], strict=True)]
            if len(haux) > 2:
                haux = (*head, [add_to(a, b) for a, b in zip(haux[2], p.haux[2], strict=True)])
            else:
                haux = tuple(head)
        if rgrads is not None:
            rgrads = [a + b for a, b in zip(rgrads, p.rgrads, strict=True)]
    return Part(outs, finite, haux, rgrads, first.n_values)


class StepKernel:
    """The configuration of one structured-VI run and its pure step function.

    Parameters
    ----------
    bound : StructuredBound
    algorithm : Algorithm
    schedule : Schedule
    hypers : PointHyperparameters or MeanFieldHyperparameters or None
    monotone : bool
        Reject candidates whose bound is lower (valid when the bound estimate is
        deterministic: full batch and quadrature / fixed draws).
    rayleighs : RayleighGlobals or None
    nseg : int
        Segments of q(w).
    chunk_budget : float, optional
        Bytes of intermediates a term may hold in one evaluation (default
        :data:`CHUNK_BYTES`); a term that would hold more is reduced chunk by chunk.
    chunk_size : int, optional
        Observations per chunk of every data term that can be split (tests, and
        users who know their memory); ``None`` chooses by ``chunk_budget``.
    trust_region : bool, optional
        Cap each block's mean step at :data:`STOCHASTIC_MAX_MEAN_STEP` current sds
        (:func:`_trust_region`). ``None`` (the default): when the kernel is not
        monotone. The fits pass whether their estimates are noisy (minibatches,
        row subsampling, Monte Carlo draws): a deterministic full-batch bound with a
        constant schedule takes its steps whole, so that ``rho = 1`` with a
        Gaussian likelihood lands on the exact posterior in one step.
    """

    def __init__(
        self,
        bound,
        algorithm,
        schedule,
        hypers=None,
        monotone=True,
        rayleighs=None,
        nseg: int = 0,
        chunk_budget: float = None,
        chunk_size=None,
        trust_region: bool | None = None,
    ):
        self.bound = bound
        self.rayleighs = rayleighs
        self.algorithm = algorithm
        self.schedule = schedule
        self.monotone = bool(monotone)
        self.trust_region = not self.monotone if trust_region is None else bool(trust_region)
        self.hypers = hypers if (hypers is not None and getattr(hypers.spec, "size", 0)) else None
        self.nseg = int(nseg)
        #: Bytes of intermediates a term may hold in one evaluation before it is
        #: reduced chunk by chunk (:meth:`chunk_plan`).
        self.chunk_budget = CHUNK_BYTES if chunk_budget is None else float(chunk_budget)
        #: Observations per chunk of every splittable data term (``None``: by budget).
        self.chunk_size = chunk_size
        #: Phases of a step: the factors of a matrix factorization move in turn.
        self.n_phases = len(getattr(bound, "phase_segments", [None]))
        self.coupled = (
            self.hypers is not None
            and (
                self.hypers.mode == "meanfield"
                or (self.hypers.mode == "point" and self.hypers.spec.optimizer is None)
            )
            and self.monotone
            and self.n_phases == 1
            and algorithm.parameterization == "precision"
            and algorithm.newton_mean
            and self.hypers.spec.size <= MAX_COUPLED_HYPERS
        )
        # Arrow coupling of the head segment (fixed effects) with the others.
        head = getattr(bound, "arrow_head", None)
        self.arrow_head = (
            head if (self.n_phases == 1 and algorithm.parameterization == "precision") else None
        )
        self.arrow_body = (
            set(getattr(bound, "arrow_body", ())) if self.arrow_head is not None else set()
        )
        #: ``row_batch``: the windows of rows of the batched segment a step moves
        self.windows = getattr(bound, "row_windows", None)

    # ------------------------------------------------------------------- state
    def init_state(self, means, factors) -> KernelState:
        """The state before the first iteration (NumPy values): the candidate is the
        start q, nothing accepted yet (``bound = -inf``)."""
        means = tuple(np.asarray(m, dtype="float64") for m in means)
        factors = tuple(np.asarray(f, dtype="float64") for f in factors)
        q = QState(means, factors)
        opt0 = tuple(_as_tuples(o) for o in self.algorithm.init_opt_state(means, factors))
        crosses = ()
        hyper = self.hypers.init_state() if self.hypers is not None else None
        if self.coupled:
            n_h = self.hypers.spec.size
            crosses = tuple(np.zeros(np.shape(m) + (n_h,)) for m in means) + tuple(
                np.zeros(np.shape(f) + (n_h,)) for f in factors
            )
            hyper = self.hypers.with_linear_response(hyper, [np.shape(m) + (n_h,) for m in means])
        arrow = None
        if self.arrow_head is not None:
            head = self.arrow_head
            p = np.shape(means[head])[-1]
            # segments not coupled with the head: no cross (X) and a zero G, kept as None
            arrow = ArrowState(
                X=tuple(
                    np.zeros(np.shape(m) + (p,)) if s in self.arrow_body else None
                    for s, m in enumerate(means)
                ),
                G=tuple(
                    np.eye(p)[None]
                    if s == head
                    else (np.zeros(np.shape(m) + (p,)) if s in self.arrow_body else None)
                    for s, m in enumerate(means)
                ),
                LS=np.asarray(factors[head])[0],
            )
        return KernelState(
            base=q,
            cand=q,
            grads=tuple(np.zeros_like(m) for m in means),
            hessians=tuple(np.zeros_like(f) for f in factors),
            bound=np.asarray(-np.inf),
            phase_bounds=np.full(self.n_phases, -np.inf),
            phase=np.asarray(0, dtype="int64"),
            scale=np.asarray(self.schedule.initial_scale(), dtype="float64"),
            t=np.asarray(0.0),
            base_opt=opt0,
            cand_opt=opt0,
            crosses=crosses,
            arrow=arrow,
            hyper=hyper,
            rayleigh=self.rayleighs.init_state() if self.rayleighs is not None else None,
        )

    def reset_candidate(self, state: KernelState) -> KernelState:
        """``state`` (values) with the candidate equal to the base (after a divergence,
        new data or a replaced q)."""
        hyper, rayleigh = state.hyper, state.rayleigh
        if hyper is not None:
            hyper = self.hypers.reset(hyper)
        if rayleigh is not None:
            rayleigh = self.rayleighs.reset(rayleigh)
        return state._replace(cand=tree_map(np.copy, state.base), hyper=hyper, rayleigh=rayleigh)

    # -------------------------------------------------------------------- step
    def _next_phase_only(self, phase):
        """The phase whose factor alone needs ``g`` and ``H`` at the candidate, or ``None``.

        A stochastic kernel accepts every finite candidate, so after a step of
        one factor of a matrix factorization only the factor that moves next
        needs its derivatives (a monotone one also needs this phase's value).
        Not where hyperparameters enter the bilinear terms (learned ordinal
        cutpoints): their derivatives would pass through the conditional, and
        their sigma-point average would batch it (a batched conditional
        computes both sides).
        """
        if self.n_phases < 2 or self.monotone:
            return None
        if self.hypers is not None and self.bound.bilinear.depends_on(self.hypers.spec.values):
            return None
        return (phase + 1) % self.n_phases

    def step(
        self, state: KernelState, by_node: bool = False, inner_mode=None, external=None
    ) -> tuple[KernelState, StepInfo]:
        """One iteration as a graph: the new state and the :class:`StepInfo`.

        ``state`` is symbolic (usually :attr:`SharedState.symbolic`). With several
        *phases* (matrix factorization: one per factor) each step moves only the
        segments of the current phase, and a candidate is judged by that phase's
        value, the objective its gradients belong to. ``by_node`` sums
        one-dimensional quadratures a node at a time (a JAX step); ``inner_mode`` is
        the compile mode of the scans that reduce chunked terms (the backend's own).
        ``external`` is a :class:`Part` of some terms computed outside the step (their
        indices: ``external.terms``), e.g. summed over the chunks of a Dask array
        (:meth:`chunk_statistics`); the step evaluates the other terms itself.
        """
        alg = self.algorithm
        nseg = self.nseg
        cand = [GaussianBlocks(m, f) for m, f in zip(*state.cand, strict=True)]
        outside = set(external.terms) if external is not None else set()
        plan = {i: n for i, n in self.chunk_plan().items() if i not in outside}
        if not plan and not outside:
            part = self._evaluate(state, by_node)
        else:
            # the terms split into chunks are reduced chunk by chunk; the rest, the
            # entropies and the KL divergences are evaluated once
            rest = [i for i in range(len(self.bound.terms)) if i not in plan and i not in outside]
            parts = [self._evaluate(state, by_node, terms=rest)]
            parts += [
                self._reduced_term(state, by_node, i, size, inner_mode) for i, size in plan.items()
            ]
            if external is not None:
                parts.append(external.part)
            part = _sum_parts(parts)
        outs, finite, haux, rgrads = part.outs, part.finite, part.haux, part.rgrads
        n_values = part.n_values
        value, phase_values = outs[0], pt.stack(outs[1:n_values])
        grads = outs[n_values : n_values + nseg]
        hessians = outs[n_values + nseg : n_values + 2 * nseg]
        indefinite = self.bound.indefinite_segments
        xs = outs[n_values + 2 * nseg : len(outs) - len(indefinite)]
        if indefinite:
            # the indefinite part of H (general terms) is replaced by its projection
            hessians = list(hessians)
            for s, part in zip(indefinite, outs[len(outs) - len(indefinite) :], strict=True):
                # a non-finite part leaves H non-finite (the candidate is rejected below);
                # the eigendecomposition gets finite numbers
                part = pt.switch(pt.isfinite(part), part, 0.0)
                hessians[s] = projected_hessian(hessians[s], part)
        if rgrads is not None:
            for x in rgrads:
                finite = finite & pt.isfinite(x)
        for x in [*grads, *hessians, *xs]:
            finite = finite & pt.all(pt.isfinite(x))
        finite = finite & pt.all(pt.isfinite(phase_values))
        if self.monotone:
            current, base = phase_values[state.phase], state.phase_bounds[state.phase]
            tol = 1e-9 * pt.abs(base) + 1e-9
            better = pt.or_(~pt.isfinite(base), current >= base - tol)
            accept = finite & better
        else:
            accept = finite
        sel = lambda a, b: pt.switch(accept, a, b)  # noqa: E731
        new_base = [
            GaussianBlocks(sel(c.mean, m), sel(c.factor, f))
            for c, m, f in zip(cand, *state.base, strict=True)
        ]
        g = [sel(gc, gb) for gc, gb in zip(grads, state.grads, strict=True)]
        H = [sel(hc, hb) for hc, hb in zip(hessians, state.hessians, strict=True)]
        new_bound = sel(value, state.bound)
        restarted = alg.restart_opt_state(state.base_opt)
        opt = [_select_tree(accept, c, b) for c, b in zip(state.cand_opt, restarted, strict=True)]
        scale = self.schedule.next_scale(state.scale, accept)
        t = state.t + pt.cast(accept, "float64")
        # row_batch: the schedule counted in passes over the windows (each window is
        # an unbiased estimate of the whole; counted in steps, the topics of a topic
        # model stalled at 6.10 nats where passes reached 6.02 in the same time)
        passes = t if self.windows is None else t / self.windows.n_windows
        rho = pt.minimum(self.schedule.base(passes) * scale, 1.0)
        # Plain values for NaN-free arithmetic in the unused branch.
        g_safe = [pt.switch(pt.isfinite(x), x, 0.0) for x in g]
        H_safe = [pt.switch(pt.isfinite(x), x, 0.0) for x in H]
        stepped, stepped_opt = alg.step(new_base, g_safe, H_safe, rho, scale, t, opt)
        if self.windows is not None:
            stepped, stepped_opt = self._window_step(
                state.t, accept, new_base, g_safe, H_safe, scale, t, opt, stepped, stepped_opt
            )
        arrow_state, arrow = state.arrow, None
        if self.arrow_head is not None:
            X = iter(
                [
                    sel(xc, xb)
                    for xc, xb in zip(xs, [b for b in state.arrow.X if b is not None], strict=True)
                ]
            )
            X = tuple(None if b is None else next(X) for b in state.arrow.X)
            Q = [None if x is None else -pt.switch(pt.isfinite(x), x, 0.0) for x in X]
            # The arrow of the curvature -E[H] itself (not of q's precisions, which lag
            # behind it while rho < 1 and need not form a positive definite arrow with Q).
            curv = Arrow(self.arrow_head, [cholesky(-_sym(h)) for h in H_safe], Q)
            stepped, arrow = self._arrow_mean_step(stepped, new_base, g_safe, curv, rho)
            G, LS = self._arrow_view(curv, new_base[self.arrow_head].factor, state.arrow)
            arrow_state = ArrowState(X=X, G=G, LS=LS)
        if self.trust_region and self.algorithm.parameterization == "precision":
            stepped = [_trust_region(st, old) for st, old in zip(stepped, new_base, strict=True)]
        hyper_state, crosses = state.hyper, state.crosses
        if self.hypers is not None:
            coupling = None
            if self.coupled:
                # Finite: a non-finite cross derivative rejects the candidate (hfinite).
                crosses = tuple(
                    b if c is None else sel(c, b)
                    for c, b in zip(haux[2], state.crosses, strict=True)
                )
                coupling = (
                    [st.factor for st in stepped],
                    g_safe,
                    [None if c is None else x for c, x in zip(haux[2], crosses, strict=True)][
                        :nseg
                    ],
                    [None if c is None else x for c, x in zip(haux[2], crosses, strict=True)][
                        nseg:
                    ],
                    [st.factor for st in new_base],
                    arrow,
                )
            hyper_state = self.hypers.accept(state.hyper, accept, haux)
            hyper_state, joint = self.hypers.step(hyper_state, rho, scale, t, coupling)
            if joint is not None:
                stepped = [
                    st if dP is None else GaussianBlocks(st.mean, _shifted_factor(st.factor, dP))
                    for st, dP in zip(stepped, joint.precision_shifts, strict=True)
                ]
                stepped = [
                    st if d is None else GaussianBlocks(st.mean + d, st.factor)
                    for st, d in zip(stepped, joint.shifts, strict=True)
                ]
        nph = n_values - 1
        next_phase = (
            pt.switch(accept, (state.phase + 1) % nph, state.phase) if nph > 1 else state.phase
        )
        next_cand, next_opt = [], []
        for s in range(nseg):
            if nph == 1:
                next_cand.append(stepped[s])
                next_opt.append(stepped_opt[s])
                continue
            moves = pt.constant(np.array([s in seg for seg in self.bound.phase_segments]))[
                next_phase
            ]
            next_cand.append(
                GaussianBlocks(
                    pt.switch(moves, stepped[s].mean, new_base[s].mean),
                    pt.switch(moves, stepped[s].factor, new_base[s].factor),
                )
            )
            next_opt.append(_select_tree(moves, stepped_opt[s], opt[s]))
        rayleigh_state = state.rayleigh
        if self.rayleighs is not None:
            rayleigh_state = self.rayleighs.accept(state.rayleigh, accept, rgrads)
            rayleigh_state = self.rayleighs.step(rayleigh_state, rho, scale, t)
        new_state = KernelState(
            base=QState(tuple(b.mean for b in new_base), tuple(b.factor for b in new_base)),
            cand=QState(tuple(c.mean for c in next_cand), tuple(c.factor for c in next_cand)),
            grads=tuple(g),
            hessians=tuple(H),
            bound=new_bound,
            phase_bounds=pt.switch(accept, phase_values, state.phase_bounds),
            phase=pt.cast(next_phase, "int64"),
            scale=scale,
            t=t,
            base_opt=tuple(_as_tuples(o) for o in opt),
            cand_opt=tuple(_as_tuples(o) for o in next_opt),
            crosses=crosses,
            arrow=arrow_state,
            hyper=hyper_state,
            rayleigh=rayleigh_state,
        )
        return new_state, StepInfo(new_bound, value, pt.cast(accept, "int8"), rho)

    # -------------------------------------------------------------- evaluation
    def chunk_plan(self) -> dict:
        """Observations per chunk of the bound's terms that are split (by term index):
        those whose intermediates, batched over q(h)'s sigma points and the Rayleigh
        nodes, would pass :attr:`chunk_budget` bytes (or every splittable data term
        longer than :attr:`chunk_size`)."""
        multiplier = 1.0
        if self.hypers is not None and self.hypers.mode == "meanfield":
            multiplier *= len(self.hypers.w)
        if self.rayleighs is not None:
            multiplier *= self.rayleighs.n_nodes ** len(self.rayleighs.rayleighs)
        return self.bound.chunk_sizes(
            self.chunk_budget, self.chunk_size, multiplier, scans=not self._batches_parts()
        )

    def _evaluate(self, state, by_node, terms=None, chunk=None, mode=None) -> Part:
        """The bound's outputs at the candidate (``terms``: a part of them, ``chunk``:
        restricted to a chunk of one term's observations), averaged over the
        Rayleigh globals' nodes and q(h)'s sigma points, with the hyperparameters' and
        Rayleigh scales' derivatives. The entropies and KL divergences of q belong to
        the whole and to the part of the terms not split (``chunk is None``)."""
        nseg = self.nseg
        whole = chunk is None
        cand = [GaussianBlocks(m, f) for m, f in zip(*state.cand, strict=True)]
        # (a factor's subsample windows advance once per step of that factor, whether
        # or not the other side is computed too: see _turns)
        turns = self._turns(state.t)
        ev = self.bound.evaluate(
            cand,
            phase=self._next_phase_only(state.phase),
            step=turns,
            by_node=by_node,
            terms=terms,
            chunk=chunk,
            with_entropy=whole,
            # a term's own scans (one product at a time) only where nothing batches
            # the graph afterwards
            scans=not whole and not self._batches_parts(),
            scan_mode=mode,
        )
        n_values = 1 + len(ev.phase_values)
        stats = [ev.value, *ev.phase_values, *ev.grads, *ev.hessians]
        xs = []
        if self.arrow_head is not None:
            crosses = ev.crosses if ev.crosses is not None else [None] * nseg
            for s, (c, b) in enumerate(zip(crosses, state.arrow.X, strict=True)):
                if c is not None and b is None:
                    raise AssertionError(f"segment {s} has a cross block outside the arrow's body")
            xs = [
                pt.zeros(b.type.shape) if (c is None and b is not None) else c
                for c, b in zip(crosses, state.arrow.X, strict=True)
            ]
            xs = [x for x in xs if x is not None]
        outs = [*stats, *xs, *(h for h in ev.indefinite or [] if h is not None)]
        if self.rayleighs is not None:
            outs = self.rayleighs.evaluate(state.rayleigh, outs, n_values=n_values, kl=whole)
        finite = pt.isfinite(outs[0])
        haux = None
        if self.hypers is not None:
            kw = {"cross": range(n_values, n_values + 2 * nseg)} if self.coupled else {}
            outs, hfinite, haux = self.hypers.evaluate(
                state.hyper, outs, n_values=n_values, entropy=whole, **kw
            )
            finite = pt.isfinite(outs[0]) & hfinite
        rgrads = None
        if self.rayleighs is not None:
            rgrads = self.rayleighs.gradients(state.rayleigh, outs[0])
        return Part(list(outs), finite, haux, rgrads, n_values)

    def chunk_statistics(self, state, terms, size: int, by_node: bool = False, mode=None):
        """The :class:`Part` of the terms ``terms`` on a chunk of ``size`` observations,
        the first ``size`` of each term's observation axis, as a flat list of outputs.

        Returns ``(weight, flat, rebuild)``: the chunk's weight vector ``(size,)`` (an
        input: 0 for padding), the outputs (the finiteness as int8: chunks combine by
        minimum, everything else by sum) and the function that rebuilds a
        :class:`Part` from such a list (of sums). With the data of the terms replaced
        by a chunk's arrays this is the map of a map-reduce over the data's chunks,
        whose reduction the step takes as ``external``.
        """
        weight = pt.vector("chunk_weight", dtype="float64", shape=(size,))
        chunk = Chunk(pt.arange(size, dtype="int64"), weight)
        parts = [self._evaluate(state, by_node, terms=[i], chunk=chunk, mode=mode) for i in terms]
        flat, rebuild = _flatten_part(_sum_parts(parts))
        for x in flat:
            if None in x.type.shape:
                raise ValueError("chunk statistics: an output of unknown shape")
        return weight, flat, rebuild

    def _batches_parts(self) -> bool:
        """Whether the evaluation is batched over q(h)'s sigma points or the Rayleigh
        globals' nodes (by :func:`~pymc_mcssvi.recognize.vectorize.vectorize_graph`)."""
        meanfield = self.hypers is not None and self.hypers.mode == "meanfield"
        return meanfield or self.rayleighs is not None

    def _reduced_term(self, state, by_node, index: int, size: int, mode=None) -> Part:
        """Term ``index``'s :class:`Part`, reduced over chunks of ``size`` of its
        observations by a scan: the step holds one chunk's intermediates at a time."""
        term = self.bound.terms[index]
        chunk_index, chunk_weight = chunk_layout(term.n_obs, size)
        idx = pt.vector("chunk_index", dtype="int64", shape=(size,))
        w = pt.vector("chunk_weight", dtype="float64", shape=(size,))
        part = self._evaluate(state, by_node, terms=[index], chunk=Chunk(idx, w), mode=mode)
        flat, rebuild = _flatten_part(part)
        for x in flat:
            if None in x.type.shape:
                raise ValueError(f"chunked term {term.name!r}: an output of unknown shape")

        def body(i, wt, *acc):
            current = graph_replace(flat, {idx: i, w: wt}, strict=False)
            return [
                pt.minimum(a, c) if a.dtype == "int8" else a + c
                for a, c in zip(acc, current, strict=True)
            ]

        init = [
            pt.ones((), dtype="int8")
            if x.dtype == "int8"
            else pt.zeros(x.type.shape, dtype=x.dtype)
            for x in flat
        ]
        with warnings.catch_warnings():
            # PyTensor deprecates scan's ``mode`` (the inner graph is to inherit the
            # outer compilation); it is still honoured, and needed by the Python backend
            warnings.filterwarnings("ignore", "The `mode` argument of `scan`", FutureWarning)
            sums = pytensor.scan(
                body,
                sequences=[pt.constant(chunk_index), pt.constant(chunk_weight)],
                outputs_info=init,
                return_updates=False,
                mode=mode,
            )
        sums = sums if isinstance(sums, list | tuple) else [sums]
        return rebuild([x[-1] for x in sums])

    def _turns(self, t):
        """The evaluation's number for the accepted-step count ``t``
        (:attr:`EvalOptions.step <pymc_mcssvi.terms.base.EvalOptions>`): the factors
        of a matrix factorization move in turn, so a factor's subsample windows (and
        ``row_batch``'s windows of rows) advance once per step of that factor."""
        return pt.cast(t, "int64") // self.n_phases

    def _window_step(self, t_old, accept, base, g, H, scale, t, opt, stepped, stepped_opt):
        """``row_batch``: the batched segment's step moves the rows of the window whose
        ``g`` and ``H`` the base holds (the candidate's window if it was accepted, the
        last accepted one's if not) and keeps its other rows. Those rows take whole
        natural steps (``rho = 1``, backed off with the others after a non-finite
        bound): the step to their optimum given the other globals, as stochastic
        variational inference re-fits its local variables (decreasing steps counted
        in passes left a topic model at 6.07 nats instead of 6.02)."""
        s = self.bound.general.batched
        # the accepted-step count at which the base's g and H were evaluated
        evaluated = self._turns(pt.maximum(t_old - pt.cast(~accept, "float64"), 0.0))
        rows = self.bound.general.window_rows(evaluated % self.windows.n_windows)
        rho_rows = pt.minimum(scale, 1.0)
        (moved,), (moved_opt,) = self.algorithm.step(
            [base[s]], [g[s]], [H[s]], rho_rows, scale, t, [opt[s]]
        )
        stepped, stepped_opt = list(stepped), list(stepped_opt)
        stepped[s] = GaussianBlocks(
            pt.switch(rows[:, None], moved.mean, base[s].mean),
            pt.switch(rows[:, None, None], moved.factor, base[s].factor),
        )
        stepped_opt[s] = _select_rows(rows, moved_opt, opt[s])
        return stepped, stepped_opt

    def _arrow_mean_step(self, stepped, base, g, curv, rho):
        """Damped Newton step of the means with the arrow curvature (head-body coupling kept).

        The algorithms' natural mean step ``rho P_s^{-1} g_s`` is blockwise; with
        the cross blocks of the expected Hessian it becomes ``rho C^{-1} g``
        for the arrow ``C`` of ``-E[H]`` (:mod:`~pymc_mcssvi.algorithms.arrow`;
        the same at ``rho = 1``, and the same fixed points, ``g = 0``). Only
        for algorithms whose mean step is that natural step; where ``C`` is
        not positive definite the blockwise step is kept.

        Returns the new candidate states and ``curv`` (for the
        hyperparameters' joint step), or ``None``.
        """
        if not self.algorithm.newton_mean:
            return stepped, None
        schur = schur_factor(curv)
        delta = arrow_solve(curv, g, schur)
        ok = pt.all(pt.isfinite(schur[0]))
        for L in curv.factors:
            ok = ok & pt.all(pt.isfinite(L))
        for d in delta:
            ok = ok & pt.all(pt.isfinite(d))
        stepped = [
            GaussianBlocks(pt.switch(ok, b.mean + rho * d, st.mean), st.factor)
            for st, b, d in zip(stepped, base, delta, strict=True)
        ]
        return stepped, curv

    def _arrow_view(self, curv, head_factor, old):
        """``G`` and the Schur factor of the accepted state's curvature.

        Where the curvature is not positive definite (a likelihood that is not
        log-concave) the view is q's own block-diagonal covariance: ``G`` the
        identity on the head and zero elsewhere, ``L_S`` the head's factor.
        """
        G, L_S = arrow_view(curv)
        ok = pt.all(pt.isfinite(L_S))
        for x, before in zip(G, old.G, strict=True):
            if before is not None:
                ok = ok & pt.all(pt.isfinite(x))
        LS = pt.switch(ok, L_S, head_factor[0])
        new_G = []
        for s, (x, before) in enumerate(zip(G, old.G, strict=True)):
            if before is None:  # not coupled with the head: G is zero, kept as None
                new_G.append(None)
                continue
            plain = x if s == self.arrow_head else pt.zeros_like(x)  # the head's G is I
            new_G.append(pt.switch(ok, x, plain))
        return tuple(new_G), LS


def _as_tuples(tree):
    """Optimizer states as nested tuples (the state trees' node type)."""
    if isinstance(tree, list | tuple):
        return tuple(_as_tuples(x) for x in tree)
    return tree


def _sym(x):
    return 0.5 * (x + pt.matrix_transpose(x))


def _shifted_factor(L, dP):
    """Cholesky factor of ``L L^T + dP`` (symmetrized), or ``L`` if that is not positive definite."""
    dP = 0.5 * (dP + pt.matrix_transpose(dP))
    L2 = cholesky(precision(GaussianBlocks(None, L), "precision") + dP)
    return pt.switch(pt.all(pt.isfinite(L2)), L2, L)


#: Largest Mahalanobis length of one block's mean step, under the block's current
#: precision, in stochastic (minibatch / row-subsampled) fits.
STOCHASTIC_MAX_MEAN_STEP = 10.0


def _trust_region(stepped: GaussianBlocks, old: GaussianBlocks) -> GaussianBlocks:
    """Shorten each block's mean step to :data:`STOCHASTIC_MAX_MEAN_STEP` current sds.

    Stochastic fits take no backtracking steps: a step from a subsample whose
    estimates are far off (heavily up-weighted rows) can throw a block many
    posterior sds away, where the next estimates are worse still. In the
    Mahalanobis metric of the current q the cap is invariant to the
    parameterization; once q is near its optimum the steps are far shorter.
    """
    delta = stepped.mean - old.mean
    z = bmv(pt.matrix_transpose(old.factor), delta)  # L^T delta, (R, K)
    length = pt.sqrt(pt.sum(z**2, axis=-1, keepdims=True))
    shrink = pt.minimum(1.0, STOCHASTIC_MAX_MEAN_STEP / pt.maximum(length, 1e-300))
    return GaussianBlocks(old.mean + shrink * delta, stepped.factor)


def _select_rows(rows, a, b):
    """``a`` where ``rows`` (``(R,)`` booleans), else ``b``, for every array of an
    optimizer state with ``R`` leading rows (the others from ``a``)."""
    if isinstance(a, tuple):
        return tuple(_select_rows(rows, x, y) for x, y in zip(a, b, strict=True))
    if a.type.ndim == 0 or a.type.shape[0] != rows.type.shape[0]:
        return a
    return pt.switch(rows.reshape((-1,) + (1,) * (a.type.ndim - 1)), a, b)


def _select_tree(cond, a, b):
    if isinstance(a, tuple):
        return tuple(_select_tree(cond, x, y) for x, y in zip(a, b, strict=True))
    return pt.switch(cond, a, b)
