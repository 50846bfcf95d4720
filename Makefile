# Two commands for a newcomer: `make demo` and `make test`. Both set up .venv first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.crosscut-installed
OUT    ?= out

.PHONY: setup demo test test-heavy lint typecheck pytest clean

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q -e '.[dev,vision]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	mkdir -p $(OUT)
	$(PY) -m crosscut.cli partition torchvision:resnet50 --devices 4xV100 --batch 32 --microbatches 4 -o $(OUT)/resnet50-plan.json
	$(PY) -m crosscut.cli show $(OUT)/resnet50-plan.json -o $(OUT)/resnet50-plan.html
	@echo "plan: $(OUT)/resnet50-plan.json   picture: $(OUT)/resnet50-plan.html"

lint: setup
	$(VENV)/bin/ruff check crosscut tests benchmarks examples
	$(VENV)/bin/ruff format --check crosscut tests benchmarks examples

typecheck: setup
	$(VENV)/bin/mypy

# a worker killed (out of memory) ends the run, named, instead of leaving xdist waiting;
# tests that time a deadline run alone afterwards, not beside a 4-rank torchrun on 2 cores
pytest: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -n 2 --dist loadgroup --max-worker-restart 0 -q --durations=30 -m "not timed"
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -m timed

test: lint typecheck pytest

# the 34 heavy classifiers and the family sweeps, one process each (~2 h on 2 cores; not part of `make test`)
test-heavy: setup
	$(PY) tests/run_heavy.py

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache .mypy_cache .ruff_cache
