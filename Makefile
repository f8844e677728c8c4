# Two commands on a fresh machine:  `make run` (train the tiny model end to end) and `make test`.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
# Every other dependency at the version CI last passed with (`make lock` refreshes it);
# `make CONSTRAINTS=` resolves the newest versions pyproject.toml allows instead.
CONSTRAINTS ?= constraints.txt
VENV := .venv
BIN := $(VENV)/bin
# Two environments in one venv, each with its own stamp: running needs only the extras of
# `make run` (loss.png, and the object store of ARGS="--s3"); the tests add theirs (Triton,
# transformers, megatron-core, ...: most of the download) on top. So `make test` after
# `make run` installs only the difference, and `make run` after `make test` nothing.
RUN_EXTRAS := plot,s3
STAMP := $(VENV)/.installed-$(TORCH_VERSION)
TEST_STAMP := $(VENV)/.installed-$(TORCH_VERSION)-test
PIP_C := $(if $(CONSTRAINTS),-c "$(CONSTRAINTS)")
PYTEST := $(BIN)/python -m pytest
# Single-process tests spread over this many pytest-xdist workers (`auto`: one a core); the
# multi-process (`dist`) tests, each already several ranks, run one at a time after them.
TEST_WORKERS ?= auto

.PHONY: install install-test lock run lint test test-fast test-slow test-gpu coverage protos system-deps clean

# torch is installed first and pinned, so resolving the project's `torch>=` floor never
# pulls another build. Where pip's index has only PyPI's Linux wheel (the multi-GB CUDA
# build), set TORCH_INDEX=https://download.pytorch.org/whl/cpu for the CPU one (leave it unset
# where pip already finds a CPU build, e.g. from a local wheel cache or mirror).
$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)")
	$(BIN)/python -m pip install -q -e ".[$(RUN_EXTRAS)]" $(PIP_C)
	touch $@

# The run extras again, so pip keeps what is installed and adds only the test extra.
$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e ".[$(RUN_EXTRAS),test]" $(PIP_C)
	touch $@

install: $(STAMP)
install-test: $(TEST_STAMP)

# Re-resolve the dependencies to the newest versions pyproject.toml allows, run the tests,
# and only when they pass write those versions to constraints.txt (commit it with the change
# that needed it). A fresh environment in .venv-lock, so the working one is not touched.
lock:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q --upgrade pip
	.venv-lock/bin/python -m pip install -q "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)")
	.venv-lock/bin/python -m pip install -q -e ".[test]"
	.venv-lock/bin/python -m pytest -m "not slow and not gpu" -q
	{ sed -n '1,2p' constraints.txt; .venv-lock/bin/python -m pip freeze --exclude-editable | grep -iv '^torch=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf .venv-lock

# The whole topology as local processes (a data worker, the checkpoint service, the trainer)
# on the embedded default: `meshtrain up`. ARGS adds launcher or trainer options, e.g.
# `make run ARGS="--s3 --nproc-per-node 2"`.
run: $(STAMP)
	$(BIN)/meshtrain up --config deploy/configs/tiny.toml $(ARGS)

# Lint, format and types (the tools come with the test extra): ruff's rules and formatting,
# mypy over the library ([tool.mypy] in pyproject.toml), and the import contracts
# ([tool.importlinter]). Each failing command fails the target.
lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# Everything but slow and GPU tests (what CI runs), after `lint`: the single-process ones on
# every core, then the multi-process ones. pytest exits 5 when it ran no test, and make treats
# that as the failure it is.
test: $(TEST_STAMP) lint
	$(PYTEST) -n $(TEST_WORKERS) -m "not slow and not gpu and not dist" -q
	$(PYTEST) -m "dist and not slow and not gpu" -q

# While editing (under 4 minutes on 2 cores): no multi-process, end-to-end or slow tests, after `lint`.
test-fast: $(TEST_STAMP) lint
	$(PYTEST) -n $(TEST_WORKERS) -m "not slow and not gpu and not dist and not e2e" -q

test-slow: $(TEST_STAMP)
	$(PYTEST) -m "slow" -q

test-gpu: $(TEST_STAMP)
	$(PYTEST) -m "gpu" -q

# Line coverage of what `make test` runs, reported per repository file (pyproject's
# [tool.coverage]: services/, kernels/ and protos/ under one path each).
coverage: $(TEST_STAMP)
	$(BIN)/python -m coverage run -m pytest -m "not slow and not gpu" -q
	$(BIN)/python -m coverage report --skip-covered --sort=cover

# Optional, as root on Debian/Ubuntu: docker-compose and a single-node Slurm for the deploy
# tests (they skip, saying why, without them).
system-deps:
	sh deploy/install-test-deps.sh

# Regenerate the gRPC stubs (committed; grpcio-tools pinned to the oldest grpcio we support).
# Compiled through meshtrain/protos (a link to protos/) so the stubs import meshtrain.protos.
protos: $(STAMP)
	$(BIN)/python -m pip install -q "grpcio-tools==1.84.0"
	for f in meshtrain/protos/*/v1/*.proto; do \
	  $(BIN)/python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. $$f; done

clean:
	rm -rf $(VENV) .cache runs .pytest_cache
