"""The one fit loop of the three algorithms: iterations, stopping rule, callbacks,
progress bar and divergence handling.

:func:`run` calls a compiled step (:mod:`~pymc_mcssvi.backend.compile`) until the
stopping rule says the bound has converged or ``n`` iterations are done (with
``tol=None``, exactly ``n``). A :class:`Rejections` tracker restarts a start whose bound cannot be
evaluated (narrower, then jittered; :mod:`~pymc_mcssvi.pymc.start`) and raises
:class:`~pymc_mcssvi.exceptions.DivergenceError` after :data:`MAX_REJECTIONS`
rejected candidates in a row, with the last accepted state kept.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
from pymc.progress_bar import CustomProgress
from rich.console import Console
from rich.progress import Progress, TextColumn

from pymc_mcssvi.exceptions import DivergenceError
from pymc_mcssvi.pymc.start import (
    MAX_START_JITTERS,
    MAX_START_SHRINKS,
    jitter_start,
    shrink_start,
    start_diagnosis,
)

__all__ = [
    "MAX_REJECTIONS",
    "PER_OBSERVATION_GAIN",
    "PER_OBSERVATION_MIN",
    "STOCHASTIC_MEAN_TOL",
    "STOCHASTIC_WINDOW",
    "LoopResult",
    "Rejections",
    "converged_full_batch",
    "converged_per_observation",
    "converged_stochastic",
    "run",
    "start_not_finite",
]

logger = logging.getLogger("pymc_mcssvi")

#: Consecutive rejected steps after which the fit is declared divergent.
MAX_REJECTIONS = 40
#: Iterations per window of the stochastic stopping rule (bound averages compared
#: between the last two windows; ``pm.Minibatch`` fits: the averaged q's means too).
STOCHASTIC_WINDOW = 50
#: ``pm.Minibatch`` fits stop only when the iterate average's means moved by at most
#: this many of its sds (root mean square over the coordinates) in the last window.
STOCHASTIC_MEAN_TOL = 0.1
#: Iterations of the full-batch rule's window (each gain within ``tol``).
FULL_BATCH_WINDOW = 3
#: Matrix factorizations (``tol="auto"``, full batch): also converged when each gain of
#: the window is at most this many nats per observation. Their bound creeps on for
#: hundreds of iterations (slow modes of the factors, near-symmetries of ``U V^T``)
#: after the predictions have settled: 1000 x 1000 binary, K = 20: held-out NLL
#: 0.2960 -> 0.2959 from iteration 16 to 56, while the bound still gained 1,340 nats
#: (gains per observation 3e-4 per iteration at 16, 2e-6 at 56; 1e-4 at iteration 23).
PER_OBSERVATION_GAIN = 1e-4
#: ... for factorizations of at least this many observations (iterations of seconds).
#: Smaller ones converge to the relative rule as before: on a few hundred ratings the
#: per-observation rule stopped while slow modes still moved the predictions (a 15 x 12
#: matrix: probabilities 0.07 off the converged fit; learned bias scales 30% off).
PER_OBSERVATION_MIN = 20_000


def converged_full_batch(scores, gains, tol) -> bool:
    """In each of the last :data:`FULL_BATCH_WINDOW` iterations the candidate's bound
    differed from the current one by at most ``tol * (|ELBO| + 10)``, whether the step
    was accepted (it gained little) or rejected (it would have lost little: the
    remaining difference is at the level of quadrature error).

    Examples
    --------
    >>> converged_full_batch(np.array([10.0, 9.0, 9.0, 9.0, 9.0]), [1.0, 1e-9, 0.0, -1e-9], 1e-7)
    True
    """
    if len(scores) == 0:
        return False
    # the absolute part (1e-6 at the default tol) scales with tol, so that a smaller
    # tol is honoured near ELBO = 0 and for tight checks (tol=1e-12)
    return _gains_within(scores, gains, tol * (abs(scores[-1]) + 10.0))


def converged_per_observation(scores, gains, n_observations) -> bool:
    """In each of the last :data:`FULL_BATCH_WINDOW` iterations the candidate's bound
    differed from the current one by at most :data:`PER_OBSERVATION_GAIN` nats per
    observation (the stopping rule of full-batch matrix factorizations, beside
    :func:`converged_full_batch`).

    Examples
    --------
    >>> converged_per_observation(np.array([9.0, 8.0, 7.9, 7.8, 7.7]), [1.0, 0.1, 0.1, 0.1], 10_000)
    True
    """
    return _gains_within(scores, gains, PER_OBSERVATION_GAIN * n_observations)


def _gains_within(scores, gains, limit) -> bool:
    """The last :data:`FULL_BATCH_WINDOW` gains are within ``limit`` (in absolute value)
    and the bounds around them finite: the window test of the full-batch rules."""
    k = FULL_BATCH_WINDOW
    if len(scores) <= k or not np.all(np.isfinite(scores[-k - 1 :])):
        return False
    return all(abs(g) <= limit for g in gains[-k:])


def converged_stochastic(scores, tol, locations=None) -> bool:
    """The averages of the last two windows of :data:`STOCHASTIC_WINDOW` iterations
    differ by at most ``tol`` (relative), and, for fits that return the iterates'
    average (``locations``: the average's ``(means, sds)`` at the end of the last two
    windows), the average's means moved by at most :data:`STOCHASTIC_MEAN_TOL` of its
    sds (root mean square) in the last window."""
    w = STOCHASTIC_WINDOW
    if len(scores) < 2 * w:
        return False
    a, b = np.mean(scores[-w:]), np.mean(scores[-2 * w : -w])
    if abs(a - b) > tol * abs(b):
        return False
    if locations is None:
        return True
    if len(locations) < 2:
        return False
    (m0, _), (m1, sd1) = locations
    return float(np.sqrt(np.mean(((m1 - m0) / sd1) ** 2))) <= STOCHASTIC_MEAN_TOL


def start_not_finite(model, cand_bound, approx, iteration, tried: str = "") -> DivergenceError:
    """The error of a fit whose bound was never finite: where the observed variables'
    log densities are not finite at the initial point (data outside the likelihood's
    support, e.g. a negative count), and what to check."""
    what = (
        f"The ELBO's derivatives are not finite at the starting point (the ELBO is, {cand_bound})"
        if np.isfinite(cand_bound)
        else f"The ELBO is not finite at the starting point ({cand_bound})"
    )
    return DivergenceError(
        f"{what},{tried}. "
        f"{start_diagnosis(model)}Check the observed data against the likelihood's "
        "support, the `start` values, and expressions whose derivatives are not "
        "finite where q puts mass (x ** 0 at x = 0, sqrt(x) at 0); a smaller "
        "`start_sigma` can help.",
        approx=approx,
        iteration=iteration,
    )


class Rejections:
    """Counts rejected candidates, restarts a start whose bound is not finite and
    declares divergence.

    While no step has been accepted and the candidate's bound is not finite, the
    start is narrowed (:func:`~pymc_mcssvi.pymc.start.shrink_start`, up to
    :data:`~pymc_mcssvi.pymc.start.MAX_START_SHRINKS` times) and then jittered
    (:func:`~pymc_mcssvi.pymc.start.jitter_start`); after :data:`MAX_REJECTIONS`
    rejections in a row :meth:`track` raises
    :class:`~pymc_mcssvi.exceptions.DivergenceError` with the candidate reset to the
    last accepted state.
    """

    def __init__(self, kernel, store, model, random_seed):
        self.kernel = kernel
        self.store = store
        self.model = model
        self.random_seed = random_seed
        self.count = 0
        self.shrinks = 0
        self.jitters = 0

    def track(self, accepted: bool, cand_bound: float, iteration: int, approx) -> None:
        base = float(self.store.symbolic.bound.get_value())
        if not accepted and not np.isfinite(base):
            if self.shrinks < MAX_START_SHRINKS:
                self.shrinks += 1
                self.count = 0
                self.store.set(shrink_start(self.kernel, self.store.get(), 10.0))
                logger.info(
                    "The bound or its derivatives are not finite at the start (%s); starting "
                    "again with q's sd %gx smaller.",
                    cand_bound,
                    10.0**self.shrinks,
                )
                return
            if self.jitters < MAX_START_JITTERS:
                seed = self.random_seed if isinstance(self.random_seed, int | np.integer) else 0
                rng = np.random.default_rng([int(seed) % 2**32, self.jitters])
                self.jitters += 1
                self.count = 0
                self.store.set(jitter_start(self.kernel, self.store.get(), rng))
                logger.info(
                    "The bound or its derivatives are not finite at the start (%s); starting "
                    "again from jittered means.",
                    cand_bound,
                )
                return
        self.count = 0 if accepted else self.count + 1
        if self.count < MAX_REJECTIONS:
            return
        self.store.set(self.kernel.reset_candidate(self.store.get()))
        self.count = 0
        if not np.isfinite(base):
            raise start_not_finite(
                self.model,
                cand_bound,
                approx,
                iteration,
                " nor with a narrower q or at jittered starts",
            )
        raise DivergenceError(
            f"The fit diverged at iteration {iteration}: {MAX_REJECTIONS} consecutive steps gave a "
            f"non-finite or lower ELBO (last candidate: {cand_bound}). The approximation keeps the "
            f"last good state (ELBO {base:,.6g}); it is available as `error.approx`. Try a smaller "
            "`rho0`, or `schedule='power'`.",
            approx=approx,
            iteration=iteration,
        )


@dataclass
class LoopResult:
    """The iterations of one call of :func:`run`: their negative bounds (``scores``),
    whether the stopping rule stopped the loop, and the divergence that ended it, if
    any (raised by the caller once the iterations are recorded)."""

    scores: np.ndarray
    converged: bool = False
    error: DivergenceError | None = None
    iterations: int = field(default=0)


def run(
    step,
    *,
    total: int,
    auto_stop: bool,
    stop_rule,
    current_bound,
    after_step,
    callbacks,
    approx,
    start_iter: int,
    progressbar: bool,
    progressbar_theme,
) -> LoopResult:
    """Iterate ``step`` up to ``total`` times.

    Parameters
    ----------
    step : callable
        One iteration, returning a :class:`~pymc_mcssvi.algorithms.state.StepInfo`.
    auto_stop : bool
        Stop when ``stop_rule(scores, gains)`` is true.
    current_bound : callable
        The accepted state's bound before the iteration (for the gains).
    after_step : callable
        ``after_step(info, iteration)`` after each iteration (iterate averaging, the
        rejection tracker); may raise ``DivergenceError``.
    callbacks : list of callable
        PyMC's ``callback(approx, losses, i)``; ``StopIteration`` ends the fit.
    start_iter : int
        Iterations of earlier calls (the callbacks' count continues).
    """
    scores = np.full(total, np.nan)
    gains: list[float] = []
    result = LoopResult(scores)
    i = 0
    with CustomProgress(
        *Progress.get_default_columns(),
        TextColumn("{task.fields[loss]}"),
        console=Console(theme=progressbar_theme),
        disable=not progressbar,
    ) as progress:
        task = progress.add_task("Fitting", total=total, loss="")
        try:
            for i in range(total):
                prev = float(current_bound())
                info = step()
                scores[i] = -float(info.bound)
                cand = float(info.candidate_bound)
                gains.append(cand - prev if np.isfinite(prev) else np.inf)
                after_step(info, start_iter + i)
                progress.update(task, advance=1)
                if i % 5 == 0 or i == total - 1:
                    progress.update(
                        task, loss=f"-ELBO = {scores[i]:,.6g}  rho = {float(info.rho):.3g}"
                    )
                for cb in callbacks:
                    cb(approx, scores[: i + 1], start_iter + i + 1)
                if auto_stop and stop_rule(scores[: i + 1], gains):
                    result.converged = True
                    progress.update(task, total=i + 1, completed=i + 1)
                    i += 1
                    break
            else:
                i = total
        except StopIteration as e:
            logger.info(str(e))
            i += 1
        except KeyboardInterrupt:
            pass
        except DivergenceError as err:
            result.error = err
            i += 1
    result.scores = scores[:i]
    result.iterations = i
    return result
