# kvrows: `make demo` runs the main job, `make test` runs lint, types and tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck pytest conform conform-deep bench clean install mlxlm-tests

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip "setuptools>=77" wheel

# pip compiles every installed module on one core; compileall does it on two, and skips
# transformers' 2,600 model modules (mlx-lm imports transformers for its tokenizers, never a
# model of its own): the install takes 30 s instead of 45.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --no-compile -e ".[dev]" --config-settings editable_mode=strict
	$(BIN)/python -m compileall -q -j 2 -x 'transformers/models/' \
		"$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null
	touch $(STAMP)

# Strict editable installs link the files that exist at install time, so a
# cheap re-link runs before every target that imports the package (once per make run;
# `make test` runs its three parts with SKIP_INSTALL=1 after one).
install: $(STAMP)
ifneq ($(SKIP_INSTALL),1)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e . --config-settings editable_mode=strict >/dev/null
endif

demo: install
	$(BIN)/kvrows demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy runs outside the checkout so the top-level kvrows/ folder does not shadow
# the installed package (whose kvrows.reference etc. map to reference/ etc.).
typecheck: install
	mkdir -p build/typecheck
	# One cache for the three runs: the tests and benchmarks reuse the package's and the
	# dependencies' analysis (a cold CI run takes a third of the time).
	cd build/typecheck && ../../$(BIN)/mypy --config-file ../../pyproject.toml --cache-dir ../mypy-cache -p kvrows
	cd tests && ../$(BIN)/mypy --config-file ../pyproject.toml --cache-dir ../build/mypy-cache .
	cd benchmarks && ../$(BIN)/mypy --config-file ../pyproject.toml --cache-dir ../build/mypy-cache .

# Two workers: CI runs on two cores, and the conformance machines are CPU-bound.
PYTEST_WORKERS ?= 2

pytest: install
	# A fixed hash seed: the derandomized conformance runs then draw the same examples on
	# every machine (set iteration order feeds some draws).
	PYTHONHASHSEED=0 $(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist worksteal

# Lint, types and tests at once: mypy and ruff run on one core each while pytest's two
# workers start and finish (each part's output is printed whole when it ends).
test: install
	$(MAKE) --no-print-directory -j 3 --output-sync=target SKIP_INSTALL=1 lint typecheck pytest

conform: install
	$(BIN)/kvrows conform --profile ci

conform-deep: install
	KVROWS_PROFILE=deep $(BIN)/kvrows conform --profile deep

bench: install
	$(BIN)/kvrows bench

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache .hypothesis

# mlx-lm's own cache and model tests (from the installed version's sdist, fetched once into
# build/mlxlm-tests/) on mlx-lm's classes, then with kvrows' drop-ins rebound: not in CI
# (about a minute on two cores); spec/mlx-lm-drop-in.md §5 lists the expected differences.
mlxlm-tests: install
	$(BIN)/python tools/mlxlm_tests/run.py
