# Two commands on a fresh clone:  `make demo`  and  `make test`.
# Each creates (or reuses) the virtual environment .venv and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv demo test margins bench docs site clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch==2.13.0 first: that pin takes the local CPU wheel instead of a multi-GB CUDA download.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(BIN)/python demo/run_study.py --sizes 256 --variants softmax mhla_all mhla_auto linear --out demo_out

test: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests

# The tolerance audit: the suite once more, recording how close every float comparison comes to its
# bound (tests/margins.py); MARGINS_LOG collects runs (other CPUs, OPENBLAS_CORETYPE=...), then merge them.
MARGINS_LOG ?= margins.jsonl
margins: venv
	MHLA_MARGINS=$(abspath $(MARGINS_LOG)) PYTHONPYCACHEPREFIX=$(abspath .margins_pyc) \
	  $(BIN)/python -m pytest -q -p no:cacheprovider -o enable_assertion_pass_hook=true tests
	$(BIN)/python tests/margins.py $(MARGINS_LOG)

bench: venv
	$(BIN)/python benchmarks/bench_ops.py

# The documentation site (mkdocs.yml): `make docs` serves it at http://127.0.0.1:8000 and rebuilds on edits;
# `make site` builds it into site/, failing on any warning (a broken link or anchor, a docstring griffe cannot parse).
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

site: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

clean:
	rm -rf $(VENV) demo_out site
