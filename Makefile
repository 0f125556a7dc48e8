# rcdl developer commands. Everything installs into the current interpreter ($(PYTHON)).
PYTHON ?= python3

.PHONY: setup setup-demo torch demo test test-long bench lint typecheck check-results docs

# What the tests install: the test tools (the dev extra) and the library extras the tests use.
# The tools install through constraints.txt (their pinned versions) and `make test` checks the
# pins before it runs (.ci/pins.py): a fresh machine and a developer's run the same tools.
TEST_EXTRAS = dev,classical,faiss,triton,fast-cpu
comma := ,
PIP_PINNED = $(PYTHON) -m pip install -c constraints.txt

# torch==2.13.0 is installed only when no torch is importable, so a user's own (CUDA) build is kept.
torch:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "torch==2.13.0"

# The editable install is skipped when .setup-stamp says it was made by this interpreter from
# this pyproject.toml and constraints.txt, this checkout's rcdl and the extras are still found,
# and the installed tools match their pins (rm .setup-stamp to force it).
SETUP_KEY = $(shell $(PYTHON) -c "import hashlib, sys; h = hashlib.sha256(); [h.update(open(f, 'rb').read()) for f in ('pyproject.toml', 'constraints.txt')]; print(sys.executable, h.hexdigest()[:16])")
RCDL_FROM_HERE = import os; from importlib.util import find_spec as f; assert f('rcdl').origin.startswith(os.path.abspath('src'))
setup: torch
	@if [ "$$(cat .setup-stamp 2>/dev/null)" = "$(SETUP_KEY)" ] && $(PYTHON) -c "$(RCDL_FROM_HERE); import sys; sys.exit(not all(map(f, ('sklearn', 'faiss', 'triton', 'numba', 'pytest', 'xdist'))))" 2>/dev/null && $(PYTHON) .ci/pins.py --quiet $(subst $(comma), ,$(TEST_EXTRAS)) 2>/dev/null; then \
		echo "setup: rcdl and the test tools are installed from this checkout as pinned (rm .setup-stamp to reinstall)"; \
	else \
		$(PIP_PINNED) -e ".[$(TEST_EXTRAS)]" && echo "$(SETUP_KEY)" > .setup-stamp; \
	fi

# What the demo needs: rcdl itself (torch, numpy, tqdm, matplotlib), no extra (skipped where
# `make setup`, which installs more, is up to date).
DEMO_KEY = $(shell $(PYTHON) -c "import hashlib, sys; print(sys.executable, hashlib.sha256(open('pyproject.toml', 'rb').read()).hexdigest()[:16])")
setup-demo: torch
	@if { [ "$$(cat .setup-demo-stamp 2>/dev/null)" = "$(DEMO_KEY)" ] || [ "$$(cat .setup-stamp 2>/dev/null)" = "$(SETUP_KEY)" ]; } && $(PYTHON) -c "$(RCDL_FROM_HERE)" 2>/dev/null; then \
		echo "setup-demo: rcdl is installed from this checkout and pyproject.toml is unchanged (rm .setup-demo-stamp to reinstall)"; \
	else \
		$(PYTHON) -m pip install -e . && echo "$(DEMO_KEY)" > .setup-demo-stamp; \
	fi

demo: setup-demo
	$(PYTHON) -m rcdl demo

# RCDL_REQUIRE_EXTRAS: the tests of these extras (which setup installs) fail, not skip, if one
# did not install; without it they skip, naming the install command (tests/conftest.py). The
# triton extra's tests run the Triton kernels on CPU through Triton's interpreter.
# The tests run on TEST_WORKERS pytest-xdist workers of one thread each (one per core the
# process may use, at most 4; 0 runs them in this process), the tests that start processes of
# their own one after another on one worker (--dist loadgroup, tests/conftest.py). No test
# over 15 s on 2 cores; the 15 slowest are printed.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; n = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1; print(min(n, 4) if n > 1 else 0)")
test: setup
	$(PYTHON) .ci/pins.py $(subst $(comma), ,$(TEST_EXTRAS))
	RCDL_REQUIRE_EXTRAS=classical,faiss,triton,fast-cpu $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15

# The tests marked `long` (over 15 s on 2 cores, left out of `make test`), e.g. the quick
# cifar10-1epoch outcome with the ResNet-MLP baselines at the paper's width.
test-long: setup
	$(PYTHON) .ci/pins.py $(subst $(comma), ,$(TEST_EXTRAS))
	RCDL_REQUIRE_EXTRAS=classical,faiss,triton,fast-cpu $(PYTHON) -m pytest -q -m long --durations=15

bench:
	$(PYTHON) benchmarks/bench_attention.py

lint:
	$(PYTHON) -m ruff check src tests benchmarks tools

# mypy over src/rcdl with the settings of [tool.mypy] in pyproject.toml (mypy: the dev extra)
typecheck:
	$(PYTHON) -m mypy

# Re-run every committed --quick configuration under results/ and compare it with its committed
# numbers (docs/results.md): tightly on the machine class recorded there (CPU ISA, torch, threads;
# the runs use 1 thread unless $OMP_NUM_THREADS or ARGS="--threads N"), loosely elsewhere.
# Data: $RCDL_DATA, else ../shared/data; extra flags in ARGS, e.g.
# make check-results ARGS="--only cifar10-1epoch --data-dir DIR"   (or ARGS=--update, --list)
check-results:
	$(PYTHON) tools/check_results.py $(ARGS)

# The documentation site (mkdocs.yml) into site/; the docs extra is installed (as constraints.txt
# pins it) if mkdocs is missing or an installed docs tool differs from its pin.
# --strict: a broken link, a page missing from the nav or a docstring not matching its
# signature fails the build (docs/contributing.md).
docs:
	@$(PYTHON) -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null && $(PYTHON) .ci/pins.py --quiet docs 2>/dev/null || $(PIP_PINNED) -e ".[docs]"
	$(PYTHON) -m mkdocs build --strict
