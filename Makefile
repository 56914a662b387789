# The two commands of the quick start, and the pieces they are made of.
#   make bench   build a venv, install fastpin into it, run python -m fastpin.bench
#   make test    the C core's tests (plain, ASan+UBSan, TSan), then pytest against
#                fastpin installed into the venv as a user would install it
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export FASTPIN_WERROR ?= 1

.PHONY: bench test test-c test-py install clean

$(VENV)/.deps: requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

$(VENV)/.installed: $(VENV)/.deps setup.py pyproject.toml $(wildcard csrc/*.c csrc/*.h fastpin/*.py fastpin/*.pyi fastpin/py.typed)
	$(PY) -m pip install -q --no-build-isolation .
	touch $@

install: $(VENV)/.installed

bench: install
	cd $(VENV) && bin/python -m fastpin.bench $(BENCH_ARGS)

test-c:
	$(MAKE) -C tests/c test asan tsan

# bin/pytest rather than python -m pytest: the source tree must not shadow
# the installed package.
test-py: install
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

test: test-c test-py

clean:
	rm -rf build $(VENV) fastpin/*.so *.egg-info
	$(MAKE) -C tests/c clean
