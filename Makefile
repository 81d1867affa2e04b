# Two commands on a fresh clone: `make run` (the main job) and `make test`.
# Both create .venv from the pinned lock (requirements.txt) and reinstall when it changes.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

export PYTHONHASHSEED := 0

.PHONY: setup run test lint docs test-slow test-browser bench gpu-check clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; set PYTHON=/path/to/python3.11"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/ckptlab notebooks run --file default --out results

# Two test workers on two cores, one PyTorch thread each: more threads than cores makes every
# torch op several times slower (OpenMP threads wait on each other), and tests assert properties, not speed.
# The 20 slowest are listed at the end: where the suite's time goes.
test: $(STAMP) lint
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadscope --durations=20 tests notebooks --nbval-lax --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg

# The layers of docs/design.md (import-linter contracts in pyproject.toml) and ruff's small rule set.
lint: $(STAMP)
	$(BIN)/lint-imports --no-cache
	$(BIN)/ruff check ckptlab tests benchmarks

# Opt-in, minutes: the wheel installed into a fresh venv with only the core dependencies measures.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -p no:xdist -m slow tests

# The documentation site, offline, into site/: the pages in docs/, the executed notebooks of
# results/ with their figures, and the API reference from the docstrings (mkdocs.yml).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# Opt-in: the explorer (notebook 06) in JupyterLab in headless Chromium, installed from Debian if
# missing; a slider and a dropdown change re-measure. Screenshots + report.json in results/browser-check/.
# Also the built documentation site: notebook 02's page shows its figure (tests/browser/test_docs_browser.py).
test-browser: $(STAMP)
	timeout -s INT 900 $(BIN)/python -m pytest -q -p no:xdist -m browser tests/browser

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py

# GPU validation (ckptlab/apps/gpu_check.py): every claim ckptlab makes about a GPU, within 8 minutes,
# into results/gpu-check-<device>/ with report.md (pass or fail per claim). Exits 2 without a GPU.
# It builds nothing: the venv's Python where there is one, else the machine's own python3 (a GPU
# image without network has its own torch; the check needs nothing else to start).
gpu-check:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,python3) -m ckptlab.apps.gpu_check

clean:
	rm -rf $(VENV)
