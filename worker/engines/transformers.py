"""The transformers engine: batched, KV-cached sampling with echo.hf; weights swapped in place.

It runs the trainer's own forward (`echo.hf`), so its behaviour log-probs equal the trainer's
π for the same version up to float rounding (`mismatch_kl` ≈ 0); no probe is needed after an
install, only the exact name and shape check.
"""

from __future__ import annotations

import torch

from echo.hf import Sample, completion_logprobs, sample
from worker.engines.base import Engine, EngineError, GenerationParams, check_snapshot, load_snapshot


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
        with self._exclusive("install"):
            state = load_snapshot(version, weights)
            expected = self.model.state_dict()  # tied models list the head too, as snapshots do
            check_snapshot(version, state, {k: v.shape for k, v in expected.items()}, self.version)
            with torch.no_grad():  # copy into the existing parameters: no re-allocation, no restart
                for name, tensor in state.items():
                    expected[name].copy_(tensor)
            self.version = version

    def generate(self, prompts, params: GenerationParams) -> list[list[Sample]]:
        with self._exclusive("generate"):
            if self.version < 0:
                raise EngineError("no snapshot installed yet: install one before generating")
            flat = [p for p in prompts for _ in range(params.n)]
            outs = sample(self.model, flat, max_new_tokens=params.max_new_tokens, stop_ids=params.stop_ids,
                          pad_id=params.pad_id, temperature=params.temperature, top_p=params.top_p,
                          generator=self.generator)
            return [outs[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    @torch.no_grad()
    def score(self, prompt, completion, temperature):
        logp, _ = completion_logprobs(self.model, [prompt], [completion], pad_id=0, temperature=temperature)
        return logp[0, : len(completion)].tolist()
