# Two commands on a fresh clone: `make run` (the main job) and `make test`.
# Both create .venv from the pinned lock (requirements.txt) and reinstall when it changes.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

export MPLBACKEND := agg
export PYTHONHASHSEED := 0

.PHONY: setup run test bench gpu-check clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; set PYTHON=/path/to/python3.11"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/ckptlab measure --model gpt-tiny --batch 4 --seq 64 --policy none,every=2,density=0.5,segments=sqrt,full

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py

# GPU validation of sweeps (ckptlab/gpu_check.py): a CUDA sweep at gpt2-small shape, tracker vs
# allocator peaks, one memory snapshot, into results/gpu-check-<device>/. Fails clearly without a GPU.
gpu-check: $(STAMP)
	$(BIN)/python -m ckptlab.gpu_check

clean:
	rm -rf $(VENV)
