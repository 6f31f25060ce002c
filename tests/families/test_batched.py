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
