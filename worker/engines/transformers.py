"""The transformers engine: batched, KV-cached sampling with echo.hf; weights swapped in place.

It runs the trainer's own forward (`echo.hf`), so its behaviour log-probs equal the trainer's
π for the same version up to float rounding (`mismatch_kl` ≈ 0); no probe is needed after a
full install, only the exact name and shape check.

LoRA mode (`lora`): the base is loaded from `model_dir` once and each version is a PEFT adapter
of its own (`v<version>`), the `lora.keep` newest kept loaded. An install adds the new adapter
beside the others, copies the blob in, activates it, and scores the learner's probe: unless the
log-probs match the learner's for that version (`echo.lora`), the new adapter is deleted and
the engine stays on the previous one, untouched. Every generate activates the adapter of the
version it is stamped with.
"""

from __future__ import annotations

import torch

from echo.hf import Sample, completion_logprobs, sample
from echo.lora import peft_name, quiet_peft
from worker.engines.base import (
    Engine,
    EngineError,
    GenerationParams,
    InstallVerificationError,
    adapter_tolerance,
    check_adapter,
    check_snapshot,
    load_snapshot,
    probe_error,
    probe_tokens,
)

#: fp32 runs the learner's own code: a silent no-op load shows as soon as the adapter moves the
#: probe by more than this (half precision: `LORA_PROBE_TOLERANCE`).
FP32_PROBE_TOLERANCE = 1e-5
HALF_PROBE_TOLERANCE = {"bfloat16": 0.1, "float16": 0.05}


class TransformersEngine(Engine):
    name = "transformers"

    def __init__(self, model_dir, device, dtype, threads, seed, lora=None):
        super().__init__(model_dir, device, dtype, threads, seed, lora)
        from transformers import AutoConfig, AutoModelForCausalLM

        if device == "auto":
            self.device = device = "cuda" if torch.cuda.is_available() else "cpu"
        torch.set_num_threads(threads)
        if lora is None:
            config = AutoConfig.from_pretrained(model_dir)
            # Architecture only: the weights arrive as a snapshot from the learner.
            self.model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).to(device).eval()
        else:  # the frozen base, from the directory (check_base proved it is the learner's)
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
            self.model.requires_grad_(False)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.peft = None  # LoRA: the PEFT wrapper, made at the first install
        self.adapters: list[int] = []  # LoRA: versions loaded, oldest first
        self.last_install: dict[str, float] = {}

    def install(self, version: int, weights: bytes) -> None:
        with self._exclusive("install"):
            if self.lora is not None:
                return self._install_adapter(version, weights)
            state = load_snapshot(version, weights)
            expected = self.model.state_dict()  # tied models list the head too, as snapshots do
            check_snapshot(version, state, {k: v.shape for k, v in expected.items()}, self.version)
            with torch.no_grad():  # copy into the existing parameters: no re-allocation, no restart
                for name, tensor in state.items():
                    expected[name].copy_(tensor)
            self.version = version

    # --- LoRA ------------------------------------------------------------------------------------

    def _install_adapter(self, version: int, weights: bytes) -> None:
        meta = check_adapter(version, weights, self.lora, self.version)
        state = load_snapshot(version, weights)
        name = f"v{version}"
        if version in self.adapters:  # the same version again (a resend): start from a clean slot
            self._delete(version)
        self._add(name)
        try:
            params = {peft_name(n, name): p for n, p in self.model.named_parameters() if f".{name}." in n}
            check_snapshot(version, state, {k: p.shape for k, p in params.items()}, self.version)
            self._load(params, state)
            self.peft.set_adapter(name)
            prompt, completion = probe_tokens(self.model.get_output_embeddings().weight.shape[0])
            got = self._score(prompt, completion, 1.0)
            error = probe_error(got, meta)
            tolerance = adapter_tolerance(FP32_PROBE_TOLERANCE if self.dtype == "float32"
                                          else HALF_PROBE_TOLERANCE[self.dtype], self.lora)
            self.last_install = {"probe_error": error}
            if not error <= tolerance:  # `not <=`: NaN fails too
                raise InstallVerificationError(
                    f"after loading adapter v{version} the engine's probe log-probs differ from the learner's by "
                    f"{error:.3g} per token (tolerance {tolerance}): the adapter is not live as the learner trained "
                    f"it; refusing v{version}, the engine keeps v{self.version}")
        except BaseException:
            self._delete_name(name)
            if self.version >= 0:
                self.peft.set_adapter(f"v{self.version}")
            raise
        self.adapters.append(version)
        self.version = version
        while len(self.adapters) > self.lora.keep:  # the keep newest: S + 2, a batch finishes on its own
            self._delete(self.adapters[0])

    @torch.no_grad()
    def _load(self, params: dict, state: dict) -> None:
        """Copy the adapter's tensors into its slot (tests replace it with a load that silently
        does nothing: the probe must catch it)."""
        for key, tensor in state.items():
            params[key].copy_(tensor)

    def _add(self, name: str) -> None:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=self.lora.rank, lora_alpha=self.lora.alpha, target_modules=list(self.lora.target_modules),
                            lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
        if self.peft is None:
            with quiet_peft():
                self.peft = get_peft_model(self.model, config, adapter_name=name, autocast_adapter_dtype=False)
        else:
            self.peft.add_adapter(name, config)
        self.peft.requires_grad_(False)

    def _delete(self, version: int) -> None:
        self._delete_name(f"v{version}")
        self.adapters = [v for v in self.adapters if v != version]

    def _delete_name(self, name: str) -> None:
        if self.peft is None or name not in self.peft.peft_config:
            return
        if len(self.peft.peft_config) > 1:
            self.peft.delete_adapter(name)
        else:  # the only adapter (a first install refused): back to the bare base
            self.model = self.peft.unload()
            self.peft = None

    def _use(self, version: int) -> None:
        if self.lora is not None and self.peft is not None:
            name = f"v{version}"
            if self.peft.active_adapter != name:
                self.peft.set_adapter(name)

    # --- generation ------------------------------------------------------------------------------

    def generate(self, prompts, params: GenerationParams) -> list[list[Sample]]:
        with self._exclusive("generate"):
            if self.version < 0:
                raise EngineError("no snapshot installed yet: install one before generating")
            self._use(self.version)
            flat = [p for p in prompts for _ in range(params.n)]
            outs = sample(self.model, flat, max_new_tokens=params.max_new_tokens, stop_ids=params.stop_ids,
                          pad_id=params.pad_id, temperature=params.temperature, top_p=params.top_p,
                          generator=self.generator)
            return [outs[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def score(self, prompt, completion, temperature):
        if self.version >= 0:
            self._use(self.version)
        return self._score(prompt, completion, temperature)

    @torch.no_grad()
    def _score(self, prompt, completion, temperature):
        logp, _ = completion_logprobs(self.model, [prompt], [completion], pad_id=0, temperature=temperature)
        return logp[0, : len(completion)].tolist()
