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

.PHONY: help bench test test-c test-py test-pythons notebook install clean

help:
	@echo "make bench         venv in $(VENV) + install, then python -m fastpin.bench (BENCH_ARGS=--quick: short)"
	@echo "make test          test-c, then test-py: what CI runs first"
	@echo "make test-c        the C core's tests: plain, ASan+UBSan, TSan (tests/c)"
	@echo "make test-py       pytest against fastpin installed into $(VENV) (PYTEST_ARGS=...)"
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

test-pythons:
	bash .ci/test-pythons $(PYTHONS)

clean:
	rm -rf build dist $(VENV) .venv-py3.* fastpin/*.so *.egg-info
	$(MAKE) -C tests/c clean
