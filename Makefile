# One-command set-up: `make demo` trains the CPU demo and lets the model continue a prompt,
# `make test` runs the whole suite.
# Both create .venv on first use and install the torch pinned below (its CPU wheel where pip finds one
# locally; elsewhere give TORCH_INDEX=https://download.pytorch.org/whl/cpu so no multi-GB CUDA build is
# pulled); on a GPU machine install your CUDA torch into .venv first (see README).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.megatron_ds-installed

.PHONY: install lint format test demo clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): setup.py $(BIN)/python
	@$(BIN)/python -c "import torch" 2>/dev/null || \
		$(BIN)/python -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# ruff (pinned in setup.py's test extra) checks style and formatting; `make format` fixes both.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Two pytest-xdist workers, whole files each (module fixtures stay shared): a multi-rank test leaves a core idle
# while it imports, launches and checks, and the other worker fills it (~25% less wall time on 2 cores).
TEST_WORKERS ?= 2
test: lint
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

demo: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" bash examples/pretrain_gpt_cpu_demo.sh

clean:
	rm -rf $(VENV) demo_data checkpoints runs
