"""Data in Dask arrays (``mc.dask_data``): the data terms summed over the chunks.

The fit on Dask data must be the fit on the same data in memory: same bound, same q
(the sums differ in their order of addition only), whatever the scheduler (threads,
a ``distributed`` cluster, one of whose workers is killed mid-fit) and whatever the
source (a Dask array in memory, a Zarr store on disk).
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pymc as pm
import pytensor
import pytest

import pymc_mcssvi as mc

da = pytest.importorskip("dask.array")

N, P, G, C = 2300, 3, 12, 500


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(7)
    X = rng.normal(size=(N, P))
    g = rng.integers(0, G, N)
    u = 0.7 * rng.normal(size=G)
    y = rng.binomial(1, 1 / (1 + np.exp(-(X @ np.array([0.5, -1.0, 0.2]) + u[g]))))
    return X, g, y


def _model(X, g, y, wrap):
    """A random-intercept logistic regression whose three arrays come from ``wrap``."""
    with pm.Model() as model:
        Xd, gd, yd = wrap("X", X), wrap("g", g), wrap("y", y)
        w = pm.Normal("w", 0, 1, shape=P)
        s = pm.HalfNormal("s", 1)
        z = pm.Normal("z", 0, 1, shape=G)
        pm.Bernoulli("obs", logit_p=Xd @ w + s * z[gd], observed=yd)
    return model


def _glm(X, g, y, wrap):
    """A logistic regression (no hyperparameters: the cheaper fit)."""
    with pm.Model() as model:
        Xd, yd = wrap("X", X), wrap("y", y)
        w = pm.Normal("w", 0, 1, shape=P)
        pm.Bernoulli("obs", logit_p=Xd @ w, observed=yd)
    return model


def _in_memory(name, a):
    return pm.Data(name, a, shape=a.shape)


def _dask(name, a):
    return mc.dask_data(name, da.from_array(a, chunks=(C, *a.shape[1:])))


def _fit(model, **kw):
    # q(h)'s post-fit profile needs the whole data (skipped with Dask data)
    return pm.fit(method="hmcssvi", model=model, progressbar=False, hyper_marginal="gaussian", **kw)


def _reference(model):
    approx = _fit(model, chunk_size=C)
    return approx.hist, approx.mean.eval(), approx.std.eval()


@pytest.fixture(scope="module")
def reference(data):
    """The random-intercept fit on the data in memory, reduced in chunks of the same
    length."""
    return _reference(_model(*data, _in_memory))


@pytest.fixture(scope="module")
def glm_reference(data):
    """The logistic regression's fit on the data in memory."""
    return _reference(_glm(*data, _in_memory))


def _same_fit(approx, reference):
    hist, mean, std = reference
    assert len(approx.hist) == len(hist)
    np.testing.assert_allclose(approx.hist, hist, rtol=1e-9)
    np.testing.assert_allclose(approx.mean.eval(), mean, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(approx.std.eval(), std, rtol=1e-7, atol=1e-9)


def test_threads_give_the_in_memory_fit(data, reference):
    """N = 2,300 rows in chunks of 500: the last chunk is padded (weight 0)."""
    model = _model(*data, _dask)
    assert model["X"].get_value().shape == (C, P)  # the model holds the first chunk
    approx = _fit(model)
    _same_fit(approx, reference)
    assert approx.inference._dask.n_chunks == 5
    assert approx.inference._dask.terms == ("obs",)
    idata = approx.sample(50, random_seed=1)
    assert np.isfinite(idata.posterior["s"].values).all()


def test_zarr_store_on_disk(data, glm_reference, tmp_path):
    zarr = pytest.importorskip("zarr")
    arrays = {}
    for name, a in zip("Xy", data[::2], strict=True):
        z = zarr.open_array(
            str(tmp_path / f"{name}.zarr"),
            mode="w",
            shape=a.shape,
            chunks=(C, *a.shape[1:]),
            dtype=a.dtype,
        )
        z[...] = a
        arrays[name] = zarr.open_array(str(tmp_path / f"{name}.zarr"), mode="r")
    model = _glm(*data, lambda name, a: mc.dask_data(name, arrays[name]))
    _same_fit(_fit(model), glm_reference)


def test_rows_are_rechunked_to_the_first_arrays(data, glm_reference):
    X, _, y = data
    with pm.Model() as model:
        Xd = mc.dask_data("X", da.from_array(X, chunks=(C, 1)))  # columns: one chunk
        yd = mc.dask_data("y", da.from_array(y, chunks=250))  # rows: X's chunks
        w = pm.Normal("w", 0, 1, shape=P)
        pm.Bernoulli("obs", logit_p=Xd @ w, observed=yd)
    assert model["y"].get_value().shape == (C,)
    _same_fit(_fit(model), glm_reference)


def test_errors_name_the_data(data):
    X, g, y = data
    with pm.Model():
        with pytest.raises(TypeError, match="'X'.*dask.array"):
            mc.dask_data("X", X)
        with pytest.raises(ValueError, match="scalar"):
            mc.dask_data("c", da.from_array(np.float64(1.0)))
    with pm.Model():
        mc.dask_data("X", da.from_array(X, chunks=(C, P)))
        with pytest.raises(ValueError, match="'y' has 2299 rows where 'X' has 2300"):
            mc.dask_data("y", da.from_array(y[:-1], chunks=C))
    with pm.Model() as model:
        Xd = mc.dask_data("X", da.from_array(X, chunks=((200, 800, 800, 500), (P,))))
        yd = mc.dask_data("y", da.from_array(y, chunks=C))
        w = pm.Normal("w", 0, 1, shape=P)
        pm.Bernoulli("obs", logit_p=Xd @ w, observed=yd)
    with pytest.raises(ValueError, match=r"rechunk\(\{0: 800\}\)"):
        mc.HMCSSVI(model=model)
    with pm.Model() as model:
        Xd = mc.dask_data("X", da.from_array(X, chunks=(C, P)))
        yd = mc.dask_data("y", da.from_array(y, chunks=C))
        w = pm.Normal("w", 0, 1, shape=P)
        pm.Bernoulli("obs", logit_p=Xd @ w, observed=yd)
    with pytest.raises(ValueError, match="diagnose=True"):
        pm.fit(method="hmcssvi", model=model, diagnose=True, progressbar=False)


@pytest.mark.slow
def test_a_cluster_with_a_worker_killed_mid_fit(data, glm_reference):
    """The same fit on ``LocalCluster(n_workers=2)``: one worker's process is killed
    after the second iteration; Dask recomputes its chunks and the fit is unchanged."""
    distributed = pytest.importorskip("distributed")
    model = _glm(*data, _dask)
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        killed = []

        pids = client.run(os.getpid)

        def kill_one(approx, losses, i):
            if i == 2:
                victim = sorted(pids)[0]
                os.kill(pids[victim], signal.SIGKILL)
                killed.append(victim)

        approx = _fit(model, callbacks=[kill_one])
        assert killed
    _same_fit(approx, glm_reference)


def test_dask_batch_reads_a_few_chunks_and_lands_on_the_full_fit(data, glm_reference):
    """``dask_batch=2`` of the 5 chunks: each iteration reads 2 chunks (counted on
    the array), the stochastic steps come near the full-batch q and the full-data
    steps after them (``polish``) land on it."""
    X, _, y = data
    reads = []

    def counted(block):
        reads.append(block.shape[0])
        return block

    Xc = da.from_array(X, chunks=(C, P)).map_blocks(counted, dtype=X.dtype)
    with pm.Model() as model:
        Xd = mc.dask_data("X", Xc)
        yd = mc.dask_data("y", da.from_array(y, chunks=C))
        w = pm.Normal("w", 0, 1, shape=P)
        pm.Bernoulli("obs", logit_p=Xd @ w, observed=yd)
    _, mean, std = glm_reference
    reads.clear()
    rough = pm.fit(
        20, method="hmcssvi", model=model, progressbar=False, dask_batch=2, random_seed=3, tol=None
    )
    assert len(reads) == 2 * 20
    assert np.all(np.abs(rough.mean.eval() - mean) < 1.0 * std)
    polished = pm.fit(method="hmcssvi", model=model, progressbar=False, dask_batch=2, random_seed=3)
    np.testing.assert_allclose(polished.mean.eval(), mean, atol=1e-3 * std.min())
    np.testing.assert_allclose(polished.std.eval(), std, rtol=1e-3)
    with pytest.raises(ValueError, match="dask_batch applies to data in Dask arrays"):
        pm.fit(method="hmcssvi", model=_glm(*data, _in_memory), dask_batch=2)


def test_chunks_on_jax(data, glm_reference):
    """``backend="jax"``: the chunks' function is compiled with JAX (the step on their
    sums too); the same fit."""
    pytest.importorskip("jax")
    mode = pytensor.config.mode
    approx = _fit(_glm(*data, _dask), backend="jax")
    assert approx.inference._dask.chunk.backend == "jax"
    _same_fit(approx, glm_reference)
    # two worker threads compiling at once could leave PyTensor's global mode at
    # JAX's (its rewriting sets it): then .eval() returned JAX arrays
    assert pytensor.config.mode == mode
    assert type(approx.mean.eval()) is np.ndarray


def test_an_interrupt_keeps_the_last_state_and_the_fit_resumes(data, glm_reference):
    """Ctrl-C while the chunks of the fourth iteration are computed: the fit returns
    with the three accepted iterations, and ``fit()`` again goes on from there to
    the uninterrupted fit."""
    X, _, y = data
    reads = []

    def interrupting(block):
        reads.append(1)
        if len(reads) == 1 + 5 * 3 + 2:  # the first chunk (dask_data), 3 iterations, 2 more
            raise KeyboardInterrupt
        return block

    with pm.Model() as model:
        Xd = mc.dask_data(
            "X", da.from_array(X, chunks=(C, P)).map_blocks(interrupting, dtype=X.dtype)
        )
        yd = mc.dask_data("y", da.from_array(y, chunks=C))
        w = pm.Normal("w", 0, 1, shape=P)
        pm.Bernoulli("obs", logit_p=Xd @ w, observed=yd)
    inference = mc.HMCSSVI(model=model, hyper_marginal="gaussian")
    stopped = inference.fit(progressbar=False)
    assert len(stopped.hist) == 3
    np.testing.assert_allclose(stopped.hist, glm_reference[0][:3], rtol=1e-9)
    _same_fit(inference.fit(progressbar=False), glm_reference)
