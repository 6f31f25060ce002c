"""First-order ascent rules (:mod:`pymc_mcssvi.algorithms.optimizers`).

Checks
------
* ``Optimizer.update`` of ``"sgd"``, ``"adagrad"`` and ``"adam"`` against a NumPy
  re-implementation over several steps (state carried from step to step, the
  learning rate times the kernel's ``scale``, Adam's bias correction by ``t``);
* ``init`` (state shapes and dtype) and ``restart`` (Adam drops its first
  moment only, the others keep their state);
* that adagrad and adam steps increase a concave quadratic (ascent convention);
* the validation errors and :func:`make_optimizer` with a name, a
  ``(name, lr)`` pair and an instance.
"""

import numpy as np
import pytensor.tensor as pt
import pytest

from pymc_mcssvi.algorithms.optimizers import Optimizer, make_optimizer


def numpy_update(opt, grad, state, scale, t):
    """Reference implementation of one step: ``(delta, new_state)``."""
    lr = opt.lr * scale
    if opt.kind == "sgd":
        return lr * grad, ()
    if opt.kind == "adagrad":
        acc = state[0] + grad**2
        return lr * grad / (np.sqrt(acc) + opt.eps), (acc,)
    m, v = state
    m = opt.beta1 * m + (1 - opt.beta1) * grad
    v = opt.beta2 * v + (1 - opt.beta2) * grad**2
    t = max(float(t), 1.0)
    mhat = m / (1 - opt.beta1**t)
    vhat = v / (1 - opt.beta2**t)
    return lr * mhat / (np.sqrt(vhat) + opt.eps), (m, v)


def symbolic_update(opt, grad, state, scale, t):
    """``opt.update`` on constant inputs, evaluated."""
    delta, new = opt.update(
        pt.as_tensor(grad), tuple(pt.as_tensor(s) for s in state), scale, pt.as_tensor(float(t))
    )
    return delta.eval(), tuple(np.asarray(s.eval()) for s in new)


OPTIMIZERS = [
    Optimizer("sgd", lr=0.3),
    Optimizer("adagrad", lr=0.7),
    Optimizer("adam", lr=0.05),
    Optimizer("adam", lr=0.2, beta1=0.5, beta2=0.9, eps=1e-3),
]


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=["sgd", "adagrad", "adam", "adam-custom"])
def test_update_matches_numpy_over_several_steps(opt, rng):
    shape = (3, 2)
    state_sym = opt.init(np.zeros(shape))
    state_ref = tuple(s.copy() for s in state_sym)
    scales = [1.0, 0.5, 0.5, 0.75, 1.0, 0.25]
    for t, scale in enumerate(scales, start=1):
        g = rng.normal(size=shape) * (1.0 + t)  # gradients of changing size
        delta, state_sym = symbolic_update(opt, g, state_sym, scale, t)
        delta_ref, state_ref = numpy_update(opt, g, state_ref, scale, t)
        np.testing.assert_allclose(delta, delta_ref, rtol=1e-12, atol=1e-15)
        assert len(state_sym) == len(state_ref)
        for a, b in zip(state_sym, state_ref, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)


def test_sgd_is_lr_times_scale_times_grad():
    opt = Optimizer("sgd", lr=0.5)
    delta, state = symbolic_update(opt, np.array([2.0, -4.0]), (), 0.25, 3)
    np.testing.assert_array_equal(delta, [0.25, -0.5])
    assert state == ()


def test_adagrad_first_step_is_lr_times_sign():
    # acc = g^2 after one step, so the step is lr * g / |g| (up to eps).
    opt = Optimizer("adagrad", lr=0.4)
    g = np.array([3.0, -0.01, 250.0])
    delta, (acc,) = symbolic_update(opt, g, opt.init(g), 1.0, 1)
    np.testing.assert_allclose(delta, 0.4 * np.sign(g), rtol=1e-6)
    np.testing.assert_allclose(acc, g**2, rtol=1e-15)


def test_adam_bias_correction_first_step():
    # With bias correction the first step is lr * g / (|g| + eps) for any beta1, beta2;
    # without it the step would be (1 - beta1) / sqrt(1 - beta2) ~ 3.2 times that.
    opt = Optimizer("adam", lr=0.1)
    g = np.array([0.5, -2.0])
    delta, (m, v) = symbolic_update(opt, g, opt.init(g), 1.0, 1)
    np.testing.assert_allclose(delta, 0.1 * np.sign(g), rtol=1e-7)
    np.testing.assert_allclose(m, 0.1 * g, rtol=1e-14)
    np.testing.assert_allclose(v, 0.001 * g**2, rtol=1e-12)


def test_adam_t_below_one_is_treated_as_one():
    opt = Optimizer("adam", lr=0.1)
    g = np.array([0.5, -2.0])
    at_one, _ = symbolic_update(opt, g, opt.init(g), 1.0, 1)
    at_zero, _ = symbolic_update(opt, g, opt.init(g), 1.0, 0)
    np.testing.assert_allclose(at_zero, at_one, rtol=1e-14)
    assert np.all(np.isfinite(at_zero))


def test_init_shapes_and_dtype():
    value = np.arange(6, dtype="int64").reshape(2, 3)
    assert Optimizer("sgd").init(value) == ()
    (acc,) = Optimizer("adagrad").init(value)
    assert acc.shape == (2, 3) and acc.dtype == np.float64 and not acc.any()
    m, v = Optimizer("adam").init(value)
    assert m.shape == v.shape == (2, 3)
    assert m.dtype == v.dtype == np.float64
    assert not m.any() and not v.any()
    m[0, 0] = 1.0  # separate arrays: the two moments do not alias
    assert v[0, 0] == 0.0
    (scalar,) = Optimizer("adagrad").init(np.float64(2.0))
    assert scalar.shape == ()


def test_restart_drops_adam_momentum_only():
    m0, v0 = np.array([0.3, -1.0]), np.array([2.0, 5.0])
    m, v = Optimizer("adam").restart((pt.as_tensor(m0), pt.as_tensor(v0)))
    np.testing.assert_array_equal(m.eval(), [0.0, 0.0])
    np.testing.assert_array_equal(v.eval(), v0)
    acc = (pt.as_tensor(v0),)
    (kept,) = Optimizer("adagrad").restart(acc)
    np.testing.assert_array_equal(kept.eval(), v0)
    assert Optimizer("sgd").restart(()) == ()


def test_restarted_adam_step_follows_the_gradient():
    # A momentum pointing away from the gradient: after restart the step has the
    # gradient's sign in every coordinate.
    opt = Optimizer("adam", lr=0.1)
    g = np.array([1.0, -1.0, 0.5])
    state = (pt.as_tensor(-5.0 * g), pt.as_tensor(np.full(3, 0.01)))
    stale, _ = opt.update(pt.as_tensor(g), state, 1.0, 4)
    fresh, _ = opt.update(pt.as_tensor(g), opt.restart(state), 1.0, 4)
    assert np.all(np.sign(stale.eval()) == -np.sign(g))
    assert np.all(np.sign(fresh.eval()) == np.sign(g))


@pytest.mark.parametrize(
    "opt", [Optimizer("adagrad", lr=0.3), Optimizer("adam", lr=0.05)], ids=["adagrad", "adam"]
)
def test_steps_increase_a_concave_quadratic(opt):
    A = np.array([[2.0, 0.5], [0.5, 1.0]])
    c = np.array([1.0, -2.0])

    def f(x):
        return -0.5 * (x - c) @ A @ (x - c)

    x = np.array([3.0, 1.0])
    state = opt.init(x)
    values = [f(x)]
    for t in range(1, 26):
        grad = -A @ (x - c)
        delta, state = symbolic_update(opt, grad, state, 1.0, t)
        x = x + delta
        values.append(f(x))
    assert np.all(np.diff(values) > 0), values
    # and they make progress towards the maximum at c (f(c) = 0)
    assert values[-1] > 0.5 * values[0]


def test_validation_errors():
    with pytest.raises(ValueError, match="optimizer must be 'adagrad', 'adam' or 'sgd'"):
        Optimizer("rmsprop")
    for lr in (0.0, -0.1):
        with pytest.raises(ValueError, match="learning rate must be positive"):
            Optimizer("adam", lr=lr)


def test_make_optimizer():
    opt = make_optimizer("adam", 0.3)
    assert opt == Optimizer("adam", lr=0.3)
    opt = make_optimizer(("sgd", 2), 0.3)  # the pair's rate wins over the default
    assert opt.kind == "sgd" and opt.lr == 2.0 and isinstance(opt.lr, float)
    given = Optimizer("adagrad", lr=0.9, eps=1e-4)
    assert make_optimizer(given, 0.1) is given
    with pytest.raises(ValueError, match="optimizer must be"):
        make_optimizer("lbfgs", 1.0)
    with pytest.raises(ValueError, match="learning rate must be positive"):
        make_optimizer(("adam", -1.0), 1.0)
