"""Model zoo: what ``pymc_mcssvi.describe`` makes of PyMC models as users write them.

Each model in :mod:`tests.recognize.zoo_models` is checked for

* the role of *every* free variable,
* the predictor form of *every* observed variable,
* the covariance structure of *every* Gaussian global (exact strings),

and, where relevant, the scaling of observed variables, the reason a Normal
variable was demoted to a hyperparameter, and the notes. Unsupported models
must raise :class:`pymc_mcssvi.UnsupportedModelError` naming the variable.

Every case states the behaviour a PyMC user would expect.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pymc as pm
import pytest
from pymc.variational.opvi import VariationalInferenceError

import pymc_mcssvi
from tests.recognize import zoo_models as Z

GAUSS = "gaussian global"
HYPER = "hyperparameter"
RAYL = "rayleigh global"
QUAD = "local, marginalized by quadrature"
LEAF = "predictive leaf"


def ENUM(k):
    return f"local, marginalized by enumeration ({k} values)"


# name -> expected recognition. Keys:
#   roles      {free RV: role}            (must list every free RV)
#   predictor  {observed RV: form}        (must list every observed RV; str = exact, re.Pattern = fullmatch)
#   q          {Gaussian global: structure} (must list every Gaussian global)
#   scaling    {observed RV: scaling}     (optional)
#   reason     {hyperparameter: fragment of its note}   (optional)
#   notes      [fragments that must appear in d.notes]  (optional)
ZOO: dict[str, dict] = {
    # ------------------------------------------------------------------ GLMs
    "logistic_matmul": dict(
        roles={"w": GAUSS}, predictor={"y": "dense affine"}, q={"w": "full (3 x 3)"}
    ),
    "logistic_math_dot": dict(
        roles={"w": GAUSS}, predictor={"y": "dense affine"}, q={"w": "full (3 x 3)"}
    ),
    "logistic_intercept": dict(
        roles={"b": GAUSS, "w": GAUSS},
        predictor={"y": "dense affine"},
        q={"b": "full (4 x 4) with w", "w": "full (4 x 4) with b"},
    ),
    "logistic_pm_data": dict(
        roles={"w": GAUSS}, predictor={"y": "dense affine"}, q={"w": "full (3 x 3)"}
    ),
    "logistic_coords_dims": dict(
        roles={"intercept": GAUSS, "beta": GAUSS},
        predictor={"y": "dense affine"},
        q={"intercept": "full (4 x 4) with beta", "beta": "full (4 x 4) with intercept"},
    ),
    "logistic_sum_product": dict(
        roles={"w": GAUSS}, predictor={"y": "dense affine"}, q={"w": "full (3 x 3)"}
    ),
    "logistic_stacked_scalars": dict(
        roles={"b0": GAUSS, "b1": GAUSS, "b2": GAUSS},
        predictor={"y": "dense affine"},
        q={
            "b0": "full (3 x 3) with b1, b2",
            "b1": "full (3 x 3) with b0, b2",
            "b2": "full (3 x 3) with b0, b1",
        },
    ),
    "vector_matrix_product": dict(
        roles={"w": GAUSS}, predictor={"y": "dense affine"}, q={"w": "full (3 x 3)"}
    ),
    "probit": dict(roles={"w": GAUSS}, predictor={"y": "dense affine"}, q={"w": "full (3 x 3)"}),
    "poisson_exp": dict(
        roles={"w": GAUSS}, predictor={"y": "dense affine"}, q={"w": "full (3 x 3)"}
    ),
    "negative_binomial": dict(
        roles={"w": GAUSS, "alpha": HYPER},
        predictor={"y": "dense affine"},
        q={"w": "full (3 x 3)"},
    ),
    "gamma_regression": dict(
        roles={"w": GAUSS, "shape": HYPER},
        predictor={"y": "dense affine"},
        q={"w": "full (3 x 3)"},
    ),
    "student_t": dict(
        roles={"w": GAUSS, "nu": HYPER, "sigma": HYPER},
        predictor={"y": "dense affine"},
        q={"w": "full (3 x 3)"},
    ),
    "linear_regression": dict(
        roles={"intercept": GAUSS, "w": GAUSS, "sigma": HYPER},
        predictor={"y": "dense affine"},
        q={"intercept": "full (4 x 4) with w", "w": "full (4 x 4) with intercept"},
    ),
    "binomial_trials": dict(
        roles={"w": GAUSS}, predictor={"y": "dense affine"}, q={"w": "full (3 x 3)"}
    ),
    "beta_regression": dict(
        roles={"w": GAUSS, "kappa": HYPER},
        predictor={"y": "dense affine"},
        q={"w": "full (3 x 3)"},
    ),
    "exponential_survival": dict(
        roles={"w": GAUSS}, predictor={"t": "dense affine"}, q={"w": "full (3 x 3)"}
    ),
    "poisson_offset": dict(
        roles={"w": GAUSS}, predictor={"y": "dense affine"}, q={"w": "full (3 x 3)"}
    ),
    "deterministic_predictor": dict(
        roles={"w": GAUSS}, predictor={"y": "dense affine"}, q={"w": "full (3 x 3)"}
    ),
    "horseshoe": dict(
        roles={"tau": HYPER, "lam": HYPER, "w": GAUSS, "sigma": HYPER},
        predictor={"y": "dense affine"},
        q={"w": "full (5 x 5)"},
    ),
    "two_likelihoods": dict(
        roles={"w": GAUSS},
        predictor={"y_bin": "dense affine", "y_cont": "dense affine"},
        q={"w": "full (3 x 3)"},
    ),
    # softmax over a row: not elementwise in one predictor -> Monte Carlo + autodiff
    "multinomial_logistic": dict(
        roles={"W": GAUSS}, predictor={"y": "general"}, q={"W": "full (9 x 9)"}
    ),
    # a multivariate likelihood: its log density over the support by Monte Carlo + autodiff
    "multivariate_observed": dict(
        roles={"mu": GAUSS},
        predictor={"Y": "dense affine (MvNormal, whitened)"},
        q={"mu": "full (2 x 2)"},
    ),
    # two predictors (location and log scale)
    "heteroskedastic": dict(
        roles={"w": GAUSS, "v": GAUSS},
        predictor={"y": "two affine predictors"},
        q={"w": "full (6 x 6) with v", "v": "full (6 x 6) with w"},
    ),
    # A Laplace prior on the real line: a Gaussian global whose prior is a quadrature term
    # (it was "no Gaussian global" before non-Gaussian priors were supported).
    "laplace_coefficients": dict(
        roles={"w": GAUSS}, predictor={"y": "dense affine"}, q={"w": "full (3 x 3)"}
    ),
    # A scalar Normal log noise scale is a hyperparameter, like a HalfNormal sigma would be,
    # so the likelihood keeps its single affine predictor.
    "log_sigma_likelihood": dict(
        roles={"w": GAUSS, "log_sigma": HYPER},
        predictor={"y": "dense affine"},
        q={"w": "full (3 x 3)"},
        reason={"log_sigma": "sets the scale or shape of 'y'"},
    ),
    "ordered_logistic": pytest.param(
        dict(
            roles={"w": GAUSS, "cutpoints": HYPER},
            predictor={"y": "dense affine"},
            q={"w": "full (3 x 3)"},
        ),
    ),
    "zero_inflated_poisson": pytest.param(
        dict(
            roles={"w": GAUSS, "psi": HYPER},
            predictor={"y": "dense affine"},
            q={"w": "full (3 x 3)"},
        ),
    ),
    "normal_mixture_likelihood": pytest.param(
        dict(roles={"w": GAUSS}, predictor={"y": "dense affine"}, q={"w": "full (3 x 3)"}),
    ),
    "censored_regression": pytest.param(
        dict(roles={"w": GAUSS}, predictor={"y": "dense affine"}, q={"w": "full (3 x 3)"}),
    ),
    "truncated_regression": pytest.param(
        dict(roles={"w": GAUSS}, predictor={"y": "dense affine"}, q={"w": "full (3 x 3)"}),
    ),
    # ------------------------------------------------------ Gaussian shapes
    "scalar_mean": dict(
        roles={"mu": GAUSS, "sigma": HYPER},
        predictor={"y": "dense affine"},
        q={"mu": "full (1 x 1)"},
    ),
    "matrix_coefficients": pytest.param(
        dict(roles={"W": GAUSS}, predictor={"y": "dense affine"}, q={"W": "full (12 x 12)"}),
    ),
    "mvnormal_cov": dict(
        roles={"w": GAUSS}, predictor={"y": "dense affine"}, q={"w": "full (3 x 3)"}
    ),
    "mvnormal_tau": dict(
        roles={"w": GAUSS}, predictor={"y": "dense affine"}, q={"w": "full (3 x 3)"}
    ),
    "mvnormal_lkj": dict(
        roles={"chol": HYPER, "ab": GAUSS, "sigma": HYPER},
        predictor={"y": "gather"},
        q={"ab": "full (16 x 16)"},
    ),
    "several_gaussians": dict(
        roles={"alpha": GAUSS, "beta": GAUSS, "gamma": GAUSS, "sigma": HYPER},
        predictor={"y": "dense affine"},
        q={
            "alpha": "full (6 x 6) with beta, gamma",
            "beta": "full (6 x 6) with alpha, gamma",
            "gamma": "full (6 x 6) with alpha, beta",
        },
    ),
    "mvnormal_hierarchical_mean": pytest.param(
        dict(
            roles={"m0": GAUSS, "w": GAUSS},
            predictor={"y": "dense affine"},
            q={"m0": "full (4 x 4) with w", "w": "full (4 x 4) with m0"},
        ),
    ),
    # ---------------------------------------------------------- hierarchical
    # (mu + sd * z)[g] gathers the intercept too, so the whole predictor is one gather
    "random_intercepts_noncentered": dict(
        roles={"mu": GAUSS, "sd": HYPER, "z": GAUSS, "sigma": HYPER},
        predictor={"y": "gather"},
        q={"mu": "full (7 x 7) with z", "z": "full (7 x 7) with mu"},
    ),
    "random_intercepts_centered": dict(
        roles={"mu_a": GAUSS, "sd": HYPER, "a": GAUSS},
        predictor={"y": "gather"},
        q={"mu_a": "full (7 x 7) with a", "a": "full (7 x 7) with mu_a"},
    ),
    "random_slopes": dict(
        roles={"sd_a": HYPER, "sd_b": HYPER, "a": GAUSS, "b": GAUSS, "sigma": HYPER},
        predictor={"y": "gather"},
        q={"a": "full (10 x 10) with b", "b": "full (10 x 10) with a"},
    ),
    "random_slopes_large": pytest.param(
        dict(
            roles={"sd_a": HYPER, "sd_b": HYPER, "a": GAUSS, "b": GAUSS, "sigma": HYPER},
            predictor={"y": "gather"},
            q={"a": "block 600 x (2 x 2) with b", "b": "block 600 x (2 x 2) with a"},
        ),
    ),
    "random_slopes_noncentered_dims": dict(
        roles={"b0": GAUSS, "sd_a": HYPER, "sd_b": HYPER, "z_a": GAUSS, "z_b": GAUSS},
        predictor={"y": "dense affine + gather"},
        q={
            "b0": "full (17 x 17) with z_a, z_b",
            "z_a": "full (17 x 17) with b0, z_b",
            "z_b": "full (17 x 17) with b0, z_a",
        },
    ),
    "random_slopes_large_with_intercept": pytest.param(
        dict(
            roles={"beta": GAUSS, "sd": HYPER, "a": GAUSS, "b": GAUSS},
            predictor={"y": "dense affine + gather"},
            q={
                "beta": "full (2 x 2)",
                "a": "block 600 x (2 x 2) with b",
                "b": "block 600 x (2 x 2) with a",
            },
            notes=["keep the coupling of beta with a, b (arrow curvature)"],
        ),
    ),
    "crossed_effects": dict(
        roles={
            "mu": GAUSS,
            "sd_s": HYPER,
            "sd_i": HYPER,
            "u": GAUSS,
            "v": GAUSS,
            "sigma": HYPER,
        },
        predictor={"y": "dense affine + gather"},
        q={
            "mu": "full (14 x 14) with u, v",
            "u": "full (14 x 14) with mu, v",
            "v": "full (14 x 14) with mu, u",
        },
    ),
    "nested_index": dict(
        roles={"s": GAUSS, "sd_c": HYPER, "c": GAUSS, "sigma": HYPER},
        predictor={"y": "gather"},
        q={"s": "full (12 x 12) with c", "c": "full (12 x 12) with s"},
    ),
    "nested_index_direct": dict(
        roles={"s": GAUSS, "sd_c": HYPER, "c": GAUSS},
        predictor={"y": "gather"},
        q={"s": "full (12 x 12) with c", "c": "full (12 x 12) with s"},
    ),
    "log_scale_normal": dict(
        roles={"log_s": HYPER, "a": GAUSS},
        predictor={"y": "gather"},
        q={"a": "full (6 x 6)"},
        reason={"log_s": "sets the scale of 'a'"},
    ),
    "nonlinear_mean_prior": dict(
        roles={"mu_a": HYPER, "a": GAUSS},
        predictor={"y": "gather"},
        q={"a": "full (6 x 6)"},
        reason={"mu_a": "enters the mean of 'a' non-linearly"},
    ),
    "nonlinear_regression": dict(
        roles={"a": GAUSS, "b": HYPER, "sigma": HYPER},
        predictor={"y": "dense affine"},
        q={"a": "full (1 x 1)"},
        reason={"b": "enters non-linearly in the predictor of 'y'"},
    ),
    "random_walk_spline": pytest.param(
        dict(
            roles={"sd": HYPER, "steps": GAUSS},
            predictor={"y": "dense affine"},
            q={"steps": "full (6 x 6)"},
        ),
    ),
    # -------------------------------------------------- matrix factorization
    "pmf_sum": dict(
        roles={"U": GAUSS, "V": GAUSS, "sigma": HYPER},
        predictor={"r": "bilinear"},
        q={"U": "block 12 x (3 x 3)", "V": "block 10 x (3 x 3)"},
    ),
    "pmf_einsum": dict(
        roles={"U": GAUSS, "V": GAUSS},
        predictor={"r": "bilinear"},
        q={"U": "block 12 x (3 x 3)", "V": "block 10 x (3 x 3)"},
    ),
    "pmf_with_biases": dict(
        roles={"U": GAUSS, "V": GAUSS},
        predictor={"r": "bilinear"},
        q={"U": "block 12 x (3 x 3)", "V": "block 10 x (3 x 3)"},
    ),
    "pmf_dense_missing": dict(
        roles={"U": GAUSS, "V": GAUSS, "Y_unobserved": LEAF},
        predictor={"Y_observed": "bilinear"},
        q={"U": "block 12 x (3 x 3)", "V": "block 10 x (3 x 3)"},
    ),
    # ------------------------------------------- free variables nothing reads
    "predictions_in_model": dict(
        roles={"w": GAUSS, "y_new": LEAF, "noisy_new": LEAF},
        predictor={"y": "dense affine"},
        q={"w": "full (3 x 3)"},
    ),
    "missing_observed": dict(
        roles={"w": GAUSS, "y_unobserved": LEAF},
        predictor={"y_observed": "dense affine"},
        q={"w": "full (3 x 3)"},
    ),
    # ------------------------------------------------------ Rayleigh globals
    "gme_rayleigh": dict(
        roles={"w1": GAUSS, "w2": RAYL, "f": QUAD},
        predictor={"y": "dense affine, through local 'f'"},
        q={"w1": "full (3 x 3)"},
    ),
    "gme_weibull2": dict(  # the same prior as a Rayleigh, but a hyperparameter
        roles={"w1": GAUSS, "w2": HYPER, "f": QUAD},
        predictor={"y": "dense affine, through local 'f'"},
        q={"w1": "full (3 x 3)"},
    ),
    "gme_weibull15": dict(
        roles={"w1": GAUSS, "w2": HYPER, "f": QUAD},
        predictor={"y": "dense affine, through local 'f'"},
        q={"w1": "full (3 x 3)"},
    ),
    "rayleigh_regression_scale": dict(
        roles={"w": GAUSS, "s": RAYL},
        predictor={"y": "dense affine"},
        q={"w": "full (3 x 3)"},
    ),
    # ---------------------------------------------------------------- locals
    "gme_halfnormal_scale": dict(
        roles={"w1": GAUSS, "tau": HYPER, "f": QUAD},
        predictor={"y": "dense affine, through local 'f'"},
        q={"w1": "full (3 x 3)"},
    ),
    "olre_centered": dict(
        roles={"w": GAUSS, "sd": HYPER, "eta": QUAD},
        predictor={"y": "dense affine, through local 'eta'"},
        q={"w": "full (3 x 3)"},
    ),
    "olre_additive": pytest.param(
        dict(
            roles={"w": GAUSS, "sd": HYPER, "eps": QUAD},
            predictor={"y": "dense affine, through local 'eps'"},
            q={"w": "full (3 x 3)"},
        ),
    ),
    "zero_inflation_indicator": dict(
        roles={"w": GAUSS, "z": ENUM(2)},
        predictor={"y": "dense affine, with discrete local 'z'"},
        q={"w": "full (3 x 3)"},
    ),
    # two different affine predictors, one per component -> general
    "mixture_regression_switch": dict(
        roles={"w0": GAUSS, "w1": GAUSS, "z": ENUM(2)},
        predictor={"y": "general, with discrete local 'z'"},
        q={"w0": "full (6 x 6) with w1", "w1": "full (6 x 6) with w0"},
    ),
    "mixture_means_stack": pytest.param(
        dict(
            roles={"mu0": GAUSS, "mu1": GAUSS, "z": ENUM(2)},
            predictor={"y": re.compile(r".*, with discrete local 'z'")},
            q={"mu0": "full (2 x 2) with mu1", "mu1": "full (2 x 2) with mu0"},
        ),
    ),
    "mixture_three_components": pytest.param(
        dict(
            roles={"mus": GAUSS, "z": ENUM(3)},
            predictor={"y": re.compile(r".*, with discrete local 'z'")},
            q={"mus": "full (3 x 3)"},
        ),
    ),
    # ------------------------------------------------------------- minibatch
    "minibatch_total_size": dict(
        roles={"w": GAUSS},
        predictor={"y": "dense affine"},
        q={"w": "full (3 x 3)"},
        scaling={"y": "N/|M| = 200/50"},
    ),
    "minibatch_glmm": dict(
        roles={"beta": GAUSS, "sd": HYPER, "a": GAUSS},
        predictor={"y": "dense affine + gather"},
        q={"beta": "full (11 x 11) with a", "a": "full (11 x 11) with beta"},
        scaling={"y": "N/|M| = 200/40"},
    ),
    # ------------------------------------------------------------ potentials
    "potential_on_gaussians": dict(
        roles={"w": GAUSS},
        predictor={"y": "dense affine"},
        q={"w": "full (3 x 3)"},
        notes=["pm.Potential 'sum_to_zero' depends on the Gaussian globals"],
    ),
    "potential_on_hyper": dict(
        roles={"w": GAUSS, "sigma": HYPER},
        predictor={"y": "dense affine"},
        q={"w": "full (3 x 3)"},
        notes=["pm.Potential 'sigma_penalty' does not involve the Gaussian globals"],
    ),
}

Q_OF_ROLE = {
    HYPER: "meanfield Gaussian or point (hyper=)",
    RAYL: "Rayleigh",
    QUAD: "integrated out",
    LEAF: "prior given the others",
}


def _params():
    out = []
    for name, exp in ZOO.items():
        if isinstance(exp, dict):
            out.append(pytest.param(name, exp, id=name))
        else:  # pytest.param(expected, marks=...)
            out.append(pytest.param(name, *exp.values, marks=exp.marks, id=name))
    return out


def _matches(expected, actual):
    if isinstance(expected, re.Pattern):
        return expected.fullmatch(actual) is not None
    return expected == actual


@pytest.mark.parametrize(("name", "expected"), _params())
def test_zoo_recognition(name, expected):
    model = getattr(Z, name)()
    d = pymc_mcssvi.describe(model)

    roles = {r["name"]: r["role"] for r in d.variables}
    assert set(expected["roles"]) == {rv.name for rv in model.free_RVs}, "zoo entry incomplete"
    assert roles == expected["roles"]

    preds = {r["name"]: r["predictor"] for r in d.observed}
    assert set(expected["predictor"]) == {rv.name for rv in model.observed_RVs}
    for obs, form in expected["predictor"].items():
        assert _matches(form, preds[obs]), (obs, preds[obs])

    structures = {r["name"]: r["q"] for r in d.variables if r["role"] == GAUSS}
    assert structures == expected["q"]
    for r in d.variables:
        if r["role"] in Q_OF_ROLE:
            assert r["q"] == Q_OF_ROLE[r["role"]], r
        elif r["role"].startswith("local, marginalized by enumeration"):
            assert r["q"] == "integrated out", r

    scaling = {r["name"]: r["scaling"] for r in d.observed}
    expected_scaling = {o: "1" for o in preds} | expected.get("scaling", {})
    assert scaling == expected_scaling

    notes_of = {r["name"]: r["note"] for r in d.variables}
    for hyper, fragment in expected.get("reason", {}).items():
        assert fragment in notes_of[hyper]
    for fragment in expected.get("notes", []):
        assert any(fragment in n for n in d.notes), d.notes
    if not expected.get("notes"):
        assert d.notes == []


# ------------------------------------------------------------------ locals
@pytest.mark.parametrize(
    ("name", "local", "observed"),
    [
        ("gme_rayleigh", "f", "y"),
        ("gme_halfnormal_scale", "f", "y"),
        ("olre_centered", "eta", "y"),
        ("zero_inflation_indicator", "z", "y"),
        ("mixture_regression_switch", "z", "y"),
    ],
)
def test_local_names_its_observed(name, local, observed):
    d = pymc_mcssvi.describe(getattr(Z, name)())
    (row,) = [r for r in d.variables if r["name"] == local]
    assert row["note"] == f"of {observed!r}"
    (lc,) = d.tlm.locals
    assert (lc.name, lc.observed) == (local, observed)


# --------------------------------------------------------------- minibatch
def test_minibatch_without_total_size_warns():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyMC's own warning when the model is built
        model = Z.minibatch_no_total_size()
    with pytest.warns(UserWarning, match="total_size") as record:
        d = pymc_mcssvi.describe(model)
    assert any("'y'" in str(w.message) for w in record)
    assert d.role("w") == GAUSS
    assert d.predictor("y") == "dense affine"
    assert d.structure("w") == "full (3 x 3)"
    assert d.observed[0]["scaling"] == "1"


# ---------------------------------------------------------- cov overrides
@pytest.mark.parametrize(
    ("name", "cov", "expected"),
    [
        ("random_slopes", "diag", {"a": "diag (5)", "b": "diag (5)"}),
        ("random_slopes", {"a": "diag"}, {"a": "diag (5)", "b": "full (5 x 5)"}),
        (
            "random_slopes",
            "block",
            {"a": "block 5 x (2 x 2) with b", "b": "block 5 x (2 x 2) with a"},
        ),
        (
            "random_slopes_large",
            "block",
            {"a": "block 600 x (2 x 2) with b", "b": "block 600 x (2 x 2) with a"},
        ),
        (
            "random_slopes_large_with_intercept",
            {"a": "block", "b": "block"},
            {
                "beta": "full (2 x 2)",
                "a": "block 600 x (2 x 2) with b",
                "b": "block 600 x (2 x 2) with a",
            },
        ),
        (
            "random_slopes_large_with_intercept",
            "block",
            {
                "beta": "diag (2)",
                "a": "block 600 x (2 x 2) with b",
                "b": "block 600 x (2 x 2) with a",
            },
        ),
        ("pmf_sum", "full", {"U": "full (66 x 66) with V", "V": "full (66 x 66) with U"}),
        ("pmf_sum", "diag", {"U": "diag (36)", "V": "diag (30)"}),
        ("mvnormal_lkj", {"ab": "block"}, {"ab": "block 8 x (2 x 2)"}),
        ("matrix_coefficients", "block", {"W": "block 3 x (4 x 4)"}),
        (
            "random_slopes_noncentered_dims",
            "block",
            {
                "b0": "diag (1)",
                "z_a": "block 8 x (2 x 2) with z_b",
                "z_b": "block 8 x (2 x 2) with z_a",
            },
        ),
        ("logistic_intercept", "diag", {"b": "diag (1)", "w": "diag (3)"}),
        (
            "crossed_effects",
            {"u": "diag", "v": "diag"},
            {"mu": "full (1 x 1)", "u": "diag (8)", "v": "diag (5)"},
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_cov_override(name, cov, expected):
    d = pymc_mcssvi.describe(getattr(Z, name)(), cov=cov)
    assert {r["name"]: r["q"] for r in d.variables if r["role"] == GAUSS} == expected


def test_cov_override_unknown_variable():
    with pytest.raises(
        pymc_mcssvi.UnsupportedModelError, match=r"Variable 'sigma'.*not a Gaussian global"
    ) as err:
        pymc_mcssvi.describe(Z.linear_regression(), cov={"sigma": "diag"})
    assert err.value.variable == "sigma"
    assert "intercept" in err.value.remedy and "'w'" in err.value.remedy


@pytest.mark.parametrize("cov", ["dense", {"w": "banana"}])
def test_cov_override_unknown_structure(cov):
    with pytest.raises(ValueError, match="cov must be one of"):
        pymc_mcssvi.describe(Z.linear_regression(), cov=cov)


# ------------------------------------------------------------------ errors
ERRORS = [
    ("gamma_poisson", "lam", "no Gaussian"),
    ("gaussian_latent_only", "f", "no Gaussian"),
    ("nan_design_matrix", "y", "contains NaN values"),
    ("discrete_scalar_latent", "k", "discrete free variable"),
    ("bernoulli_wrong_size", "z", "discrete free variable"),
    ("bernoulli_shared_by_two_observed", "z", "discrete free variable"),
    ("cluster_assignment_per_group", "z", "discrete free variable"),
]


@pytest.mark.parametrize(("name", "variable", "fragment"), ERRORS, ids=[e[0] for e in ERRORS])
def test_zoo_unsupported(name, variable, fragment):
    model = getattr(Z, name)()
    pattern = re.escape(f"Variable '{variable}'") + ".*" + re.escape(fragment)
    with pytest.raises(pymc_mcssvi.UnsupportedModelError, match=pattern) as err:
        pymc_mcssvi.describe(model)
    assert err.value.variable == variable
    assert "What to do:" in str(err.value)
    assert isinstance(err.value, VariationalInferenceError)
    assert isinstance(err.value, ValueError)


# ------------------------------------------------------------------ timing
def test_largest_zoo_model_recognition():
    """The largest zoo model is recognized with its full size.

    Its recognition time against a fit is measured by
    ``docs/scripts/recognition_gallery.py`` (docs/recognition.md), not here:
    timings do not belong in unit tests.
    """
    model = Z.random_slopes_large_with_intercept()
    d = pymc_mcssvi.describe(model)
    assert sum(g.size for g in d.tlm.gaussians) == 1202
    assert d.seconds > 0


def test_zoo_size():
    assert len(ZOO) + len(ERRORS) + 1 >= 35  # + minibatch_no_total_size


def test_mean_coefficients_beside_a_larger_scale_predictor_are_described_as_such():
    """Group-level log scales (12 Gaussian coordinates in the likelihood's sd) make the
    scale the main predictor; the two mean coefficients become hyperparameters, and their
    note says they set the mean (it said "scale or shape")."""
    rng = np.random.default_rng(317)
    g, x = rng.integers(0, 12, 200), rng.normal(size=200)
    with pm.Model() as model:
        b0 = pm.Normal("b0", 0.0, 5.0)
        b1 = pm.Normal("b1", 0.0, 2.0)
        log_s = pm.Normal("log_s", pm.Normal("mu_ls", 0, 1), pm.HalfNormal("tau_ls", 1), shape=12)
        pm.Normal("y", b0 + b1 * x, pm.math.exp(log_s)[g], observed=rng.normal(size=200))
    notes = {r["name"]: r["note"] for r in pymc_mcssvi.describe(model).variables}
    assert "sets the mean of 'y'" in notes["b0"] and "sets the mean of 'y'" in notes["b1"]


def test_piecewise_switch_on_data_is_an_affine_predictor():
    """``pm.math.switch`` on a data condition between two affine expressions (a broken-stick
    regression) is affine row by row; it went through the Monte Carlo + autodiff path (14 s
    against 1.4 s, same accuracy, in the held-out battery)."""
    rng = np.random.default_rng(348)
    x = rng.uniform(-2, 2, 100)
    with pm.Model() as model:
        b0, b_lo, b_hi = (pm.Normal(n, 0.0, 2.0) for n in ("b0", "b_lo", "b_hi"))
        mu = b0 + pm.math.switch(x < 0, b_lo * x, b_hi * x)
        pm.Normal("y", mu, pm.HalfNormal("sigma", 1.0), observed=rng.normal(size=100))
    assert pymc_mcssvi.describe(model).predictor("y") == "dense affine"
