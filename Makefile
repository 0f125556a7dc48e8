# rcdl developer commands. Everything installs into the current interpreter ($(PYTHON)).
PYTHON ?= python3

.PHONY: setup demo test bench lint

# torch==2.13.0 is installed only when no torch is importable, so a user's own (CUDA) build is kept.
setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "torch==2.13.0"
	$(PYTHON) -m pip install -e ".[dev,classical]"

demo: setup
	$(PYTHON) -m rcdl demo

test: setup
	$(PYTHON) -m pytest -q

bench:
	$(PYTHON) benchmarks/bench_attention.py

lint:
	$(PYTHON) -m ruff check src tests benchmarks
