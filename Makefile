# crispedit — two entry points that work on a fresh CPU machine:
#   make demo   edit 6 facts into SmolLM2 with crispedit and ft, print before/after + drift
#               (runs results/demo/command.sh: the command whose output results/demo/demo.txt stores)
#   make test   ruff (the formatter's check, then the linter), then unit tests + the real-model tests chosen for CI,
#               printing the 25 slowest (installs chromium for the playground's browser test when it is missing
#               and apt-get can, as root; goes on without it otherwise), then the documentation site, strictly
#               (make docs)
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
PIP     := $(VPY) -m pip
STAMP   := $(VENV)/.crispedit-installed

.PHONY: venv demo test test-all test-slow bench docs results clean

venv: $(STAMP)

# Idempotent: the stamp is rebuilt only when the dependency files change.
$(STAMP): pyproject.toml requirements-lock.txt requirements-nodeps.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check torch==2.13.0
	$(PIP) install -q --disable-pip-version-check -r requirements-lock.txt
	$(PIP) install -q --disable-pip-version-check --no-deps -r requirements-nodeps.txt
	$(PIP) install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

demo: venv
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" sh results/demo/command.sh

test: venv
	$(VENV)/bin/ruff format --check src tests benchmarks results scripts
	$(VENV)/bin/ruff check src tests benchmarks results scripts
	-sh scripts/ensure_chromium.sh
	$(VPY) -m pytest -q -m "not slow or ci" --durations=25
	$(MAKE) docs

# The documentation site (mkdocs.yml: docs/, results/, the API reference from the docstrings, the CLI's --help)
# into build/site, strict: a dead link or anchor, a page left out of the navigation or a renamed function
# in the API reference fails the build. Offline: no fonts or scripts fetched.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# Regenerate every table and figure of results/, results/README.md and the README's generated blocks.
results: venv
	$(VPY) results/make.py

test-all: venv
	$(VPY) -m pytest -q

test-slow: venv
	$(VPY) -m pytest -q -m slow

bench: venv
	$(VPY) benchmarks/bench_projection.py
	$(VPY) benchmarks/bench_kfac.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
