r"""The structured evidence lower bound and its natural-gradient ingredients.

With the locals marginalized (paper eqs. vlb / vlbi) the bound is

.. math::

    \mathcal L(q) = \sum_{\text{terms}} E_q[\log p(y \mid w, h)]
                    + E_q[\log p(w \mid h)] + \log p(h) + \mathbb H[q(w)],

where the Gaussian prior enters as whitened residuals (an exact, closed-form
"likelihood" term) so that ``E_q[log p(w)] + H[q] = -KL(q || p)``.
:class:`StructuredBound` builds, for given q parameters, the value of the bound
and the per-segment ``g`` and ``H`` of the log joint that every algorithm needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytensor.tensor as pt
from pytensor.gradient import NullTypeGradError
from pytensor.graph.utils import MethodNotDefined
from pytensor.tensor.exceptions import NotScalarConstantError

from pymc_mcssvi.estimators.bilinear import BilinearEstimator
from pymc_mcssvi.estimators.general import GeneralEstimator
from pymc_mcssvi.estimators.predictor import PredictorGeometry
from pymc_mcssvi.estimators.quadrature import (
    expected_derivatives,
    expected_pair_derivatives,
    expected_standard_normal,
)
from pymc_mcssvi.exceptions import UnsupportedModelError
from pymc_mcssvi.families.gaussian import GaussianBlocks, covariance, entropy
from pymc_mcssvi.recognize.graph import evaluate_static
from pymc_mcssvi.recognize.layout import arrow_head

__all__ = ["BoundEvaluation", "StructuredBound"]

#: Gauss-Hermite nodes per predictor of a two-predictor likelihood (their square in all).
PAIR_POINTS = 7
#: Quadrature nodes (at least) for a log density with kinks in its predictor: its
#: expectations come from Stein's lemma on the values, whose quadrature converges
#: more slowly than for a smooth integrand (Laplace: 3% error at 32 nodes).
KINKED_POINTS = 32


@dataclass
class BoundEvaluation:
    """Symbolic outputs of one bound evaluation."""

    value: pt.TensorVariable
    grads: list
    hessians: list
    expected_loglik: pt.TensorVariable
    entropy: pt.TensorVariable
    phase_values: list = None
    crosses: list = None


class StructuredBound:
    """Bound, ``g`` and ``H`` of a :class:`~pymc_mcssvi.recognize.ir.TwoLevelModel`.

    Parameters
    ----------
    tlm : TwoLevelModel
    parameterization : {"precision", "covariance"}
    estimator : {"quadrature", "mc"}
        One-dimensional expectations in predictor space.
    n_points : int
        Gauss-Hermite nodes or MC draws per predictor entry.
    n_draws : int
        Draws of the general (non-affine) estimator.
    fixed_draws : bool
        Reuse the general estimator's draws every iteration.
    seed : int
    bilinear_draws : int or "sigma"
    row_subsample : int, optional
        Matrix factorization: observations per row in each iteration
        (:class:`~pymc_mcssvi.estimators.bilinear.BilinearEstimator`).
    """

    def __init__(
        self,
        tlm,
        parameterization: str = "precision",
        estimator: str = "quadrature",
        n_points: int = 12,
        n_draws: int = 64,
        fixed_draws: bool = True,
        seed: int = 0,
        bilinear_draws=4,
        row_subsample=None,
    ):
        self.tlm = tlm
        self.parameterization = parameterization
        self.estimator = estimator
        self.n_points = n_points
        seg_of = {gid: s for s, seg in enumerate(tlm.segments) for gid in seg.members}

        def geometry(term):
            n_rows = pt.prod(pt.as_tensor(term.eta_shape)) if term.eta_shape else pt.constant(1)
            n_rows = _static_if_constant(pt.cast(n_rows, "int64"))
            return PredictorGeometry(term, tlm.segments, seg_of, n_rows)

        self.geometries = [geometry(term) for term in tlm.predictor_terms]
        #: per two-predictor term: the geometries of eta_1, eta_2 and their sum
        self.pair_geometries = [tuple(geometry(t) for t in p.parts) for p in tlm.pair_terms]
        self.general = GeneralEstimator(tlm, n_draws=n_draws, fixed=fixed_draws, seed=seed)
        affine = [None if t.affine is None else geometry(t.affine) for t in tlm.bilinear_terms]
        self.bilinear = BilinearEstimator(
            tlm,
            seg_of,
            parameterization,
            n_draws=bilinear_draws,
            n_points=n_points,
            seed=seed,
            row_subsample=row_subsample,
            affine_geometries=affine,
        )
        self.arrow_head = arrow_head(tlm)

    def work_estimate(self, local_factor: float = 1.0, linear_algebra: bool = True) -> float:
        """Rough number of floating-point operations of one iteration.

        Used to choose between running the step with Python-level operations
        (no compilation) and compiling it. ``local_factor`` multiplies the
        quadrature work of likelihoods with a marginalized local (their inner
        nodes). ``linear_algebra=False`` leaves out the factorizations of q's
        blocks, which run in LAPACK whatever the backend.
        """
        local_names = {lc.observed for lc in self.tlm.locals}
        total = 0.0
        for term, geom in zip(self.tlm.predictor_terms, self.geometries, strict=True):
            per_row = 0.0 if term.gaussian else 10.0 * self.n_points
            if term.name in local_names:
                per_row *= local_factor
            total += _numeric_size(geom.n_rows) * (per_row + self._design_work(geom))
        for geoms in self.pair_geometries:
            # as a likelihood's 10 per node and graph, for twice the graphs (l, two l',
            # three l''): calibrated as that, the uncompiled step was faster than JAX's
            # below it (5,000-row heteroscedastic GLMM: 5.2 s against 8.6 s) and as fast
            # at 20,000 rows (13 s against 12 s)
            per_row = 2 * 10.0 * PAIR_POINTS**2 + sum(self._design_work(g) for g in geoms)
            total += _numeric_size(geoms[0].n_rows) * per_row
        if self.general.active:
            total += 50.0 * self.general.n_draws * self.general.dim**2
        for (term, su, _), layout in zip(self.bilinear.items, self.bilinear.layouts, strict=True):
            n = _numeric_size(term.left_rows.shape[0])
            if layout is None:
                rows = 2 * n
            else:  # observations per side after per-row subsampling
                B = self.bilinear.row_subsample
                rows = sum(min(n, len(counts) * B) for _, counts, _ in layout)
            K = self.tlm.segments[su].k
            draws = 2 * K if self.bilinear.n_draws == "sigma" else self.bilinear.n_draws
            total += rows * draws * (10.0 * self.bilinear.n_points + 4.0 * K * K)
        if linear_algebra:
            for seg in self.tlm.segments:
                total += 2.0 * seg.rows * seg.k**3
        return total

    def _design_work(self, geom) -> float:
        """Flops per predictor entry of a geometry's moments and derivatives."""
        work = 0.0
        for p in geom.pieces:
            seg = self.tlm.segments[p.segment]
            if p.dense_path:
                work += 4.0 * seg.dim
            elif p.mixed:
                d = sum(len(c) for c, _ in p.dense)
                work += 4.0 * (d * d + 4 * d + 16)
            else:
                work += 4.0 * max(1, seg.k) ** 2
        return work

    def predictor_variances(self, states: list[GaussianBlocks]):
        """Variance under q of each affine predictor entry (one vector per predictor of
        each likelihood term)."""
        covs = [covariance(st, self.parameterization) for st in states]
        means = [st.mean for st in states]
        geoms = self.geometries + self._pair_predictor_geometries()
        return [g.moments(means, covs, g.prepare())[1] for g in geoms]

    def _term_expectations(self, term, mu, var, need_hessian=True, by_node=False):
        """``(T, alpha, beta)`` of a non-Gaussian predictor term (flat ``alpha``, ``beta``)."""
        shape = term.eta_shape
        try:
            T, alpha, beta = expected_derivatives(
                term.logp,
                term.placeholder,
                mu.reshape(shape) if shape else mu[0],
                var.reshape(shape) if shape else var[0],
                method=self.estimator,
                n_points=self.n_points if term.smooth else max(self.n_points, KINKED_POINTS),
                need_hessian=need_hessian,
                derivatives="direct" if term.smooth else "stein",
                by_node=by_node,
            )
        except (MethodNotDefined, NullTypeGradError) as err:
            raise UnsupportedModelError(
                term.name,
                "PyTensor cannot differentiate its log density twice in the predictor "
                f"({type(err).__name__}: {err})",
                "fit this model with pm.sample() or pm.fit(method='advi'), or write the "
                "likelihood with functions PyTensor differentiates",
            ) from err
        return T, alpha.reshape((-1,)), None if beta is None else beta.reshape((-1,))

    def predictor_curvatures(self, states: list[GaussianBlocks]):
        """``E_q[d^2 log p / d f^2]`` per entry of each non-Gaussian affine predictor term.

        Positive entries mark a log density that is not concave in its predictor
        where q puts it (a Student-t residual beyond ``sqrt(nu) sigma``, a normal
        likelihood under a log link below half the observation).
        """
        covs = [covariance(st, self.parameterization) for st in states]
        means = [st.mean for st in states]
        out = []
        for term, geom in zip(self.tlm.predictor_terms, self.geometries, strict=True):
            if not term.gaussian:
                mu, var = geom.moments(means, covs, geom.prepare())
                out.append(self._term_expectations(term, mu, pt.maximum(var, 0.0))[2])
        return out

    def _pair_predictor_geometries(self):
        """The two predictors' geometries of every two-predictor term (not their sum's)."""
        return [g for pair in self.pair_geometries for g in pair[:2]]

    def sensitivities(self, n_segments: int):
        """Per segment, ``sum_i a_i^2`` over the rows of the likelihoods' affine predictors.

        ``a_i`` is a row's coefficient vector on the segment's coordinates (the
        predictor's Jacobian), so each entry is the squared norm of a column of
        that Jacobian: how strongly the data can move with the coordinate,
        whatever the likelihood's curvature. Priors, non-affine and bilinear
        terms are left out. ``(R, K)`` tensors (zeros where nothing enters).
        """
        out = [None] * n_segments
        for term, geom in zip(self.tlm.predictor_terms, self.geometries, strict=True):
            if term.kind == "likelihood":
                out = geom.column_norms(out, geom.prepare())
        for geom in self._pair_predictor_geometries():
            out = geom.column_norms(out, geom.prepare())
        return [
            pt.zeros((seg.rows, seg.k)) if c is None else c
            for c, seg in zip(out, self.tlm.segments, strict=True)
        ]

    def evaluate(
        self,
        states: list[GaussianBlocks],
        need_derivatives: bool = True,
        need_hessian: bool = True,
        phase=None,
        step=None,
        by_node: bool = False,
    ):
        """Build the bound and its natural-gradient ingredients for ``states``.

        ``phase`` (symbolic integer, matrix factorizations only) computes the
        bilinear terms for that phase's factor only (see
        :meth:`BilinearEstimator.expectations`): the other factor's ``g`` and
        ``H`` from those terms are zero and every phase value is that phase's.
        ``step`` (symbolic integer, with ``row_subsample``) numbers the
        evaluation so that the rows' subsample windows advance through their
        observations (:meth:`BilinearEstimator.expectations`). ``by_node`` sums
        one-dimensional quadratures a node at a time (for a JAX step, see
        :func:`~pymc_mcssvi.estimators.quadrature.expected_derivatives`).

        Returns
        -------
        BoundEvaluation
            ``grads[s]`` is ``(R, K)`` and ``hessians[s]`` is ``(R, K, K)`` for
            segment ``s``: expected gradient and Hessian of the log joint
            (likelihood and Gaussian prior), with minibatch scaling applied.
            With an :attr:`arrow_head`, ``crosses[s]`` is the ``(R, K, p)``
            cross block of that Hessian between segment ``s`` and the head
            (``None`` for the head and uncoupled segments; affine predictor
            terms only).
        """
        tlm = self.tlm
        covs = [covariance(st, self.parameterization) for st in states]
        means = [st.mean for st in states]
        nseg = len(states)
        grads, hessians = [None] * nseg, [None] * nseg
        crosses = [None] * nseg
        head = self.arrow_head if (need_derivatives and need_hessian) else None
        expected = pt.constant(0.0)
        for term, geom in zip(tlm.predictor_terms, self.geometries, strict=True):
            designs = geom.prepare()
            mu, var = geom.moments(means, covs, designs)
            var = pt.maximum(var, 0.0)
            if term.gaussian:
                T, alpha, beta = expected_standard_normal(mu, var)
            else:
                T, alpha, beta = self._term_expectations(term, mu, var, need_hessian, by_node)
            expected = expected + pt.sum(T)
            if need_derivatives:
                grads, hessians = geom.accumulate(
                    alpha, beta if need_hessian else None, grads, hessians, designs
                )
                if head is not None:
                    crosses = geom.accumulate_cross(beta, head, crosses, designs)
        for pair, geoms in zip(tlm.pair_terms, self.pair_geometries, strict=True):
            T, grads, hessians, crosses = self._pair(
                pair, geoms, means, covs, grads, hessians, crosses, need_derivatives, need_hessian
            )
            expected = expected + T
        T_gen, g_gen, H_gen = self.general.expectations(states, self.parameterization, need_hessian)
        expected = expected + T_gen
        if need_derivatives:
            grads = [_add(a, b) for a, b in zip(grads, g_gen, strict=True)]
            hessians = [_add(a, b) for a, b in zip(hessians, H_gen, strict=True)]
        T_phase = None
        if self.bilinear.active:
            T_v, T_u, g_bil, H_bil = self.bilinear.expectations(
                states, covs, need_hessian, phase, step=step, by_node=by_node
            )
            T_phase = [T_v, T_u]
            if need_derivatives:
                grads = [_add(a, b) for a, b in zip(grads, g_bil, strict=True)]
                hessians = [_add(a, b) for a, b in zip(hessians, H_bil, strict=True)]
        for c in tlm.constant_terms:
            expected = expected + pt.sum(c.logp)
        ent = pt.sum([entropy(st, self.parameterization) for st in states])
        grads = [
            _zeros_like(st.mean) if g is None else g for g, st in zip(grads, states, strict=True)
        ]
        hessians = [
            _zeros_like(st.factor) if h is None else h
            for h, st in zip(hessians, states, strict=True)
        ]
        if T_phase is None:
            return BoundEvaluation(
                expected + ent, grads, hessians, expected, ent, [expected + ent], crosses
            )
        phase = [expected + ent + T for T in T_phase]
        value = 0.5 * (phase[0] + phase[1])
        return BoundEvaluation(
            value, grads, hessians, expected + 0.5 * (T_phase[0] + T_phase[1]), ent, phase
        )

    def _pair(self, pair, geoms, means, covs, grads, hessians, crosses, derivatives, hessian):
        """A two-predictor term's expected log density, and its ``g``, ``H`` (and arrow
        crosses) added to the lists.

        The predictors' joint Gaussian per entry comes from the moments of ``eta_1``,
        ``eta_2`` and ``eta_1 + eta_2`` (the covariance is half the sum's variance minus
        theirs); with the expected second derivatives ``b_jk`` the Hessian
        ``J_1' b_11 J_1 + J_2' b_22 J_2 + J_1' b_12 J_2 + J_2' b_12 J_1`` is accumulated
        as ``J_1' (b_11 - b_12) J_1 + J_2' (b_22 - b_12) J_2 + (J_1 + J_2)' b_12 (J_1 + J_2)``
        by the three predictors' geometries (polarization): the designs' own paths
        (gathers, dense blocks, the arrow's crosses), nothing formed per pair.
        """
        shape = pair.parts[0].eta_shape
        designs = [g.prepare() for g in geoms]
        (m1, v1), (m2, v2), (_, vs) = [
            g.moments(means, covs, d) for g, d in zip(geoms, designs, strict=True)
        ]
        v1, v2 = pt.maximum(v1, 0.0), pt.maximum(v2, 0.0)
        c = 0.5 * (pt.maximum(vs, 0.0) - v1 - v2)

        def shaped(x):
            return x.reshape(shape) if shape else x[0]

        T, (a1, a2), (b11, b12, b22) = expected_pair_derivatives(
            pair.logp, pair.placeholders, [shaped(x) for x in (m1, v1, m2, v2, c)], PAIR_POINTS
        )
        if not derivatives:
            return pt.sum(T), grads, hessians, crosses
        a1, a2, b11, b12, b22 = (x.reshape((-1,)) for x in (a1, a2, b11, b12, b22))
        betas = (b11 - b12, b22 - b12, b12) if hessian else (None, None, None)
        alphas = (a1, a2, pt.zeros_like(a1))
        head = self.arrow_head if hessian else None
        for geom, d, a, b in zip(geoms, designs, alphas, betas, strict=True):
            grads, hessians = geom.accumulate(a, b, grads, hessians, d)
            if head is not None:
                crosses = geom.accumulate_cross(b, head, crosses, d)
        return pt.sum(T), grads, hessians, crosses

    @property
    def phase_segments(self):
        """Segments each phase of the kernel moves (one phase: all of them)."""
        nseg = len(self.tlm.segments)
        if self.bilinear.active:
            return self.bilinear.phase_segments(nseg)
        return [set(range(nseg))]


def _static_if_constant(n):
    """``n`` as a constant when it does not depend on data that can change (``pm.Data``).

    Graphs shaped by a symbolic row count make PyTensor infer static shapes by
    rewriting clones of them at every ``broadcast_to`` / ``zeros``.
    """
    try:
        return pt.constant(int(pt.get_underlying_scalar_constant_value(n)), dtype="int64")
    except NotScalarConstantError:
        return n


def _zeros_like(x):
    """Zeros of ``x``'s shape, from its static shape when known: a symbolic shape makes
    PyTensor infer the static one by rewriting a clone of the whole graph behind ``x``
    (0.27 s for the states of the hyperparameters' profile, which follow a bound evaluation)."""
    shape = x.type.shape
    return pt.zeros(shape if None not in shape else x.shape, dtype=x.dtype)


def _add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def _numeric_size(n) -> float:
    """Value of a symbolic size (only used to pick a backend)."""
    try:
        return float(evaluate_static([n])[0])
    except Exception:
        return 1e4  # unknown: a medium-sized guess
