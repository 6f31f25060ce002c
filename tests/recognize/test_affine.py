"""Affine predictor analysis: every recognized form must reproduce the expression."""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
import scipy.sparse as sp
from pytensor.sparse import as_sparse_variable
from pytensor.sparse import math as ps_math

from pymc_mcssvi.recognize.affine import linearize

N, D, G, K = 7, 3, 4, 2
_R = np.random.default_rng(2)
#: Fixed matrices of the solve and chained-product cases (a sparse GP's K_uu, ...).
M1, M2 = _R.normal(size=(D, D)), _R.normal(size=(D, D))
SPD = M1 @ M1.T + D * np.eye(D)
CHOL = np.linalg.cholesky(SPD)


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(N, D))
    g = rng.integers(0, G, N)
    x = rng.normal(size=N)
    w = pt.vector("w", shape=(D,))
    b = pt.scalar("b")
    A = pt.matrix("A", shape=(G, K))
    a = pt.vector("a", shape=(G,))
    order = [w, b, A, a]
    vals = [rng.normal(size=D), np.array(0.7), rng.normal(size=(G, K)), rng.normal(size=G)]
    return X, g, x, order, vals


def _cases(X, g, x, w, b, A, a):
    return {
        "matmul": (X @ w, True),
        "dot_plus_intercept": (pt.dot(X, w) + b, True),
        "sum_product": ((X * w).sum(-1), True),
        "gather_plus_dense": (a[g] + X @ w, True),
        "random_slope": (A[g, 0] + A[g, 1] * x, True),
        "rowwise_sum": ((A[g] * X[:, :2]).sum(-1), True),
        "negation_division": (-(X @ w) / 2.0 - b, True),
        "stack": (X[:, :2] @ pt.stack([b, a[0]]), True),
        "concatenate": (X @ pt.concatenate([w[:2], A[0, :1]]), True),
        "matrix_product_gather": ((X[:, :2] @ A.T)[np.arange(N), g], True),
        "scalar": (b * 3.0, True),
        "broadcast": (pt.zeros(N) + b, True),
        "einsum": (pt.einsum("nk,nk->n", A[g], X[:, :2]), True),
        "reshape_gather": (A.reshape((G * K,))[g * 2 + 1], True),
        "vector_matrix": (w @ X.T, True),
        "switch_on_data": (pt.switch(x < 0, b * x, A[g, 0] * x + 1.0), True),
        "switch_on_data_matrix": (pt.switch(X[:, 0] > 0.3, X @ w, -b), True),
        "solve": (X @ pt.linalg.solve(SPD, w, assume_a="pos"), True),
        "solve_triangular": (X @ pt.linalg.solve_triangular(CHOL, w, lower=True), True),
        "cho_solve": (X @ pt.linalg.cho_solve((CHOL, True), w), True),
        "solve_matrix_rhs": (pt.linalg.solve(SPD[:K, :K], A.T).sum(0)[g], True),
        "chained_products": (X @ (M1 @ (M2 @ w)), True),
        "chained_products_right": (((w @ M1) @ M2) @ X.T, True),
        "solve_by_global_not_affine": (pt.linalg.solve(SPD + pt.diag(w), X[:D, 0]), False),
        "set_slice": (X @ pt.zeros(D)[1:].set(a[: D - 1]), True),
        "set_advanced": (X @ pt.zeros(D)[[2, 0]].set(A[1]), True),
        "set_over_global": (X @ pt.set_subtensor(w[1:], a[:2] * 2.0 - 1.0), True),
        "inc_advanced_unique": (X @ pt.inc_subtensor(w[[0, 2]], a[:2]), True),
        "set_lower_triangle": (
            (X @ pt.zeros((D, D))[np.tril_indices(D)].set(a[:2].repeat(3))).sum(-1),
            True,
        ),
        "set_with_offsets": (pt.set_subtensor((X @ w + 1.0)[:2], b * 2.0 + 3.0), True),
        "inc_repeated_positions_not_affine": (
            X @ pt.inc_subtensor(pt.zeros(D)[[0, 0]], a[:2]),
            False,
        ),
        "switch_on_global_not_affine": (pt.switch(b > 0, X @ w, -(X @ w)), False),
        "exp_not_affine": (pt.exp(X @ w), False),
        "bilinear_not_affine": ((A[g] * A[g]).sum(-1), False),
        "product_not_affine": (b * w[0], False),
        # offsets with a length-one axis, summed or contracted over that axis
        "sum_of_broadcast_offset": (pt.sum(x[:, None] + X * w, axis=1), True),
        "sum_axis0_of_broadcast_offset": ((x[None, :] + (X * w).T).sum(0), True),
        "sum_keepdims_of_broadcast_offset": (
            pt.sum(x[:, None] + X * w, axis=1, keepdims=True)[:, 0],
            True,
        ),
        "dot_with_constant_offset": (X @ (0.5 + 0.3 * w), True),
        "dot_with_constant_offset_left": ((w * 0.3 + 0.5) @ X.T, True),
        "dot_with_gathered_offset": (X[:, :2] @ (x[:1] + A[g[0]]), True),
        "cumsum_of_constant_offset": (X @ pt.cumsum(w + 1.0), True),
        # a nonzero integer condition selects the first branch (not a weight g)
        "switch_on_integer_condition": (pt.switch(g, b * x, A[g, 0] - 1.0), True),
        "sparse_structured_dot": (
            ps_math.structured_dot(as_sparse_variable(sp.csr_matrix(X)), w[:, None])[:, 0],
            True,
        ),
        "stack_of_row_pieces": (
            pt.stack([X[i] @ w + b - w[0] * x[i] for i in range(N)] + [b * 2.0, a[1] + 1.0]),
            True,
        ),
        "concatenate_mixed_sources": (
            pt.concatenate([X[:2] @ w, a[g[:3]] + b, pt.zeros(2), A[g[:2], 1] * x[:2]]),
            True,
        ),
        "sparse_dot_on_the_right": (
            ps_math.dot(w[None, :], as_sparse_variable(sp.csr_matrix(X.T)))[0],
            True,
        ),
    }


CASES = [
    "matmul",
    "dot_plus_intercept",
    "sum_product",
    "gather_plus_dense",
    "random_slope",
    "rowwise_sum",
    "negation_division",
    "stack",
    "concatenate",
    "matrix_product_gather",
    "scalar",
    "broadcast",
    "einsum",
    "reshape_gather",
    "vector_matrix",
    "switch_on_data",
    "switch_on_data_matrix",
    "solve",
    "solve_triangular",
    "cho_solve",
    "solve_matrix_rhs",
    "chained_products",
    "chained_products_right",
    "solve_by_global_not_affine",
    "set_slice",
    "set_advanced",
    "set_over_global",
    "inc_advanced_unique",
    "set_lower_triangle",
    "set_with_offsets",
    "inc_repeated_positions_not_affine",
    "switch_on_global_not_affine",
    "exp_not_affine",
    "bilinear_not_affine",
    "product_not_affine",
    "sum_of_broadcast_offset",
    "sum_axis0_of_broadcast_offset",
    "sum_keepdims_of_broadcast_offset",
    "dot_with_constant_offset",
    "dot_with_constant_offset_left",
    "dot_with_gathered_offset",
    "cumsum_of_constant_offset",
    "switch_on_integer_condition",
    "sparse_structured_dot",
    "sparse_dot_on_the_right",
    "stack_of_row_pieces",
    "concatenate_mixed_sources",
]


@pytest.mark.parametrize("name", CASES)
def test_linearize_reproduces_expression(setup, name):
    X, g, x, order, vals = setup
    w, b, A, a = order
    expr, affine = _cases(X, g, x, w, b, A, a)[name]
    form = linearize(expr, {v: i for i, v in enumerate(order)})
    if not affine:
        assert form is None
        return
    assert form is not None
    total = 0.0 if form.offset is None else form.offset
    for t in form.terms:
        contrib = order[t.source].ravel()[t.cols] * (1.0 if t.vals is None else t.vals)
        total = total + contrib.sum(-1)
    fn = pytensor.function(order, [expr, pt.as_tensor(total)], on_unused_input="ignore")
    want, got = fn(*vals)
    np.testing.assert_allclose(got, np.broadcast_to(want, np.shape(got)), rtol=1e-12, atol=1e-12)


def test_dense_and_gather_terms_are_classified(setup):
    X, g, x, order, vals = setup
    w, b, A, a = order
    form = linearize(a[g] + X @ w + b, {v: i for i, v in enumerate(order)})
    kinds = {t.source: t.is_dense for t in form.terms}
    assert kinds == {0: True, 1: True, 3: False}


@pytest.mark.parametrize("name", ["chained_products", "chained_products_right", "solve"])
def test_chained_dense_products_keep_one_contraction(setup, name):
    """``A @ (B @ w)`` is ``(A @ B) @ w``: the term reads ``w`` through its ``D``
    columns, not through ``D`` per product (``D**3`` for a sparse GP's projection)."""
    X, g, x, order, vals = setup
    w, b, A, a = order
    expr, _ = _cases(X, g, x, w, b, A, a)[name]
    (term,) = linearize(expr, {v: i for i, v in enumerate(order)}).terms
    assert term.is_dense
    assert pytensor.function([], term.cols.shape[-1])() == D
