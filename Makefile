# The two commands of the quick start, and the pieces they are made of
# (`make help` lists them).
#   make bench   a venv with torch, numpy, matplotlib and tqdm, fastpin built into it,
#                then the side-by-side benchmark
#   make test    the C core's tests (plain, ASan+UBSan, TSan), then pytest in the same
#                venv with the development packages added
# fastpin goes into the venv as an editable install: the source tree is the package,
# its extension built beside the sources, so `python -m fastpin.bench` and `import
# fastpin` work from the clone's root too (docs/development.md says why).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch the venv gets. Empty: chosen by the machine (torch.stamp below, which
# says what it is about to download and why before it does). Else pip's own words,
# used as given, e.g. TORCH_SPEC=torch==2.13.0+cpu or
# TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128".
TORCH_SPEC ?=
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# The Pythons `make test-pythons` builds fastpin for (default: every 3.10-3.13 found).
PYTHONS ?=
export FASTPIN_WERROR ?= 1

.PHONY: help bench test test-c test-py test-asan-py test-tsan-py test-pythons notebook install install-dev clean

help:
	@echo "make bench         venv in $(VENV) (torch, numpy, matplotlib, tqdm) + fastpin, then the benchmark (BENCH_ARGS=--quick: short)"
	@echo "make test          test-c, then test-py: what CI runs first"
	@echo "make test-c        the C core's tests: plain, ASan+UBSan, TSan (tests/c)"
	@echo "make test-py       pytest in $(VENV), with requirements-dev.txt added (PYTEST_ARGS=...)"
	@echo "make test-asan-py  pytest of pin_memory, zero-copy, the Loader, settings on an ASan+UBSan build"
	@echo "make test-tsan-py  pytest of the copy pool from many Python threads on a TSan build"
	@echo "make test-pythons  each Python 3.10-3.13 found (PYTHONS=...): fastpin built into a"
	@echo "                   venv without torch (.venv-py3.X), and the tests that need no torch"
	@echo "make notebook      examples/compare_throughput.ipynb run headless in $(VENV), to out/"
	@echo "make install       only the venv of make bench, fastpin in it"
	@echo "make install-dev   the same, with requirements-dev.txt (what make test uses)"
	@echo "make clean         remove the venvs, build outputs and the C tests' builds"
	@echo "Variables: PYTHON=$(PYTHON) VENV=$(VENV) TORCH_SPEC=\"$(TORCH_SPEC)\" (empty: CPU build unless a GPU is found)"
	@echo "           TORCH_VERSION=$(TORCH_VERSION) TORCH_CPU_INDEX=$(TORCH_CPU_INDEX) (the default torch, when TORCH_SPEC is empty)"
	@echo "           FASTPIN_WERROR=$(FASTPIN_WERROR) BENCH_ARGS=\"$(BENCH_ARGS)\" (make bench's options)"
	@echo "           PYTEST_ARGS=\"$(PYTEST_ARGS)\" (make test-py's) PYTHONS=\"$(PYTHONS)\" (make test-pythons')"

# Each step says what it does before it does it: the first line comes at once.
$(VENV)/venv.stamp:
	@echo "make: a virtual environment in $(VENV) ($$($(PYTHON) --version 2>&1)); pip's own messages follow"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	touch $@

# The torch build. With TORCH_SPEC empty: the CPU build unless an NVIDIA GPU is
# found, first from pip's own configured indexes and find-links (a dry run that
# fetches their index page only: PyPI has no +cpu builds, a machine's local wheels
# may), else from PyTorch's CPU index; with a GPU, PyPI's build, the CUDA one.
# torch-constraint.txt then holds the version installed, so that no later pip
# command of the venv replaces it.
$(VENV)/torch.stamp: $(VENV)/venv.stamp
	@set -e; \
	if [ -n '$(TORCH_SPEC)' ]; then \
		spec='$(TORCH_SPEC)'; why='TORCH_SPEC, as given'; \
	elif nvidia-smi -L >/dev/null 2>&1 || [ -e /proc/driver/nvidia/version ]; then \
		spec='torch==$(TORCH_VERSION)'; \
		why="an NVIDIA GPU was found: PyPI's torch for Linux, the CUDA build, which brings NVIDIA's CUDA libraries: several GB to download. For the CPU build instead: Ctrl-C, make clean, make bench TORCH_SPEC='torch==$(TORCH_VERSION)+cpu --extra-index-url $(TORCH_CPU_INDEX)'"; \
	else \
		echo "make: torch: no NVIDIA GPU found; asking pip's configured indexes for the CPU build, torch==$(TORCH_VERSION)+cpu"; \
		if $(PY) -m pip install -q --dry-run --no-deps 'torch==$(TORCH_VERSION)+cpu' >/dev/null 2>&1; then \
			spec='torch==$(TORCH_VERSION)+cpu'; why="the CPU build (about 200 MB), which pip's configured indexes offer"; \
		else \
			spec='torch==$(TORCH_VERSION)+cpu --extra-index-url $(TORCH_CPU_INDEX)'; \
			why="the CPU build (about 200 MB), from PyTorch's CPU index: pip's configured indexes do not have it (PyPI has only the CUDA build)"; \
		fi; \
	fi; \
	echo "make: torch: pip install $$spec"; \
	echo "make: torch: $$why"; \
	$(PY) -m pip install --progress-bar on $$spec
	$(PY) -c "from importlib.metadata import version; print('torch==' + version('torch'))" \
		> $(VENV)/torch-constraint.txt
	@echo "make: torch: $$(cat $(VENV)/torch-constraint.txt) installed"
	touch $@

$(VENV)/bench-deps.stamp: $(VENV)/torch.stamp requirements-bench.txt
	@echo "make: numpy, matplotlib, tqdm and fastpin's build tools (requirements-bench.txt)"
	$(PY) -m pip install -q -c $(VENV)/torch-constraint.txt -r requirements-bench.txt
	touch $@

# The ecosystem packages resolve against the torch installed and never replace it.
$(VENV)/dev-deps.stamp: $(VENV)/bench-deps.stamp requirements-dev.txt
	@echo "make: the development packages (requirements-dev.txt: pytest, Lightning, Accelerate, mypy, Jupyter's kernel...)"
	$(PY) -m pip install -q -c $(VENV)/torch-constraint.txt -r requirements-dev.txt
	touch $@

# Editable: the extension is built into fastpin/ beside the sources, and the venv
# imports the tree. Only the C sources and the build files call for a rebuild.
$(VENV)/installed.stamp: $(VENV)/bench-deps.stamp setup.py pyproject.toml MANIFEST.in $(wildcard csrc/*.c csrc/*.h)
	@echo "make: building fastpin's C extension into the source tree, installed editable in $(VENV)"
	$(PY) -m pip install -q --no-build-isolation --no-deps --editable .
	touch $@

install: $(VENV)/installed.stamp

install-dev: $(VENV)/installed.stamp $(VENV)/dev-deps.stamp

# Run from here, so BENCH_ARGS' paths (--json run.json) are relative to where make
# ran; -I (isolated: also on 3.10, where -P is missing) keeps the current directory
# off sys.path (and PYTHON* variables out), so a recipe copied elsewhere still
# imports the venv's fastpin.
bench: install
	$(PY) -I -m fastpin.bench $(BENCH_ARGS)

test-c:
	$(MAKE) -C tests/c test asan tsan

test-py: install-dev
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

test: test-c test-py

# The venv's kernel (jupyter prefers a venv's own kernelspecs) starts in examples/;
# the executed copy goes to out/ (ignored), the JSON and plot to the notebook's
# OUT_DIR (the system temp dir). --output is relative to the notebook's folder.
notebook: install-dev
	mkdir -p out
	$(VENV)/bin/jupyter-execute --output=../out/compare_throughput.ipynb examples/compare_throughput.ipynb

# The Python-level tests whose C paths the C core's own tests do not reach, on
# the extension built FASTPIN_DEBUG=1 FASTPIN_SANITIZE=address in a copy of the
# tree (the venv's fastpin stays as installed), gcc's ASan and UBSan runtimes
# preloaded (DataLoader workers and subprocesses inherit them; leaks are
# CPython's and torch's, at exit). --capture=sys: a report is written to fd 2,
# which pytest's default capture would lose with the halted process. A report
# fails the run even where a test passed (from a worker the test let die); one
# in a subprocess whose stderr a test reads fails that test by its exit status.
ASAN_PY_TESTS := test_pin_batch test_pin_memory test_pin_default test_properties test_dlpack test_arena \
	test_zero_copy test_record test_shared_arena test_loader test_loader_stats test_install \
	test_reliability test_settings test_index_queue test_copier_spin
# A forked DataLoader worker is left out under both sanitizers. gcc 12's ASan
# takes no allocator lock around fork (LLVM added one in #75290): a worker forked
# while another thread allocates can hang in its first malloc; the first
# zero-copy Loader of the run did, 2 runs of 3 (spawn starts it instead). TSan
# kills a child forked from a process with threads (die_after_fork).
FORKED_WORKER := --deselect tests/test_copier_spin.py::test_a_zero_copy_worker_streams_from_4_mib_on_one_thread
test-asan-py: SAN = address
test-asan-py: SAN_DIR = build/asan-py
test-asan-py: SAN_RUNTIME = LD_PRELOAD=$$(gcc -print-file-name=libasan.so):$$(gcc -print-file-name=libubsan.so) \
	ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
test-asan-py: SAN_TESTS = $(ASAN_PY_TESTS:%=tests/%.py) $(FORKED_WORKER) $(foreach p,False True,\
	--deselect "tests/test_zero_copy.py::test_workers_write_into_the_shared_arena[$(p)-fork]")
test-asan-py: SAN_REPORT = : runtime error: |ERROR: AddressSanitizer
# The copy pool from many Python threads (tests/test_copier_spin.py) on a TSan
# build, made and run the same way; suppressions in tests/tsan-py.supp.
test-tsan-py: SAN = thread
test-tsan-py: SAN_DIR = build/tsan-py
test-tsan-py: SAN_RUNTIME = LD_PRELOAD=$$(gcc -print-file-name=libtsan.so) \
	TSAN_OPTIONS="halt_on_error=0 report_signal_unsafe=0 suppressions=$$PWD/tests/tsan-py.supp"
test-tsan-py: SAN_TESTS = tests/test_copier_spin.py $(FORKED_WORKER)
test-tsan-py: SAN_REPORT = WARNING: ThreadSanitizer
test-asan-py test-tsan-py: $(VENV)/dev-deps.stamp
	rm -rf $(SAN_DIR) && mkdir -p $(SAN_DIR)/tests
	cp -r setup.py pyproject.toml README.md LICENSE csrc fastpin $(SAN_DIR)/
	cp tests/*.py tests/*.supp $(SAN_DIR)/tests/ && rm -f $(SAN_DIR)/fastpin/*.so
	cd $(SAN_DIR) && CC=gcc FASTPIN_DEBUG=1 FASTPIN_SANITIZE=$(SAN) \
		$(abspath $(PY)) setup.py -q build_ext --inplace
	cd $(SAN_DIR) && { $(SAN_RUNTIME) \
	$(abspath $(PY)) -m pytest -q --capture=sys $(SAN_TESTS) $(PYTEST_ARGS) \
	2>&1; echo $$? > pytest.rc; } | tee pytest.log
	test "$$(cat $(SAN_DIR)/pytest.rc)" = 0
	! grep -E '$(SAN_REPORT)' $(SAN_DIR)/pytest.log

test-pythons:
	bash .ci/test-pythons $(PYTHONS)

clean:
	rm -rf build dist $(VENV) .venv-py3.* fastpin/*.so *.egg-info
	$(MAKE) -C tests/c clean
