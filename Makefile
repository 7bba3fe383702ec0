# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch that this machine keeps on disk; on a GPU machine install your CUDA/ROCm torch first.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/paradit generate --model flux2-tiny --device cpu --gpus 2 --ulysses 2 --verify-serial \
		--prompt "a lighthouse on a cliff at dusk" --seed 0 --out out/demo.png

# Three test processes on 2 cores (780 tests: 7:09 with three against 8:44 with two, on a machine also running other
# work): much of a test's time goes to waiting on its workers and subprocesses, which a third process fills. Each file
# runs whole in one of them (its module fixtures are built once).
test: $(STAMP)
	$(BIN)/ruff check paradit tests benchmarks
	$(BIN)/ruff format --check paradit tests benchmarks
	$(BIN)/python -m pytest -q -n 3 --dist loadfile --durations=15

lint: $(STAMP)
	$(BIN)/ruff check paradit tests benchmarks
	$(BIN)/ruff format --check paradit tests benchmarks

clean:
	rm -rf $(VENV) out
