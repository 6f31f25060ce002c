"""Evaluation of data graphs at recognition (:mod:`pymc_mcssvi.recognize.graph`)."""

import numpy as np
import pytensor
import pytensor.tensor as pt

from pymc_mcssvi.recognize.graph import evaluate_static, perform_constant_graph


def test_constant_graphs_are_evaluated_node_by_node_as_a_compiled_function_would(rng):
    """The flat positions of a row gather, arithmetic and a shared value: the same
    values as a compiled function, without compiling one."""
    rows = rng.integers(0, 7, 50)
    positions = pt.as_tensor(np.arange(21).reshape(7, 3, 1))
    data = pytensor.shared(rng.normal(size=50))
    exprs = [positions[pt.as_tensor(rows)], pt.exp(data) * 2 + rows, pt.as_tensor(rows).shape[0]]
    got = perform_constant_graph(exprs)
    want = pytensor.function([], exprs)()
    assert got is not None
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(evaluate_static(exprs)[0], want[0])


def test_graphs_with_free_inputs_are_left_to_compilation():
    x = pt.vector("x")
    assert perform_constant_graph([x * 2]) is None
