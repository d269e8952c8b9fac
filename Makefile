# make tour   set up, then run every strategy's correctness check under torchrun and summarise
# make test   set up, then run the whole test suite (CPU, gloo)
# make quick  the quick subset of the tests (no setup, skips tests marked slow)
PYTHON ?= python3
export PYTHON

.PHONY: setup tour test quick
setup:
	bash scripts/setup.sh

tour: setup
	$(PYTHON) tour.py

test: setup
	$(PYTHON) -m pytest -q tests

quick:
	$(PYTHON) -m pytest -q -m "not slow" tests
