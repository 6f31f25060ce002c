"""Draws of marginalized local latents for ``approx.sample``.

The bound integrates the locals out, so q has no parameters for them. To give
``approx.sample()`` a value for every free variable, each local gets its
marginal posterior under q, computed once after the fit by averaging
``p(f_i | w, y_i)`` over draws of the globals:

* Gaussian local: the posterior mean and variance of ``f_i`` (law of total
  variance over the draws; given ``w`` they come from the same inner
  quadrature the bound uses), drawn as independent normals;
* discrete local: the posterior probabilities ``E_q[p(z_i = k | w, y_i)]``,
  drawn by inverse CDF.

A Gaussian local's draws in ``approx.sample()`` are then made conditional on
the same draw of the globals (:func:`conditional_local_sampler`): its mean and
sd given ``w`` come from the inner quadrature, and the marginal draw's standard
normal deviate is reused (exact for a Gaussian likelihood; a non-centered
``theta = mu + tau * z`` keeps its spread). Discrete locals are drawn from their
marginals, independently of the globals. Locals are flagged in
``posterior.attrs["marginal_locals"]``.
"""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt

from pymc_mcssvi.backend.modes import python_step_mode
from pymc_mcssvi.posterior.settings import SETTINGS
from pymc_mcssvi.recognize.graph import as_float, remove_checks, shape64
from pymc_mcssvi.recognize.marginalize import in_local_layout, laplace_nodes
from pymc_mcssvi.recognize.roles import dist_params
from pymc_mcssvi.recognize.stabilize import stable_logp
from pymc_mcssvi.recognize.vectorize import vectorize_graph

__all__ = ["LocalMoments", "conditional_local_sampler", "local_posteriors"]


#: Elements (draws x nodes x observations) of one batch of :func:`local_posteriors`. A
#: module constant, not a field of ``SETTINGS``, while a test outside
#: ``tests/posterior`` sets it on this module.
BATCH_ELEMENTS = 2_000_000


def _over_draws(values, outputs, summed):
    """``outputs`` (graphs of ``values``) vectorized over a leading draws axis and
    compiled, summed over that axis if ``summed``.

    Compiled with FAST_COMPILE's rewrites, not with merging only as the profile's
    re-fits: they pay for themselves over the draws; and with the ufunc rewrites of
    the Python backend (:func:`~pymc_mcssvi.backend.modes.python_step_mode`):
    FAST_COMPILE's ``Elemwise`` runs a ``Clip`` (the inner quadrature's Newton
    steps) element by element in Python, 12 million calls in one
    ``approx.sample(1000)`` of a 2,000-row GLMM with observation-level locals.
    """
    batched = [pt.TensorType(v.dtype, shape=(None, *v.type.shape))(name=v.name) for v in values]
    outs = vectorize_graph(outputs, dict(zip(values, batched, strict=True)))
    if summed:
        outs = [pt.sum(o, axis=0) for o in outs]
    return pytensor.function(
        batched,
        outs,
        mode=python_step_mode(),
        on_unused_input="ignore",
        allow_input_downcast=True,
    )


class LocalMoments:
    """The compiled ``draws of the other free variables -> (mean, second moment)`` of a
    Gaussian local given them (:func:`_gaussian_local_moments`, vectorized over the
    draws), compiled on first use and shared by :func:`local_posteriors` and
    :func:`conditional_local_sampler`.

    Attributes
    ----------
    names : list of str
        Value names of the other free variables, in the function's input order.
    """

    def __init__(self, model, lc, locals_, n_inner=None):
        self.model, self.lc = model, lc
        self.n_inner = SETTINGS.local_nodes if n_inner is None else n_inner
        local_rvs = {x.rv for x in locals_}
        self.values = [model.rvs_to_values[rv] for rv in model.free_RVs if rv not in local_rvs]
        self.names = [v.name for v in self.values]
        self._fn = None

    def __getstate__(self):
        """Pickled without the compiled function (compiled again on first use)."""
        return {**self.__dict__, "_fn": None}

    def __call__(self, *args):
        if self._fn is None:
            outputs = list(_gaussian_local_moments(self.model, self.lc, self.n_inner))
            self._fn = _over_draws(self.values, outputs, summed=False)
        return self._fn(*args)


def _batch_draws(per_draw: int) -> int:
    """Draws per call so that one batch holds about :data:`BATCH_ELEMENTS` elements."""
    return int(max(1, BATCH_ELEMENTS // max(per_draw, 1)))


def _observed_logp(model, lc):
    """Elementwise log likelihood of the observed variable local ``lc`` belongs to, in
    the local's layout (:func:`~pymc_mcssvi.recognize.marginalize.in_local_layout`)."""
    obs = model[lc.observed]
    # Stable, ufunc-only form: PyTensor's scalar softplus runs a Python call per element.
    logp_y = stable_logp(remove_checks(model.logp(vars=[obs], sum=False)[0]))
    return in_local_layout(logp_y, lc.shape)


def _draw_average(values, outputs, samples, names, draws, per_draw):
    """Average ``outputs`` (graphs of ``values``) over the ``draws`` rows of ``samples``.

    The graphs are vectorized over a leading draws axis and evaluated in batches
    of about :data:`BATCH_ELEMENTS` elements (``per_draw`` elements per draw), one
    call per batch rather than one per draw.
    """
    fn = _over_draws(values, outputs, summed=True)
    size = min(draws, _batch_draws(per_draw))
    acc = [0.0] * len(outputs)
    for lo in range(0, draws, size):
        res = fn(*[np.asarray(samples[n][lo : lo + size]) for n in names])
        acc = [a + r for a, r in zip(acc, res, strict=True)]
    return [a / draws for a in acc]


def _gaussian_local_moments(model, lc, n_inner):
    """Graphs of the mean and second moment of Gaussian local ``lc`` given the other
    free variables' values (adaptive Gauss-Hermite quadrature of its observed's
    likelihood, :func:`~pymc_mcssvi.recognize.marginalize.laplace_nodes`)."""
    logp_y = _observed_logp(model, lc)
    loc, scale = (
        pt.broadcast_to(as_float(p), shape64(lc.shape))
        for p in model.replace_rvs_by_values(dist_params(lc.rv))
    )
    nodes, logw = laplace_nodes(logp_y, lc.value, loc, scale, n_inner)
    ll = logw + vectorize_graph(logp_y, {lc.value: nodes})
    wts = pt.exp(ll - pt.logsumexp(ll, axis=0, keepdims=True))
    return pt.sum(wts * nodes, axis=0), pt.sum(wts * pt.square(nodes), axis=0)


def conditional_local_sampler(lc, params, moments: LocalMoments):
    """``samples -> {name: draws}`` replacing Gaussian local ``lc``'s marginal draws by
    draws given the globals of the same draw.

    The returned function takes the dict of draws by value-variable name (as
    ``approx.sample_dict_fn`` gives them, and an unused ``random_seed``) and
    returns ``lc``'s new draws: the conditional mean plus the conditional sd
    (``moments``) times the standard normal deviate of the marginal draw.
    """
    fn, names = moments, moments.names
    n = int(np.prod(lc.shape)) if len(lc.shape) else 1
    size = _batch_draws(moments.n_inner * n)
    name = lc.value.name

    def draw(samples, random_seed=None):
        marginal = np.asarray(samples[name], dtype="float64")
        mean = params[lc.name]["mean"].get_value()
        sd = params[lc.name]["sd"].get_value()
        eps = np.where(sd > 0, (marginal - mean) / np.where(sd > 0, sd, 1.0), 0.0)
        out = np.empty_like(marginal)
        with np.errstate(all="ignore"):
            for lo in range(0, marginal.shape[0], size):
                a, b = fn(*[np.asarray(samples[nm][lo : lo + size]) for nm in names])
                cond_sd = np.sqrt(np.maximum(b - a**2, 0.0))
                out[lo : lo + size] = a + cond_sd * eps[lo : lo + size]
        return {name: out.astype(samples[name].dtype)}

    return draw


def local_posteriors(model, approx, locals_, params, moments, draws=200, random_seed=0):
    """Fill ``params`` with the marginal posteriors of the locals under ``approx``
    (``moments``: the Gaussian locals' :class:`LocalMoments` by name)."""
    others = [rv for rv in model.free_RVs if rv not in {lc.rv for lc in locals_}]
    names = [model.rvs_to_values[rv].name for rv in others]
    sample_fn = approx.sample_dict_fn
    samples = sample_fn(draws, random_seed=random_seed)
    values = [model.rvs_to_values[rv] for rv in others]
    for lc in locals_:
        n = int(np.prod(lc.shape)) if len(lc.shape) else 1
        if lc.kind == "discrete":
            logp_y = _observed_logp(model, lc)
            logp_z = remove_checks(model.logp(vars=[lc.rv], sum=False)[0])
            ks = pt.broadcast_to(
                pt.constant(
                    np.arange(lc.support)
                    .reshape((-1,) + (1,) * len(lc.shape))
                    .astype(lc.value.dtype)
                ),
                (lc.support, *lc.shape),
            )
            joint = vectorize_graph(logp_z + logp_y, {lc.value: ks})
            post = pt.exp(joint - pt.logsumexp(joint, axis=0, keepdims=True))
            (acc,) = _draw_average(values, [post], samples, names, draws, lc.support * n)
            probs = np.asarray(acc).reshape(lc.support, -1).T
            params[lc.name]["probs"].set_value(probs / probs.sum(axis=1, keepdims=True))
        else:
            fn = moments[lc.name]
            size = _batch_draws(fn.n_inner * n)
            mean, second = 0.0, 0.0
            for lo in range(0, draws, size):
                m1, m2 = fn(*[np.asarray(samples[nm][lo : lo + size]) for nm in fn.names])
                mean, second = mean + m1.sum(0), second + m2.sum(0)
            mean, second = mean / draws, second / draws
            params[lc.name]["mean"].set_value(mean)
            params[lc.name]["sd"].set_value(np.sqrt(np.maximum(second - mean**2, 0.0)))
