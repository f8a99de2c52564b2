# Two commands: `make demo` and `make test`. Both create or reuse .venv.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIMM := $(VENV)/bin/pimm
DEMO_DATA := data/demo

.PHONY: demo test venv lint bench clean docs docs-ref

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

$(DEMO_DATA)/train.h5: | venv
	$(PIMM) data synth --out $@ --events 2400 --seed 1

$(DEMO_DATA)/val.h5: | venv
	$(PIMM) data synth --out $@ --events 400 --seed 2

demo: venv $(DEMO_DATA)/train.h5 $(DEMO_DATA)/val.h5
	OMP_NUM_THREADS=1 $(PIMM) launch --train.config demo/semseg --resources.nproc-per-node 2

test: venv
	$(PY) -m pytest -q tests

lint: venv
	$(VENV)/bin/ruff check pimm tests benchmarks examples

docs: venv
	# NO_MKDOCS_2_WARNING: Material prints a banner about its successor on every build; it is not a build warning
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

docs-ref: venv
	$(PY) -m pimm.docs_reference

bench: venv
	$(PY) benchmarks/throughput.py

clean:
	rm -rf exp data .pytest_cache
