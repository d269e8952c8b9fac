# make tour   set up, then run every strategy's correctness check under torchrun and summarise
# make test   set up, then run the test suite but the heavy tests (CPU, gloo; CI runs this)
# make quick  the quick subset of the tests (no setup, skips tests marked slow or heavy)
# make test-heavy  only the tests marked heavy (CI runs them after make test)
# make test-all  everything: make test and make test-heavy in one run
# make bench  every strategy against PyTorch's own and the single device, timed interleaved:
#             results/bench-cpu.json (W=2 at 6 rounds, W=4 at 4; about 35 minutes on 2 cores)
PYTHON ?= python3
export PYTHON

.PHONY: setup tour test test-heavy test-all quick bench
setup:
	bash scripts/setup.sh

tour: setup
	$(PYTHON) tour.py

test: setup
	$(PYTHON) -m pytest -q -ra -m "not heavy" --durations=40 tests

test-heavy: setup
	$(PYTHON) -m pytest -q -ra -m heavy --durations=25 tests

test-all: setup
	$(PYTHON) -m pytest -q -ra tests

quick:
	$(PYTHON) -m pytest -q -ra -m "not slow and not heavy" tests

bench: setup
	$(PYTHON) scripts/bench.py --world 2 --pairs 6 --out results/bench-cpu.json
	$(PYTHON) scripts/bench.py --world 4 --pairs 4 --merge --out results/bench-cpu.json
	$(PYTHON) scripts/bench.py --table results/bench-cpu.json --wide
