"""The choice of backend for a fit's step and its compilation.

``backend=None`` runs small steps with Python-level (NumPy) operations, whose
set-up is cheap, and compiles large ones (JAX when installed, numba otherwise):
:func:`choose_backend`. :func:`compile_step` builds the step's graph from the
kernel's pure step function over the fit's shared state and compiles it; the
wrappers below give every backend the same interface (a call returns the
:class:`~pymc_mcssvi.algorithms.state.StepInfo`, ``maker`` is the compiled
function's).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import time
import warnings

import numpy as np
from pymc.pytensorf import compile as pm_compile
from pymc.pytensorf import resolve_backend_compile_kwargs
from pytensor.compile.mode import Mode, get_mode
from pytensor.graph.rewriting.basic import in2out

from pymc_mcssvi.algorithms.hyperparameters import unbatch_constant_split
from pymc_mcssvi.algorithms.state import StepInfo
from pymc_mcssvi.backend.modes import (
    graph_building,
    per_element_ops,
    python_few_calls_mode,
    python_step_mode,
    without_structure_rewrites,
)
from pymc_mcssvi.estimators.quadrature import softplus_of_nonpositive
from pymc_mcssvi.families.gaussian import broadcast_products_as_matmul

__all__ = [
    "BLAS_THREADS_BLOCK",
    "BLAS_THREADS_WORK",
    "blas_threads_for",
    "COMPILE_WORK_THRESHOLD",
    "JAX_FALLBACK_COMPILE_WORK",
    "NUMBA_COMPILE_WORK_THRESHOLD",
    "UPGRADE_AT",
    "StepFunction",
    "choose_backend",
    "compile_step",
    "fallback_backend",
    "jax_available",
    "named_backend_kwargs",
]

logger = logging.getLogger("pymc_mcssvi")

#: Below this many estimated flops per iteration BLAS runs on one thread.
BLAS_THREADS_WORK = 5e8
#: ... and below this dimension of q's largest block: several BLAS threads pay only for
#: single calls of a few hundred dimensions (a block's factorization). Batched small
#: products and thin matrices are slower with them: a 252-coordinate topic model's step
#: took 0.49 s on one OpenBLAS thread and 5.5 s on two, a 20,000 x 500 logistic
#: regression's 0.52 s and 1.08 s (2-core machine, other work running).
BLAS_THREADS_BLOCK = 256
#: Estimated flops per iteration (without the blocks' factorizations) above which
#: ``backend=None`` compiles the step with JAX: from there JAX's 2.5-6x faster iterations
#: repay its 4-8 s of set-up within about 17 iterations (docs/benchmarks.md).
COMPILE_WORK_THRESHOLD = 4e7
#: The same threshold without JAX (a cold numba compilation costs 40-190 s).
NUMBA_COMPILE_WORK_THRESHOLD = 1e8
#: When JAX cannot run an automatically chosen step: uncompiled below this many
#: estimated flops per iteration, numba above.
JAX_FALLBACK_COMPILE_WORK = 1e9
#: Iterations a ``"python"`` step runs compiled with merging only before it is
#: recompiled with the full rewrites (the break-even of the two, see :class:`UpgradingStep`).
UPGRADE_AT = 120
#: Seconds of iterations after which an automatically chosen ``"python"`` step is
#: replaced by a JAX one (when JAX is installed): about JAX's compilation time, so a
#: fit that turns out long pays at most about twice the better choice (the ski-rental
#: rule of :class:`UpgradingStep`, on measured time). The flop estimate behind
#: :func:`choose_backend` misses element-wise work: a 300 x 50 horseshoe regression
#: (120 sigma points of its 52 hyperparameter coordinates) took 0.37 s an iteration
#: uncompiled and 0.12 s with JAX, 52 s against 22 s for its 137 iterations.
JAX_SWITCH_SECONDS = 5.0
#: ... when its iterations take this long on average: below it an uncompiled iteration
#: is mostly the Python VM's per-node overhead and small LAPACK calls, which JAX does
#: not make much faster (a 60 x 40 factorization, 0.056 s an iteration: 11.9 s for its
#: 134 iterations uncompiled, 13.8 s with JAX from the start, 22 s with a switch after
#: 5 s); above it, element-wise work over large arrays that JAX fuses.
JAX_SWITCH_ITERATION_SECONDS = 0.2


@functools.cache
def jax_available() -> bool:
    """Whether JAX is installed (the automatic backend of large steps)."""
    return importlib.util.find_spec("jax") is not None


def choose_backend(work_without_linear_algebra: float) -> str:
    """The backend of ``backend=None`` for a step of this much per-observation work.

    The work leaves out the factorizations of q's blocks: they run in LAPACK whatever
    the backend, and compiling buys the fusion of the per-observation work only.
    Above :data:`COMPILE_WORK_THRESHOLD` estimated flops per iteration the step is
    compiled with JAX when it is installed (4-7x sooner than numba, and 1.1-1.8x
    faster per iteration on CPU); without JAX with numba above
    :data:`NUMBA_COMPILE_WORK_THRESHOLD`; else it runs uncompiled (``"python"``).

    Examples
    --------
    >>> choose_backend(1e3)
    'python'
    """
    if jax_available():
        return "jax" if work_without_linear_algebra > COMPILE_WORK_THRESHOLD else "python"
    return "numba" if work_without_linear_algebra > NUMBA_COMPILE_WORK_THRESHOLD else "python"


def blas_threads_for(work: float, largest_block: int, load=None, cpus=None) -> int | None:
    """BLAS threads of a fit with ``blas_threads=None``: 1, or ``None`` (BLAS's own
    choice, every core).

    Several threads are left to BLAS only when one iteration is large (at least
    :data:`BLAS_THREADS_WORK` estimated flops), q has a block of
    :data:`BLAS_THREADS_BLOCK` or more dimensions (single LAPACK calls large enough to
    share), and a core is idle: a 1-minute ``load`` average (default
    :func:`os.getloadavg`) at most ``cpus - 1`` (default :func:`os.cpu_count`).
    Otherwise OpenBLAS's threads spin against each other or against other work for
    small calls, which cost 2-10x per iteration in measurements on 2 cores.

    Examples
    --------
    >>> blas_threads_for(1e10, 2, load=0.0, cpus=2)  # many small blocks: one thread
    1
    >>> blas_threads_for(1e10, 1000, load=0.0, cpus=2) is None  # a large block, idle cores
    True
    >>> blas_threads_for(1e10, 1000, load=3.0, cpus=2)  # the cores are busy
    1
    """
    if work < BLAS_THREADS_WORK or largest_block < BLAS_THREADS_BLOCK:
        return 1
    cpus = (os.cpu_count() or 1) if cpus is None else cpus
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # not available on this platform
            load = 0.0
    return None if load <= cpus - 1 else 1


def fallback_backend(work: float) -> str:
    """Backend used when JAX cannot run an automatically chosen step: uncompiled below
    :data:`JAX_FALLBACK_COMPILE_WORK` estimated flops per iteration (a cold numba
    compilation costs about a minute), numba above."""
    return "python" if work < JAX_FALLBACK_COMPILE_WORK else "numba"


def named_backend_kwargs(backend, compile_kwargs):
    """``compile_kwargs`` with the mode of a backend given by name, without PyTensor's
    matrix-structure rewrites (:func:`~pymc_mcssvi.backend.modes.without_structure_rewrites`:
    the step's matrices are dense by construction, and asking PyTensor's assumption
    system about them costs seconds of rewriting for nothing). A mode passed in
    ``compile_kwargs`` is used as given."""
    ck = resolve_backend_compile_kwargs(backend, compile_kwargs)
    if backend is not None and isinstance(ck.get("mode"), Mode):
        ck["mode"] = without_structure_rewrites(ck["mode"])
    return ck


def jax_step_mode(mode=None) -> Mode:
    """The JAX step's mode: PyTensor's JAX mode with the plugin's rewrites: stacked
    products of small blocks as batched dots, static split positions (the gradients of
    joins batched over sigma points), and a softplus of a non-positive argument as
    ``log1p(exp(.))`` (PyTensor's JAX softplus evaluates all its branches)."""
    return get_mode(mode if mode is not None else "JAX").register(
        (in2out(broadcast_products_as_matmul), 0.5),
        (in2out(unbatch_constant_split), 59),
        (in2out(softplus_of_nonpositive), 59.1),
    )


class StepFunction:
    """A compiled step: calling it runs one iteration and returns its
    :class:`~pymc_mcssvi.algorithms.state.StepInfo`; ``maker`` is the compiled
    function's (for inspection)."""

    def __init__(self, fn):
        self.fn = fn

    @property
    def maker(self):
        return self.fn.maker

    def __call__(self) -> StepInfo:
        return StepInfo._make(self.fn())


class UpgradingStep(StepFunction):
    """A ``"python"`` step compiled cheaply first, fully once the fit runs long.

    PyTensor's canonicalization of a step graph (800-1,300 nodes) costs 1.2-2.5 s
    more than merging alone and makes each iteration 1.3-1.4x cheaper, so it pays
    for itself after 117-143 iterations, while most full-batch fits of small and
    medium models end sooner. This step runs its first :data:`UPGRADE_AT`
    iterations compiled with merging only and then recompiles with the full
    rewrites: at most about twice the better choice's cost whatever the fit's
    length (the ski-rental rule, with the switch near the break-even). The switch
    depends on the iteration count only, so fits stay reproducible. ``fit(n=...)``
    upgrades at once when ``n`` reaches past :data:`UPGRADE_AT`, and so does a
    cheap function that would evaluate an element-wise op one element at a time
    (:func:`~pymc_mcssvi.backend.modes.per_element_ops`). Both functions update the
    same shared state; the second is compiled without reseeding the random
    generators, so the draws continue.

    With ``switch`` (a function of a fallback step that compiles the JAX step), the
    time of the iterations after the first is summed, and once it passes
    :data:`JAX_SWITCH_SECONDS` at more than :data:`JAX_SWITCH_ITERATION_SECONDS` an
    iteration, the rest of the fit runs ``switch``'s step: the same
    graph over the same shared state, so the fit goes on where it was (up to
    rounding, and a JAX step's own copies of the random generators). That switch
    depends on measured time: pass ``backend=`` to ``fit`` for a fixed backend.
    """

    def __init__(self, compile_fn, switch=None):
        self._compile = compile_fn
        self._fn = None
        self.calls = 0
        self.upgraded = False
        self.switch = switch
        self.switched = None
        self.elapsed = 0.0

    @property
    def fn(self):
        return self.compile()

    def compile(self):
        """The current function, compiled (merging only) on first use."""
        if self._fn is None:
            self._fn = self._compile(full=False)
            if per_element_ops(self._fn.maker.fgraph):
                # an element-wise op without a NumPy ufunc that only the full rewrites
                # remove would be evaluated one element at a time
                self._fn = self._compile(full=True, reseed=False)
                self.upgraded = True
        return self._fn

    def __call__(self) -> StepInfo:
        if self.switched is not None:
            return self.switched()
        if not self.upgraded and self.calls >= UPGRADE_AT:
            self.upgrade()
        self.calls += 1
        start = time.perf_counter()
        out = StepInfo._make(self.fn())
        if self.switch is not None and self.calls > 1:  # the first call compiles
            self.elapsed += time.perf_counter() - start
            slow = self.elapsed > JAX_SWITCH_ITERATION_SECONDS * (self.calls - 1)
            if self.elapsed > JAX_SWITCH_SECONDS and slow:
                switch, self.switch = self.switch, None
                handed = switch(self._python_step)
                self.switched = None if handed is self else handed
        return out

    def _python_step(self, err) -> StepFunction:
        """This step, uncompiled from now on (the fallback of a failed hand-over: its
        calls go on counting towards :data:`UPGRADE_AT`)."""
        logger.info(f"JAX cannot run this step ({type(err).__name__}); staying uncompiled")
        self.switched = None
        return self

    def upgrade(self):
        """Switch to the fully rewritten function now (not needed once the step has
        handed over to JAX)."""
        if not self.upgraded and self.switched is None:
            self._fn = self._compile(full=True, reseed=self._fn is None)
            self.upgraded = True


class HostStateStep(StepFunction):
    """A JAX-compiled step that leaves NumPy arrays in the shared state.

    PyTensor's JAX backend stores JAX arrays in the shared variables it updates;
    every other function of the fit (sampling, local posteriors, ``approx.mean.eval()``)
    runs on the Python/C backends, whose SciPy calls need NumPy arrays. The state is
    ``O(blocks x K^2)``, so the copy is small next to the step.
    """

    def __init__(self, fn, store):
        super().__init__(fn)
        self.store = store

    def __call__(self) -> StepInfo:
        out = self.fn()
        self.store.to_host()
        return StepInfo._make(np.asarray(o) for o in out)


class TracedOnFirstCall(StepFunction):
    """An automatically chosen JAX step that falls back when JAX cannot trace it.

    PyTensor's JAX functions are traced on their first call, so an operation JAX
    cannot handle with the step's shapes (e.g. a ``Split`` whose sizes are not
    constants) fails there, not at compilation. Then the step is replaced by
    ``fallback(error)`` (logged at INFO level by the caller).
    """

    def __init__(self, step: HostStateStep, fallback):
        self.step = step
        self.fallback = fallback
        self.traced = False

    @property
    def fn(self):
        return self.step.fn

    def __call__(self) -> StepInfo:
        if self.traced:
            return self.step()
        try:
            out = self.step()
        except (KeyboardInterrupt, StopIteration):
            raise
        except Exception as err:  # JAX tracing errors have no common base class
            self.step.store.to_host()
            self.step = self.fallback(err)
            out = self.step()
        self.traced = True
        return out


def is_jax_mode(backend, compile_kwargs) -> bool:
    """Whether a step compiled with these arguments runs on JAX."""
    mode = (
        named_backend_kwargs(backend, compile_kwargs).get("mode") if backend != "python" else None
    )
    return backend == "jax" or (
        isinstance(mode, Mode) and type(mode.linker).__name__ == "JAXLinker"
    )


def compile_step(
    kernel, store, model, backend, compile_kwargs, random_seed, switch=None, external=None
) -> StepFunction:
    """Compile ``kernel``'s step over the shared state ``store`` for ``backend``
    (``external``: the :class:`~pymc_mcssvi.algorithms.kernel.ExternalPart` of terms
    whose statistics the caller computes, e.g. over a Dask array's chunks).

    ``backend="python"`` gives an :class:`UpgradingStep` (the plugin's own Python
    modes; ``switch``: see there), JAX a :class:`HostStateStep`, numba and C a plain
    :class:`StepFunction`.
    """
    compile_kwargs = dict(compile_kwargs or {})
    ck = named_backend_kwargs(backend, compile_kwargs) if backend != "python" else {}
    jax = is_jax_mode(backend, compile_kwargs)
    # a scan that reduces chunked terms runs its body in the step's own backend (the
    # Python backend's: the Python VM with the plugin's rewrites, not C thunks)
    inner = python_step_mode() if backend == "python" else None
    # quadratures node by node help XLA where whole arrays of observations would stream
    # through memory; a chunked step's arrays are a chunk's, and the node-by-node form
    # costs compilation time and memory
    by_node = jax and not kernel.chunk_plan()
    with graph_building():
        new_state, info = kernel.step(
            store.symbolic, by_node=by_node, inner_mode=inner, external=external
        )
        outputs, updates = list(info), store.updates(new_state)
    if backend == "python":

        def compile_python(full, reseed=True):
            mode = python_step_mode() if full else python_few_calls_mode()
            # an upgrade keeps the generators' state: no reseeding (``False``)
            seed = random_seed if reseed else False
            with model, warnings.catch_warnings():
                warnings.filterwarnings("ignore", "The RandomType SharedVariables")
                return pm_compile(
                    [],
                    outputs,
                    updates=updates,
                    random_seed=seed,
                    **{**compile_kwargs, "mode": mode},
                )

        step = UpgradingStep(compile_python, switch)
        if kernel.chunk_plan():
            # the cheap first compilation (merging only) would keep every chunk's
            # accumulator of the reducing scans: the full rewrites from the start
            step.upgrade()
        return step
    if jax:
        ck["mode"] = jax_step_mode(ck.get("mode"))
    with model, warnings.catch_warnings():
        # JAX steps draw from copies of their generators (Monte Carlo draws): expected.
        warnings.filterwarnings("ignore", "The RandomType SharedVariables", UserWarning)
        fn = pm_compile([], outputs, updates=updates, random_seed=random_seed, **ck)
    return HostStateStep(fn, store) if jax else StepFunction(fn)
