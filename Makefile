# make tour   set up, then run every strategy's correctness check under torchrun and summarise
# make test   set up, then run the test suite but the heavy tests (CPU, gloo; CI runs this)
# make quick  the quick subset of the tests (no setup, skips tests marked slow)
# make test-all  everything, also the tests marked heavy (W=3 on the realistic checkpoint)
PYTHON ?= python3
export PYTHON

.PHONY: setup tour test test-all quick
setup:
	bash scripts/setup.sh

tour: setup
	$(PYTHON) tour.py

test: setup
	$(PYTHON) -m pytest -q -m "not heavy" tests

test-all: setup
	$(PYTHON) -m pytest -q tests

quick:
	$(PYTHON) -m pytest -q -m "not slow and not heavy" tests
