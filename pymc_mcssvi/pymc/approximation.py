"""PyMC ``Group`` and ``Approximation`` classes backed by the structured q.

The groups read the step kernel's *accepted* state directly (its shared
variables are the groups' parameters), so everything downstream of ``pm.fit``
works on the result: ``approx.sample`` (ArviZ data in the constrained space
with coords and dims), ``approx.sample_node``, ``pm.sample_posterior_predictive``
on the samples, ``approx.mean`` / ``std`` / ``cov`` and callbacks.
"""

from __future__ import annotations

import contextlib
import threading
from typing import NamedTuple

import cloudpickle
import numpy as np
import pymc as pm
import pytensor.tensor as pt
from pymc.backends.base import MultiTrace
from pymc.backends.ndarray import NDArray
from pymc.variational.opvi import Approximation, Group, node_property

try:
    from pytensor.conditional.op import ifelse
except ImportError:  # PyTensor releases before the module moved
    from pytensor.ifelse import ifelse
from xarray import DataArray, Dataset

from pymc_mcssvi.backend.modes import graph_building
from pymc_mcssvi.families.gaussian import GaussianBlocks, covariance, sample
from pymc_mcssvi.posterior.marginal import grid_interpolation, node_interpolation, table_transform
from pymc_mcssvi.posterior.profile_grid import conditional_transform
from pymc_mcssvi.pymc import diagnostics, persist

__all__ = [
    "ConditionalView",
    "FactorTriangle",
    "PointGroup",
    "StructuredApproximation",
    "StructuredGaussianGroup",
]


class ConditionalView(NamedTuple):
    """Shared variables of the Gaussian globals' draws given the hyperparameters' draws.

    Set after a fit from q(w | h) re-fitted at the profile points of q(h) (see
    :mod:`pymc_mcssvi.posterior.marginal`); used while ``on`` is 1.

    Attributes
    ----------
    on : SharedVariable
        int8 flag.
    factors : list of SharedVariable
        Per segment, the factor (in the group's parameterization) of the draws'
        noise before scaling (:func:`~pymc_mcssvi.posterior.marginal.averaged_view_factors`).
    sd_table : SharedVariable
        ``(n_h, len(NODES), ddim)`` log ratios of the conditional sds along q(h)'s
        axes: each draw's noise is scaled by them at its ``h``.
    mean_table : SharedVariable
        ``(n_h, len(NODES), ddim)``: the conditional means in the data's
        coordinates along q(h)'s axes
        (:func:`~pymc_mcssvi.posterior.marginal.conditional_mean_table`): a
        draw's mean is ``exp(-LS(h)) (center + M(t))``.
    log_scale_axes : SharedVariable
        ``(n_h, len(NODES), ddim)``: ``LS``, the log scales of the data's
        coordinates (half the log ratio of the predictor Jacobian's squared column
        norms to the centre's) where they add up across q(h)'s axes: their values
        at the nodes along each axis, interpolated and summed at each draw
        (:func:`~pymc_mcssvi.posterior.marginal.node_interpolation`).
    log_scale_grid : SharedVariable
        ``(len(NODES)^n_h, ddim)``: ``LS`` where they do not add up, on the tensor
        grid of the nodes along q(h)'s axes
        (:func:`~pymc_mcssvi.posterior.marginal.grid_interpolation`); one row
        (a placeholder, not evaluated) when they do.
    scale_masks : SharedVariable
        ``(2, ddim)``: the coordinates whose noise (row 0) and mean (row 1)
        follow ``LS`` (see :func:`~pymc_mcssvi.posterior.marginal.data_coordinates`).
    moments : DrawMoments
        The mean part's moments: its mean, covariance and cross-covariance with
        ``h`` (:func:`~pymc_mcssvi.posterior.marginal.draw_moments`).
    moment_factors : list of SharedVariable
        Per segment, the factor of the scaled noise's covariance averaged over
        q(h): the own covariance ``std`` and ``cov`` report.
    """

    on: object
    factors: list
    sd_table: object
    mean_table: object
    log_scale_axes: object
    log_scale_grid: object
    scale_masks: object
    moments: object
    moment_factors: list


class FactorTriangle:
    """The triangles of a shared stack of triangular factors: ``get_value()`` is the
    ``(..., K (K + 1) / 2)`` entries on and below the diagonal (``lower=True``, the
    precision's Cholesky factors of MC-SSVI and H-MC-SSVI) or on and above it
    (S-DSVI's ``S = C^T C``, ``C`` upper), ``set_value`` takes them back.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> f = pytensor.shared(np.array([[[1.0, 0.0], [2.0, 3.0]]]), name="factor")
    >>> FactorTriangle(f).get_value().tolist()
    [[1.0, 2.0, 3.0]]
    >>> FactorTriangle(f).set_value([[4.0, 5.0, 6.0]]); f.get_value().tolist()
    [[[4.0, 0.0], [5.0, 6.0]]]
    >>> c = pytensor.shared(np.array([[[1.0, 2.0], [0.0, 3.0]]]), name="factor")
    >>> FactorTriangle(c, lower=False).get_value().tolist()
    [[1.0, 2.0, 3.0]]
    """

    def __init__(self, shared, lower=True):
        self.shared = shared
        self.name = shared.name
        self._indices = np.tril_indices if lower else np.triu_indices

    def get_value(self, borrow=False):
        value = self.shared.get_value(borrow=True)
        i, j = self._indices(value.shape[-1])
        return value[..., i, j]

    def set_value(self, value, borrow=False):
        """Set the triangles (as :meth:`get_value` gives them); the rest stays 0."""
        full = np.zeros_like(self.shared.get_value(borrow=True))
        i, j = self._indices(full.shape[-1])
        full[..., i, j] = value
        self.shared.set_value(full)

    def __repr__(self):
        return f"FactorTriangle({self.name})"


def _scatter(target, idx, values):
    return pt.set_subtensor(target[..., idx.reshape(-1)], values.reshape((*values.shape[:-2], -1)))


#: Spawn key of the conditional samplers' seeds. PyMC seeds the approximation's own
#: generators with ``SeedSequence(random_seed).spawn(k)`` (keys ``(0,)`` to
#: ``(k-1,)``); children of the same sequence made each conditional draw's noise
#: the very standard normals its hyperparameters were drawn from (a Flat
#: intercept's slope came out perfectly correlated with it, 40% too narrow).
CONDITIONAL_SPAWN_KEY = 0x636F6E64


def conditional_seeds(random_seed, n: int) -> list[np.random.SeedSequence]:
    """``n`` seeds for the conditional samplers, independent of PyMC's own draws.

    Examples
    --------
    >>> from pymc.pytensorf import reseed_rngs
    >>> import pytensor
    >>> rng = pytensor.shared(np.random.default_rng())
    >>> reseed_rngs([rng], 5)
    >>> ours = np.random.default_rng(conditional_seeds(5, 1)[0])
    >>> bool(ours.standard_normal() != rng.get_value().standard_normal())
    True
    """
    entropy = np.random.SeedSequence(random_seed).entropy
    parent = np.random.SeedSequence(entropy, spawn_key=(CONDITIONAL_SPAWN_KEY,))
    return parent.spawn(n)


class StructuredGaussianGroup(Group):
    """Gaussian q over the Gaussian globals, factorized over segments.

    Built by the inference classes; ``segments``, ``flat_maps``, the shared means
    and factors and the ``parameterization`` are passed as keyword arguments.
    An optional ``response=(hyper_group, responses)`` makes the draws follow
    the hyperparameter group's draws ``h``: ``w = m + A eps + U (h - mu_h)`` with
    ``U`` (``responses``, ``(R, K, n_h)`` per segment, ``None`` for none) the
    linear response of q(w)'s mean; ``std`` and ``cov`` include ``U cov(h) U^T``.
    An optional ``arrow=(head, G, L_S)`` (see
    :func:`~pymc_mcssvi.algorithms.arrow.arrow_view`) replaces q(w)'s
    block-diagonal covariance by the inverse of the arrow precision that keeps
    the head segment's coupling with the others (linear response for q(w)):
    the head's own noise is replaced by ``G L_S^{-T} e_head``.
    An optional ``marginal=(on, V, s, T, shift, cov)`` (shared variables, see
    :mod:`~pymc_mcssvi.posterior.marginal`) replaces the Gaussian by the
    skewed axis marginal while ``on`` is 1; ``center`` stays the Gaussian's
    mean (the point other groups' linear responses are taken at). An optional
    ``grid=(on, D, T, C, rows)`` (shared variables, see
    :mod:`~pymc_mcssvi.posterior.profile_grid`) replaces both, while its
    ``on`` is 1, by draws ``h = center + D t`` of the profile on a grid: ``t_1``
    by the quantile table ``T[0]``, ``t_2`` (two coordinates) by the
    conditional tables ``C`` at ``rows`` of ``t_1``.
    An optional ``view`` (:class:`ConditionalView`) replaces q's own factors
    in the draws (by ``view.factors``) and in ``std`` and ``cov`` (by
    ``view.moment_factors``) while ``view.on`` is 1, scales each draw's noise
    by the conditional sds at its ``h`` (see
    :func:`~pymc_mcssvi.posterior.marginal.averaged_view_factors`) and
    replaces the linear response of its mean by the conditional means (see
    :func:`~pymc_mcssvi.posterior.marginal.conditional_mean_table`); ``mean``,
    ``std``, ``cov`` and ``cross_cov`` are then the draws' (see
    :class:`~pymc_mcssvi.posterior.marginal.DrawMoments`).
    """

    __param_spec__ = {"segment_means": ("d",), "segment_factors": ("d",)}
    short_name = "structured_gaussian"
    alias_names = frozenset(["sg"])

    def __init_group__(self, group):
        super().__init_group__(group)
        kw = self._kwargs
        self.segments = kw["segments"]
        self.flat_maps = kw["flat_maps"]
        self.parameterization = kw["parameterization"]
        self.shared_means = kw["means"]
        self.shared_factors = kw["factors"]
        self.response = kw.get("response")
        self.arrow = kw.get("arrow")
        self.marginal = kw.get("marginal")
        self.grid = kw.get("grid")
        self.view = kw.get("view")
        if self.view is not None and self.arrow is not None:
            raise ValueError("a factor view and the arrow view cannot be combined")
        self.shared_params = {
            **{m.name: m for m in self.shared_means},
            **{f.name: f for f in self.shared_factors},
        }
        self._finalize_init()

    @property
    def params(self):
        """The means, and the factors' triangles (:class:`FactorTriangle`).

        The factors' structural zeros are left out: PyMC's
        ``CheckParametersConvergence`` (default ``diff="relative"``) reads a
        constant 0 as a relative change of 1 and never stopped a fit (S-DSVI's
        factors are upper triangular: their lower triangles, read before, were
        those zeros).
        """
        lower = self.parameterization == "precision"
        return [*self.shared_means, *(FactorTriangle(f, lower) for f in self.shared_factors)]

    def _responses(self):
        """``(hyper_group, [(U_s, flat_map_s), ...])`` or ``None``."""
        if self.response is None:
            return None
        hyper, responses = self.response
        pairs = [
            (U, idx) for U, idx in zip(responses, self.flat_maps, strict=True) if U is not None
        ]
        return (hyper, pairs) if pairs else None

    def _response_matrix(self, hyper, pairs):
        """``U`` as a dense ``(ddim, n_h)`` matrix in this group's flat order."""
        n_h = hyper.ddim
        out = pt.zeros((self.ddim, n_h))
        for U, idx in pairs:
            out = pt.set_subtensor(out[idx.reshape(-1)], U.reshape((-1, n_h)))
        return out

    def _arrow_matrix(self):
        """``G`` of the arrow view as a dense ``(ddim, p)`` matrix in this group's flat order."""
        _, G, L_S = self.arrow
        p = L_S.type.shape[-1]
        out = pt.zeros((self.ddim, p))
        for G_s, idx in zip(G, self.flat_maps, strict=True):
            if G_s is not None:  # None: a segment not coupled with the head (zero)
                out = pt.set_subtensor(out[idx.reshape(-1)], G_s.reshape((-1, p)))
        return out

    def _arrow_covariance(self):
        """``G S^{-1} G^T`` factor: ``G L_S^{-T}`` as a dense ``(ddim, p)`` matrix."""
        L_S = self.arrow[2]
        # (G L_S^{-T})^T = L_S^{-1} G^T
        return pt.linalg.solve_triangular(L_S, self._arrow_matrix().T, lower=True).T

    def _own_states(self):
        """``(state, flat_map)`` of the segments whose own blocks enter the covariance."""
        head = None if self.arrow is None else self.arrow[0]
        states = self._states(moments=True)
        return [
            (st, idx)
            for s, (st, idx) in enumerate(zip(states, self.flat_maps, strict=True))
            if s != head
        ]

    def _states(self, moments=False):
        """The segments' states; with a view, its draws' factors (or, with ``moments``,
        the factors of the covariance ``std`` and ``cov`` report)."""
        factors = list(self.shared_factors)
        if self.view is not None:
            view_factors = self.view.moment_factors if moments else self.view.factors
            factors = [
                pt.switch(pt.eq(self.view.on, 1), v, f)
                for v, f in zip(view_factors, factors, strict=True)
            ]
        return [GaussianBlocks(m, f) for m, f in zip(self.shared_means, factors, strict=True)]

    @node_property
    def symbolic_random(self):
        eps = self.symbolic_initial
        out = pt.zeros_like(eps)
        for st, idx, seg in zip(self._states(), self.flat_maps, self.segments, strict=True):
            e = eps[:, idx.reshape(-1)].reshape((eps.shape[0], seg.rows, seg.k))
            out = _scatter(out, idx, sample(st, self.parameterization, e))
        if self.arrow is not None:
            head = self.arrow[0]
            idx, st = self.flat_maps[head], self._states()[head]
            out = _scatter(out, idx, pt.broadcast_to(st.mean, (eps.shape[0], *st.mean.shape)))
            out = out + eps[:, idx.reshape(-1)] @ self._arrow_covariance().T
        resp = self._responses()
        if resp is not None:
            hyper, pairs = resp
            h = hyper.symbolic_random - hyper.center[None, :]
            linear = out + h @ self._response_matrix(hyper, pairs).T
            if self.view is not None and hyper.marginal is not None:
                view = self.view
                _, V, s, *_ = hyper.marginal
                t = (h @ V) / s
                centre = self.center[None, :]
                n_axes = view.mean_table.get_value(borrow=True).shape[0]
                ls = node_interpolation(t, view.log_scale_axes)
                # lazy: 2^n_axes gathers per draw, only for a grid that is filled
                ls = ls + ifelse(
                    pt.gt(view.log_scale_grid.shape[0], 1),
                    grid_interpolation(t, view.log_scale_grid, n_axes),
                    pt.zeros_like(ls),
                )
                noise_ls, mean_ls = ls * view.scale_masks[0], ls * view.scale_masks[1]
                noise = pt.exp(node_interpolation(t, view.sd_table) - noise_ls) * (out - centre)
                mean = pt.exp(-mean_ls) * (centre + node_interpolation(t, view.mean_table))
                out = pt.switch(pt.eq(view.on, 1), mean + noise, linear)
            else:
                out = linear
        if self.marginal is not None:
            on, V, s, T, _, _ = self.marginal
            skewed = self.center[None, :] + (s * table_transform(eps, T)) @ V.T
            out = pt.switch(pt.eq(on, 1), skewed, out)
        if self.grid is not None:
            on, D, T, C, rows = self.grid
            t = table_transform(eps[:, :1], T[:1])
            if self.ddim == 2:
                t = pt.stack([t[:, 0], conditional_transform(t[:, 0], eps[:, 1], C, rows)], axis=1)
            out = pt.switch(pt.eq(on, 1), self.center[None, :] + D * t, out)
        # the fit's tables are float64: draws in floatX, as PyMC's groups give them
        # (``sample_node`` substitutes them for floatX value variables)
        return out.astype(eps.dtype)

    @node_property
    def center(self):
        """Mean of the Gaussian q (the expansion point of linear responses)."""
        out = pt.zeros((self.ddim,))
        for st, idx in zip(self._states(), self.flat_maps, strict=True):
            out = _scatter(out, idx, st.mean)
        return out

    def _view_moments(self):
        """``(on, DrawMoments)`` of the conditional view, or ``None``."""
        if self.view is None:
            return None
        return self.view.on, self.view.moments

    @node_property
    def mean(self):
        vm = self._view_moments()
        if vm is not None:
            on, mom = vm
            return self.center + pt.switch(pt.eq(on, 1), mom.shift, 0.0)
        if self.marginal is None:
            return self.center
        on, _, _, _, shift, _ = self.marginal
        return self.center + pt.switch(pt.eq(on, 1), shift, 0.0)

    @node_property
    def cov(self):
        out = pt.zeros((self.ddim, self.ddim))
        for st, idx in self._own_states():
            S = covariance(st, self.parameterization)
            out = pt.set_subtensor(out[idx[:, :, None], idx[:, None, :]], S)
        if self.arrow is not None:
            A = self._arrow_covariance()
            out = out + A @ A.T
        resp = self._responses()
        if resp is not None:
            U = self._response_matrix(*resp)
            linear = U @ resp[0].cov @ U.T
            vm = self._view_moments()
            if vm is not None:
                on, m = vm
                linear = pt.switch(pt.eq(on, 1), m.R @ m.R.T, linear)
            out = out + linear
        if self.marginal is not None:
            on, *_, cov = self.marginal
            out = pt.switch(pt.eq(on, 1), cov, out)
        return out

    @node_property
    def std(self):
        out = pt.zeros((self.ddim,))
        for st, idx in self._own_states():
            S = covariance(st, self.parameterization)
            out = _scatter(out, idx, pt.diagonal(S, axis1=-2, axis2=-1))
        if self.arrow is not None:
            out = out + pt.sum(self._arrow_covariance() ** 2, axis=-1)
        resp = self._responses()
        if resp is not None:
            U = self._response_matrix(*resp)
            linear = pt.sum((U @ resp[0].cov) * U, axis=-1)
            vm = self._view_moments()
            if vm is not None:
                on, m = vm
                linear = pt.switch(pt.eq(on, 1), pt.sum(m.R**2, axis=-1), linear)
            out = out + linear
        if self.marginal is not None:
            on, *_, cov = self.marginal
            out = pt.switch(pt.eq(on, 1), pt.diagonal(cov), out)
        return pt.sqrt(out)

    def cross_cov(self, other):
        """Covariance of this group's flat vector with ``other``'s (zero unless responding to it)."""
        resp = self._responses()
        if resp is None or resp[0] is not other:
            return pt.zeros((self.ddim, other.ddim))
        out = self._response_matrix(*resp) @ other.cov
        vm = self._view_moments()
        if vm is not None and other.marginal is not None:
            on, m = vm
            out = pt.switch(pt.eq(on, 1), m.cross, out)
        return out

    @node_property
    def symbolic_logq_not_scaled(self):
        raise NotImplementedError(
            "the structured q is fitted by its own bound, not by PyMC operators"
        )


class PointGroup(Group):
    """A point mass (type-II ML / MAP estimate) in PyMC's unconstrained space."""

    __param_spec__ = {"point": ("d",)}
    short_name = "point"
    has_logq = False

    def __init_group__(self, group):
        super().__init_group__(group)
        self.shared_params = {"point": self._kwargs["point"]}
        self._finalize_init()

    @node_property
    def symbolic_random(self):
        point = self.shared_params["point"]
        eps = self.symbolic_initial
        return pt.broadcast_to(point[None, :], (eps.shape[0], self.ddim)).astype(eps.dtype)

    @node_property
    def mean(self):
        return self.shared_params["point"]

    @node_property
    def std(self):
        return pt.zeros((self.ddim,))

    @node_property
    def cov(self):
        return pt.zeros((self.ddim, self.ddim))


class RayleighGroup(Group):
    """``q(w) = Rayleigh(sigma_q)`` for scalar positive globals, in PyMC's log space.

    Draws ``log(sigma_q sqrt(2 E))`` with ``E = -log Phi(-z)``, ``z`` the group's
    standard normal initial draws (an exact transform to ``Exponential(1)``).
    """

    __param_spec__ = {"rayleigh_scale": ("d",)}
    short_name = "rayleigh"

    def __init_group__(self, group):
        super().__init_group__(group)
        self.scales = self._kwargs["scales"]
        self.shared_params = {s.name: s for s in self.scales}
        self._finalize_init()

    def _scale_vector(self):
        return pt.stack([pt.reshape(s, ()) for s in self.scales])

    @node_property
    def symbolic_random(self):
        z = self.symbolic_initial
        log_phi_minus = pt.log(0.5 * pt.erfc(z / np.sqrt(2.0)))  # log Phi(-z)
        E = -log_phi_minus
        return (pt.log(self._scale_vector())[None, :] + 0.5 * pt.log(2.0 * E)).astype(z.dtype)

    @node_property
    def mean(self):
        # E[log(sigma sqrt(2E))] = log sigma + (log 2 - euler_gamma) / 2
        return pt.log(self._scale_vector()) + 0.5 * (np.log(2.0) - np.euler_gamma)

    @node_property
    def std(self):
        return pt.ones((self.ddim,)) * np.sqrt(np.pi**2 / 24.0)

    @node_property
    def cov(self):
        return pt.diag(self.std**2)


#: Whether this thread is inside :meth:`StructuredApproximation.__reduce_ex__`.
_PICKLING = threading.local()


class StructuredApproximation(Approximation):
    """The result of an MC-SSVI / H-MC-SSVI / S-DSVI fit.

    A PyMC :class:`~pymc.variational.opvi.Approximation`: sample it with
    :meth:`sample`, read ``hist`` (negative ELBO per iteration) and the
    flat views :attr:`mean`, :attr:`std`, :attr:`cov` (ordered as
    :attr:`ordering`), or the per-variable ``mean_data`` / ``std_data``.

    Point-estimated hyperparameters are constant across draws; their names
    are recorded in ``sample(...)``'s ``posterior.attrs["point_estimates"]``.
    """

    def __init__(self, groups, model=None):
        super().__init__(groups, model=model)
        self.hist = np.asarray(())
        self.n_iter = 0
        self.converged = None
        self.point_estimates: list[str] = []
        self.marginal_locals: list[str] = []
        #: Free variables nothing reads, drawn from their prior given the others
        #: (:mod:`~pymc_mcssvi.pymc.leaves`).
        self.predictive_leaves: list[str] = []
        #: Zero-argument callables returning ``(samples, random_seed) -> {value name:
        #: new draws}``, applied in order to the draws (see
        #: :class:`~pymc_mcssvi.posterior.conditional.ConditionalGlobals` and
        #: :func:`~pymc_mcssvi.pymc.locals.conditional_local_sampler`); built on the
        #: first :meth:`sample`.
        self.conditional_factories: list = []
        self._conditional: list | None = None
        #: The model's data containers and shared dim lengths with their values at the
        #: end of the fit (see :meth:`fitted_data`).
        self.fitted_data_values: dict = {}
        #: The model's coordinate values at the end of the fit (restored while sampling).
        self.fitted_coords: dict = {}
        #: The inference that fitted it (what :meth:`save` writes; not pickled).
        self.inference = None
        #: The PSIS diagnosis made at the end of the fit (``pm.fit(diagnose=...)``), or None.
        self.diagnosis = None

    def save(self, path) -> None:
        """Write the fit to ``path`` (netCDF): q's parameters, the hyperparameters'
        state, the history, the inference's options and a fingerprint of the model.

        :func:`pymc_mcssvi.load` reads it back as a working approximation, and
        ``pm.fit(method=..., start=path)`` resumes the fit from it: the resumed
        fit's history continues this one's, with the same numbers as a fit that
        was never interrupted (full batch; a ``pm.Minibatch`` fit's batches are
        drawn afresh).

        Examples
        --------
        >>> import os, tempfile, numpy as np, pymc as pm, pymc_mcssvi
        >>> X = np.random.default_rng(0).normal(size=(100, 2))
        >>> y = np.random.default_rng(1).poisson(np.exp(X @ [0.5, -0.3]))
        >>> with pm.Model() as model:
        ...     w = pm.Normal("w", 0, 1, shape=2)
        ...     _ = pm.Poisson("y", mu=pm.math.exp(X @ w), observed=y)
        ...     approx = pm.fit(method="hmcssvi", progressbar=False)
        >>> path = os.path.join(tempfile.mkdtemp(), "fit.nc")
        >>> approx.save(path)
        >>> loaded = pymc_mcssvi.load(path, model)
        >>> bool(np.allclose(loaded.mean.eval(), approx.mean.eval(), rtol=0, atol=1e-12))
        True
        """
        if self.inference is None:
            raise ValueError(
                "this approximation has no fit to save (it was unpickled or built by hand): "
                "save the approximation that pm.fit returned"
            )
        persist.write(persist.snapshot(self.inference), path)

    def __getstate__(self):
        # the inference (compiled functions) is left out: save() and pymc_mcssvi.load()
        # keep a fit that can go on
        return {k: v for k, v in self.__dict__.items() if k != "inference"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.inference = None

    def __reduce_ex__(self, protocol):
        # A PyMC model (which the groups hold) pickles with cloudpickle only: the
        # standard pickle is handed the approximation as cloudpickle's bytes
        if getattr(_PICKLING, "inside", False):
            return super().__reduce_ex__(protocol)
        _PICKLING.inside = True
        try:
            payload = cloudpickle.dumps(self, protocol=protocol)
        finally:
            _PICKLING.inside = False
        return (cloudpickle.loads, (payload,))

    @property
    def ordering(self):
        """Variable name to ``(name, slice, shape, dtype)`` in the flat views."""
        out, off = {}, 0
        for g in self.groups:
            for name, (nm, slc, shape, dtype) in g.ordering.items():
                out[name] = (nm, slice(slc.start + off, slc.stop + off), shape, dtype)
            off += g.ddim
        return out

    @node_property
    def mean(self):
        return pt.concatenate([g.mean for g in self.groups])

    @node_property
    def std(self):
        return pt.concatenate([g.std for g in self.groups])

    @node_property
    def cov(self):
        rows = []
        for i, gi in enumerate(self.groups):
            row = []
            for j, gj in enumerate(self.groups):
                if i == j:
                    row.append(gi.cov)
                elif getattr(gi, "response", None) is not None:
                    row.append(gi.cross_cov(gj))
                elif getattr(gj, "response", None) is not None:
                    row.append(gj.cross_cov(gi).T)
                else:
                    row.append(pt.zeros((gi.ddim, gj.ddim)))
            rows.append(pt.concatenate(row, axis=1))
        return pt.concatenate(rows, axis=0)

    def _to_data(self, flat) -> Dataset:
        """Map a flat vector to a Dataset keyed by value variable.

        Variables without dims get ArviZ-style ``<name>_dim_<i>`` dimensions, so
        several unnamed variables of different shapes can share one Dataset
        (PyMC's ``Group.var_to_data`` names them all ``dim_0``).
        """
        values = np.asarray(flat.eval() if hasattr(flat, "eval") else flat)
        rv_names = {v.name: rv.name for rv, v in self.model.rvs_to_values.items()}
        result = {}
        for name, slc, shape, dtype in self.ordering.values():
            dims = self.model.named_vars_to_dims.get(rv_names.get(name, name))
            if dims is None or len(dims) != len(shape):
                dims = [f"{name}_dim_{i}" for i in range(len(shape))]
                coords = None
            else:
                coords = {d: np.asarray(self.model.coords[d]) for d in dims}
            result[name] = DataArray(
                values[slc].reshape(shape).astype(dtype), coords=coords, dims=dims, name=name
            )
        return Dataset(result)

    @property
    def mean_data(self) -> Dataset:
        """Posterior means of the value variables (unconstrained space)."""
        return self._to_data(self.mean)

    @property
    def std_data(self) -> Dataset:
        """Posterior standard deviations of the value variables (unconstrained space)."""
        return self._to_data(self.std)

    @node_property
    def sample_dict_fn(self):
        """Draws keyed by value variable, in the model's order.

        PyMC's trace backend reads the point dict positionally, so with several
        groups the draws must follow ``model.value_vars``, not the group order.
        """
        inner = super().sample_dict_fn
        order = [v.name for v in self.model.value_vars]

        def ordered(draws=100, *, random_seed=None):
            with self.fitted_data():
                out = inner(draws, random_seed=random_seed)
                samplers = self._conditional_samplers()
                seeds = conditional_seeds(random_seed, len(samplers))
                for draw, child in zip(samplers, seeds, strict=True):
                    out.update(draw(out, random_seed=child))
            return {name: out[name] for name in order if name in out}

        return ordered

    @contextlib.contextmanager
    def fitted_data(self):
        """The model's data as it was fitted, for the duration of the block.

        The draws of q(w | h) re-fitted at each hyperparameter draw, of the
        linear-response view and of integrated-out locals are computed from the
        model's graph, which reads its ``pm.Data`` containers. After
        ``pm.set_data`` (new predictors for out-of-sample predictions) they
        would condition on the new data (a placeholder ``y = 0`` moved a group
        mean by 3.5), or fail on its new length; ``approx.sample()`` is the
        posterior of the fitted data, as with ``pm.ADVI``.
        """
        changed = self.changed_data()
        for var in changed:
            var.set_value(self.fitted_data_values[var], borrow=True)
        try:
            yield
        finally:
            for var, now in changed.items():
                var.set_value(now, borrow=True)

    def changed_data(self) -> dict:
        """The model's data containers and shared dim lengths whose values differ from
        the fitted ones (``pm.set_data`` since the fit), with their current values."""
        out = {}
        for var, value in self.fitted_data_values.items():
            now = var.get_value(borrow=True)
            if not np.array_equal(now, value):
                out[var] = now
        return out

    @contextlib.contextmanager
    def _fitted_coords(self):
        """The model's coordinate values as they were fitted, for the duration of the block:
        after ``model.set_dim`` (more groups for predictions) the draws keep the fitted
        lengths, and labelling them with the new coordinates failed in xarray
        (``conflicting sizes for dimension``; so does ``pm.ADVI``'s approximation)."""
        coords = getattr(self.model, "_coords", None)
        changed = {}
        if isinstance(coords, dict):
            for name, value in self.fitted_coords.items():
                now = coords.get(name)
                if now is not None and tuple(now) != tuple(value):
                    changed[name] = now
                    coords[name] = value
        try:
            yield
        finally:
            for name, now in changed.items():
                coords[name] = now

    def _conditional_samplers(self):
        if self._conditional is None or len(self._conditional) != len(self.conditional_factories):
            self._conditional = [make() for make in self.conditional_factories]
        return self._conditional

    def sample(self, draws=500, *, random_seed=None, return_inferencedata=True, **kwargs):
        """Draw from the approximation; see :meth:`pymc.variational.opvi.Approximation.sample`.

        The draws are computed with Python-level operations (no compilation),
        which is faster than compiling for a one-off call.
        """
        if not isinstance(draws, int | np.integer) or isinstance(draws, bool) or draws < 1:
            raise ValueError(f"draws must be a positive integer, got {draws!r}")
        # the fitted data with the fitted coordinates: after ``pm.set_data(...,
        # coords=...)`` the data groups had the new length under the old labels (an
        # xarray CoordinateValidationError)
        with graph_building(), self.fitted_data(), self._fitted_coords():
            out = super().sample(
                draws, random_seed=random_seed, return_inferencedata=return_inferencedata, **kwargs
            )
        return self._label(out, return_inferencedata)

    def trace_from_samples(self, samples: dict, *, return_inferencedata=True, **kwargs):
        """ArviZ data (or a ``MultiTrace``) of given draws, as :meth:`sample` returns them.

        ``samples`` maps each value variable's name to its draws (first axis); the
        draws are transformed to the constrained space with the model's
        deterministics, as in :meth:`sample`.
        """
        kwargs["log_likelihood"] = False
        names = [v.name for v in self.model.value_vars if v.name in samples]
        draws = len(next(iter(samples.values())))
        trace = NDArray(
            model=self.model, test_point={name: np.asarray(samples[name][0]) for name in names}
        )
        with graph_building(), self.fitted_data(), self._fitted_coords():
            try:
                trace.setup(draws=draws, chain=0)
                for i in range(draws):
                    trace.record(
                        {name: np.asarray(samples[name][i]) for name in names}, in_warmup=False
                    )
            finally:
                trace.close()
            multi = MultiTrace([trace])
            if not return_inferencedata:
                return multi
            out = pm.to_inference_data(multi, model=self.model, **kwargs)
        return self._label(out, return_inferencedata)

    def diagnose(self, draws: int = 1000, *, random_seed=None):
        """PSIS diagnosis of the fit: Pareto k-hat of ``p(y, theta) / q(theta)``
        (trustworthy below 0.7, or below :func:`~pymc_mcssvi.pymc.diagnostics.khat_threshold`
        of q's dimension in many dimensions) and importance-reweighted draws.

        See :func:`pymc_mcssvi.pymc.diagnostics.diagnose`.

        Examples
        --------
        >>> import numpy as np, pymc as pm, pymc_mcssvi
        >>> y = np.random.default_rng(0).normal(1.0, 1.0, size=50)
        >>> with pm.Model():
        ...     mu = pm.Normal("mu", 0, 10)
        ...     _ = pm.Normal("y", mu, 1.0, observed=y)
        ...     approx = pm.fit(method="mcssvi", progressbar=False)
        >>> d = approx.diagnose(random_seed=0)
        >>> d.trustworthy, d.khat  # q is the exact posterior: all weights equal
        (True, -inf)
        """
        return diagnostics.diagnose(self, draws, random_seed=random_seed)

    def _label(self, out, return_inferencedata):
        """Record the point estimates, integrated-out locals and leaves in the attrs."""
        if return_inferencedata:
            for key, names in (
                ("point_estimates", self.point_estimates),
                ("marginal_locals", self.marginal_locals),
                ("predictive_leaves", self.predictive_leaves),
            ):
                if names:
                    out["posterior"].attrs[key] = list(names)
        return out
