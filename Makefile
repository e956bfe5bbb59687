# Two commands on a fresh machine:  make demo   and   make test
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test venv clean root-cause

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

test: $(STAMP)
	$(PY) -m pytest -q tests

# torchrun's Root Cause over 20 runs per fault and monitor interval (about 40 min on 2 cores)
root-cause: $(STAMP)
	$(PY) bench/torchrun_root_cause.py --runs 20 --monitor-interval 0.1 1 --faults raise kill hang

clean:
	rm -rf $(VENV)
