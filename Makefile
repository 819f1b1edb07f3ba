# `make demo` (the benchmark; writes under out/ only), `make publish` (README and docs/benchmarks.md
# regenerated from that run's results), `make test` (the whole suite, pinned by constraints.txt) and
# `make test-min` (the suite on the oldest Python, torch, numpy, transformers, accelerate and
# Lightning that pyproject.toml declares, pinned by constraints-min.txt).
# Each creates its virtual environment (.venv/, .venv-min/) when it is missing.
PYTHON ?= python3
# The oldest Python that pyproject.toml declares (requires-python); pyenv's 3.10 where it has one.
PYTHON_MIN ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.10.*/bin/python3.10) python3.10)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.odb-installed
VENV_MIN := .venv-min
PY_MIN := $(VENV_MIN)/bin/python
STAMP_MIN := $(VENV_MIN)/.odb-installed

.PHONY: demo publish test test-fast test-min venv venv-min clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	# LLaMA-Factory's own requirements pull another torch: install it and the few packages its SFT
	# path imports without dependency resolution. Its tests are part of `make test`: a failed install
	# stops here (and tests/integrations/test_llamafactory.py fails, never skips, where it does not import).
	$(PY) -m pip install -q --no-deps -c constraints.txt llamafactory peft trl datasets dill multiprocess xxhash \
		pyarrow pandas pytz omegaconf antlr4-python3-runtime requests urllib3 certifi charset-normalizer
	touch $(STAMP)

venv: $(STAMP)

# The benchmark: prints its tables and writes results.json, summary.md and the plots under out/bench.
# It changes no tracked file.
demo: $(STAMP)
	$(PY) -m odb.bench --out out/bench
	@echo "make demo: tables in out/bench/summary.md, plots in out/bench/*.png, every figure in out/bench/results.json"
	@echo "make demo: 'make publish' copies them into docs/results/ and regenerates README.md and docs/benchmarks.md"

# Publish the last `make demo`: its results file and plots become the repository's (docs/results/,
# docs/img/), and README.md's and docs/benchmarks.md's generated sections are rewritten from them.
publish: $(STAMP)
	@test -f out/bench/results.json || { echo "make publish: no out/bench/results.json. Fix: run make demo first"; exit 1; }
	mkdir -p docs/results
	cp out/bench/results.json docs/results/bench.json
	for f in out/bench/*.png; do cp "$$f" docs/img/; done
	$(PY) scripts/update_readme.py docs/results/bench.json

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# torch 2.6 from PyPI is its CUDA build (about 3 GB with its CUDA libraries); it runs on the CPU.
$(STAMP_MIN): pyproject.toml constraints-min.txt
	@command -v $(PYTHON_MIN) >/dev/null || { echo "make test-min: no $(PYTHON_MIN), the oldest Python that" \
		"pyproject.toml declares. Fix: install Python 3.10 (e.g. pyenv install 3.10) or pass PYTHON_MIN=/path/to/python3.10"; \
		exit 1; }
	test -x $(PY_MIN) || $(PYTHON_MIN) -m venv $(VENV_MIN)
	$(PY_MIN) -m pip install -q -c constraints-min.txt -e '.[dev]'
	$(PY_MIN) -m pip install -q --no-deps -c constraints-min.txt datasets dill multiprocess xxhash pyarrow pandas \
		pytz requests urllib3 certifi charset-normalizer
	touch $(STAMP_MIN)

venv-min: $(STAMP_MIN)

# Not part of it: TRL (pyproject.toml declares no TRL version; trl 0.24 needs accelerate>=1.4, above the
# accelerate floor): tests/integrations/test_trl.py and every test marked trl; the benchmark's tests (the demo and the
# training benchmark compare against TRL's packing; they never ran at the floors); and LLaMA-Factory
# (0.9.5 needs Python >= 3.11: its tests skip here, saying so). Nothing else skips for a missing package.
test-min: $(STAMP_MIN)
	$(PY_MIN) -m pytest -q -m "not trl" --ignore=tests/integrations/test_trl.py --ignore=tests/bench/test_bench_smoke.py \
		--ignore=tests/bench/test_bench_training.py

clean:
	rm -rf $(VENV) $(VENV_MIN) out .pytest_cache .hypothesis
