"""Sphinx configuration for the pymc-mcssvi documentation.

Build with ``make docs`` (``sphinx-build -W --keep-going -b html docs docs/_build/html``):
warnings are errors. Nothing here needs the network, and notebooks are rendered
from their stored outputs, never executed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pymc_mcssvi

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

project = "pymc-mcssvi"
author = "pymc-mcssvi developers"
copyright = "pymc-mcssvi developers"
version = release = pymc_mcssvi.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "numpydoc",
    "myst_nb",  # includes myst_parser: Markdown pages and .ipynb notebooks
]

# --------------------------------------------------------------------- notebooks
# The notebooks live in ../notebooks (outside the source directory). They are
# copied into docs/notebooks/ (gitignored) at every build: no symlinks, no extra
# extension, and the copy only happens when a file changed so that Sphinx's
# incremental build still works. Stale copies of removed notebooks are deleted.
NOTEBOOKS_SRC = ROOT / "notebooks"
NOTEBOOKS_DST = HERE / "notebooks"


def _copy_notebooks() -> None:
    NOTEBOOKS_DST.mkdir(exist_ok=True)
    sources = {p.name: p for p in NOTEBOOKS_SRC.glob("*.ipynb")}
    for stale in NOTEBOOKS_DST.glob("*.ipynb"):
        if stale.name not in sources:
            stale.unlink()
    for name, src in sorted(sources.items()):
        dst = NOTEBOOKS_DST / name
        if not dst.exists() or dst.read_bytes() != src.read_bytes():
            shutil.copy2(src, dst)


_copy_notebooks()

nb_execution_mode = "off"  # render stored outputs; the docs build never runs a notebook
nb_merge_streams = True

# ------------------------------------------------------------------------- MyST
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# ---------------------------------------------------------------------- autodoc
autosummary_generate = True  # stubs go to docs/generated/ (gitignored)
autodoc_typehints = "none"  # numpydoc's Parameters sections carry the types
autodoc_member_order = "bysource"
# Overridden methods without a docstring of their own (Rayleigh.logp, the
# approximation's mean/std/cov ...) would otherwise show PyMC's docstrings.
autodoc_inherit_docstrings = False
# Members inherited from PyMC (Inference, Approximation, PositiveContinuous) and
# from the builtin exceptions are not re-documented here: PyMC documents them,
# and on StructuredApproximation they would bury the API under ~25 PyMC
# internals (logq, symbolic_*, ...) that do not apply to the structured q. The
# base-class names are passed to ``:inherited-members:`` in
# _templates/autosummary/class.rst, which keeps members inherited between our
# own classes (e.g. MCSSVI.fit from StructuredVI). No warning is suppressed.
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

# No intersphinx: the build must work without network access.

templates_path = ["_templates"]
exclude_patterns = ["_build", "**.ipynb_checkpoints", "Thumbs.db", ".DS_Store"]

# ------------------------------------------------------------------------- HTML
html_theme = "pydata_sphinx_theme"
html_title = "pymc-mcssvi"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
}
# The GME benchmark writes its figure to docs/_static/; the directory may not exist.
html_static_path = ["_static"] if (HERE / "_static").is_dir() else []
