"""Stacked Cholesky factorizations and inverses of many small blocks, on every backend."""

import warnings

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

from pymc_mcssvi.families.batched import _StackedLinalg, stacked_cholesky, stacked_inverse


@pytest.fixture
def blocks():
    """Five 3 x 3 blocks, the third not positive definite."""
    A = np.random.default_rng(0).normal(size=(5, 3, 3))
    P = A @ A.transpose(0, 2, 1) + np.eye(3)
    P[2] = -np.eye(3)
    return P


@pytest.mark.parametrize("mode", ["FAST_COMPILE", "NUMBA"])
def test_stacked_ops_on_the_python_vm_and_numba(blocks, mode):
    """The Python VM runs the stacked op; numba gets PyTensor's batched ops instead of
    running the op's ``perform`` in object mode (which warned, also on a user's
    ``approx.std.eval()``). Both give NaN for a block that is not positive definite."""
    x = pt.tensor3("x")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "Numba will use object mode")
        fn = pytensor.function([x], [stacked_cholesky(x), stacked_inverse(x)], mode=mode)
    stacked = [isinstance(n.op, _StackedLinalg) for n in fn.maker.fgraph.apply_nodes]
    assert any(stacked) == (mode == "FAST_COMPILE")
    L, inv = fn(blocks)
    good = [0, 1, 3, 4]
    assert np.isnan(L[2]).all()
    np.testing.assert_allclose(L[good], np.linalg.cholesky(blocks[good]), rtol=1e-12)
    np.testing.assert_allclose(inv, np.linalg.inv(blocks), rtol=1e-10)


@pytest.mark.parametrize("mode", ["FAST_COMPILE", "NUMBA", "JAX"])
def test_stacked_lower_inverse_is_a_triangular_solve_when_compiled(mode):
    """``L^{-1}`` of lower-triangular blocks: NumPy's stacked inverse on the Python VM; in
    the compiled backends one triangular solve, not a general inverse (an LU factorization
    and two solves in JAX)."""
    if mode == "JAX":
        pytest.importorskip("jax")
    from pytensor.tensor.slinalg import SolveTriangular

    from pymc_mcssvi.families.batched import stacked_lower_inverse

    rng = np.random.default_rng(1)
    L = np.tril(rng.normal(size=(6, 4, 4))) + 3.0 * np.eye(4)
    x = pt.tensor3("x")
    fn = pytensor.function([x], stacked_lower_inverse(x), mode=mode)
    ops = [getattr(n.op, "core_op", n.op) for n in fn.maker.fgraph.apply_nodes]
    assert any(isinstance(op, SolveTriangular) for op in ops) == (mode != "FAST_COMPILE")
    assert not any(type(op).__name__ == "MatrixInverse" for op in ops)
    np.testing.assert_allclose(fn(L), np.linalg.inv(L), rtol=1e-10, atol=1e-14)
