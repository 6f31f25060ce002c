"""Cholesky factorizations and lower-triangular inverses of many small blocks, on every
backend: PyTensor's own batched ops in the graphs (native in numba and JAX), one stacked
NumPy call on the Python backend."""

import warnings

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.tensor.slinalg import SolveTriangular

from pymc_mcssvi.backend.modes import python_few_calls_mode, python_step_mode
from pymc_mcssvi.families.batched import _StackedLinalg
from pymc_mcssvi.families.gaussian import GaussianBlocks, cholesky, covariance

MODES = {
    "python_step": python_step_mode,
    "python_few_calls": python_few_calls_mode,
    "NUMBA": lambda: "NUMBA",
    "JAX": lambda: "JAX",
}


@pytest.fixture
def blocks():
    """Five 4 x 4 blocks, the third not positive definite."""
    A = np.random.default_rng(0).normal(size=(5, 4, 4))
    P = A @ A.transpose(0, 2, 1) + np.eye(4)
    P[2] = -np.eye(4)
    return P


@pytest.mark.parametrize("mode", ["python_step", "python_few_calls", "NUMBA"])
def test_block_cholesky_on_the_python_vm_and_numba(blocks, mode):
    """The Python backend's modes run one stacked call; numba compiles PyTensor's batched
    op natively (no object mode, which warned, also on a user's ``approx.std.eval()``).
    Both give NaN for a block that is not positive definite."""
    x = pt.tensor3("x", shape=(None, 4, 4))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "Numba will use object mode")
        fn = pytensor.function([x], cholesky(x), mode=MODES[mode]())
    stacked = [isinstance(n.op, _StackedLinalg) for n in fn.maker.fgraph.apply_nodes]
    assert any(stacked) == mode.startswith("python")
    L = fn(blocks)
    good = [0, 1, 3, 4]
    assert np.isnan(L[2]).all()
    np.testing.assert_allclose(L[good], np.linalg.cholesky(blocks[good]), rtol=1e-12)


@pytest.mark.parametrize("mode", ["python_step", "NUMBA", "JAX"])
def test_block_covariance_is_a_triangular_solve_when_compiled(mode):
    """``S = L^{-T} L^{-1}`` from the precision's factor: NumPy's stacked inverse of the
    triangular blocks on the Python VM; in the compiled backends one triangular solve,
    not a general inverse (an LU factorization and two solves in JAX)."""
    if mode == "JAX":
        pytest.importorskip("jax")
    rng = np.random.default_rng(1)
    L = np.tril(rng.normal(size=(6, 4, 4))) + 3.0 * np.eye(4)
    x = pt.tensor3("x", shape=(None, 4, 4))
    S = covariance(GaussianBlocks(None, x), "precision")
    fn = pytensor.function([x], S, mode=MODES[mode]())
    ops = [getattr(n.op, "core_op", n.op) for n in fn.maker.fgraph.apply_nodes]
    assert any(isinstance(op, SolveTriangular) for op in ops) == (mode != "python_step")
    assert any(isinstance(op, _StackedLinalg) for op in ops) == (mode == "python_step")
    assert not any(type(op).__name__ == "MatrixInverse" for op in ops)
    expected = np.linalg.inv(L @ L.transpose(0, 2, 1))
    np.testing.assert_allclose(fn(L), expected, rtol=1e-10, atol=1e-13)
