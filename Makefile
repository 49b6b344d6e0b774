# echo: the two commands are `make demo` and `make test`; both create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo model poker test test-slow bench clean

include mk/vllm.mk

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0    # the CPU wheel; any other torch is a multi-GB CUDA build
	$(BIN)/pip install -q -e '.[dev,p2p,market]'  # p2p: the py-libp2p relay transport is tested too; market: Vast.ai
	touch $(STAMP)

install: $(STAMP)

model: install           ## build the tiny demo model (skipped when it exists)
	$(BIN)/echo-rl build-model --config configs/demo.toml

demo: model              ## learner + the cheapest sufficient local workers (of 8) learn arithmetic with GRPO here
	$(BIN)/echo-learner --config configs/demo.toml

poker: install           ## the poker demo (ECHO-2 App. D): build and warm-start the model, train, score it
	$(BIN)/echo-rl build-model --config configs/poker.toml --warmup-steps 400 --warmup-batch 32
	$(BIN)/echo-learner --config configs/poker.toml
	$(BIN)/echo-rl eval poker models/tiny-poker $$(ls -td runs/poker-* | head -1) --hands 400

test: install            ## the default suite, then the vLLM engine tests in .venv-vllm (slow scenarios excluded)
	$(BIN)/python -m pytest
	$(MAKE) test-vllm

test-slow: install       ## long scenarios and benchmark-style tests
	$(BIN)/python -m pytest -m slow

test-gpu: install        ## the learner and workers on a CUDA GPU (skipped without one; ~5 min)
	$(BIN)/python -m pytest -m gpu tests/gpu

bench: install           ## every benchmark whose table is in docs/benchmarks.md
	$(BIN)/echo-rl bench activation
	$(BIN)/echo-rl bench staleness
	$(BIN)/echo-rl bench simspeed
	$(BIN)/echo-rl bench overlap
	$(BIN)/echo-rl bench engines --python $(VLLM_BIN)/python

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs models .echo-cache
