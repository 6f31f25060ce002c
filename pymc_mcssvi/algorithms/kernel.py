r"""The compiled iteration: evaluate a candidate, accept or back off, step.

One call of the compiled function (one iteration) does::

    evaluate bound, g, H (and the hyperparameter gradient) at the candidate
    accept  = bound is finite  and  (schedule not monotone  or  bound did not decrease)
    base    = candidate if accept else base           (last good state)
    g, H    = those of the new base (cached when rejected)
    scale   = grow / shrink the step-size multiplier
    candidate = algorithm.step(base, g, H, rho_t)     (and a hyperparameter step)

so each iteration costs one bound evaluation and one step, a rejected candidate
costs one iteration, and the approximation always holds the best accepted state.
Because ``g`` and ``H`` of the base are cached, backing off needs no
re-evaluation: the next candidate is the same natural step with a smaller ``rho``.
A run of rejections that drives the step size to zero means the bound cannot be
evaluated near the current state: the Python loop raises
:class:`~pymc_mcssvi.exceptions.DivergenceError` and the base state is kept.
"""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt

from pymc_mcssvi.algorithms.arrow import Arrow, arrow_solve, arrow_view, schur_factor
from pymc_mcssvi.families.gaussian import GaussianBlocks, bmv, cholesky, precision

__all__ = ["MAX_COUPLED_HYPERS", "StepKernel"]

#: Largest number of mean-field hyperparameter coordinates whose step is coupled with
#: q(w)'s mean step (one extra blockwise solve per coordinate).
MAX_COUPLED_HYPERS = 32


def _shared(value, name):
    value = np.asarray(value, dtype="float64")
    return pytensor.shared(value, name=name, shape=value.shape)


class StepKernel:
    """Shared state and symbolic update of one structured-VI run.

    Parameters
    ----------
    bound : StructuredBound
    algorithm : Algorithm
    schedule : Schedule
    init_means, init_factors : list of np.ndarray
        Initial q per segment (factor in the algorithm's parameterization).
    hypers : PointHyperparameters or MeanFieldHyperparameters or None
    monotone : bool
        Reject candidates whose bound is lower (valid when the bound estimate is
        deterministic: full batch and quadrature / fixed draws).
    """

    def __init__(
        self,
        bound,
        algorithm,
        schedule,
        init_means,
        init_factors,
        hypers=None,
        monotone=True,
        rayleighs=None,
    ):
        self.bound = bound
        self.rayleighs = rayleighs
        self.algorithm = algorithm
        self.schedule = schedule
        self.hypers = hypers
        self.monotone = bool(monotone)
        nseg = len(init_means)
        self.base_mean = [_shared(m, f"base_mean_{s}") for s, m in enumerate(init_means)]
        self.base_factor = [_shared(f, f"base_factor_{s}") for s, f in enumerate(init_factors)]
        self.cand_mean = [_shared(m, f"cand_mean_{s}") for s, m in enumerate(init_means)]
        self.cand_factor = [_shared(f, f"cand_factor_{s}") for s, f in enumerate(init_factors)]
        self.base_g = [_shared(np.zeros_like(m), f"base_g_{s}") for s, m in enumerate(init_means)]
        self.base_H = [_shared(np.zeros_like(f), f"base_H_{s}") for s, f in enumerate(init_factors)]
        self.base_bound = _shared(-np.inf, "base_bound")
        #: Phases of a step: the factors of a matrix factorization move in turn.
        self.n_phases = len(getattr(bound, "phase_segments", [None]))
        self.base_phase = _shared(np.full(self.n_phases, -np.inf), "base_phase_bounds")
        self.phase = pytensor.shared(np.int64(0), name="phase")
        self.scale = _shared(schedule.initial_scale(), "step_scale")
        self.t = _shared(0.0, "accepted_steps")
        opt0 = algorithm.init_opt_state(init_means, init_factors)
        self.base_opt = [self._shared_tree(o, f"base_opt_{s}") for s, o in enumerate(opt0)]
        self.cand_opt = [self._shared_tree(o, f"cand_opt_{s}") for s, o in enumerate(opt0)]
        self.hypers = hypers if (hypers is not None and getattr(hypers.spec, "size", 0)) else None
        self.nseg = nseg
        self.coupled = (
            self.hypers is not None
            and self.hypers.mode == "meanfield"
            and self.monotone
            and self.n_phases == 1
            and algorithm.parameterization == "precision"
            and algorithm.newton_mean
            and self.hypers.spec.size <= MAX_COUPLED_HYPERS
        )
        # Cross derivatives of the accepted state: of g per segment, then of H per segment.
        self.base_cross = []
        if self.coupled:
            n_h = self.hypers.spec.size
            self.base_cross = [
                _shared(np.zeros(np.shape(m) + (n_h,)), f"base_cross_{s}")
                for s, m in enumerate(init_means)
            ] + [
                _shared(np.zeros(np.shape(f) + (n_h,)), f"base_hess_cross_{s}")
                for s, f in enumerate(init_factors)
            ]
            self.hypers.linear_response_state([np.shape(m) + (n_h,) for m in init_means])
        # Arrow coupling of the head segment (fixed effects) with the others.
        head = getattr(bound, "arrow_head", None)
        self.arrow_head = (
            head if (self.n_phases == 1 and algorithm.parameterization == "precision") else None
        )
        self.base_X, self.arrow_G, self.arrow_LS = [], [], None
        if self.arrow_head is not None:
            p = np.shape(init_means[head])[-1]
            self.base_X = [
                None if s == head else _shared(np.zeros(np.shape(m) + (p,)), f"base_X_{s}")
                for s, m in enumerate(init_means)
            ]
            self.arrow_G = [
                _shared(np.eye(p)[None] if s == head else np.zeros(np.shape(m) + (p,)), f"G_{s}")
                for s, m in enumerate(init_means)
            ]
            self.arrow_LS = _shared(np.asarray(init_factors[head])[0], "arrow_schur_factor")

    @staticmethod
    def _shared_tree(tree, name):
        return (
            tuple(
                tuple(_shared(x, f"{name}_{i}_{j}") for j, x in enumerate(part))
                for i, part in enumerate(tree)
            )
            if (tree and isinstance(tree[0], tuple))
            else tuple(_shared(x, f"{name}_{i}") for i, x in enumerate(tree))
        )

    # ------------------------------------------------------------------ graphs
    def base_states(self):
        return [GaussianBlocks(m, f) for m, f in zip(self.base_mean, self.base_factor, strict=True)]

    def hyper_replacements(self, which="base"):
        """Replacements of the hyperparameter value variables by point estimates."""
        if self.hypers is None or self.hypers.mode != "point":
            return {}
        return self.hypers.spec.replacements(
            self.hypers.base if which == "base" else self.hypers.cand
        )

    def _next_phase_only(self):
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
        return (self.phase + 1) % self.n_phases

    def build(self, by_node: bool = False):
        """Outputs ``[base_bound, cand_bound, accepted, rho]`` and the shared-variable updates.

        With several *phases* (matrix factorization: one per factor) each step
        moves only the segments of the current phase, and a candidate is
        judged by that phase's value, the objective its gradients belong to.
        """
        alg = self.algorithm
        cand = [GaussianBlocks(m, f) for m, f in zip(self.cand_mean, self.cand_factor, strict=True)]
        # The factors move in turn: a factor's subsample windows advance once per
        # step of that factor, whether or not the other side is computed too.
        turns = pt.cast(self.t, "int64") // self.n_phases
        ev = self.bound.evaluate(cand, phase=self._next_phase_only(), step=turns, by_node=by_node)
        nph = len(ev.phase_values)
        outs = [ev.value, *ev.phase_values, *ev.grads, *ev.hessians]
        nv = 1 + nph
        nx = 0
        if self.arrow_head is not None:
            xs = [
                pt.zeros(b.type.shape) if (c is None and b is not None) else c
                for c, b in zip(ev.crosses, self.base_X, strict=True)
            ]
            outs = outs + [x for x in xs if x is not None]
            nx = len(outs) - nv - 2 * self.nseg
        haux = None
        if self.rayleighs is not None:
            outs = self.rayleighs.evaluate(outs, n_values=nv)
        finite = pt.isfinite(outs[0])
        if self.hypers is not None:
            kw = {"cross": range(nv, nv + 2 * self.nseg)} if self.coupled else {}
            outs, hfinite, haux = self.hypers.evaluate(outs, n_values=nv, **kw)
            finite = pt.isfinite(outs[0]) & hfinite
        value, phase_values = outs[0], pt.stack(outs[1:nv])
        grads = outs[nv : nv + self.nseg]
        hessians = outs[nv + self.nseg : nv + 2 * self.nseg]
        xs = outs[nv + 2 * self.nseg :] if nx else []
        rgrads = None
        if self.rayleighs is not None:
            rgrads = self.rayleighs.gradients(value)
            for x in rgrads:
                finite = finite & pt.isfinite(x)
        for x in [*grads, *hessians, *xs]:
            finite = finite & pt.all(pt.isfinite(x))
        finite = finite & pt.all(pt.isfinite(phase_values))
        if self.monotone:
            current, base = phase_values[self.phase], self.base_phase[self.phase]
            tol = 1e-9 * pt.abs(base) + 1e-9
            better = pt.or_(~pt.isfinite(base), current >= base - tol)
            accept = finite & better
        else:
            accept = finite
        sel = lambda a, b: pt.switch(accept, a, b)  # noqa: E731
        new_base = [
            GaussianBlocks(sel(c.mean, m), sel(c.factor, f))
            for c, m, f in zip(cand, self.base_mean, self.base_factor, strict=True)
        ]
        g = [sel(gc, gb) for gc, gb in zip(grads, self.base_g, strict=True)]
        H = [sel(hc, hb) for hc, hb in zip(hessians, self.base_H, strict=True)]
        new_bound = sel(value, self.base_bound)
        restarted = alg.restart_opt_state(self.base_opt)
        opt = [_select_tree(accept, c, b) for c, b in zip(self.cand_opt, restarted, strict=True)]
        scale = self.schedule.next_scale(self.scale, accept)
        t = self.t + pt.cast(accept, "float64")
        rho = pt.minimum(self.schedule.base(t) * scale, 1.0)
        # Plain values for NaN-free arithmetic in the unused branch.
        g_safe = [pt.switch(pt.isfinite(x), x, 0.0) for x in g]
        H_safe = [pt.switch(pt.isfinite(x), x, 0.0) for x in H]
        stepped, stepped_opt = alg.step(new_base, g_safe, H_safe, rho, scale, t, opt)
        arrow_updates, arrow = {}, None
        if self.arrow_head is not None:
            X = iter(
                [
                    sel(xc, xb)
                    for xc, xb in zip(xs, [b for b in self.base_X if b is not None], strict=True)
                ]
            )
            X = [None if b is None else next(X) for b in self.base_X]
            arrow_updates = {b: x for b, x in zip(self.base_X, X, strict=True) if b is not None}
            Q = [None if x is None else -pt.switch(pt.isfinite(x), x, 0.0) for x in X]
            # The arrow of the curvature -E[H] itself (not of q's precisions, which lag
            # behind it while rho < 1 and need not form a positive definite arrow with Q).
            curv = Arrow(self.arrow_head, [cholesky(-_sym(h)) for h in H_safe], Q)
            stepped, arrow = self._arrow_mean_step(stepped, new_base, g_safe, curv, rho)
            arrow_updates.update(self._arrow_view_updates(curv, new_base[self.arrow_head].factor))
        if not self.monotone and self.algorithm.parameterization == "precision":
            stepped = [_trust_region(st, old) for st, old in zip(stepped, new_base, strict=True)]
        hyper_updates, cross_updates = {}, {}
        if self.hypers is not None:
            coupling = None
            if self.coupled:
                # Finite: a non-finite cross derivative rejects the candidate (hfinite).
                crosses = [
                    None if c is None else sel(c, b)
                    for c, b in zip(haux[2], self.base_cross, strict=True)
                ]
                cross_updates = {
                    b: c for b, c in zip(self.base_cross, crosses, strict=True) if c is not None
                }
                coupling = (
                    [st.factor for st in stepped],
                    g_safe,
                    crosses[: self.nseg],
                    crosses[self.nseg :],
                    [st.factor for st in new_base],
                    arrow,
                )
            hyper_updates, joint = self.hypers.updates(accept, rho, scale, t, haux, coupling)
            if joint is not None:
                stepped = [
                    st if dP is None else GaussianBlocks(st.mean, _shifted_factor(st.factor, dP))
                    for st, dP in zip(stepped, joint.precision_shifts, strict=True)
                ]
                stepped = [
                    st if d is None else GaussianBlocks(st.mean + d, st.factor)
                    for st, d in zip(stepped, joint.shifts, strict=True)
                ]
        next_phase = (
            pt.switch(accept, (self.phase + 1) % nph, self.phase) if nph > 1 else self.phase
        )
        next_cand, next_opt = [], []
        for s in range(self.nseg):
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

        updates = {}
        for s in range(self.nseg):
            updates[self.base_mean[s]] = new_base[s].mean
            updates[self.base_factor[s]] = new_base[s].factor
            updates[self.cand_mean[s]] = next_cand[s].mean
            updates[self.cand_factor[s]] = next_cand[s].factor
            updates[self.base_g[s]] = g[s]
            updates[self.base_H[s]] = H[s]
            _tree_updates(updates, self.base_opt[s], opt[s])
            _tree_updates(updates, self.cand_opt[s], next_opt[s])
        updates[self.base_bound] = new_bound
        updates[self.base_phase] = pt.switch(accept, phase_values, self.base_phase)
        updates[self.phase] = pt.cast(next_phase, "int64")
        updates[self.scale] = scale
        updates[self.t] = t
        updates.update(hyper_updates)
        updates.update(cross_updates)
        updates.update(arrow_updates)
        if self.rayleighs is not None:
            updates.update(self.rayleighs.updates(accept, rho, scale, t, rgrads))
        outputs = [new_bound, value, pt.cast(accept, "int8"), rho]
        return outputs, updates

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

    def _arrow_view_updates(self, curv, head_factor):
        """``G`` and the Schur factor of the accepted state's curvature.

        Where the curvature is not positive definite (a likelihood that is not
        log-concave) the view is q's own block-diagonal covariance: ``G`` the
        identity on the head and zero elsewhere, ``L_S`` the head's factor.
        """
        G, L_S = arrow_view(curv)
        ok = pt.all(pt.isfinite(L_S))
        for x in G:
            ok = ok & pt.all(pt.isfinite(x))
        up = {self.arrow_LS: pt.switch(ok, L_S, head_factor[0])}
        for s, (sh, x) in enumerate(zip(self.arrow_G, G, strict=True)):
            plain = x if s == self.arrow_head else pt.zeros_like(x)  # the head's G is I
            up[sh] = pt.switch(ok, x, plain)
        return up

    def reset_candidate(self):
        """Make the candidate equal to the base (used after a divergence)."""
        for s in range(self.nseg):
            self.cand_mean[s].set_value(self.base_mean[s].get_value())
            self.cand_factor[s].set_value(self.base_factor[s].get_value())
        if self.hypers is not None:
            self.hypers.reset()
        if self.rayleighs is not None:
            self.rayleighs.reset()


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


def _select_tree(cond, a, b):
    if isinstance(a, tuple):
        return tuple(_select_tree(cond, x, y) for x, y in zip(a, b, strict=True))
    return pt.switch(cond, a, b)


def _tree_updates(updates, shared_tree, values):
    if isinstance(shared_tree, tuple):
        for s, v in zip(shared_tree, values, strict=True):
            _tree_updates(updates, s, v)
    else:
        updates[shared_tree] = values
