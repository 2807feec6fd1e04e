# kvrows: `make demo` runs the main job, `make test` runs lint, types and tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck pytest conform conform-deep bench clean install mlxlm-tests

# The venv gets the current pip straight from the system's (creating it with its bundled
# pip 23 and upgrading costs twice as long, and pip 23 installs the dependencies at half
# the speed); a Python without pip, or a pip too old for --python, takes the long way.
$(BIN)/python:
	$(PYTHON) -m venv --without-pip $(VENV)
	$(PYTHON) -m pip --python $(BIN)/python install -q --upgrade pip "setuptools>=77" wheel \
		|| { $(PYTHON) -m venv --clear $(VENV) && \
		     $(BIN)/python -m pip install -q --upgrade pip "setuptools>=77" wheel; }

# pip compiles every installed module on one core; compileall does it on two, and skips
# transformers' 2,600 model modules (mlx-lm imports transformers for its tokenizers, never a
# model of its own).
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --no-compile -e ".[dev]" --config-settings editable_mode=strict
	$(BIN)/python -m compileall -q -j 2 -x 'transformers/models/' \
		"$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null
	$(MODULES) > $(LINKED)
	touch $(STAMP)

# A strict editable install links (symlinks) the modules that exist when it runs: a module
# added or removed since needs a re-link. The list of modules the last link saw is kept.
LINKED := $(VENV)/.linked
MODULES := find kvrows reference optimized conformance app persist -name '*.py' | LC_ALL=C sort | cksum

install: $(STAMP)
	@if [ "$$($(MODULES))" != "$$(cat $(LINKED) 2>/dev/null)" ]; then \
		echo "re-linking the editable install (modules added or removed)"; \
		$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e . \
			--config-settings editable_mode=strict >/dev/null && $(MODULES) > $(LINKED); \
	fi

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
	# every machine (set iteration order feeds some draws). Plain asserts: with bytecode
	# caching off (PYTHONDONTWRITEBYTECODE), pytest would rewrite every test module's asserts
	# in each worker on each run, half of a worker's 18 s collection; a failing check still
	# fails, and the machines' own messages say what was wrong (run pytest directly for
	# pytest's assert introspection).
	PYTHONHASHSEED=0 $(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist worksteal --assert=plain

# Lint, types and tests at once, after one install: mypy and ruff run beside pytest's two
# workers (each part's output is printed whole when it ends).
test:
	$(MAKE) --no-print-directory -j 3 --output-sync=target lint typecheck pytest

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
