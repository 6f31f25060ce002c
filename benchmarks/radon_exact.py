"""Exact marginal posterior of radon's scales, and what a Gaussian q(log sigma) can reach.

The GLMM benchmark's radon model (``glmm.py``: ``log.radon ~ basement + uranium +
(1 | county)``, intercept N(0, 5), coefficients N(0, 2.5), scales HalfNormal(1),
the same 80% training rows) is Gaussian given the scales, so
``p(y | sigma_county, sigma_y)`` is a Gaussian density in closed form (effects
integrated out) and the marginal posterior of ``h = log sigma`` is exact on a
grid. The script prints the exact posterior mean of ``sigma_county``, the
Laplace approximation of ``log sigma_county``'s marginal (the Gaussian that the
plugin's linear-response q(h) approximates), and split-normal corrections fitted
to the log density at ``+-z`` Laplace sds, which measure how much of the
centered models' scale-mean miss a skewed q(h) could recover.

Run ``python benchmarks/radon_exact.py`` (about 30 s on 2 cores).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import glmm  # noqa: E402


def log_marginal_grid(hc, hy, seed=0):
    """``log p(h_c, h_y | y)`` (unnormalized) on the grid ``hc x hy`` of log scales."""
    data = glmm.load_radon(seed)
    tr = data.train
    X, y = data.X[tr], data.y[tr]
    g = data.terms[0].index[tr]
    n = len(y)
    D0 = np.column_stack([np.ones(n), X])
    A = D0 @ np.diag([25.0, 6.25, 6.25]) @ D0.T
    Z = np.zeros((n, data.terms[0].n_groups))
    Z[np.arange(n), g] = 1.0
    ZZ = Z @ Z.T
    lp = np.empty((len(hc), len(hy)))
    for i, a in enumerate(hc):
        for j, b in enumerate(hy):
            sc, sy = np.exp(a), np.exp(b)
            L = np.linalg.cholesky(A + sc**2 * ZZ + sy**2 * np.eye(n))
            r = np.linalg.solve(L, y)
            # Gaussian marginal likelihood + HalfNormal(1) priors + log-Jacobians
            lp[i, j] = -0.5 * r @ r - np.log(np.diag(L)).sum() - 0.5 * (sc**2 + sy**2) + a + b
    return lp


def main():
    hc = np.linspace(np.log(0.005), np.log(0.5), 90)
    hy = np.linspace(np.log(0.65), np.log(0.86), 40)
    lp = log_marginal_grid(hc, hy)
    w = np.exp(lp - lp.max())
    w /= w.sum()
    mc = w.sum(1)
    mean_c = (mc * np.exp(hc)).sum()
    sd_c = np.sqrt((mc * np.exp(2 * hc)).sum() - mean_c**2)
    print(
        f"exact: E[sigma_county] = {mean_c:.4f} (sd {sd_c:.4f}), "
        f"E[sigma_y] = {(w.sum(0) * np.exp(hy)).sum():.4f}"
    )
    m = (mc * hc).sum()
    s_exact = np.sqrt((mc * hc**2).sum() - m**2)
    lm = np.log(mc)
    k = int(np.argmax(lm))
    step = hc[1] - hc[0]
    s = 1.0 / np.sqrt(-(lm[k + 1] - 2 * lm[k] + lm[k - 1]) / step**2)
    print(f"log sigma_county: exact mean {m:.3f}, sd {s_exact:.3f}; mode {hc[k]:.3f}")
    print(
        f"Laplace (Gaussian at the mode): sd {s:.3f}, E[sigma_county] = "
        f"{np.exp(hc[k] + s * s / 2):.4f} ({np.exp(hc[k] + s * s / 2) / mean_c - 1:+.0%})"
    )
    eps = np.random.default_rng(0).standard_normal(400_000)
    for z in (1.0, 1.5, 2.0):
        dl = lm[k] - np.interp(hc[k] - z * s, hc, lm)
        dr = lm[k] - np.interp(hc[k] + z * s, hc, lm)
        sl, sr = z * s / np.sqrt(2 * dl), z * s / np.sqrt(2 * dr)
        e = np.exp(hc[k] + np.where(eps < 0, sl, sr) * eps).mean()
        print(
            f"split normal from +-{z} sds: left sd {sl:.3f}, right sd {sr:.3f}, "
            f"E[sigma_county] = {e:.4f} ({e / mean_c - 1:+.0%})"
        )


if __name__ == "__main__":
    main()
