"""``docs/paper_reproduction.md`` and the README's headline numbers are generated from the JSON.

``docs/scripts/paper_reproduction.py`` writes every number of the page and of the
README block between ``<!-- headline:start -->`` and ``<!-- headline:end -->`` from
``benchmarks/results/*.json``. These tests fail when either was edited by hand or a
results file changed without ``make paper-page``.
"""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docs" / "scripts" / "paper_reproduction.py"


def _generator():
    name = "paper_reproduction_generator"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_the_page_is_what_the_results_generate():
    gen = _generator()
    page = gen.render_page(gen.load_results())
    assert (ROOT / "docs" / "paper_reproduction.md").read_text() == page, (
        "docs/paper_reproduction.md differs from what benchmarks/results/*.json generate: "
        "run `make paper-page` (and edit docs/scripts/paper_reproduction.py, not the page)"
    )


def test_the_readme_headline_numbers_are_what_the_results_generate():
    gen = _generator()
    readme = (ROOT / "README.md").read_text()
    assert gen.README_START in readme and gen.README_END in readme
    assert readme == gen.readme_text(gen.load_results(), readme), (
        "README.md's headline numbers differ from what benchmarks/results/*.json generate: "
        "run `make paper-page`"
    )


def test_a_changed_result_changes_the_page(tmp_path):
    gen = _generator()
    results = tmp_path / "results"
    shutil.copytree(ROOT / "benchmarks" / "results", results)
    path = results / "gme.json"
    if not path.exists():
        path = results / "gme_quick.json"
    data = json.loads(path.read_text())
    glm = next(r for r in data["runs"] if r["name"] == "GLM (H-MC-SSVI)")
    glm["nll"] = 9.8765
    path.write_text(json.dumps(data))
    page = gen.render_page(gen.load_results(results))
    assert "9.8765" in page
    assert page != (ROOT / "docs" / "paper_reproduction.md").read_text()
