# Two commands: `make demo` (the benchmark) and `make test` (the whole suite).
# Each creates the virtual environment .venv/ when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.odb-installed

.PHONY: demo test test-fast venv clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	# LLaMA-Factory's own requirements pull another torch: install it and the few packages its SFT
	# path imports without dependency resolution; if that fails its tests are skipped with the reason.
	$(PY) -m pip install -q --no-deps -c constraints.txt llamafactory peft trl datasets dill multiprocess xxhash \
		pyarrow pandas pytz omegaconf antlr4-python3-runtime requests urllib3 certifi charset-normalizer \
		|| echo "odb: LLaMA-Factory not installed; tests/test_llamafactory.py will be skipped"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m odb.bench --out out/bench
	$(PY) scripts/update_readme.py out/bench/results.json

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
