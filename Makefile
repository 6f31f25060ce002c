# Every target creates .venv itself (Python 3.12 through pyenv's .python-version).
PYTHON ?= $(shell pyenv which python 2>/dev/null || command -v python3.12 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-docs test-all lint docs bench paper-page notebooks clean

DEMO_STAMP := $(VENV)/.installed-demo

$(BIN)/python:
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 12), f"Python 3.12+ needed, got {sys.version}"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# the demo needs the package and scikit-learn only (the tests add JAX, Bambi, ruff, ...)
$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[demo]"
	touch $(DEMO_STAMP)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[test,demo,data]"
	touch $(STAMP) $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/python -m pymc_mcssvi.demo

# The fast suite (6 minutes or less on 2 cores). Tests marked `slow` (NUTS comparisons,
# larger fits, the notebooks) run with `make test-slow`, the code blocks of README.md and
# docs/ with `make test-docs`; `make test-all` runs all three.
PYTEST := $(BIN)/python -m pytest -q -x -n auto --durations=15

test: $(STAMP)
	$(PYTEST) -m "not slow" --doctest-modules pymc_mcssvi tests

test-slow: $(STAMP)
	$(PYTEST) -m slow tests

# Every python block of the pages, in order, one process (blocks of a page share state:
# docs/conftest.py).
test-docs: $(STAMP)
	$(BIN)/python -m pytest -q -p no:xdist --markdown-docs -m markdown-docs --durations=10 \
		README.md docs/*.md docs/howto/*.md

test-all: test test-slow test-docs

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[bench]"
	$(BIN)/python benchmarks/glm_logistic.py
	$(BIN)/python benchmarks/glmm.py
	$(BIN)/python benchmarks/gme.py
	$(BIN)/python benchmarks/pmf.py
	$(BIN)/python benchmarks/schedules.py
	$(BIN)/python docs/scripts/paper_reproduction.py

# docs/paper_reproduction.md and the README's headline numbers, from benchmarks/results/*.json
# (standard library only; tests/docs/test_paper_page.py checks that both are up to date)
paper-page: | $(BIN)/python
	$(BIN)/python docs/scripts/paper_reproduction.py

docs: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[docs]"
	$(BIN)/sphinx-build -W --keep-going -b html docs docs/_build/html

notebooks: $(STAMP)
	$(BIN)/python notebooks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache docs/_build docs/generated docs/notebooks
