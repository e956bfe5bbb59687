# Two commands on a fresh machine:  make demo   and   make test
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-long test-multihost test-resume bench-resume bench-spawn bench-soak conformance root-cause venv clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build first: a bare or open-ended torch requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# The tests marked long (stock-framework comparisons, more multi-host runs) keep the suite to its
# time budget: deselected here.
test: $(STAMP)
	$(PY) -m pytest -q tests -m "not long" --durations=25

# Everything, the long tests included.
test-long: $(STAMP)
	$(PY) -m pytest -q tests

# Every multi-host test (simulated hosts: needs root, ip, unshare, tc), the long ones included.
test-multihost: $(STAMP)
	$(PY) -m pytest -q tests/distributed/test_multihost.py

# Every framework x fault of the exact-resume test under torchrun (the default suite runs three)
test-resume: $(STAMP)
	FTH_RESUME_FULL=1 $(PY) -m pytest -q tests/distributed/test_resume_distributed.py

bench-resume: $(STAMP)
	$(PY) bench/resume.py

# No false alarm: healthy 8-rank Ignite and Lightning trainings beside 2 CPU hogs, 10 runs each
# (about 40 min on 2 cores); passes only when no run declared anything
bench-soak: $(STAMP)
	$(PY) bench/soak.py --runs 10

# torch's and torchdata's own DataLoader tests, stock loader vs ours (README "Restartable DataLoader").
# The test files are theirs, not ours: pass their paths, e.g.
#   make conformance TORCH_TEST=~/pytorch/test/test_dataloader.py TORCHDATA_TESTS=~/data/test/stateful_dataloader
conformance: $(STAMP)
	$(PY) -c "import expecttest" 2>/dev/null || $(PY) -m pip install -q expecttest
	$(PY) bench/dataloader_conformance.py $(if $(TORCH_TEST),--torch-test $(TORCH_TEST)) \
		$(if $(TORCHDATA_TESTS),--torchdata-tests $(TORCHDATA_TESTS))

# torchrun's Root Cause over 20 runs per fault and monitor interval (about 40 min on 2 cores)
root-cause: $(STAMP)
	$(PY) bench/torchrun_root_cause.py --runs 20 --monitor-interval 0.1 1 --faults raise kill hang

# Survivors' own output under idist.Parallel and ddp_spawn: N runs per launcher x fault (README "Spawn-family launchers")
N ?= 20
bench-spawn: $(STAMP)
	$(PY) bench/spawn_report.py --runs $(N)

clean:
	rm -rf $(VENV)
