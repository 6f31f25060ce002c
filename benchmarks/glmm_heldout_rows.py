"""Where grouseticks' held-out NLL differs from NUTS's: the rows, their groups, their effects.

The GLMM benchmark (``glmm.py``) finds H-MC-SSVI's held-out NLL on grouseticks
about 1% *below* (better than) NUTS's, for both parameterizations, while every
other accuracy target passes. This script splits that difference by held-out
row: for each row, ``-log mean_s p(y_i | theta_s)`` under the plugin's draws
minus the same under the cached NUTS reference draws, and for the rows that
contribute most it prints the count and, for each grouping factor, the group's
number of training rows and the posterior mean (sd) of its effect under both.

It needs the NUTS draws cached by a run of ``python benchmarks/glmm.py``
(``benchmarks/.cache/``). Run ``python benchmarks/glmm_heldout_rows.py`` (about
10 s).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
from scipy.special import gammaln, logsumexp

sys.path.insert(0, str(Path(__file__).parent))
import glmm  # noqa: E402


def per_row_nll(d, data):
    """``-log mean_s p(y_i | theta_s)`` for each held-out row (Poisson)."""
    te = data.test
    eta = d["intercept"][:, None] + d["beta"] @ data.X[te].T
    for t in data.terms:
        eta = eta + d[t.effect][:, t.index[te]]
    y = data.y[te]
    ll = y[None] * eta - np.exp(eta) - gammaln(y + 1.0)[None]
    return -(logsumexp(ll, axis=0) - np.log(ll.shape[0]))


def main(seed=0, n_rows=5):
    import pymc as pm

    import pymc_mcssvi  # noqa: F401  (registers the methods)

    data = glmm.load_grouseticks(seed)
    key = glmm.data_key(data, seed)
    te, tr = np.flatnonzero(data.test), np.flatnonzero(data.train)
    for centered in (False, True):
        tag = "centered" if centered else "noncentered"
        hits = sorted(glmm.CACHE.glob(f"glmm_nuts_grouseticks_{tag}_{key}_*.npz"))
        if not hits:
            sys.exit(f"no cached NUTS draws for {tag}: run `python benchmarks/glmm.py` first")
        z = np.load(hits[-1])
        nuts = {k[2:]: z[k] for k in z.files if k.startswith("d_")}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with glmm.build_model(data, centered):
                ap = pm.fit(method="hmcssvi", random_seed=1, progressbar=False)
        vi = glmm.approx_draws(ap, data, centered, 4000)
        a, b = per_row_nll(vi, data), per_row_nll(nuts, data)
        diff = a - b
        order = np.argsort(diff)
        top = order[:n_rows]
        print(
            f"{tag}: held-out NLL plugin {a.mean():.4f}, NUTS {b.mean():.4f} "
            f"({100 * (a.mean() - b.mean()) / b.mean():+.2f}%); the {n_rows} rows the plugin "
            f"predicts best relative to NUTS carry {diff[top].sum():+.2f} of the total "
            f"{diff.sum():+.2f} nats ({len(diff)} rows)"
        )
        for nm in glmm.scale_names(data):
            print(f"  {nm}: plugin {vi[nm].mean():.3f}, NUTS {nuts[nm].mean():.3f}")
        for i in top:
            row = te[i]
            print(f"  row {row}: y = {int(data.y[row])}, plugin - NUTS {diff[i]:+.3f} nats")
            for t in data.terms:
                gi = t.index[row]
                n_tr = int((t.index[tr] == gi).sum())
                e_v, e_n = vi[t.effect][:, gi], nuts[t.effect][:, gi]
                print(
                    f"    {t.effect}[{gi}] ({n_tr} training rows): plugin {e_v.mean():+.3f} "
                    f"({e_v.std():.3f}), NUTS {e_n.mean():+.3f} ({e_n.std():.3f})"
                )


if __name__ == "__main__":
    main()
