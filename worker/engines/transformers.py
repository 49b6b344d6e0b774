"""The transformers engine: batched, KV-cached sampling with echo.hf; weights swapped in place."""

from __future__ import annotations

import torch

from echo.hf import Sample, completion_logprobs, sample
from worker.engines.base import Engine, EngineError, GenerationParams


class TransformersEngine(Engine):
    name = "transformers"

    def __init__(self, model_dir, device, dtype, threads, seed):
        super().__init__(model_dir, device, dtype, threads, seed)
        from transformers import AutoConfig, AutoModelForCausalLM

        if device == "auto":
            self.device = device = "cuda" if torch.cuda.is_available() else "cpu"
        torch.set_num_threads(threads)
        config = AutoConfig.from_pretrained(model_dir)
        # Architecture only: the weights arrive as a snapshot from the learner.
        self.model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).to(device).eval()
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def install(self, version: int, weights: bytes) -> None:
        from safetensors.torch import load

        state = load(weights)
        expected = self.model.state_dict()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise EngineError(f"snapshot v{version} does not match the model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}; refusing to install (the engine keeps v{self.version})")
        for name, tensor in state.items():
            if tensor.shape != expected[name].shape:
                raise EngineError(f"snapshot v{version}: {name} has shape {tuple(tensor.shape)}, "
                                  f"model expects {tuple(expected[name].shape)}; refusing to install")
        with torch.no_grad():  # copy into the existing parameters: no re-allocation, no restart
            for name, tensor in state.items():
                expected[name].copy_(tensor)
        self.version = version

    def generate(self, prompts, params: GenerationParams) -> list[list[Sample]]:
        if self.version < 0:
            raise EngineError("no snapshot installed yet")
        flat = [p for p in prompts for _ in range(params.n)]
        outs = sample(self.model, flat, max_new_tokens=params.max_new_tokens, eos_id=params.eos_id,
                      pad_id=params.pad_id, temperature=params.temperature, top_p=params.top_p,
                      generator=self.generator)
        return [outs[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    @torch.no_grad()
    def score(self, prompt, completion, temperature):
        logp, _ = completion_logprobs(self.model, [prompt], [completion], pad_id=0, temperature=temperature)
        return logp[0, : len(completion)].tolist()
