"""``describe(model)``: what the plugin recognized in a PyMC model, as a table."""

from __future__ import annotations

import html
import time
from dataclasses import dataclass, field

import pymc as pm
import pytensor

from pymc_mcssvi.recognize.graph import evaluate_static
from pymc_mcssvi.recognize.ir import TwoLevelModel
from pymc_mcssvi.recognize.layout import arrow_head
from pymc_mcssvi.recognize.model import recognize
from pymc_mcssvi.recognize.roles import dist_name

__all__ = ["ModelDescription", "describe"]


@dataclass
class ModelDescription:
    """Roles, covariance structure and predictor forms of a two-level model.

    Attributes
    ----------
    variables : list of dict
        One row per free variable: ``name``, ``role``, ``distribution``,
        ``shape``, ``q`` (the variational family / covariance structure), ``note``.
    observed : list of dict
        One row per observed variable: ``name``, ``distribution``,
        ``predictor`` (dense affine, gather, bilinear, general, ...), ``size``,
        ``scaling``.
    notes : list of str
    seconds : float
        Time the recognition took.
    tlm : TwoLevelModel
        The engine's representation.
    """

    variables: list[dict] = field(default_factory=list)
    observed: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    tlm: TwoLevelModel | None = None

    def role(self, name: str) -> str:
        """Role of a free variable."""
        return next(r["role"] for r in self.variables if r["name"] == name)

    def structure(self, name: str) -> str:
        """Variational family / covariance structure of a free variable."""
        return next(r["q"] for r in self.variables if r["name"] == name)

    def predictor(self, name: str) -> str:
        """Predictor form of an observed variable."""
        return next(r["predictor"] for r in self.observed if r["name"] == name)

    def __str__(self) -> str:
        out = [
            _table(
                self.variables,
                ["name", "role", "distribution", "shape", "q", "note"],
                "Free variables",
            )
        ]
        out.append(
            _table(
                self.observed,
                ["name", "distribution", "predictor", "size", "scaling"],
                "Observed variables",
            )
        )
        if self.notes:
            out.append("Notes:\n" + "\n".join(f"  - {n}" for n in self.notes))
        return "\n\n".join(out)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        def tab(rows, cols, title):
            head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
            body = "".join(
                "<tr>"
                + "".join(f"<td>{html.escape(str(r.get(c, '')))}</td>" for c in cols)
                + "</tr>"
                for r in rows
            )
            return f"<h4>{html.escape(title)}</h4><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

        parts = [
            tab(
                self.variables,
                ["name", "role", "distribution", "shape", "q", "note"],
                "Free variables",
            ),
            tab(
                self.observed,
                ["name", "distribution", "predictor", "size", "scaling"],
                "Observed variables",
            ),
        ]
        if self.notes:
            parts.append(
                "<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in self.notes) + "</ul>"
            )
        return "".join(parts)


def _table(rows, cols, title):
    widths = {c: max([len(c)] + [len(str(r.get(c, ""))) for r in rows]) for c in cols}
    line = "  ".join(c.ljust(widths[c]) for c in cols)
    sep = "  ".join("-" * widths[c] for c in cols)
    body = ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join([title, line, sep, *body])


def describe(model: pm.Model | None = None, cov=None, *, show: bool = False) -> ModelDescription:
    """Recognize ``model`` and describe the result.

    Parameters
    ----------
    model : pm.Model, optional
    cov : str or dict, optional
        Covariance structure override, as for the inference classes.
    show : bool
        Also print the table.

    Returns
    -------
    ModelDescription
        Printable (text table) and displayable in notebooks (HTML).

    Raises
    ------
    UnsupportedModelError
        When the model cannot be handled; the message names the variable.

    Examples
    --------
    >>> import numpy as np, pymc as pm
    >>> import pymc_mcssvi
    >>> g = np.repeat(np.arange(4), 5)
    >>> with pm.Model() as m:
    ...     b = pm.Normal("b", 0, 1)
    ...     sd = pm.HalfNormal("sd", 1)
    ...     a = pm.Normal("a", 0, sd, shape=4)
    ...     _ = pm.Poisson("y", pm.math.exp(b + a[g]), observed=np.ones(20, dtype=int))
    >>> d = pymc_mcssvi.describe(m)
    >>> d.role("a"), d.role("sd"), d.predictor("y")
    ('gaussian global', 'hyperparameter', 'dense affine + gather')
    """
    model = pm.modelcontext(model)
    t0 = time.perf_counter()
    with pytensor.config.change_flags(mode="FAST_COMPILE"):
        tlm = recognize(model, cov=cov)
    seconds = time.perf_counter() - t0

    seg_of = {gid: s for s, seg in enumerate(tlm.segments) for gid in seg.members}
    rows = []
    for i, g in enumerate(tlm.gaussians):
        seg = tlm.segments[seg_of[i]]
        others = [tlm.gaussians[j].name for j in seg.members if j != i]
        if seg.kind == "full":
            q = f"full ({seg.dim} x {seg.dim})"
        elif seg.kind == "block":
            q = f"block {seg.rows} x ({seg.k} x {seg.k})"
        else:
            q = f"diag ({seg.dim})"
        if others:
            q += " with " + ", ".join(others)
        rows.append(
            dict(
                name=g.name,
                role="gaussian global",
                distribution=dist_name(g.rv),
                shape=g.shape,
                q=q,
                note="",
            )
        )
    for r in tlm.rayleighs:
        rows.append(
            dict(
                name=r.name,
                role="rayleigh global",
                distribution=dist_name(r.rv),
                shape=r.shape,
                q="Rayleigh",
                note="",
            )
        )
    for lc in tlm.locals:
        how = "quadrature" if lc.kind == "gaussian" else f"enumeration ({lc.support} values)"
        rows.append(
            dict(
                name=lc.name,
                role=f"local, marginalized by {how}",
                distribution=dist_name(lc.rv),
                shape=lc.shape,
                q="integrated out",
                note=f"of {lc.observed!r}",
            )
        )
    for leaf in tlm.leaves:
        rows.append(
            dict(
                name=leaf.name,
                role="predictive leaf",
                distribution=dist_name(leaf.rv),
                shape=leaf.shape,
                q="prior given the others",
                note="nothing reads it: left out of the fit, drawn exactly by approx.sample",
            )
        )
    for h in tlm.hypers:
        rows.append(
            dict(
                name=h.name,
                role="hyperparameter",
                distribution=dist_name(h.rv),
                shape=h.shape,
                q="meanfield Gaussian or point (hyper=)",
                note=h.reason,
            )
        )
    order = {rv.name: k for k, rv in enumerate(model.free_RVs)}
    rows.sort(key=lambda r: order.get(r["name"], 0))

    obs_rows = []
    for obs in model.observed_RVs:
        size = obs.type.shape
        if None in size:  # dims= or pm.Data: the length is a graph of the data
            try:
                size = tuple(int(s) for s in evaluate_static([obs.shape])[0])
            except Exception:
                size = None
        obs_rows.append(
            dict(
                name=obs.name,
                distribution=dist_name(obs),
                predictor=tlm.observed.get(obs.name, "?"),
                size="?" if size is None else "x".join(str(s) for s in size) or "1",
                scaling=tlm.scaling.get(obs.name, "1"),
            )
        )
    notes = list(tlm.notes)
    head = arrow_head(tlm)
    if head is not None:
        names = lambda segs: ", ".join(tlm.gaussians[j].name for s in segs for j in s.members)  # noqa: E731
        body = [seg for s, seg in enumerate(tlm.segments) if s != head]
        notes.append(
            f"q's segments are independent, but the steps (and, with linear_response, the draws) keep the "
            f"coupling of {names([tlm.segments[head]])} with {names(body)} (arrow curvature)"
        )
    desc = ModelDescription(rows, obs_rows, notes, seconds, tlm)
    if show:
        print(desc)
    return desc
