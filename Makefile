# `make demo` (the benchmark's headline at reduced sizes, in minutes; writes under out/demo only), `make bench`
# (the full benchmark; writes under out/bench only), `make publish` (README and docs/benchmarks.md regenerated from
# make bench's results, and make demo's time), `make test` (the whole suite, pinned by constraints.txt, with
# LLaMA-Factory's tests in an environment of their own pinned by constraints-llamafactory.txt),
# `make test-min` (the suite on the oldest Python, torch, numpy, transformers, accelerate, Lightning and
# datasets that pyproject.toml declares, pinned by constraints-min.txt) and `make test-latest` (the
# integration tests on whatever pip resolves as newest today, unpinned: not part of CI's run).
# Each creates its virtual environment (.venv/, .venv-lf/, .venv-min/, .venv-latest/) when it is missing.
PYTHON ?= python3
# The oldest Python that pyproject.toml declares (requires-python); pyenv's 3.10 where it has one.
PYTHON_MIN ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.10.*/bin/python3.10) python3.10)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.odb-installed
VENV_LF := .venv-lf
PY_LF := $(VENV_LF)/bin/python
STAMP_LF := $(VENV_LF)/.odb-installed
VENV_LATEST := .venv-latest
PY_LATEST := $(VENV_LATEST)/bin/python
VENV_MIN := .venv-min
PY_MIN := $(VENV_MIN)/bin/python
STAMP_MIN := $(VENV_MIN)/.odb-installed

.PHONY: demo bench publish test test-fast test-min test-latest venv venv-lf venv-min clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	# The `trl` extra resolved against the pins: pip refuses a pin outside what pyproject.toml declares.
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,trl]' peft
	touch $(STAMP)

venv: $(STAMP)

# LLaMA-Factory 0.9.5 imports what TRL 1.x removed and declares trl<=0.24, so it runs beside TRL 0.24 here.
# Its own requirements pull another torch: it and the few packages its SFT path imports are installed
# without dependency resolution. A failed install stops here (and its tests fail, never skip, where it does not import).
$(STAMP_LF): pyproject.toml constraints.txt constraints-llamafactory.txt
	test -x $(PY_LF) || $(PYTHON) -m venv $(VENV_LF)
	$(PY_LF) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY_LF) -m pip install -q -c constraints.txt -e '.[dev]'
	$(PY_LF) -m pip install -q --no-deps -c constraints-llamafactory.txt llamafactory peft trl datasets dill \
		multiprocess xxhash pyarrow pandas pytz omegaconf antlr4-python3-runtime requests urllib3 certifi charset-normalizer
	touch $(STAMP_LF)

venv-lf: $(STAMP_LF)

# The benchmark's headline at reduced sizes (odb.bench.demo: convergence and scale): what it runs first, a
# one-screen summary and where each plot is last; results.json, summary.md and the plots under out/demo.
demo: $(STAMP)
	$(PY) -m odb.bench --demo --out out/demo

# The full benchmark: prints its tables, then the summary; results.json, summary.md and the plots under out/bench.
# It changes no tracked file.
bench: $(STAMP)
	$(PY) -m odb.bench --out out/bench
	@echo "make bench: 'make publish' copies it into docs/results/ and regenerates README.md and docs/benchmarks.md"

# Publish the last `make bench`: its results file and plots become the repository's (docs/results/,
# docs/img/), and README.md's and docs/benchmarks.md's generated parts are rewritten from them; the last
# `make demo`'s results file (out/demo, when there is one) gives README the demo's measured time.
publish: $(STAMP)
	@test -f out/bench/results.json || { echo "make publish: no out/bench/results.json. Fix: run make bench first"; exit 1; }
	mkdir -p docs/results
	cp out/bench/results.json docs/results/bench.json
	for f in out/bench/*.png; do cp "$$f" docs/img/; done
	if [ -f out/demo/results.json ]; then cp out/demo/results.json docs/results/demo.json; fi
	$(PY) scripts/update_readme.py docs/results/bench.json

# LLAMAFACTORY_TESTS: every test marked llamafactory (the snippets and the example run in these files too).
LLAMAFACTORY_TESTS := tests/integrations/test_llamafactory.py tests/project/test_examples.py tests/project/test_doc_snippets.py

test: $(STAMP) $(STAMP_LF)
	$(PY) -m pytest -q -m "not llamafactory"
	$(PY_LF) -m pytest -q -m llamafactory $(LLAMAFACTORY_TESTS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not llamafactory"

# The newest releases of the frameworks, resolved today without constraints (torch stays at constraints.txt's
# 2.13.0, a local CPU build: the newest torch from PyPI is a multi-GB CUDA download), then the integration tests
# (TRL's among them) and the streaming-dataset resume: a release that breaks odb shows here before a user meets it.
# The `trl` extra declares the tested TRL range only, so the newest TRL and transformers are installed over it
# (pip warns); odb's checks of the names it relies on (odb.private_api) name what changed. Run it on a
# schedule or by hand; CI's .ci/run does not. LLaMA-Factory pins old TRL and datasets, so its tests stay out.
test-latest:
	test -x $(PY_LATEST) || $(PYTHON) -m venv $(VENV_LATEST)
	$(PY_LATEST) -m pip install -q -U --upgrade-strategy eager torch==2.13.0 -e '.[dev,trl]' peft
	$(PY_LATEST) -m pip install -q -U trl transformers
	$(PY_LATEST) -m pip list 2>/dev/null | grep -iE '^(torch|transformers|accelerate|lightning|trl|peft|datasets) '
	$(PY_LATEST) -m pytest -q -m "not llamafactory" tests/integrations tests/resume/test_datasets_stream.py

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

# Not part of it: TRL (the `trl` extra's floor, 1.16, needs Python >= 3.11; make test runs its pin):
# tests/integrations/test_trl.py, test_trl_refusals.py, test_trl_preference.py, test_trl_grpo.py,
# test_trl_grpo_vllm.py, test_framework_drift.py and every test marked trl; the benchmark's tests (the demo and the
# training benchmark compare against TRL's packing; they never ran at the floors); and LLaMA-Factory
# (0.9.5 needs Python >= 3.11: its tests skip here, saying so). Nothing else skips for a missing package.
# Left to `make test` as well, as work that does not depend on the versions (CI runs both; each ran in both before):
# the tests marked slow (1,024 simulated ranks of the alignment protocol, pure Python; a killed main process's
# workers exiting), the rest of tests/bench (the benchmark's own correctness: `make bench` and `make demo` run on the pins), and
# the static checks of tests/project (import layers, the options page, the agent skill's text). The doc snippets
# and the examples still run here: they exercise the integrations on the floors.
MIN_SKIPPED := --ignore=tests/integrations/test_trl.py --ignore=tests/integrations/test_trl_refusals.py --ignore=tests/integrations/test_trl_preference.py --ignore=tests/integrations/test_trl_grpo.py --ignore=tests/integrations/test_trl_grpo_vllm.py --ignore=tests/integrations/test_framework_drift.py --ignore=tests/bench --ignore=tests/project/test_layers.py \
	--ignore=tests/project/test_options_doc.py --ignore=tests/project/test_agent_skills.py

test-min: $(STAMP_MIN)
	$(PY_MIN) -m pytest -q -m "not trl and not slow" $(MIN_SKIPPED)

clean:
	rm -rf $(VENV) $(VENV_LF) $(VENV_LATEST) $(VENV_MIN) out .pytest_cache .hypothesis
