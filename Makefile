# The two commands of the README: `make demo` (the main job on the sample data: make and
# convert the samples, then train on fashion with torchrun, 2 processes) and `make test`
# (the test suite). Both bootstrap .venv first; the second time that is instant.
PY := .venv/bin/python
# Bytecode of this checkout's modules cached in its (git-ignored) __pycache__ folders: where the
# environment sets PYTHONDONTWRITEBYTECODE, each of the suite's 200 processes would compile them
# again (pytest's collection alone: 11.7 s, against 5.5 s cached, on a 2-core AMD EPYC without AVX-512)
export PYTHONDONTWRITEBYTECODE :=
DATA := data
SETS := fashion photos

.PHONY: setup demo test gpu-check gpu-bundle wheelhouse sample-data convert clean

setup:
	@bash tools/bootstrap.sh

DEMO_RECIPE := algorithms/recipes/fashion_baseline.yaml

demo: setup sample-data convert
	@$(PY) tools/summarize_data.py $(DATA)
	@.venv/bin/torchrun --standalone --nproc_per_node=2 training/main.py --config $(DEMO_RECIPE) \
	    run_dir=runs/demo-$$(date +%Y%m%d-%H%M%S)

sample-data: setup
	@$(PY) tools/make_sample_data.py $(SETS) --out $(DATA)/sample

convert: sample-data
	@for set in $(SETS); do \
	    $(PY) tools/convert_ffcv.py $(DATA)/sample/$$set $(DATA)/ffcv/$$set || exit 1; \
	    $(PY) tools/convert_wds.py $(DATA)/sample/$$set $(DATA)/wds/$$set || exit 1; \
	done

test: setup
	@$(PY) -m pytest -q

# The CUDA path in one command (tools/gpu_check.py); says so and exits 0 without CUDA. On a GPU
# node whose Python already has the dependencies: make gpu-check PY=python3 SETUP=
SETUP := setup
gpu-check: $(SETUP)
	@PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PY) tools/gpu_check.py

# What the GPU check needs on a GPU node without internet whose image has torch, packed here as
# xz-compressed chunks of at most CHUNK_MIB MiB to carry there, and installed there with
# `PYTHONPATH=. python3 tools/gpu_bundle.py install gpu-bundle` (tools/gpu_bundle.py). GPU_PYTHON: an
# interpreter of the node's Python version; CUDA: the major version of the node's torch build.
GPU_PYTHON ?= python3.12
CUDA ?= 13
CHUNK_MIB ?= 58
gpu-bundle: setup
	@$(PY) tools/gpu_bundle.py pack gpu-bundle --python $(GPU_PYTHON) --cuda $(CUDA) --chunk-mib $(CHUNK_MIB)

# Every package the set-up needs, for an offline install: WHEELHOUSE=DIR bash tools/bootstrap.sh
WHEELHOUSE ?= wheelhouse
TORCH ?= cpu
wheelhouse:
	@bash tools/wheelhouse.sh $(WHEELHOUSE) $(TORCH)

clean:
	rm -rf $(DATA)/ffcv $(DATA)/wds runs
