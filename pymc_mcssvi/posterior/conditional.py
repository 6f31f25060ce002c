"""Draws of the Gaussian globals from q(w | h) re-fitted at each draw of the hyperparameters.

The linear-response view draws ``w | h`` from one Gaussian moved along ``h``:
the mean by tables along q(h)'s axes
(:func:`~pymc_mcssvi.posterior.marginal.conditional_mean_table`), the
covariance averaged over the profile points and scaled per coordinate
(:func:`~pymc_mcssvi.posterior.marginal.averaged_view_factors`). With few
groups that is not enough: in ``a = mu_a + sigma_a z``, each ``a_g`` is fixed by
its rows while ``mu_a`` and ``z`` lie on a ridge whose direction turns with
``sigma_a``, and no single covariance (nor one per axis) follows it: the draws
of ``a`` come out too wide although each free variable's are right.

Here each draw of ``h`` gets its own q(w | h): the natural steps of
:func:`~pymc_mcssvi.posterior.marginal.refit_graph` vectorized over the draws,
from the linear response of the fitted q(w), until the bound settles (a step
that lowers it is retried with half the step size), then ``w = m(h) +
L(h)^{-T} e``. It costs about as much per draw and step as a fit's iteration
costs per sigma point, so it is used only when ``draws`` times
``SETTINGS.expected_steps`` times that stays below
``SETTINGS.exact_conditional_work`` (the fit's flop estimate, checked before
compiling) and, in memory measured on the compiled step, below
``SETTINGS.exact_conditional_bytes`` (small models, which are the ones with few
groups); larger samples keep the linear-response draws.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
import pytensor.tensor as pt
from pymc.pytensorf import compile as pm_compile
from pytensor.compile.builders import OpFromGraph
from pytensor.compile.rewriting import inline_ofg_node
from pytensor.graph.replace import graph_replace
from pytensor.graph.traversal import io_toposort
from pytensor.tensor.blockwise import Blockwise
from pytensor.tensor.elemwise import Elemwise
from threadpoolctl import threadpool_limits

from pymc_mcssvi.backend.modes import graph_building, python_few_calls_mode
from pymc_mcssvi.posterior.marginal import refit_graph
from pymc_mcssvi.posterior.profile_grid import LADDER
from pymc_mcssvi.posterior.settings import SETTINGS
from pymc_mcssvi.recognize.vectorize import shapes_at_fixed, vectorize_graph

__all__ = [
    "GridNodes",
    "node_corners",
    "SPECIAL_FUNCTIONS",
    "held_bytes",
    "step_measure",
    "ConditionalGlobals",
]

#: Scalar ops whose SciPy evaluation costs far more than the fit's flop estimate
#: assumes (its 10 flops per quadrature node), each element budgeted at
#: ``SETTINGS.special_function_flops``: the log-gamma family and its derivatives
#: (Beta, Gamma, negative binomial, Student-t likelihoods with learned shapes; the
#: curvature of digamma is ``polygamma(2, x)``, a Hurwitz zeta), incomplete gamma and
#: beta functions, Bessel functions and inverse error functions.
SPECIAL_FUNCTIONS = frozenset(
    {
        "GammaLn", "Psi", "TriGamma", "PolyGamma", "GammaInc", "GammaIncC",
        "GammaIncInv", "GammaIncCInv", "BetaInc", "BetaIncInv", "Hyp2F1",
        "Ive", "Kve", "Jv", "I0", "I1", "J0", "J1",
        "Erfinv", "Erfcinv",
    }
)  # fmt: skip


class GridNodes(NamedTuple):
    """q(w | h) re-fitted at the nodes of the gridded q(h)
    (:mod:`~pymc_mcssvi.posterior.profile_grid`): ``h = centre + scales *
    LADDER[index]``.

    Attributes
    ----------
    centre, scales : np.ndarray
        ``(n_h,)`` the grid's centre and coordinate scales.
    index : np.ndarray
        ``(m, n_h)`` the nodes' positions in :data:`~pymc_mcssvi.posterior.profile_grid.LADDER`.
    means, factors : list of np.ndarray
        Per segment, the re-fitted means ``(m, R, K)`` and precision Cholesky factors
        ``(m, R, K, K)``.
    values : np.ndarray
        ``(m,)`` the profile there (the bounds of the re-fitted q(w | h)).
    """

    centre: np.ndarray
    scales: np.ndarray
    index: np.ndarray
    means: list
    factors: list
    values: np.ndarray


class ConditionalGlobals:
    """``samples -> {name: draws}``: the Gaussian globals re-drawn from q(w | h) at each ``h``.

    Parameters
    ----------
    kernel : StepKernel
        The fitted kernel (its bound and hyperparameters).
    store : SharedState
        The fit's state: its accepted q(w) and the hyperparameters' linear responses.
    model : pm.Model
    group : StructuredGaussianGroup
        The Gaussian globals' group (its ``ordering`` and ``flat_maps``).
    work_per_draw : float
        Estimated flops of one natural step for one draw.

    Attributes
    ----------
    nodes : GridNodes or None
        Set by a fit whose q(h) is gridded: the draws take q(w | h) interpolated
        between the nodes around their ``h`` (:func:`node_corners`), each node an
        exact re-fit, instead of a re-fit at every draw.
    """

    def __init__(self, kernel, store, model, group, work_per_draw):
        self.kernel = kernel
        self.store = store
        self.model = model
        self.group = group
        self.work_per_draw = float(max(work_per_draw, 1.0))
        self.nodes = None
        self._fn = None
        self._per_draw = None

    def __getstate__(self):
        """Pickled without the compiled re-fit (its mode holds PyTensor rewriters that
        do not pickle); it is compiled again on first use."""
        return {**self.__dict__, "_fn": None}

    def affordable(self, draws: int, hs=None, measured=None) -> bool:
        """Whether ``draws`` re-fits fit in ``SETTINGS.exact_conditional_work`` (the fit's
        flop estimate) and, given the first draws ``hs`` of the hyperparameters, in
        ``SETTINGS.exact_conditional_bytes`` (the compiled step's memory, measured) and
        ``SETTINGS.exact_conditional_work`` again with the step's special functions
        counted at ``SETTINGS.special_function_flops`` each (measured), each re-fit
        taking ``SETTINGS.expected_steps`` steps. ``measured = (bytes, special
        elements)`` per draw, from another compiled step of one re-fit
        (:func:`step_measure`), stands in for measuring this one (whose compilation it
        then spares)."""
        steps = draws * SETTINGS.expected_steps
        if steps * self.work_per_draw > SETTINGS.exact_conditional_work:
            return False
        if hs is None and measured is None:
            return True
        nbytes, specials = measured if measured is not None else self._measure(hs)
        if steps * nbytes > SETTINGS.exact_conditional_bytes:
            return False
        work = self.work_per_draw + SETTINGS.special_function_flops * specials
        return steps * work <= SETTINGS.exact_conditional_work

    def bytes_per_draw(self, hs) -> float:
        """Bytes of the intermediates of one natural step, per draw.

        Measured, not estimated: the step is run on the first one and two draws of
        ``hs`` and the memory its Python VM holds (every intermediate) is compared,
        so shared inputs cancel. The fit's flop estimate misses most of it (an
        ordinal likelihood's cumulative probabilities hold far more than they
        compute).
        """
        return self._measure(hs)[0]

    def _measure(self, hs) -> tuple[float, float]:
        """Bytes (:meth:`bytes_per_draw`) and special-function elements
        (:data:`SPECIAL_FUNCTIONS`) of one natural step, per draw, measured once."""
        if self._per_draw is None:
            held, special = [], []
            for n in (1, 2):
                self.refit([h[:n] for h in hs], max_steps=1)
                held.append(held_bytes(self._fn.fn))
                special.append(_special_elements(self._fn.fn))
            self._per_draw = (
                float(max(held[1] - held[0], 1)),
                float(max(special[1] - special[0], 0)),
            )
        return self._per_draw

    def _compile(self):
        k = self.kernel
        with graph_building():
            inputs, outputs = _inlined(
                *refit_graph(k.bound, k.hypers.spec, self.store.symbolic.base, project=False)
            )
            if k.hypers.spec.fixed_shapes:
                outputs = shapes_at_fixed(inputs, outputs)
            batched = [
                # from the type: pt.tensor tries a name as a dtype first, and raises on
                # Bambi's ("1|g_sigma_log__")
                pt.TensorType(v.dtype, shape=(None, *v.type.shape))(name=v.name)
                for v in inputs
            ]
            outs = vectorize_graph(outputs, dict(zip(inputs, batched, strict=True)))
            with self.model:
                fn = pm_compile(
                    batched,
                    outs,
                    mode=python_few_calls_mode(),
                    on_unused_input="ignore",
                    # float64 draws into a floatX=float32 model's value variables
                    allow_input_downcast=True,
                )
        nseg = k.nseg

        def step(hs, rho, means, factors):
            out = fn(*hs, rho, *means, *factors)
            return out[0], list(out[1 : 1 + nseg]), list(out[1 + nseg :])

        step.fn = fn
        return step

    def refit(self, hs, max_steps=None, start=None, floor=None):
        """Re-fitted ``(means, factors, values)`` of q(w | h) for a batch of draws ``hs``.

        ``hs`` lists the hyperparameters' draws by value variable, each ``(n, ...)``;
        ``values`` are the bounds of the re-fitted q(w | h) (the profile at each draw),
        ``-inf`` where the bound was not finite at the start. Each re-fit starts from
        the fitted q(w) moved to its ``h`` by the linear response, or with ``start =
        (means, factors, at)`` (``(n, ...)`` each, ``at`` the flat ``h`` they were
        fitted at) from those, moved by it.

        At most ``max_steps`` natural steps (default
        ``SETTINGS.max_conditional_steps``), each computed for the draws still moving
        only. With ``floor``, a
        draw whose bound stays below it even if the rest of its re-fit gained
        ``SETTINGS.floor_gains`` times its last step's gain stops there: its value is
        then a lower bound of the profile, well below ``floor``.
        """
        if max_steps is None:
            max_steps = SETTINGS.max_conditional_steps
        if self._fn is None:
            self._fn = self._compile()
        state = self.store.get(borrow=True)
        n = hs[0].shape[0]
        flat_h = _flat_h(hs)
        if start is None:
            dh = flat_h - state.hyper.base_mean[0]
            means = [
                m[None] + np.tensordot(dh, U, [[1], [-1]])
                for m, U in zip(state.base.means, state.hyper.lr_responses, strict=True)
            ]
            factors = [np.broadcast_to(f, (n, *f.shape)) for f in state.base.factors]
        else:
            start_means, factors, at = start
            dh = flat_h - at
            means = [
                m + np.tensordot(dh, U, [[1], [-1]])
                for m, U in zip(start_means, state.hyper.lr_responses, strict=True)
            ]
        means = [np.array(m) for m in means]  # written per draw below
        factors = [np.array(f) for f in factors]
        best_v = np.full(n, -np.inf)
        best_m, best_f = [m.copy() for m in means], [f.copy() for f in factors]
        rho, retry, done = np.ones(n), np.zeros(n, bool), np.zeros(n, bool)
        a = np.arange(n)  # the draws still moving
        for _ in range(max_steps):
            value, new_m, new_f = self._fn(
                [h[a] for h in hs], rho[a], [m[a] for m in means], [f[a] for f in factors]
            )
            r, bv = retry[a], best_v[a]
            value = np.where(r, bv, np.asarray(value, dtype="float64"))
            tol = SETTINGS.refit_tol * (np.abs(value) + 10.0)
            # a loss within the tolerance is rounding at the optimum, not an overshoot
            ok = ~r & np.isfinite(value) & (value >= bv - tol)
            gain = value - bv
            better = ok & (gain > 0)
            up = a[better]
            for s in range(len(means)):
                best_m[s][up], best_f[s][up] = means[s][up], factors[s][up]
            best_v[up] = value[better]
            stop = ok & (gain <= tol)
            if floor is not None:
                stop |= better & (value + SETTINGS.floor_gains * gain < floor)
            done[a] |= stop
            bad = ~r & ~ok & np.isfinite(bv)
            rho[a] = np.where(bad, 0.5 * rho[a], rho[a])
            take = ok | r  # move to the step just computed
            for s in range(len(means)):
                means[s][a] = np.where(_expand(take, new_m[s]), new_m[s], best_m[s][a])
                factors[s][a] = np.where(_expand(take, new_f[s]), new_f[s], best_f[s][a])
            retry[a] = bad
            a = a[~(done[a] | ~np.isfinite(best_v[a]) | (rho[a] < 1 / 16))]
            if not len(a):
                break
        return best_m, best_f, best_v

    def __call__(self, samples, random_seed=None):
        """New draws of the Gaussian globals (by value-variable name); ``{}`` when not affordable."""
        spec = self.kernel.hypers.spec
        names = [v.name for v in spec.values]
        n = int(np.asarray(samples[names[0]]).shape[0])
        if not self.affordable(n) and self.nodes is None:
            return {}
        first = [np.asarray(samples[nm], dtype="float64")[[0, min(1, n - 1)]] for nm in names]
        g = self.group
        flat = np.empty((n, g.ddim))
        keep = np.ones(n, bool)
        rng = np.random.default_rng(random_seed)
        # small blocks, one LAPACK call each: threads cost more than they save (see
        # StructuredVI._blas_limits), badly so on a busy machine
        with threadpool_limits(limits=1, user_api="blas"), np.errstate(all="ignore"):
            if self.nodes is not None:
                # A gridded q(h): q(w | h) interpolated between its nodes, each an exact
                # re-fit, is as close to NUTS as a re-fit at every draw and far cheaper
                self._draw_from_nodes(samples, names, n, rng, flat, keep)
            elif self.affordable(n, first):
                # all draws within the budget (else the linear-response view draws them
                # all, as it always did): the first ``max_refit_draws`` (spread over
                # q(h)) are re-fitted, the rest move the nearest one
                size = int(max(1, min(n, SETTINGS.refit_batch_bytes // self._measure(first)[0])))
                self._draw(
                    samples, names, n, min(size, SETTINGS.refit_batch_draws), rng, flat, keep
                )
            else:
                return {}
        out = {}
        for name, (_, slc, shape, _) in g.ordering.items():
            old = np.asarray(samples[name])
            new = flat[:, slc].reshape(n, *shape).astype(old.dtype)
            out[name] = np.where(_expand(keep, new), old.reshape(new.shape), new)
        return out

    def _draw(self, samples, names, n, size, rng, flat, keep):
        """Re-fit at most ``SETTINGS.max_refit_draws`` draws, batch by batch while the
        work lasts (:meth:`affordable`), chosen to cover the draws of ``h``
        (:func:`spread_order`: the tails too, where q(w | h) turns most); the rest
        take the q(w | h) of the nearest re-fitted draw (in ``h`` scaled by the draws'
        sds), moved to their ``h`` by the linear response. So a call's re-fits cost
        the same whatever ``draws`` is past that count (``sample(1000)`` took 3-4.6 s
        and ``sample(2000)`` 0.1 s, which fell back to the linear-response view), and
        the other draws keep most of the re-fits' accuracy."""
        H = _flat_h([np.asarray(samples[nm], dtype="float64") for nm in names])
        order = spread_order(H, min(n, SETTINGS.max_refit_draws))
        fitted, done = [], 0
        while done < len(order):
            stop = min(len(order), done + size)
            if done and not self.affordable(stop):
                break
            rows = order[done:stop]
            hs = [np.asarray(samples[nm], dtype="float64")[rows] for nm in names]
            means, factors, values = self.refit(hs)
            keep[rows] = ~np.isfinite(values)
            self._write(means, factors, rows, rng, flat)
            fitted.append((rows, means, factors, np.isfinite(values)))
            done = stop
        rest = np.setdiff1d(np.arange(n), order[:done])
        if len(rest):
            self._draw_moved(H, rest, fitted, rng, flat, keep)

    def _write(self, means, factors, rows, rng, flat):
        """Draws ``w = m + L^{-T} e`` of the blocks ``(means, factors)`` into ``flat[rows]``."""
        for m, L, idx in zip(means, factors, self.group.flat_maps, strict=True):
            e = rng.standard_normal(m.shape)
            noise = np.linalg.solve(np.swapaxes(L, -1, -2), e[..., None])[..., 0]
            cols = np.asarray(idx).reshape(-1)
            flat[rows[:, None], cols[None, :]] = (m + noise).reshape(m.shape[0], -1)

    def _draw_moved(self, H, rows, fitted, rng, flat, keep):
        """Draws ``rows`` from the nearest re-fitted draw's q(w | h), moved by the linear
        response to their own ``h`` (``H``: every draw's flat ``h``)."""
        ok = np.concatenate([f[3] for f in fitted])
        if not ok.any():
            keep[rows] = True
            return
        at = H[np.concatenate([f[0] for f in fitted])][ok]
        base_m = [np.concatenate([f[1][s] for f in fitted])[ok] for s in range(len(fitted[0][1]))]
        base_f = [np.concatenate([f[2][s] for f in fitted])[ok] for s in range(len(fitted[0][2]))]
        h = H[rows]
        keep[rows] = ~np.all(np.isfinite(h), axis=1)
        h = np.where(keep[rows][:, None], at[0], h)
        scale = np.std(at, axis=0) + 1e-12
        near = np.empty(len(rows), dtype=int)
        for lo in range(0, len(rows), 1024):  # (rows x re-fits) distances, in pieces
            d2 = (((h[lo : lo + 1024, None, :] - at[None, :, :]) / scale) ** 2).sum(-1)
            near[lo : lo + 1024] = np.argmin(d2, axis=1)
        dh = h - at[near]
        responses = self.store.get(borrow=True).hyper.lr_responses
        means = [
            m[near] + np.tensordot(dh, U, [[1], [-1]])
            for m, U in zip(base_m, responses, strict=True)
        ]
        self._write(means, [f[near] for f in base_f], rows, rng, flat)

    def _draw_from_nodes(self, samples, names, n, rng, flat, keep):
        """Draws of q(w | h) interpolated between the grid's nodes (:func:`node_corners`):
        the means multilinearly, the noise ``L^{-T} e`` with the same ``e`` at every
        corner."""
        nodes, g = self.nodes, self.group
        H = _flat_h([np.asarray(samples[nm], dtype="float64") for nm in names])
        keep[:] = ~np.all(np.isfinite(H), axis=1)
        H = np.where(keep[:, None], nodes.centre, H)
        corners = node_corners(nodes.index, (H - nodes.centre) / nodes.scales)
        for m, L, idx in zip(nodes.means, nodes.factors, g.flat_maps, strict=True):
            e = rng.standard_normal((n, *m.shape[1:]))
            # L^{-T} once per node, and one product per node, not a factor per draw
            A = np.linalg.solve(
                np.swapaxes(L, -1, -2), np.broadcast_to(np.eye(L.shape[-1]), L.shape)
            )
            out = np.zeros((n, *m.shape[1:]))
            for r, w in corners:
                noise = np.empty_like(e)
                for node in np.unique(r):
                    sel = r == node
                    noise[sel] = np.einsum("rij,drj->dri", A[node], e[sel])
                out += _expand(w, m[r]) * (m[r] + noise)
            flat[:, np.asarray(idx).reshape(-1)] = out.reshape(n, -1)


def _flat_h(hs) -> np.ndarray:
    """Draws of the hyperparameters by variable, as one ``(n, d)`` array."""
    return np.concatenate([h.reshape(h.shape[0], -1) for h in hs], axis=1)


def spread_order(H, k: int) -> np.ndarray:
    """``k`` rows of ``H`` that cover its spread: farthest-point order (in ``H`` scaled
    by its columns' sds) from the row nearest the median; rows that are not finite last.

    Examples
    --------
    >>> H = np.array([[0.0], [0.1], [5.0], [-4.0], [0.2]])
    >>> spread_order(H, 3).tolist()
    [1, 2, 3]
    """
    n = H.shape[0]
    finite = np.all(np.isfinite(H), axis=1)
    Z = np.where(finite[:, None], H, 0.0)
    Z = (
        (Z - np.median(Z[finite], axis=0)) / (np.std(Z[finite], axis=0) + 1e-12)
        if finite.any()
        else Z
    )
    dist = np.where(finite, (Z**2).sum(1), -np.inf)
    first = int(np.argmin(np.where(finite, dist, np.inf)))
    order = [first]
    dist = np.where(finite, ((Z - Z[first]) ** 2).sum(1), -np.inf)
    dist[first] = -np.inf
    for _ in range(min(k, n) - 1):
        nxt = int(np.argmax(dist))
        if not np.isfinite(dist[nxt]):
            break
        order.append(nxt)
        dist = np.minimum(dist, ((Z - Z[nxt]) ** 2).sum(1))
        dist[nxt] = -np.inf
    rest = [i for i in range(n) if not finite[i]][: max(0, k - len(order))]
    return np.array(order + rest, dtype=int)


def node_corners(index, t) -> list:
    """``[(rows, weights)]``, one pair per corner of the cell of :data:`LADDER` around
    each point ``t`` (``(draws, n_h)``, clipped to the ladder): the node's row in
    ``index`` (``(m, n_h)`` ladder positions of the evaluated nodes) and its
    multilinear weight. A corner that was not evaluated passes its weight to the
    nearest node that was.

    Examples
    --------
    >>> import numpy as np
    >>> c = int(np.flatnonzero(LADDER == 0)[0])
    >>> index = np.array([[c], [c + 1]])  # nodes at t = 0 and 1
    >>> [(r.tolist(), np.round(w, 2).tolist()) for r, w in node_corners(index, np.array([[0.25]]))]
    [([0], [0.75]), ([1], [0.25])]
    """
    n_h = index.shape[1]
    lookup = np.full((len(LADDER),) * n_h, -1)
    lookup[tuple(index.T)] = np.arange(len(index))
    cell = np.clip(np.searchsorted(LADDER, t, side="right") - 1, 0, len(LADDER) - 2)
    frac = np.clip((t - LADDER[cell]) / (LADDER[cell + 1] - LADDER[cell]), 0.0, 1.0)
    out = []
    for corner in itertools.product((0, 1), repeat=n_h):
        at = cell + np.array(corner)
        rows = lookup[tuple(at.T)]
        missing, inverse = np.unique(at[rows < 0], axis=0, return_inverse=True)
        near = [int(np.argmin(((index - c) ** 2).sum(1))) for c in missing]
        rows[rows < 0] = np.asarray(near, dtype="int64")[inverse.ravel()]
        out.append((rows, np.prod(np.where(np.array(corner) == 1, frac, 1.0 - frac), axis=1)))
    return out


def _inlined(inputs, outputs):
    """The graph with every ``OpFromGraph`` (``logsumexp``, its derivative...), bare or
    batched in a ``Blockwise``, replaced by its inner graph: vectorized over draws, such
    an op is a ``Blockwise`` that the Python VM runs once per draw and element. Replaced
    level by level (an inner graph can hold further ones, at most
    ``SETTINGS.max_inline_levels`` deep); shared variables and the inputs are kept."""
    for _ in range(SETTINGS.max_inline_levels):
        nodes = [node for node in io_toposort(inputs, outputs) if _ofg_core(node) is not None]
        if not nodes:
            break
        replace = {}
        for node in nodes:
            replace.update(zip(node.outputs, _inline(node), strict=True))
        outputs = graph_replace(outputs, replace, strict=False)
    return inputs, outputs


def _ofg_core(node):
    """The ``OpFromGraph`` of ``node``, bare or inside a ``Blockwise``, or ``None``."""
    op = node.op.core_op if isinstance(node.op, Blockwise) else node.op
    return op if isinstance(op, OpFromGraph) else None


def _inline(node):
    op = _ofg_core(node)
    if not isinstance(node.op, Blockwise):
        return inline_ofg_node(node)
    # a Blockwise of one: its inner graph on core-shaped inputs, vectorized natively
    core_inputs = [
        pt.tensor(dtype=x.dtype, shape=x.type.shape[x.type.ndim - len(sig) :])
        for x, sig in zip(node.inputs, node.op.inputs_sig, strict=True)
    ]
    core_outputs = inline_ofg_node(op.make_node(*core_inputs))
    return vectorize_graph(core_outputs, dict(zip(core_inputs, node.inputs, strict=True)))


def _special_elements(fn) -> int:
    """Elements computed by special functions (:data:`SPECIAL_FUNCTIONS`) in a compiled
    function's last call, read from its VM's storage."""
    total = 0
    for node in fn.maker.fgraph.apply_nodes:
        op = node.op
        if isinstance(op, Elemwise) and type(op.scalar_op).__name__ in SPECIAL_FUNCTIONS:
            total += sum(getattr(fn.vm.storage_map[o][0], "size", 0) for o in node.outputs)
    return total


def step_measure(fn):
    """``(bytes, special elements)`` a compiled function's Python VM held in its last
    call (:func:`held_bytes`, :func:`_special_elements`), or ``None`` for a function
    without one (JAX, numba)."""
    if getattr(fn, "vm", None) is None or not hasattr(fn.vm, "storage_map"):
        return None
    return float(held_bytes(fn)), float(_special_elements(fn))


def held_bytes(fn) -> int:
    """Bytes of the arrays a compiled function's VM holds after a call."""
    return sum(getattr(cell[0], "nbytes", 0) for cell in fn.vm.storage_map.values())


def _expand(mask, like):
    return mask.reshape((-1,) + (1,) * (np.ndim(like) - 1))
