"""The matrix-factorization builder, its offline loaders and bad input."""

import numpy as np
import pymc as pm
import pytensor.tensor as pt
import pytest
from pymc.pytensorf import compile

import pymc_mcssvi
from pymc_mcssvi.bounds.structured import StructuredBound
from pymc_mcssvi.families.gaussian import GaussianBlocks
from pymc_mcssvi.models import load_insteval, load_reuters_counts, pmf

R, C, K = 6, 5, 2


def _entries(rng, n=30):
    return rng.integers(0, R, n), rng.integers(0, C, n), rng.integers(0, 2, n)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (dict(rows=np.array([0, 1, R])), "rows must lie in [0, 6)"),
        (dict(cols=np.array([0, -1, 2])), "cols must lie in [0, 5)"),
        (dict(rows=np.array([0.0, 1.0, 2.0])), "rows must be integer indices"),
        (dict(rank=C + 1), "rank must be between 1 and min(n_rows, n_cols) = 5"),
        (dict(likelihood="ordinal", y=np.array([0, 1, 7]), n_levels=5), "ordinal ratings"),
        (dict(likelihood="cauchy"), "likelihood must be one of"),
    ],
    ids=["row-too-large", "negative-col", "float-rows", "rank", "ordinal-level", "likelihood"],
)
def test_builder_rejects_bad_input(change, fragment):
    args = dict(
        rows=np.array([0, 1, 2]),
        cols=np.array([0, 1, 2]),
        y=np.array([0, 1, 1]),
        n_rows=R,
        n_cols=C,
        rank=K,
    )
    args.update(change)
    with pytest.raises(ValueError, match=None) as err:
        pmf(**args)
    assert fragment in str(err.value)


def test_hand_written_factorization_with_an_index_out_of_range_is_a_named_error(rng):
    s, d, y = _entries(rng)
    s[-1] = R
    with pm.Model() as m:
        U = pm.Normal("U", 0, 1, shape=(R, K))
        V = pm.Normal("V", 0, 1, shape=(C, K))
        pm.Bernoulli("y", logit_p=(U[s] * V[d]).sum(-1), observed=y)
    with pytest.raises(pymc_mcssvi.UnsupportedModelError, match="outside \\[0, 6\\)") as err:
        pymc_mcssvi.describe(m)
    assert err.value.variable == "y" and "'U'" in str(err.value)


def _bound_value(model, means, factors):
    tlm = pymc_mcssvi.describe(model).tlm
    ev = StructuredBound(tlm, bilinear_draws="sigma").evaluate(
        [
            GaussianBlocks(pt.constant(m), pt.constant(f))
            for m, f in zip(means, factors, strict=True)
        ]
    )
    return float(compile([], ev.phase_values[0])())


def test_duplicated_entries_are_independent_observations(rng):
    """A (row, column) pair given twice contributes its expected log likelihood twice."""
    s, d, y = _entries(rng)
    means = [rng.normal(size=(R, K)), rng.normal(size=(C, K))]
    factors = [np.repeat(np.eye(K)[None] * 2.0, n, 0) for n in (R, C)]
    without = pmf(s[1:], d[1:], y[1:], R, C, K)
    once = pmf(s, d, y, R, C, K)
    twice = pmf(np.r_[s, s[0]], np.r_[d, d[0]], np.r_[y, y[0]], R, C, K)
    v0, v1, v2 = (_bound_value(m, means, factors) for m in (without, once, twice))
    np.testing.assert_allclose(v2 - v1, v1 - v0, rtol=1e-10)
    assert v1 != v0


@pytest.mark.parametrize(
    ("likelihood", "extra"),
    [
        ("bernoulli", {}),
        ("poisson", {}),
        ("poisson_softplus", {}),
        ("ordinal", {"cutpoints": [-1.0, 0.0, 1.0]}),
        ("ordinal", {}),
        ("ordered_probit", {"cutpoints": [-1.0, 0.0, 1.0]}),
        ("normal", {}),
    ],
)
def test_every_likelihood_is_a_bilinear_term(likelihood, extra, rng):
    s, d, _ = _entries(rng)
    y = rng.integers(0, 4, s.size)
    model = pmf(s, d, y, R, C, K, likelihood=likelihood, **extra)
    desc = pymc_mcssvi.describe(model)
    assert desc.predictor("y") == "bilinear"
    assert desc.structure("U") == f"block {R} x ({K} x {K})"
    learned = likelihood in ("ordinal", "ordered_probit") and not extra
    assert ("cutpoints" in model.named_vars) == learned


def test_learned_prior_scales_are_hyperparameters(rng):
    s, d, y = _entries(rng)
    desc = pymc_mcssvi.describe(pmf(s, d, y, R, C, K, prior_sd=None))
    roles = {r["name"]: r["role"] for r in desc.variables}
    assert roles["sigma_U"] == roles["sigma_V"] == "hyperparameter"


def test_learned_prior_scales_with_row_subsampling_fit(rng):
    """The phase switch of the subsampled step, batched over q(h)'s sigma points, stays
    an ``ifelse`` (a ``Blockwise`` of it failed on the Python backend: ``TypeError:
    'NoneType' object is not subscriptable``)."""
    s, d, y = _entries(rng)
    with pmf(s, d, y, R, C, K, prior_sd=None):
        # the factors' learned scales have no linear response: said, not silent
        with pytest.warns(UserWarning, match="'sigma_U', 'sigma_V'.*too small and too narrow"):
            approx = pm.fit(
                n=12,
                method="hmcssvi",
                random_seed=1,
                progressbar=False,
                row_subsample=3,
            )
    assert np.isfinite(approx.hist).all()


def test_offline_loaders():
    ins = load_insteval("binary")
    r, c, y = ins["train"]
    rt, _, yt = ins["test"]
    assert (ins["n_rows"], ins["n_cols"]) == (2972, 1128)
    assert set(np.unique(y)) == {0, 1} and abs(len(yt) / (len(y) + len(yt)) - 0.2) < 1e-3
    assert (
        len(load_insteval("ordinal")["train"][0]) + len(load_insteval("ordinal")["test"][0])
        == 73421
    )
    reu = load_reuters_counts()
    assert reu["n_rows"] == 395 and reu["n_cols"] == 2000
    assert reu["train"][2].min() >= 1  # nonzero counts only
