"""Step-size schedules (:mod:`pymc_mcssvi.algorithms.schedules`).

Checks
------
* ``Schedule.base(t)`` of each kind against its formula (``"adaptive"``: 1,
  ``"inverse"``: ``rho0 / t``, ``"power"``: ``rho0 (t + tau)^-kappa``,
  ``"constant"``: ``rho0``), with ``t`` floored at 1;
* ``initial_scale`` and ``next_scale`` (growth capped at ``rho_max`` for the
  adaptive schedule and at 1 otherwise, shrinking on a rejection), the symbolic
  results evaluated with ``.eval()``;
* ``monotone`` and the validation errors;
* :func:`make_schedule`: ``"auto"`` / ``None`` by ``minibatch``, a number as a
  constant schedule, overrides, and a :class:`Schedule` passed through.
"""

import numpy as np
import pytensor.tensor as pt
import pytest

from pymc_mcssvi.algorithms.schedules import Schedule, make_schedule

T = np.array([1.0, 2.0, 3.0, 7.5, 100.0])


def _base(schedule, t):
    return float(schedule.base(pt.as_tensor(np.float64(t))).eval())


@pytest.mark.parametrize(
    ("schedule", "formula"),
    [
        (Schedule("adaptive", rho0=0.3), lambda t: 1.0),
        (Schedule("inverse", rho0=0.8), lambda t: 0.8 / t),
        (Schedule("power", rho0=2.0, tau=4.0, kappa=0.6), lambda t: 2.0 * (t + 4.0) ** -0.6),
        (Schedule("power", rho0=0.5, tau=1.0, kappa=1.0), lambda t: 0.5 / (t + 1.0)),
        (Schedule("constant", rho0=0.25), lambda t: 0.25),
    ],
    ids=["adaptive", "inverse", "power", "power-kappa1", "constant"],
)
def test_base_matches_formula(schedule, formula):
    for t in T:
        np.testing.assert_allclose(_base(schedule, t), formula(t), rtol=1e-13)


@pytest.mark.parametrize(
    ("schedule", "at_one"),
    [
        (Schedule("inverse", rho0=0.8), 0.8),
        (Schedule("power", rho0=2.0, tau=4.0, kappa=0.6), 2.0 * 5.0**-0.6),
    ],
    ids=["inverse", "power"],
)
def test_t_below_one_is_floored_at_one(schedule, at_one):
    # t = 0 (no accepted step yet) and fractional t use the value at t = 1, not rho0 / 0.
    for t in (0.0, 0.25, -3.0):
        np.testing.assert_allclose(_base(schedule, t), at_one, rtol=1e-13)


def test_base_takes_an_integer_and_a_symbolic_t():
    s = Schedule("inverse", rho0=3.0)
    np.testing.assert_allclose(float(s.base(4).eval()), 0.75, rtol=1e-14)
    t = pt.scalar("t", dtype="float64")
    f = s.base(t)
    np.testing.assert_allclose(f.eval({t: 6.0}), 0.5, rtol=1e-14)
    np.testing.assert_allclose(f.eval({t: 0.5}), 3.0, rtol=1e-14)


def test_initial_scale():
    # The adaptive schedule's multiplier starts at rho0, the decreasing ones at 1.
    assert Schedule("adaptive", rho0=0.4).initial_scale() == 0.4
    assert Schedule("adaptive").initial_scale() == 1.0
    for kind in ("inverse", "power", "constant"):
        assert Schedule(kind, rho0=0.4).initial_scale() == 1.0


def _next(schedule, scale, accepted):
    scale, accepted = pt.as_tensor(np.float64(scale)), pt.as_tensor(np.array(accepted))
    return float(schedule.next_scale(scale, accepted).eval())


def test_next_scale_adaptive_grows_up_to_rho_max_and_shrinks_on_rejection():
    s = Schedule("adaptive", grow=2.0, shrink=0.25, rho_max=3.0)
    assert _next(s, 0.5, True) == 1.0  # 0.5 * 2
    assert _next(s, 1.0, True) == 2.0  # above 1: the cap is rho_max, not 1
    assert _next(s, 2.0, True) == 3.0  # 4 capped at 3
    assert _next(s, 3.0, True) == 3.0
    assert _next(s, 2.0, False) == 0.5  # 2 * 0.25
    assert _next(s, 3.0, False) == 0.75


@pytest.mark.parametrize("kind", ["inverse", "power", "constant"])
def test_next_scale_decreasing_schedules_cap_at_one(kind):
    s = Schedule(kind, grow=1.5, shrink=0.5, rho_max=4.0)
    assert _next(s, 0.5, True) == 0.75
    assert _next(s, 0.8, True) == 1.0  # 1.2 capped at 1 (rho_max is the adaptive cap)
    assert _next(s, 1.0, False) == 0.5
    assert _next(s, 0.5, False) == 0.25


def test_next_scale_symbolic_accept_flag():
    s = Schedule("adaptive", grow=1.5, shrink=0.5, rho_max=1.0)
    scale = pt.scalar("scale", dtype="float64")
    acc = pt.scalar("acc", dtype="int8")
    out = s.next_scale(scale, acc)
    assert float(out.eval({scale: 0.4, acc: 1})) == pytest.approx(0.6, rel=1e-14)
    assert float(out.eval({scale: 0.4, acc: 0})) == pytest.approx(0.2, rel=1e-14)


def test_backoff_then_recovery_sequence():
    # Three rejections then accepted steps: 1 -> 1/8 -> grows by 1.5 back to the cap of 1.
    s = Schedule("constant", rho0=0.9)
    scale, seen = s.initial_scale(), []
    for acc in [False, False, False, True, True, True, True, True, True]:
        scale = _next(s, scale, acc)
        seen.append(scale)
    want = [0.5, 0.25, 0.125, 0.1875, 0.28125, 0.421875, 0.6328125, 0.94921875, 1.0]
    np.testing.assert_allclose(seen, want, rtol=1e-14)


def test_monotone_only_for_adaptive():
    assert Schedule("adaptive").monotone
    for kind in ("inverse", "power", "constant"):
        assert not Schedule(kind).monotone


def test_validation_errors():
    with pytest.raises(ValueError, match="schedule must be one of"):
        Schedule("cosine")
    for rho0 in (0.0, -1.0):
        with pytest.raises(ValueError, match="rho0 must be positive"):
            Schedule("constant", rho0=rho0)
    for kappa in (0.0, -0.5, 1.2):
        with pytest.raises(ValueError, match=r"kappa must be in \(0, 1\]"):
            Schedule("power", kappa=kappa)
    # kappa = 1 is allowed, and kappa only matters for "power"
    assert Schedule("power", kappa=1.0).kappa == 1.0
    assert Schedule("inverse", kappa=2.0).kind == "inverse"


def test_make_schedule_auto():
    assert make_schedule("auto", minibatch=False) == Schedule("adaptive")
    assert make_schedule("auto", minibatch=True) == Schedule("power")
    assert make_schedule(None, minibatch=True).kind == "power"
    assert make_schedule(None, minibatch=False).kind == "adaptive"
    # overrides reach the resolved schedule
    s = make_schedule("auto", minibatch=True, rho0=0.5, tau=10.0, kappa=0.9)
    assert (s.kind, s.rho0, s.tau, s.kappa) == ("power", 0.5, 10.0, 0.9)
    np.testing.assert_allclose(_base(s, 2.0), 0.5 * 12.0**-0.9, rtol=1e-13)


def test_make_schedule_number_is_constant():
    for value in (0.3, 2):
        s = make_schedule(value, minibatch=False)
        assert s.kind == "constant"
        assert s.rho0 == float(value)
        np.testing.assert_allclose(_base(s, 17.0), float(value), rtol=0)
    with pytest.raises(ValueError, match="rho0 must be positive"):
        make_schedule(0.0, minibatch=False)


def test_make_schedule_named_and_passthrough():
    assert make_schedule("inverse", minibatch=True, rho0=2.0) == Schedule("inverse", rho0=2.0)
    given = Schedule("power", rho0=0.7, tau=3.0, kappa=0.55)
    # an instance is returned unchanged, whatever minibatch and the overrides say
    assert make_schedule(given, minibatch=False, rho0=5.0) is given
    with pytest.raises(ValueError, match="schedule must be one of"):
        make_schedule("cosine", minibatch=False)
