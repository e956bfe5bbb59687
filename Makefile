# Two commands on a fresh machine:  make demo   and   make test
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-ranges dist test-long test-multihost test-resume test-scale bench-resume bench-goodput bench-inplace bench-spawn bench-soak bench-scale bench-spares bench-spares-sharded conformance root-cause venv clean

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

# The oldest and the newest end of each range in pyproject.toml's extras, each installed into a
# fresh venv (.venv-ranges/<end>), then a fast subset: the unit tests, the README's snippets (the
# Lightning one also under pytorch_lightning), Lightning's ddp_spawn path and Ignite's
# hang_timeout="auto" (the other private APIs). torch is 2.13.0 (CPU) at both ends: other torch
# versions pull a multi-GB CUDA build. Not part of `make test`: 20-30 min on 2 shared cores (installs
# included; docs/benchmarks.md, "Version ranges").
RANGE_OLDEST := "pytorch-ignite==0.5.0.post2" "lightning==2.5.0" "pytorch-lightning==2.5.0" "torchdata==0.11.0"
RANGE_NEWEST := "pytorch-ignite>=0.5,<0.6" "lightning>=2.5,<2.7" "pytorch-lightning>=2.5,<2.7" "torchdata>=0.11,<0.12"
RANGE_TESTS  := tests/unit tests/distributed/test_readme_ignite.py tests/distributed/test_readme_lightning.py \
	"tests/distributed/test_lightning_distributed.py::test_every_rank_raises_with_the_cause[ddp_spawn-raise-True]" \
	tests/distributed/test_autohang_distributed.py::test_ignite_rank_hung_in_a_step_after_warm_up_is_reported_within_the_learned_deadline
test-ranges:
	status=0; for end in oldest newest; do \
		v=.venv-ranges/$$end; rm -rf $$v; $(PYTHON) -m venv $$v || exit 1; \
		$$v/bin/python -m pip install -q --upgrade pip || exit 1; \
		$$v/bin/python -m pip install -q torch==2.13.0 || exit 1; \
		if [ $$end = oldest ]; then $$v/bin/python -m pip install -q $(RANGE_OLDEST) || exit 1; \
		else $$v/bin/python -m pip install -q --upgrade $(RANGE_NEWEST) || exit 1; fi; \
		$$v/bin/python -m pip install -q "pytest>=8" "pytest-timeout>=2.3" || exit 1; \
		$$v/bin/python -m pip install -q --no-deps -e . || exit 1; \
		echo "== $$end end:"; $$v/bin/python -m pip list 2>/dev/null | grep -iE "^(torch|pytorch-ignite|lightning|pytorch-lightning|torchdata) "; \
		$$v/bin/python -m pytest -q -p no:cacheprovider $(RANGE_TESTS) || status=1; \
	done; exit $$status

# The sdist and the wheel in dist/, checked as a package index would (twine check --strict: the
# README renders as the long description). Build tools in their own venv, not in .venv.
dist:
	test -x .venv-dist/bin/python || $(PYTHON) -m venv .venv-dist
	.venv-dist/bin/python -m pip install -q build twine
	rm -rf dist && .venv-dist/bin/python -m build
	.venv-dist/bin/python -m twine check --strict dist/*

# Everything, the long tests included.
test-long: $(STAMP)
	$(PY) -m pytest -q tests

# Every multi-host test (simulated hosts: needs root, ip, unshare, tc), the long ones included.
test-multihost: $(STAMP)
	$(PY) -m pytest -q tests/distributed/test_multihost.py tests/distributed/test_multihost_recover.py \
		tests/distributed/test_multihost_spares.py

# Every framework x fault of the exact-resume test under torchrun (the default suite runs three)
test-resume: $(STAMP)
	FTH_RESUME_FULL=1 $(PY) -m pytest -q tests/distributed/test_resume_distributed.py

# Healthy jobs at 4, 8 and 16 ranks (the 8 and 16 beside 2 CPU hogs): no stall at start, no false
# alarm, two store connections per rank (about 15 min on 2 cores)
test-scale: $(STAMP)
	$(PY) -m pytest -q tests/distributed/test_scale.py

# Healthy jobs at 2, 4, 8 and 16 ranks, stock and with the library side by side: time to the first
# trained iteration, lag, the library's store connections and CPU per rank; then 8 and 16 ranks in
# recover_in_place with hang_timeout 5 s beside 2 CPU hogs (docs/benchmarks.md, "Scale")
bench-scale: $(STAMP)
	$(PY) bench/scale.py --worlds 2 4 8 16 --reps 5
	$(PY) bench/scale.py --worlds 8 16 --reps 3 --hogs 2 --hang-timeout 5 --inplace 2 --no-stock

bench-resume: $(STAMP)
	$(PY) bench/resume.py

# A lost host taken over by spares on simulated hosts (root), per phase (docs/benchmarks.md, "Spares").
bench-spares: $(STAMP)
	$(PY) bench/multihost_spares.py --reps 3

# The same with FSDP2 shards of 100 MB per rank (root, issue 42): the spare served from a partner's copy,
# then the same job from its checkpoint, in turn (docs/sharded.md, "A lost host with spares").
bench-spares-sharded: $(STAMP)
	$(PY) bench/multihost_spares.py --shard-mb 100 --reps 3 --frameworks ignite lightning

# Goodput: Ignite and Lightning, 4 and 8 ranks, 10 min of 50 ms steps per run, with no fault, then faults
# drawn at random (raise, kill, hang, worker-kill, lose) one per 60 s and one per 20 s, recovered in
# place beside torchrun's relaunch from a checkpoint every 100 steps (20 runs: about 4-5 h on 2 cores;
# docs/benchmarks.md, "Goodput"). The table in goodput.md, the plot in goodput.png (with matplotlib).
bench-goodput: $(STAMP)
	$(PY) bench/goodput.py --out goodput.md --plot goodput.png

# Recovering in place beside the relaunch, in one run each: a raise, a hang (hang_timeout 3 s), a SIGKILL;
# 5 runs per framework and mode.
bench-inplace: $(STAMP)
	$(PY) bench/resume.py --reps 5 --fault raise --modes inplace,resume
	$(PY) bench/resume.py --reps 5 --fault hang --modes inplace,resume
	$(PY) bench/resume.py --reps 5 --fault kill --modes inplace,resume

# No false alarm: healthy 8-rank Ignite and Lightning trainings beside 2 CPU hogs, 10 runs each
# (about 40 min on 2 cores); passes only when no run declared anything
bench-soak: $(STAMP)
	$(PY) bench/soak.py --runs 10

# torch's and torchdata's own DataLoader tests, stock loader vs ours (docs/benchmarks.md, "RestartableDataLoader").
# The test files are theirs, not ours: pass their paths, e.g.
#   make conformance TORCH_TEST=~/pytorch/test/test_dataloader.py TORCHDATA_TESTS=~/data/test/stateful_dataloader
conformance: $(STAMP)
	$(PY) -c "import expecttest" 2>/dev/null || $(PY) -m pip install -q expecttest
	$(PY) bench/dataloader_conformance.py $(if $(TORCH_TEST),--torch-test $(TORCH_TEST)) \
		$(if $(TORCHDATA_TESTS),--torchdata-tests $(TORCHDATA_TESTS))

# torchrun's Root Cause over 20 runs per fault and monitor interval (about 40 min on 2 cores)
root-cause: $(STAMP)
	$(PY) bench/torchrun_root_cause.py --runs 20 --monitor-interval 0.1 1 --faults raise kill hang

# Survivors' own output under idist.Parallel and ddp_spawn: N runs per launcher x fault (docs/benchmarks.md, "Spawn-family launchers")
N ?= 20
bench-spawn: $(STAMP)
	$(PY) bench/spawn_report.py --runs $(N)

clean:
	rm -rf $(VENV)
