# The two commands of the README: `make verify` (the main job) and `make test` (the suite).
# Both set up .venv first, with nothing but Python >= 3.11 and pip.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SOURCES := pyproject.toml $(shell find cli model impl proofs testing upstream vllm_target -name '*.py' 2>/dev/null)

.PHONY: venv verify test verify-vllm history clean

venv: $(VENV)/.ready

# The code folders install as the kvoffload package through a link tree (strict editable
# mode), so a new module needs a reinstall: the stamp depends on every source file.
$(VENV)/.ready: $(SOURCES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip "setuptools>=68"
	# torch pinned, so that a fresh machine takes the CPU build it has on disk.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q --no-build-isolation -e ".[test]" \
		--config-settings editable_mode=strict
	touch $@

# A short conformance campaign of the implementation, then the mutation matrix (its
# campaigns one process per core).
verify: venv
	$(BIN)/kvoffload verify --seconds 30

# vLLM's own offload code under the machine (docs/upstream.md): 0.29.0 must show the bugs of
# #53498, 0.34.0 must conform. Installs each release into the cache folder when absent.
verify-vllm: venv
	$(BIN)/kvoffload verify --target vllm==0.29.0 --install
	$(BIN)/kvoffload verify --target vllm==0.34.0 --install

# The bug history (docs/history.md): each historical bug in the model's reach found by the
# machine in the last release that has it, its fix conforming, and every release from 0.19.0
# to 0.34.0 held to its own model. Installs the releases absent (0.5 to 0.8 GB each); CI runs
# a sample (.ci/run). `kvoffload history --releases --write docs/history.md` rewrites the page.
history: venv
	$(BIN)/kvoffload history --releases --install

# The tests one process per core (pytest-xdist): each test's outcome is its own, whatever
# runs beside it.
test: venv
	$(BIN)/kvoffload prove
	$(BIN)/python -m pytest -n auto
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy -p kvoffload
	$(BIN)/mypy tests

clean:
	rm -rf $(VENV) build .hypothesis .pytest_cache .mypy_cache .ruff_cache
