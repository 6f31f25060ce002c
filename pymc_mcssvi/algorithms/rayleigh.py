"""Rayleigh globals in the step kernel (paper section 3.3, eqs. opt-nat-sigma / opt-sigma).

Each scalar Rayleigh global ``w2`` has ``q(w2) = Rayl(sigma_q)``. The bound's
graphs read ``w2`` through PyMC's value variable ``log(w2)``; :meth:`evaluate`
averages them over Gauss nodes ``w2_j = sigma_q sqrt(2 exp(t_j))``
(deterministic, so backtracking stays valid) and adds ``-KL(q || prior)``.
:meth:`updates` takes the natural-gradient step on ``theta = -1/(2 sigma_q^2)``
(MC-SSVI, H-MC-SSVI) or a first-order step on ``sigma_q`` (S-DSVI), with the
gradient of the full bound obtained by automatic differentiation.

The natural step of a Rayleigh scale overshoots where the expected log
likelihood is far from linear in ``E[w2^2]`` (on the paper's GME the
fixed-point step alternated between doubling and halving ``sigma_q``), and a
rejected candidate shrinks the step size shared with the Gaussian globals. Each
Rayleigh global therefore scales the shared ``rho`` by a factor of its own that
halves when its gradient changes sign between accepted steps and grows by 1.5
(up to 1) otherwise, as Rprop does.
"""

from __future__ import annotations

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.replace import graph_replace

from pymc_mcssvi.algorithms.state import RayleighState
from pymc_mcssvi.exceptions import UnsupportedModelError
from pymc_mcssvi.families.rayleigh import kl_rayleigh, natural_step_rayleigh, rayleigh_nodes
from pymc_mcssvi.recognize.graph import depends_on_any
from pymc_mcssvi.recognize.vectorize import vectorize_graph

__all__ = ["RayleighGlobals"]


class RayleighGlobals:
    """q over the Rayleigh globals of a model.

    Parameters
    ----------
    model : pm.Model
    rayleighs : list of RayleighGlobal
    natural : bool
        Natural-gradient steps (MC-SSVI, H-MC-SSVI) or first-order steps (S-DSVI).
    optimizer : Optimizer, optional
        First-order rule for S-DSVI.
    n_nodes : int
        Quadrature nodes per Rayleigh global (see :func:`~pymc_mcssvi.families.rayleigh.log_exponential_nodes`).
    init_scale : dict, optional
        Initial ``sigma_q`` by name (default: the prior scale at the initial point).
    """

    def __init__(self, model, rayleighs, natural=True, optimizer=None, n_nodes=8, init_scale=None):
        if len(rayleighs) > 2:
            raise UnsupportedModelError(
                rayleighs[2].name,
                "more than two Rayleigh globals are not supported",
                "combine them into fewer scales",
            )
        for r in rayleighs:
            tr = model.rvs_to_transforms.get(r.rv)
            if r.size != 1:
                raise UnsupportedModelError(
                    r.name,
                    "vector-valued Rayleigh globals are not supported yet",
                    "use one scalar Rayleigh per scale",
                )
            if tr is None or type(tr).__name__ != "LogTransform":
                raise UnsupportedModelError(
                    r.name,
                    "a Rayleigh global needs PyMC's default log transform",
                    "do not pass `transform=` for it",
                )
        self.model = model
        self.rayleighs = rayleighs
        self.natural = natural
        self.optimizer = optimizer
        self.n_nodes = int(n_nodes)
        ip = model.initial_point()
        self.init_scales = []
        for r in rayleighs:
            if init_scale and r.name in init_scale:
                s0 = float(init_scale[r.name])
            else:
                # The support point is sigma * sqrt(pi / 2).
                s0 = float(np.exp(np.asarray(ip[r.value.name]).reshape(-1)[0])) / np.sqrt(np.pi / 2)
            if not np.isfinite(s0) or s0 <= 0:
                raise UnsupportedModelError(
                    r.name,
                    f"its prior scale must be positive (got an initial scale of {s0})",
                    "check the Rayleigh `sigma`",
                )
            self.init_scales.append(s0)

    def init_state(self) -> RayleighState:
        """The start: ``sigma_q`` at the prior scale's initial point."""
        opt = self.optimizer if (self.optimizer and not self.natural) else None
        opt0 = tuple(tuple(opt.init(np.asarray(s0))) if opt else () for s0 in self.init_scales)
        scales = tuple(np.asarray(s0, dtype="float64") for s0 in self.init_scales)
        return RayleighState(
            base=scales,
            cand=scales,
            grad=tuple(np.asarray(0.0) for _ in scales),
            rho_factor=tuple(np.asarray(1.0) for _ in scales),
            base_opt=opt0,
            cand_opt=opt0,
        )

    def reset(self, state: RayleighState) -> RayleighState:
        """The candidates back at the accepted scales (values)."""
        return state._replace(cand=tuple(np.copy(b) for b in state.base))

    def evaluate(self, state: RayleighState, outputs, n_values=1, kl=True):
        """Outputs averaged over q(w2); the first ``n_values`` (bound values) also get
        ``-KL`` (with ``kl``: a part of a bound split into parts takes it once)."""
        outs = list(outputs)
        for r, sigma in zip(self.rayleighs, state.cand, strict=True):
            v = pt.scalar(f"{r.name}_node_value", dtype=r.value.dtype)
            singles = graph_replace(
                outs, {r.value: v.reshape(r.value.type.shape) if r.value.ndim else v}, strict=False
            )
            w2, wts = rayleigh_nodes(sigma, self.n_nodes)
            batched = vectorize_graph(singles, {v: pt.log(w2)})
            outs = [
                pt.tensordot(wts, b, axes=[[0], [0]]) if depends_on_any(x, [v]) else b
                for x, b in zip(singles, batched, strict=True)
            ]
            if kl:
                tau = pt.reshape(r.prior_scale, ())
                divergence = kl_rayleigh(sigma, tau)
                outs = [o - divergence if i < n_values else o for i, o in enumerate(outs)]
        return outs

    def gradients(self, state: RayleighState, value):
        """``dL/dsigma_q`` of the final (fully averaged) bound."""
        return [pt.grad(pt.switch(pt.isfinite(value), value, 0.0), s) for s in state.cand]

    def accept(self, state: RayleighState, accept, grads) -> RayleighState:
        """The accepted scales and gradients (and each scale's step-size factor)."""
        base, grad, rho_factor, base_opt = [], [], [], []
        for i, g in enumerate(grads):
            sigma = pt.switch(accept, state.cand[i], state.base[i])
            gsel = pt.switch(accept, g, state.grad[i])
            rr = state.rho_factor[i]
            opt = state.base_opt[i]
            if self.natural:
                gsafe = pt.switch(pt.isfinite(gsel), gsel, 0.0)
                flipped = pt.lt(state.grad[i] * gsafe, 0.0)
                rr = pt.switch(accept, pt.switch(flipped, 0.5 * rr, pt.minimum(1.5 * rr, 1.0)), rr)
            else:
                restarted = self.optimizer.restart(state.base_opt[i])
                opt = tuple(
                    pt.switch(accept, c, b)
                    for c, b in zip(state.cand_opt[i], restarted, strict=True)
                )
            base.append(sigma)
            grad.append(gsel)
            rho_factor.append(rr)
            base_opt.append(opt)
        return state._replace(
            base=tuple(base),
            grad=tuple(grad),
            rho_factor=tuple(rho_factor),
            base_opt=tuple(base_opt),
        )

    def step(self, state: RayleighState, rho, scale, t) -> RayleighState:
        """The next candidates: a natural step on ``-1/(2 sigma^2)`` scaled by each
        scale's own factor, or a first-order step on ``sigma`` (S-DSVI)."""
        cand, cand_opt = [], []
        for i, sigma in enumerate(state.base):
            gsafe = pt.switch(pt.isfinite(state.grad[i]), state.grad[i], 0.0)
            if self.natural:
                cand.append(natural_step_rayleigh(sigma, gsafe, rho * state.rho_factor[i]))
                cand_opt.append(state.cand_opt[i])
            else:
                delta, nxt = self.optimizer.update(gsafe, state.base_opt[i], scale, t)
                new = sigma + delta
                cand.append(pt.switch(new > 0, new, np.nan))
                cand_opt.append(tuple(nxt))
        return state._replace(cand=tuple(cand), cand_opt=tuple(cand_opt))
