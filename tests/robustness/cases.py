"""The fault-injection matrix: bad inputs across the model families.

A :class:`Case` is one bad input: a model family built from data with one fault
injected (NaN or inf in one data array, a wrong shape, an index out of range,
empty or degenerate data, data at extreme scales, a likelihood that is not
log-concave) or a bad keyword argument to ``pm.fit``. :func:`all_cases` returns
the whole matrix; :data:`FAST` names the representative subset that runs in the
fast suite.

Each family is a plain PyMC model over named data arrays; an array is passed
either as a NumPy array or as ``pm.Data`` (then the error may name it). A case
lists the names an error message may use to point at the culprit
(:attr:`Case.names`): the observed variable that reads the array, the
``pm.Data`` container, the variable or the keyword.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pymc as pm
import pytensor.tensor as pt

__all__ = ["FAMILIES", "FAST", "Case", "Family", "all_cases", "fast_cases"]

#: Observations per data set: small, so that each fit takes a fraction of a second.
N = 60
#: Iterations of every fit (``n`` is a cap: a fit that converges stops earlier).
N_ITER = 40


@dataclass(frozen=True)
class Family:
    """A model family: its data (by array name), which arrays are indices (integer
    codes into a global's rows, with the number of rows), which one is observed, and
    a builder ``build(data, as_data) -> pm.Model`` where ``as_data`` is the set of
    array names wrapped in ``pm.Data``."""

    name: str
    data: Callable[[], dict]
    build: Callable[[dict, frozenset], pm.Model]
    observed: str
    covariates: tuple = ()
    indices: dict = field(default_factory=dict)  # array name -> rows of the global it indexes
    #: variables whose shapes the covariates must match (named by a shape error)
    coefficients: tuple = ()
    #: arrays that may be passed as pm.Data
    containers: tuple = ()
    #: continuous arrays that are scaled to 1e-8 and 1e8 (not counts or probabilities)
    scalable: tuple = ()
    method: str = "hmcssvi"


def _wrap(name, value, as_data):
    return pm.Data(name, value) if name in as_data else value


def _observed(name, value, as_data):
    """Observed data, as ``pm.Data`` named ``<name>_data`` when ``name`` is in ``as_data``."""
    return pm.Data(container(name), value) if name in as_data else value


def container(array: str, observed=("y", "counts")) -> str:
    """The ``pm.Data`` name of a data array (the observed data's: ``<name>_data``)."""
    return f"{array}_data" if array in observed else array


def _index(name, value, as_data):
    """An index array, cast to integers in the model when it holds floats (group codes
    read from a float column)."""
    x = _wrap(name, value, as_data)
    return pt.cast(x, "int64") if np.asarray(value).dtype.kind == "f" else x


# ------------------------------------------------------------------ the families
def _bernoulli_data():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(N, 3))
    offset = rng.normal(0, 0.2, N)
    y = (X @ [1.0, -0.5, 0.3] + offset + rng.logistic(size=N) > 0).astype("int64")
    return {"X": X, "offset": offset, "y": y}


def _bernoulli(d, as_data, flat=False):
    with pm.Model() as m:
        X, off = _wrap("X", d["X"], as_data), _wrap("offset", d["offset"], as_data)
        if flat:
            b0, w = pm.Flat("b0"), pm.Flat("w", shape=d["X"].shape[1])
        else:
            b0 = pm.Normal("b0", 0, 2)
            w = pm.Normal("w", 0, 1, shape=3)
        pm.Bernoulli("y", logit_p=b0 + X @ w + off, observed=_observed("y", d["y"], as_data))
    return m


def _poisson_data():
    rng = np.random.default_rng(2)
    X = rng.normal(size=(N, 2))
    exposure = np.log(rng.uniform(0.5, 2.0, N))
    y = rng.poisson(np.exp(0.3 + X @ [0.5, -0.3] + exposure))
    return {"X": X, "exposure": exposure, "y": y}


def _poisson(d, as_data):
    with pm.Model() as m:
        X, off = _wrap("X", d["X"], as_data), _wrap("exposure", d["exposure"], as_data)
        b0 = pm.Normal("b0", 0, 2)
        w = pm.Normal("w", 0, 1, shape=2)
        pm.Poisson("y", pm.math.exp(b0 + X @ w + off), observed=_observed("y", d["y"], as_data))
    return m


def _gaussian_data():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(N, 3))
    y = 1.0 + X @ [0.5, -1.0, 0.2] + rng.normal(0, 0.5, N)
    return {"X": X, "y": y}


def _gaussian(d, as_data, likelihood="normal", nu=None):
    with pm.Model() as m:
        X = _wrap("X", d["X"], as_data)
        b0 = pm.Normal("b0", 0, 5)
        w = pm.Normal("w", 0, 1, shape=3)
        sigma = pm.HalfNormal("sigma", 1)
        mu = b0 + X @ w
        y = _observed("y", d["y"], as_data)
        if likelihood == "studentt":
            pm.StudentT("y", nu=nu, mu=mu, sigma=sigma, observed=y)
        else:
            pm.Normal("y", mu, sigma, observed=y)
    return m


def _ordinal_data():
    rng = np.random.default_rng(4)
    X = rng.normal(size=(N, 2))
    latent = X @ [1.0, -0.5] + rng.logistic(size=N)
    y = np.digitize(latent, [-1.0, 0.0, 1.0]).astype("int64")
    return {"X": X, "y": y}


def _ordinal(d, as_data):
    with pm.Model() as m:
        X = _wrap("X", d["X"], as_data)
        w = pm.Normal("w", 0, 1, shape=2)
        c = pm.Normal(
            "cutpoints",
            0,
            3,
            shape=3,
            transform=pm.distributions.transforms.ordered,
            initval=[-1.0, 0.0, 1.0],
        )
        pm.OrderedLogistic("y", eta=X @ w, cutpoints=c, observed=_observed("y", d["y"], as_data))
    return m


G = 6


def _glmm_data():
    rng = np.random.default_rng(5)
    X = rng.normal(size=(N, 2))
    g = rng.integers(0, G, N)
    y = (X @ [0.8, -0.4] + rng.normal(0, 0.8, G)[g] + rng.logistic(size=N) > 0).astype("int64")
    return {"X": X, "g": g, "y": y}


def _glmm(d, as_data):
    with pm.Model() as m:
        X, g = _wrap("X", d["X"], as_data), _index("g", d["g"], as_data)
        w = pm.Normal("w", 0, 1, shape=2)
        sa = pm.HalfNormal("sa", 1)
        a = pm.Normal("a", 0, sa, shape=G)
        pm.Bernoulli("y", logit_p=X @ w + a[g], observed=_observed("y", d["y"], as_data))
    return m


R, C, K = 8, 6, 2


def _mf_data():
    rng = np.random.default_rng(6)
    r, c = rng.integers(0, R, N), rng.integers(0, C, N)
    U, V = rng.normal(size=(R, K)), rng.normal(size=(C, K))
    y = (U[r] * V[c]).sum(-1) + rng.normal(0, 0.5, N)
    return {"rows": r, "cols": c, "y": y}


def _mf(d, as_data):
    with pm.Model() as m:
        r, c = _index("rows", d["rows"], as_data), _index("cols", d["cols"], as_data)
        U = pm.Normal("U", 0, 1, shape=(R, K))
        V = pm.Normal("V", 0, 1, shape=(C, K))
        pm.Normal("y", (U[r] * V[c]).sum(-1), 0.5, observed=_observed("y", d["y"], as_data))
    return m


D, W, T = 20, 5, 2


def _topic_data():
    rng = np.random.default_rng(7)
    topics = rng.dirichlet(np.ones(W), size=T)
    theta = rng.dirichlet(np.ones(T), size=D)
    total = rng.integers(20, 40, D)
    counts = np.stack([rng.multinomial(n, p) for n, p in zip(total, theta @ topics, strict=True)])
    return {"topics": topics, "total": total, "counts": counts}


def _topic(d, as_data):
    with pm.Model() as m:
        topics = _wrap("topics", d["topics"], as_data)
        total = _wrap("total", d["total"], as_data)
        eta = pm.Normal("eta", 0, 1, shape=(d["counts"].shape[0], T))
        p = pm.math.softmax(eta, axis=-1) @ topics
        pm.Multinomial("counts", n=total, p=p, observed=_observed("counts", d["counts"], as_data))
    return m


def _minibatch_data():
    rng = np.random.default_rng(8)
    X = rng.normal(size=(N, 2))
    y = 0.5 + X @ [1.0, -1.0] + rng.normal(0, 0.5, N)
    return {"X": X, "y": y}


def _minibatch(d, as_data):
    with pm.Model() as m:
        Xm, ym = pm.Minibatch(d["X"], d["y"], batch_size=20)
        b0 = pm.Normal("b0", 0, 5)
        w = pm.Normal("w", 0, 1, shape=2)
        pm.Normal("y", b0 + Xm @ w, 0.5, observed=ym, total_size=d["y"].shape[0])
    return m


FAMILIES = {
    f.name: f
    for f in [
        Family(
            "bernoulli",
            _bernoulli_data,
            _bernoulli,
            "y",
            covariates=("X", "offset"),
            coefficients=("w", "b0"),
            containers=("X", "offset", "y"),
            scalable=("X", "offset"),
        ),
        Family(
            "poisson",
            _poisson_data,
            _poisson,
            "y",
            covariates=("X", "exposure"),
            coefficients=("w", "b0"),
            containers=("X", "exposure", "y"),
            scalable=("X", "exposure"),
            method="mcssvi",
        ),
        Family(
            "gaussian",
            _gaussian_data,
            _gaussian,
            "y",
            covariates=("X",),
            coefficients=("w", "b0"),
            containers=("X", "y"),
            scalable=("X", "y"),
        ),
        Family(
            "ordinal",
            _ordinal_data,
            _ordinal,
            "y",
            covariates=("X",),
            coefficients=("w",),
            containers=("X", "y"),
            scalable=("X",),
        ),
        Family(
            "glmm",
            _glmm_data,
            _glmm,
            "y",
            covariates=("X",),
            indices={"g": G},
            coefficients=("w", "a"),
            containers=("X", "g", "y"),
            scalable=("X",),
        ),
        Family(
            "mf",
            _mf_data,
            _mf,
            "y",
            indices={"rows": R, "cols": C},
            coefficients=("U", "V"),
            containers=("rows", "cols", "y"),
            scalable=("y",),
        ),
        Family(
            "topic",
            _topic_data,
            _topic,
            "counts",
            covariates=("topics", "total"),
            coefficients=("eta",),
            containers=("topics", "total", "counts"),
        ),
        Family(
            "minibatch",
            _minibatch_data,
            _minibatch,
            "y",
            covariates=("X",),
            coefficients=("w", "b0"),
            scalable=("X", "y"),
            method="sdsvi",
        ),
    ]
}


# ------------------------------------------------------------------ the cases
@dataclass(frozen=True)
class Case:
    """One bad input.

    Attributes
    ----------
    id : str
        ``family/fault`` (the pytest id).
    family : str
    build : callable
        ``build() -> pm.Model``, with the fault injected into its data.
    fit_kwargs : dict
        Arguments of ``pm.fit`` besides the model.
    names : tuple of str
        Names an error message may give the culprit (any one of them suffices).
    keyword : bool
        Whether ``names`` are keywords of ``pm.fit`` (matched as words, not only as
        quoted names).
    must_raise : bool
        A successful fit is a bad outcome too (a bad keyword or data array accepted
        silently).
    must_warn : str
        A regular expression a warning of a successful fit must match (an improper
        posterior), else the fit is a bad outcome.
    must_not_warn : str
        A regular expression no warning of a successful fit may match (an improper
        posterior reported for a proper one).
    """

    id: str
    family: str
    build: Callable[[], pm.Model]
    fit_kwargs: dict
    names: tuple
    keyword: bool = False
    must_raise: bool = False
    must_warn: str = ""
    must_not_warn: str = ""


def _fit_kwargs(fam: Family, **extra):
    return {"method": fam.method, "n": N_ITER, "random_seed": 1, "progressbar": False, **extra}


def _case(fam, fault, data_fn, as_data=frozenset(), names=(), build=None, set_later=True, **kw):
    """A case of family ``fam`` on the data of ``data_fn``.

    The arrays in ``as_data`` are ``pm.Data``: with ``set_later`` the model is built on
    the family's clean data and the faulty arrays arrive by ``pm.set_data`` before the
    fit (PyMC refuses NaN in a new ``pm.Data``, not in ``pm.set_data``), otherwise the
    containers hold the faulty data from the start.
    """
    build = build or fam.build

    def make():
        if not (as_data and set_later):
            return build(data_fn(), as_data)
        model = build(fam.data(), as_data)
        bad = data_fn()
        with model:
            pm.set_data({container(k): bad[k] for k in as_data})
        return model

    where = "+data" if as_data else ""
    containers = tuple(container(k) for k in as_data)
    return Case(
        f"{fam.name}/{fault}{where}",
        fam.name,
        make,
        _fit_kwargs(fam, **kw.pop("fit", {})),
        tuple(dict.fromkeys((fam.observed, *containers, *names))),
        **kw,
    )


def _with(fam, array, transform):
    """A data function: the family's data with ``array`` transformed."""

    def data():
        d = fam.data()
        d[array] = transform(np.array(d[array]))
        return d

    return data


def _at(value, pos=7, dtype="float64"):
    """A transform: the array as ``dtype`` with ``value`` at flat position ``pos``."""

    def put(a):
        a = a.astype(dtype)
        a.flat[pos] = value
        return a

    return put


def _variants(fam: Family, array: str) -> list[frozenset]:
    """``array`` as a NumPy array, and as ``pm.Data`` when the family allows it."""
    return [frozenset()] + ([frozenset({array})] if array in fam.containers else [])


def _clean_model(fam: Family) -> pm.Model:
    return fam.build(fam.data(), frozenset())


def _data_faults(fam: Family) -> list[Case]:
    """NaN, +inf and -inf in every data array, as NumPy and as pm.Data."""
    out = []
    arrays = [fam.observed, *fam.covariates, *fam.indices]
    for array in arrays:
        for label, value in (("nan", np.nan), ("inf", np.inf), ("-inf", -np.inf)):
            for as_data in _variants(fam, array):
                imputed = label == "nan" and array == fam.observed and not as_data
                out.append(
                    _case(
                        fam,
                        f"{label}-in-{array}",
                        _with(fam, array, _at(value)),
                        as_data,
                        must_raise=not imputed,
                    )
                )
    return out


def _shape_faults(fam: Family) -> list[Case]:
    """Arrays one row short or one column too many."""
    out = []
    for array in [*fam.covariates, *fam.indices]:
        for as_data in _variants(fam, array):
            out.append(
                _case(
                    fam,
                    f"short-{array}",
                    _with(fam, array, lambda a: a[:-1]),
                    as_data,
                    names=(array, *fam.coefficients),
                    must_raise=True,
                )
            )
    for array in fam.covariates:
        if fam.data()[array].ndim == 2:
            out.append(
                _case(
                    fam,
                    f"extra-column-{array}",
                    _with(fam, array, lambda a: np.column_stack([a, a[:, :1]])),
                    frozenset({array}) & frozenset(fam.containers),
                    names=(array, *fam.coefficients),
                    must_raise=True,
                )
            )
    obs_long = _with(fam, fam.observed, lambda a: np.concatenate([a, a[:1]]))
    out.append(
        _case(fam, f"long-{fam.observed}", obs_long, names=fam.coefficients, must_raise=True)
    )
    return out


def _index_faults(fam: Family) -> list[Case]:
    """Negative, out-of-range, float and fractional indices."""
    out = []
    for array, rows in fam.indices.items():
        faults = {
            "negative": _at(-1, dtype="int64"),
            "out-of-range": _at(rows, dtype="int64"),
            "far-out-of-range": _at(10 * rows + 3, dtype="int64"),
        }
        for label, put in faults.items():
            for as_data in [frozenset(), frozenset({array})]:
                out.append(
                    _case(
                        fam,
                        f"{label}-{array}",
                        _with(fam, array, put),
                        as_data,
                        names=(array, *fam.coefficients),
                        must_raise=True,
                    )
                )
        for label, conv in {
            "float-whole": lambda a: a.astype("float64"),
            "float-fractional": lambda a: a.astype("float64") + 0.5,
        }.items():
            for as_data in [frozenset(), frozenset({array})]:
                out.append(
                    _case(
                        fam,
                        f"{label}-{array}",
                        _with(fam, array, conv),
                        as_data,
                        names=(array, *fam.coefficients),
                        set_later=False,  # a float container, cast to integers in the model
                        must_raise=label != "float-whole",
                    )
                )
    return out


def _empty(fam: Family) -> Case:
    def data():
        d = fam.data()
        rows = d[fam.observed].shape[0]
        return {
            k: (v[:0] if k != "topics" and np.ndim(v) and v.shape[0] == rows else v)
            for k, v in d.items()
        }

    return _case(fam, "empty", data, must_raise=True)


def _scaled(fam: Family) -> list[Case]:
    """The family's continuous covariates, and its continuous observed data, times 1e-8
    and 1e8."""
    groups = {
        "covariates": [k for k in fam.scalable if k != fam.observed],
        "observed": [k for k in fam.scalable if k == fam.observed],
    }
    out = []
    for what, arrays in groups.items():
        for scale in (1e-8, 1e8) if arrays else ():

            def data(arrays=arrays, scale=scale):
                d = fam.data()
                for k in arrays:
                    d[k] = d[k] * scale
                return d

            out.append(_case(fam, f"{what}-scaled-{scale:g}", data))
    return out


def _columns(fam: Family) -> list[Case]:
    """Constant, all-zero and collinear columns of a design matrix."""
    if "X" not in fam.covariates:
        return []

    def constant(a):
        a[:, 1] = 1.0
        return a

    def zero(a):
        a[:, 0] = 0.0
        return a

    def collinear(a):
        a[:, -1] = a[:, 0] + (a[:, 1] if a.shape[1] > 2 else 0.0)
        return a

    def duplicate(a):
        a[:, 1] = a[:, 0]
        return a

    return [
        _case(fam, f"{label}-column", _with(fam, "X", f))
        for label, f in [
            ("constant", constant),
            ("zero", zero),
            ("collinear", collinear),
            ("duplicate", duplicate),
        ]
    ]


def _separation() -> list[Case]:
    """Complete separation, quasi-complete separation (a tied pair with both labels on
    the separating hyperplane) and overlapping classes, each with Normal and with Flat
    priors. With Flat priors the first two posteriors are improper (a warning must say
    so); the third is proper (no such warning)."""
    fam = FAMILIES["bernoulli"]

    def separable():
        d = fam.data()
        d["y"] = (d["X"][:, 0] > 0).astype("int64")
        d["offset"] = np.zeros(N)
        return d

    def quasi_separable():
        d = separable()
        x0 = d["X"][:, 0]
        edge = np.argmin(np.where(x0 > 0, x0, np.inf))
        tied = np.flatnonzero(x0 < 0)[0]
        d["X"][tied] = d["X"][edge]
        return d

    def overlapping():
        d = separable()
        flip = np.random.default_rng(10).choice(N, N // 6, replace=False)
        d["y"][flip] ^= 1
        return d

    out = []
    for label, data, improper in [
        ("separable", separable, True),
        ("quasi-separable", quasi_separable, True),
        ("overlapping", overlapping, False),
    ]:
        out.append(_case(fam, f"{label}-normal-prior", data, must_not_warn="improper"))
        out.append(
            _case(
                fam,
                f"{label}-flat-prior",
                data,
                names=("b0", "w"),
                build=lambda d, a: _bernoulli(d, a, flat=True),
                must_warn="improper" if improper else "",
                must_not_warn="" if improper else "improper",
            )
        )
    return out


def _heavy_tails() -> list[Case]:
    """StudentT likelihoods with nu < 1 (not log-concave), with and without outliers."""
    fam = FAMILIES["gaussian"]
    out = []
    for nu in (0.3, 0.5, 0.9):
        out.append(
            _case(
                fam,
                f"studentt-nu{nu}",
                fam.data,
                build=lambda d, a, nu=nu: _gaussian(d, a, "studentt", nu),
            )
        )

    def outliers():
        d = fam.data()
        d["y"][:5] += 1e3
        return d

    out.append(
        _case(
            fam,
            "studentt-nu0.5-outliers",
            outliers,
            build=lambda d, a: _gaussian(d, a, "studentt", 0.5),
        )
    )
    return out


def _zero_inflation() -> list[Case]:
    """Zero inflation with a Bernoulli local: a product, a switch, and PyMC's own."""
    rng = np.random.default_rng(9)
    y = rng.poisson(2.0, N) * (rng.random(N) > 0.3)

    def build(kind):
        def make():
            with pm.Model() as m:
                b = pm.Normal("b", 0, 1)
                if kind == "zip":
                    pm.ZeroInflatedPoisson("y", 0.7, pm.math.exp(b), observed=y)
                    return m
                z = pm.Bernoulli("z", 0.3, shape=N)
                if kind == "product":
                    mu = pm.math.exp(b) * (1 - z)
                else:
                    mu = pm.math.switch(pt.eq(z, 1), 0.0, pm.math.exp(b))
                pm.Poisson("y", mu, observed=y)
            return m

        return make

    return [
        Case(
            f"zero-inflation/{kind}",
            "zero-inflation",
            build(kind),
            {"method": "hmcssvi", "n": N_ITER, "random_seed": 1, "progressbar": False},
            ("y", "z", "b"),
        )
        for kind in ("product", "switch", "zip")
    ]


#: Bad keyword arguments of pm.fit: (label, kwargs, the keyword the message must name).
BAD_KWARGS = [
    ("unknown-keyword", {"obj_n_mc": 10}, "obj_n_mc"),
    ("misspelled-keyword", {"chunksize": 10}, "chunksize"),
    ("n-negative", {"n": -5}, "n"),
    ("n-zero", {"n": 0}, "n"),
    ("n-float", {"n": 2.5}, "n"),
    ("n-string", {"n": "10"}, "n"),
    ("n-bool", {"n": True}, "n"),
    ("cov-unknown", {"cov": "dense"}, "cov"),
    ("cov-number", {"cov": 3}, "cov"),
    ("cov-unknown-variable", {"cov": {"nope": "diag"}}, "nope"),
    ("cov-bad-structure", {"cov": {"w": "dense"}}, "w"),
    ("hyper-unknown", {"hyper": "map"}, "hyper"),
    ("hyper-number", {"hyper": 1}, "hyper"),
    ("bound-unknown", {"bound": "elbo"}, "bound"),
    ("schedule-unknown", {"schedule": "cosine"}, "schedule"),
    ("schedule-negative", {"schedule": -0.5}, "schedule"),
    ("schedule-zero", {"schedule": 0.0}, "schedule"),
    ("schedule-list", {"schedule": [1.0]}, "schedule"),
    ("backend-unknown", {"backend": "cuda"}, "backend"),
    ("backend-number", {"backend": 1}, "backend"),
    ("estimator-unknown", {"estimator": "exact"}, "estimator"),
    ("inner-unknown", {"inner": "laplace"}, "inner"),
    ("n_points-zero", {"n_points": 0}, "n_points"),
    ("n_points-negative", {"n_points": -3}, "n_points"),
    ("n_points-float", {"n_points": 2.5}, "n_points"),
    ("n_draws-zero", {"n_draws": 0}, "n_draws"),
    ("n_inner-zero", {"n_inner": 0}, "n_inner"),
    ("rho0-negative", {"rho0": -1.0}, "rho0"),
    ("rho0-string", {"rho0": "big"}, "rho0"),
    ("kappa-out-of-range", {"kappa": 2.0, "schedule": "power"}, "kappa"),
    ("tau-negative", {"tau": -3.0, "schedule": "power"}, "tau"),
    ("tol-negative", {"tol": -1.0}, "tol"),
    ("tol-string", {"tol": "tight"}, "tol"),
    ("max_iter-zero", {"max_iter": 0, "n": None}, "max_iter"),
    ("chunk_size-zero", {"chunk_size": 0}, "chunk_size"),
    ("chunk_size-negative", {"chunk_size": -10}, "chunk_size"),
    ("chunk_size-string", {"chunk_size": "big"}, "chunk_size"),
    ("start_sigma-zero", {"start_sigma": 0.0}, "start_sigma"),
    ("start_sigma-nan", {"start_sigma": np.nan}, "start_sigma"),
    ("start-unknown-variable", {"start": {"nope": 1.0}}, "nope"),
    ("start-nan", {"start": {"b0": np.nan}}, "b0"),
    ("mean_optimizer-unknown", {"mean_optimizer": "lbfgs"}, "mean_optimizer"),
    ("hyper_optimizer-unknown", {"hyper_optimizer": "bfgs"}, "hyper_optimizer"),
    ("hyper_marginal-unknown", {"hyper_marginal": "grid"}, "hyper_marginal"),
    ("n_rayleigh_nodes-zero", {"n_rayleigh_nodes": 0}, "n_rayleigh_nodes"),
    ("row_subsample-without-factorization", {"row_subsample": 5}, "row_subsample"),
    ("blas_threads-zero", {"blas_threads": 0}, "blas_threads"),
    ("callbacks-not-callable", {"callbacks": [5]}, "callbacks"),
    ("random_seed-string", {"random_seed": "seed"}, "random_seed"),
    ("method-misspelled", {"method": "hmc-ssvi"}, "method"),
    ("inf_kwargs-and-direct", {"inf_kwargs": {"hyper": "point"}, "hyper": "point"}, "hyper"),
    ("fixed_draws-string", {"fixed_draws": "yes"}, "fixed_draws"),
    ("start_sigma-unknown-variable", {"start_sigma": {"nope": 1.0}}, "nope"),
    ("compile_kwargs-not-dict", {"compile_kwargs": 5}, "compile_kwargs"),
    ("linear_response-string", {"linear_response": "no"}, "linear_response"),
]

#: Bad keywords tried on the matrix factorization (options that only apply there).
BAD_MF_KWARGS = [
    ("bilinear_draws-zero", {"bilinear_draws": 0}, "bilinear_draws"),
    ("bilinear_draws-string", {"bilinear_draws": "many"}, "bilinear_draws"),
    ("row_subsample-zero", {"row_subsample": 0}, "row_subsample"),
    ("row_subsample-negative", {"row_subsample": -2}, "row_subsample"),
]


def _kwarg_cases() -> list[Case]:
    out = []
    for fam_name, table in [("gaussian", BAD_KWARGS), ("mf", BAD_MF_KWARGS)]:
        fam = FAMILIES[fam_name]
        for label, kwargs, keyword in table:
            fit = {**_fit_kwargs(fam), **kwargs}
            out.append(
                Case(
                    f"{fam.name}/kwarg-{label}",
                    fam.name,
                    functools.partial(_clean_model, fam),
                    fit,
                    (keyword,),
                    keyword=True,
                    must_raise=True,
                )
            )
    return out


def all_cases() -> list[Case]:
    """The whole matrix, in a fixed order."""
    out = []
    for fam in FAMILIES.values():
        out += _data_faults(fam)
        out += _shape_faults(fam)
        out += _index_faults(fam)
        out.append(_empty(fam))
        out += _columns(fam)
        out += _scaled(fam)
    out += _separation()
    out += _heavy_tails()
    out += _zero_inflation()
    out += _kwarg_cases()
    ids = [c.id for c in out]
    dupes = {i for i in ids if ids.count(i) > 1}
    assert not dupes, f"duplicate case ids: {sorted(dupes)}"
    return out


#: The representative subset run by the fast suite: one of each kind of fault.
FAST = (
    "bernoulli/nan-in-X+data",
    "bernoulli/inf-in-offset",
    "poisson/-inf-in-y",
    "gaussian/nan-in-y",
    "gaussian/short-X+data",
    "gaussian/extra-column-X+data",
    "glmm/negative-g+data",
    "glmm/out-of-range-g",
    "glmm/float-fractional-g",
    "mf/far-out-of-range-cols",
    "mf/nan-in-y+data",
    "topic/nan-in-topics+data",
    "minibatch/inf-in-X",
    "ordinal/empty",
    "bernoulli/collinear-column",
    "gaussian/covariates-scaled-1e+08",
    "gaussian/observed-scaled-1e-08",
    "bernoulli/separable-flat-prior",
    "bernoulli/separable-normal-prior",
    "bernoulli/overlapping-flat-prior",
    "minibatch/short-X",
    "topic/short-total+data",
    "gaussian/studentt-nu0.5",
    "zero-inflation/product",
    "gaussian/kwarg-unknown-keyword",
    "gaussian/kwarg-n-negative",
    "gaussian/kwarg-cov-unknown",
    "gaussian/kwarg-backend-unknown",
    "gaussian/kwarg-chunk_size-zero",
    "gaussian/kwarg-tol-string",
    "mf/kwarg-row_subsample-zero",
)


def fast_cases() -> list[Case]:
    by_id = {c.id: c for c in all_cases()}
    return [by_id[i] for i in FAST]
