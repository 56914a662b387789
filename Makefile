# The two commands of the quick start, and the pieces they are made of
# (`make help` lists them).
#   make bench   build a venv, install fastpin into it, run python -m fastpin.bench
#   make test    the C core's tests (plain, ASan+UBSan, TSan), then pytest against
#                fastpin installed into the venv as a user would install it
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch the dev venv gets, as pip reads it. A version, not a build: pip takes
# a local CPU wheel where one lies in its find-links (the dev machines'), else
# PyPI's build for Linux, which is the CUDA one and pulls several GB of CUDA
# libraries. A CPU-only venv from PyTorch's own index:
#   make bench TORCH_SPEC="torch==2.13.0+cpu --extra-index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0
# The Pythons `make test-pythons` builds fastpin for (default: every 3.10-3.13 found).
PYTHONS ?=
export FASTPIN_WERROR ?= 1

.PHONY: help bench test test-c test-py test-asan-py test-pythons notebook install clean

help:
	@echo "make bench         venv in $(VENV) + install, then python -m fastpin.bench (BENCH_ARGS=--quick: short)"
	@echo "make test          test-c, then test-py: what CI runs first"
	@echo "make test-c        the C core's tests: plain, ASan+UBSan, TSan (tests/c)"
	@echo "make test-py       pytest against fastpin installed into $(VENV) (PYTEST_ARGS=...)"
	@echo "make test-asan-py  pytest of pin_memory, zero-copy, the Loader, settings on an ASan+UBSan build"
	@echo "make test-pythons  each Python 3.10-3.13 found (PYTHONS=...): fastpin built into a"
	@echo "                   venv without torch (.venv-py3.X), and the tests that need no torch"
	@echo "make notebook      examples/compare_throughput.ipynb run headless in $(VENV), to out/"
	@echo "make install       only the venv and fastpin in it"
	@echo "make clean         remove the venvs, build outputs and the C tests' builds"
	@echo "Variables: PYTHON=$(PYTHON) VENV=$(VENV) TORCH_SPEC=\"$(TORCH_SPEC)\" FASTPIN_WERROR=$(FASTPIN_WERROR)"
	@echo "           BENCH_ARGS=\"$(BENCH_ARGS)\" (make bench's options) PYTEST_ARGS=\"$(PYTEST_ARGS)\" (make test-py's)"
	@echo "           PYTHONS=\"$(PYTHONS)\" (make test-pythons'; empty: every 3.10-3.13 found)"

# torch in the same pip command as the rest: the ecosystem packages resolve
# against it and never replace it.
$(VENV)/.deps: requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC) -r requirements-dev.txt
	touch $@

$(VENV)/.installed: $(VENV)/.deps setup.py pyproject.toml MANIFEST.in $(wildcard csrc/*.c csrc/*.h fastpin/*.py fastpin/bench/*.py fastpin/*.pyi fastpin/py.typed)
	$(PY) -m pip install -q --no-build-isolation .
	touch $@

install: $(VENV)/.installed

# Run from here, so BENCH_ARGS' paths (--json run.json) are relative to where make
# ran; -I (isolated: also on 3.10, where -P is missing) keeps the current directory,
# the source tree, off sys.path (and PYTHON* variables out): the benchmark imports
# the installed fastpin.
bench: install
	$(PY) -I -m fastpin.bench $(BENCH_ARGS)

test-c:
	$(MAKE) -C tests/c test asan tsan

# bin/pytest rather than python -m pytest: the source tree must not shadow
# the installed package.
test-py: install
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

test: test-c test-py

# The venv's kernel (jupyter prefers a venv's own kernelspecs) starts in examples/;
# the executed copy goes to out/ (ignored), the JSON and plot to the notebook's
# OUT_DIR (the system temp dir). --output is relative to the notebook's folder.
notebook: install
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
ASAN_PY_DIR := build/asan-py
ASAN_PY_TESTS := test_pin_batch test_pin_memory test_properties test_dlpack test_arena \
	test_zero_copy test_record test_shared_arena test_loader test_loader_stats test_install \
	test_reliability test_settings
# gcc 12's ASan takes no allocator lock around fork (LLVM added one in #75290):
# a worker forked while another thread allocates can hang in its first malloc.
# The first zero-copy Loader of the run did, 2 runs of 3; spawn starts it instead.
ASAN_PY_SKIP := $(foreach p,False True,\
	--deselect "tests/test_zero_copy.py::test_workers_write_into_the_shared_arena[$(p)-fork]")
test-asan-py: $(VENV)/.deps
	rm -rf $(ASAN_PY_DIR) && mkdir -p $(ASAN_PY_DIR)/tests
	cp -r setup.py pyproject.toml README.md LICENSE csrc fastpin $(ASAN_PY_DIR)/
	cp tests/*.py $(ASAN_PY_DIR)/tests/ && rm -f $(ASAN_PY_DIR)/fastpin/*.so
	cd $(ASAN_PY_DIR) && CC=gcc FASTPIN_DEBUG=1 FASTPIN_SANITIZE=address \
		$(abspath $(PY)) setup.py -q build_ext --inplace
	cd $(ASAN_PY_DIR) && { \
	LD_PRELOAD=$$(gcc -print-file-name=libasan.so):$$(gcc -print-file-name=libubsan.so) \
	ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	$(abspath $(PY)) -m pytest -q --capture=sys $(ASAN_PY_TESTS:%=tests/%.py) $(ASAN_PY_SKIP) $(PYTEST_ARGS) \
	2>&1; echo $$? > pytest.rc; } | tee pytest.log
	test "$$(cat $(ASAN_PY_DIR)/pytest.rc)" = 0
	! grep -E ': runtime error: |ERROR: AddressSanitizer' $(ASAN_PY_DIR)/pytest.log

test-pythons:
	bash .ci/test-pythons $(PYTHONS)

clean:
	rm -rf build dist $(VENV) .venv-py3.* fastpin/*.so *.egg-info
	$(MAKE) -C tests/c clean
