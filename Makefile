# Two commands set everything up: `make run` and `make test` (see README.md).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TEST_WORKERS ?= 2   # pytest-xdist workers of `make test`, each taking whole test files (a module's fixtures stay in one)
MUTATION_SAMPLE ?= 8   # mutants per module on average, spread in proportion to each module's mutants (0 = all: a day on 2 cores)
MUTATION_SEED ?= 14  # a seed no kept sample used: a fresh draw, scored out of sample (a used one replaces its sample)
MUTATION_MINUTES ?= 60  # the Python mutant runs stop here (shared among the packages); the rest are reported "not checked"
MUTATION_PACKAGES ?=  # comma-separated packages of pyproject's [tool.kvservice.mutation.packages]; empty = all

.PHONY: run test unit integration bench lint protos gpu-check mutation clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,torch]'
	bash deploy/ci-install.sh $(BIN)/python || { [ "$$CI" = true ] && exit 1; echo "warning: test tools (or nats-server) missing; their tests skip here and FAIL under CI=true" >&2; }
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python -m kvservice.examples.main_job

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

unit: $(STAMP)
	$(BIN)/python -m pytest -q -m 'not integration and not slow'

integration: $(STAMP)
	$(BIN)/python -m pytest -q -m integration

bench: $(STAMP)
	$(BIN)/python bench/bench_manager.py --out bench/results/manager.md
	$(BIN)/python bench/bench_sharing.py --out bench/results/sharing.md
	$(BIN)/python bench/bench_durability.py --out bench/results/durability.md
	$(BIN)/python bench/bench_limits.py --results bench/results/durability.md
	$(BIN)/python bench/bench_limits.py --mix --results bench/results/durability.md
	$(BIN)/python bench/bench_cached_pages.py --results bench/results/durability.md
	$(BIN)/python bench/bench_fairness.py
	$(BIN)/python bench/bench_routing.py --out bench/results/routing.md
	$(BIN)/python bench/bench_ha.py --out bench/results/ha.md
	$(BIN)/python bench/bench_cache.py --out bench/results/cache.md

mutation: $(STAMP)
	$(BIN)/pip install --quiet 'mutmut==3.8.1'
	$(BIN)/python scripts/mutation.py --sample $(MUTATION_SAMPLE) --seed $(MUTATION_SEED) \
		--minutes $(MUTATION_MINUTES) --packages "$(MUTATION_PACKAGES)" --recheck --out bench/results/mutation.md

lint: $(STAMP)
	$(BIN)/ruff check .

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

gpu-check:  # on a GPU machine; writes bench/results/gpu-<date>-<gpu>.{md,jsonl,log}
	python3 bench/gpu_check.py --out bench/results

clean:
	rm -rf $(VENV) build .pytest_cache mutants
