# rcdl developer commands. Everything installs into the current interpreter ($(PYTHON)).
PYTHON ?= python3

.PHONY: setup demo test bench lint check-results

# torch==2.13.0 is installed only when no torch is importable, so a user's own (CUDA) build is kept.
setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "torch==2.13.0"
	$(PYTHON) -m pip install -e ".[dev,classical,faiss]"

demo: setup
	$(PYTHON) -m rcdl demo

# RCDL_REQUIRE_FAISS: the retrieval tests fail, not skip, if the faiss extra did not install
test: setup
	RCDL_REQUIRE_FAISS=1 $(PYTHON) -m pytest -q

bench:
	$(PYTHON) benchmarks/bench_attention.py

lint:
	$(PYTHON) -m ruff check src tests benchmarks

# Re-run every committed --quick configuration under results/ and compare it with its committed
# numbers (docs/results.md): tightly on the machine class recorded there (CPU ISA, torch, threads;
# the runs use 1 thread unless $OMP_NUM_THREADS or ARGS="--threads N"), loosely elsewhere.
# Data: $RCDL_DATA, else ../shared/data; extra flags in ARGS, e.g.
# make check-results ARGS="--only cifar10-1epoch --data-dir DIR"   (or ARGS=--update, --list)
check-results:
	$(PYTHON) benchmarks/check_results.py $(ARGS)
