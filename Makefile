# Two commands: `make demo` and `make test`. Both create or reuse .venv.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIMM := $(VENV)/bin/pimm
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
DEMO_DATA := data/demo
DOCS_PORT ?= 8000

# Where .venv's torch comes from, chosen when .venv is created (`make venv TORCH=cpu`):
#   pinned  the default: torch==<pyproject's pin> from pip's configured index. On Linux PyPI's wheel
#           is the CUDA build and brings the nvidia-* packages (CUDA runtime, cuDNN, NCCL: gigabytes).
#   cpu     PyTorch's CPU-only wheel index: a laptop or a CPU node, a few hundred MB.
#   cuXYZ   PyTorch's wheel index for CUDA X.Y.Z (cu126, ...): a GPU machine without a site torch.
#   system  a torch already installed (a cluster's module or container): .venv sees it through
#           --system-site-packages, and pip installs every other dependency but never torch.
# an existing .venv keeps its source: a reinstall (pyproject.toml changed) uses it again
TORCH_MADE := $(shell if [ -f $(VENV)/.installed ]; then made=$$(cat $(VENV)/.installed); echo $${made:-pinned}; fi)
TORCH ?= $(or $(TORCH_MADE),pinned)
TORCH_INDEX := https://download.pytorch.org/whl/$(TORCH)
TORCH_PIN := $(shell sed -n 's/^ *"\(torch==[^"]*\)".*/\1/p' pyproject.toml)
ifeq ($(filter pinned cpu system,$(TORCH))$(shell echo '$(TORCH)' | grep -xE 'cu[0-9]+'),)
$(error TORCH=$(TORCH) is not a torch source; use pinned (the default: pip's index), cpu (PyTorch's CPU-only wheels), cu126 or another cuXYZ (PyTorch's CUDA wheels) or system (a torch already installed, e.g. a cluster module))
endif
ifneq ($(TORCH_MADE),$(if $(TORCH_MADE),$(TORCH)))
$(error $(VENV) was installed with TORCH=$(TORCH_MADE); TORCH=$(TORCH) applies only when $(VENV) is created: remove it (rm -rf $(VENV)) and run make venv TORCH=$(TORCH) again)
endif
# every dependency of pimm and its test extra except torch (TORCH=system keeps the torch it finds)
DEPS_BUT_TORCH := import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	print(" ".join(d for d in p["dependencies"] + p["optional-dependencies"]["test"] if not d.startswith("torch=")))

.PHONY: demo test venv lint bench clean docs docs-serve docs-ref

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
ifeq ($(TORCH),system)
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	@$(PY) -c 'import torch' 2>/dev/null || { echo "make: TORCH=system, but $(PY) finds no torch: load the site's PyTorch module (module load pytorch) or container first, or use TORCH=cpu / TORCH=cu126" >&2; exit 2; }
	$(PIP) --no-deps -e .
	$(PIP) $$($(PY) -c '$(DEPS_BUT_TORCH)')
	$(PY) -c 'import torch; print("torch", torch.__version__, "from", torch.__file__, "cuda", torch.cuda.is_available())'
else
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifneq ($(TORCH),pinned)
	$(PIP) '$(TORCH_PIN)' --index-url $(TORCH_INDEX)
endif
	$(PIP) -e '.[test]'
endif
	echo $(TORCH) > $@

$(DEMO_DATA)/train.h5: | venv
	$(PIMM) data synth --out $@ --events 2400 --seed 1

$(DEMO_DATA)/val.h5: | venv
	$(PIMM) data synth --out $@ --events 400 --seed 2

demo: venv $(DEMO_DATA)/train.h5 $(DEMO_DATA)/val.h5
	OMP_NUM_THREADS=1 $(PIMM) launch --train.config demo/semseg --resources.nproc-per-node 2

# in TEST_WORKERS processes (pytest-xdist): each test file runs whole on one, the Slurm tests on one, one at a time
TEST_WORKERS ?= 2
test: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=10 tests

lint: venv
	$(VENV)/bin/ruff check pimm tests benchmarks examples

docs: venv
	# NO_MKDOCS_2_WARNING: Material prints a banner about its successor on every build; it is not a build warning
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# the built site over http://127.0.0.1:$(DOCS_PORT)/, where search works too (it does not over file://)
docs-serve: docs
	$(PY) -m http.server --bind 127.0.0.1 --directory site $(DOCS_PORT)

docs-ref: venv
	$(PY) -m pimm.docs_reference

bench: venv
	$(PY) benchmarks/throughput.py

clean:
	rm -rf exp data .pytest_cache
