"""The vLLM engine: any Hugging Face model directory, in-place installs verified against the
trainer's numbers, and behaviour log-probs of the distribution actually sampled from.

- vLLM runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): a snapshot goes from the
  downloaded bytes straight into the model with `reload_weights(weights_iterator=...)`, no
  disk round trip and no restart, and vLLM's per-layer post-processing (CPU weight packing,
  quantisation) reruns on the new weights.
- `logprobs_mode="processed_logprobs"`: the sampled token's log-prob after temperature scaling
  and top-p renormalisation, i.e. log μ exactly as `echo.hf.sample` defines it; with top_p = 1
  it equals the trainer's `completion_logprobs(..., temperature)` for the same version.
- `ignore_eos` + `stop_token_ids=stop_ids`: stop exactly where echo's other engine stops, with
  the end-of-sequence token kept in the completion (the policy chose it and is trained on it).
- Every install is checked twice. Before: the snapshot's tensor names and shapes must be the
  model's (vLLM itself only logs a warning for a missing tensor and keeps the old one). After:
  the engine's teacher-forced log-probs of a fixed probe must match the trainer's, computed
  from the same tensors with transformers. That catches what a name check cannot, e.g. a tied
  head left stale by a reload. A refused snapshot leaves the old version in place; a failed
  probe leaves the engine refusing to generate until a good snapshot installs.
- LoRA mode (`lora`): the base's weights load from the directory once (`enable_lora`), and
  each version is an adapter written to a directory of its own and added as
  `LoRARequest(name=f"v{version}", id=version + 1)`; the `lora.keep` (S + 2) newest stay
  loaded (`max_loras`), and every request names its version's adapter, so a batch in flight
  finishes on its own. An adapter is checked before (kind, base, rank, names and shapes) and
  after loading: the learner's probe log-probs for that version (`echo.lora`) must be
  reproduced with the adapter's request, else it is removed and the engine keeps its version.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from echo.hf import Sample
from echo.lora import read_weights_probe
from worker.engines.base import (
    Engine,
    EngineError,
    LORA_PROBE_TOLERANCE,
    GenerationParams,
    InstallVerificationError,
    Reference,
    adapter_tolerance,
    check_adapter,
    check_snapshot,
    load_snapshot,
    probe_error,
)

log = logging.getLogger("echo.worker.vllm")
# vLLM warns on every reload that the rotary embedding (no weights) "failed to load"; a layer
# that really missed its weights cannot get that far, check_snapshot refuses the snapshot first.
logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)

# Mean |engine − trainer| log-prob over the probe tokens that an install may show. fp32 agrees
# to ~1e-6; half precision differs in rounding, so it only catches gross errors there.
PROBE_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.05}
CPU_KV_CACHE_GIB = 1  # default KV cache on CPU (vLLM would take a fraction of all memory)


class VLLMEngine(Engine):
    name = "vllm"

    def __init__(self, model_dir: Path, device: str, dtype: str, threads: int, seed: int, lora=None):
        super().__init__(model_dir, device, dtype, threads, seed, lora)
        # In-process engine core: needed to hand tensors to reload_weights without pickling them
        # (and one process per worker is simpler to supervise). Must be set before vLLM reads it.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise EngineError("the vllm engine needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (in-process weight "
                              "installs); unset it or set it to 0")
        try:
            import torch
            import vllm
            from vllm.platforms import current_platform
        except Exception as e:  # ImportError, or a build whose compiled parts do not load here
            raise EngineError(f"vllm cannot be imported ({type(e).__name__}: {e}); create its venv with `make vllm-venv` and run "
                              ".venv-vllm/bin/echo-worker, or use --engine.type transformers") from e

        self.reference = Reference(model_dir, seed=0)
        self._sampler_proved: tuple[float, float] | None = None  # the sampling vLLM's sampler was proved at
        platform = current_platform.device_type  # "cuda", "cpu", ...: fixed by the vllm build installed
        wanted = "cuda" if device.startswith("cuda") else device
        if wanted not in ("auto", platform):
            raise EngineError(f"engine.device={device!r} but this vllm build runs on {platform!r}; "
                              f"set --engine.device {platform} or install the matching vllm build")
        self.device = platform
        kwargs: dict = {"load_format": "dummy"}  # the directory has no weights: they arrive as snapshots
        self.requests: dict = {}  # LoRA: version -> LoRARequest, oldest first
        if lora is not None:  # the base from the directory; versions are adapters
            ranks = [r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= lora.rank]
            if not ranks:
                raise EngineError(f"vLLM serves LoRA ranks up to 512, this run trains rank {lora.rank}")
            kwargs = {"load_format": "auto", "enable_lora": True, "max_loras": lora.keep, "max_cpu_loras": lora.keep,
                      "max_lora_rank": ranks[0]}
            self.adapter_dir = Path(tempfile.mkdtemp(prefix="echo-lora-"))
            self.lora_expected = _lora_names(self.reference.expected, lora.target_modules, lora.rank)
        if platform == "cpu":
            self._check_cpu_head_dim()
            # vLLM keeps torch at 1 thread unless OMP_NUM_THREADS is set, then disables
            # torch.set_num_threads; ask for ours up front and give the function back afterwards.
            os.environ.setdefault("OMP_NUM_THREADS", str(threads))
            torch.set_num_threads(threads)
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_GIB << 30
        set_num_threads = torch.set_num_threads
        t0 = time.perf_counter()
        try:
            self.llm = vllm.LLM(
                model=str(model_dir), dtype=dtype, seed=seed,
                logprobs_mode="processed_logprobs", max_logprobs=-1,  # -1: full rows for score(T != 1)
                generation_config="vllm",  # no sampling defaults from the model dir: the learner's rule
                enforce_eager=platform == "cpu",  # CPU graph compilation costs minutes, gains little
                **kwargs,
            )
        except Exception as e:  # vLLM raises many types for a model it cannot serve
            raise EngineError(f"vLLM cannot load {model_dir} ({type(e).__name__}: {e}); "
                              "use --engine.type transformers for this model") from e
        finally:
            torch.set_num_threads = set_num_threads
        log.info("vLLM %s engine on %s ready in %.1f s", vllm.__version__, platform, time.perf_counter() - t0)
        self.last_install: dict[str, float] = {}

    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        """As `Engine._exclusive`, and on CPU with this engine's OpenMP thread count in the
        calling thread: the rollout loop calls from a fresh thread each time, where OpenMP
        starts at one thread per core, and vLLM's CPU attention refuses a thread count that
        differs from the one its schedule was planned with."""
        with super()._exclusive(what):
            if self.device == "cpu":
                import torch

                torch.set_num_threads(self.threads)
            yield

    def _check_cpu_head_dim(self) -> None:
        """vLLM's CPU attention supports a few head sizes; say so now, not at the first batch."""
        try:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            supported = CPUAttentionBackend.get_supported_head_sizes()
        except (ImportError, AttributeError):  # another vllm version: let vLLM decide
            return
        cfg = self.reference.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if head_dim not in supported:
            raise EngineError(f"vLLM's CPU attention supports head sizes {supported}, this model has {head_dim}; "
                              "use --engine.type transformers for it")

    def install(self, version: int, weights: bytes) -> None:
        with self._exclusive("install"):
            if self.lora is not None:
                return self._install_adapter(version, weights)
            t0 = time.perf_counter()
            state = load_snapshot(version, weights)
            check_snapshot(version, state, self.reference.expected, self.version)
            t1 = time.perf_counter()
            try:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state.items())})
            except Exception as e:  # half-loaded: neither version is in the engine any more
                previous, self.version = self.version, -1
                raise EngineError(f"vLLM failed while loading v{version} ({type(e).__name__}: {e}); the engine no "
                                  f"longer holds v{previous} and refuses to generate until a snapshot installs") from e
            self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
            t2 = time.perf_counter()
            prompt, completion = self.reference.probe
            got = self._score(prompt, completion, 1.0)
            tolerance = PROBE_TOLERANCE[self.dtype]
            learners = read_weights_probe(weights)
            if learners is not None:  # the learner's own numbers for this version: nothing runs on this CPU
                want, probe_dtype = learners
                if probe_dtype != "float32":  # a half-precision learner's probe differs by its rounding
                    tolerance = max(tolerance, PROBE_TOLERANCE[probe_dtype])
            else:  # a snapshot without them: the trainer's π from these weights, on the CPU (an 8B forward)
                want = self.reference.logprobs(state, prompt, completion)
            error = sum(abs(a - b) for a, b in zip(got, want)) / len(want)
            sampler = self.sampling != (1.0, 1.0) and self.sampling != self._sampler_proved
            if sampler:  # and vLLM's own sampler at the run's temperature and top-p, once per setting:
                # it is vLLM's code, not the weights, that it proves (four CPU forwards at 8B)
                error = max(error, self._sampler_error(state, prompt))
            t3 = time.perf_counter()
            self.last_install = {"check_s": t1 - t0, "load_s": t2 - t1, "verify_s": t3 - t2, "probe_error": error}
            if not error <= tolerance:  # `not <=` so that NaN fails too
                previous, self.version = self.version, -1
                raise InstallVerificationError(
                    f"after installing v{version} the engine's log-probs differ from the trainer's by {error:.3g} "
                    f"per token (tolerance {tolerance}); it no longer holds v{previous} either "
                    "and refuses to generate until a snapshot installs cleanly. Report this with the vllm version; "
                    "--engine.type transformers works meanwhile")
            if sampler:
                self._sampler_proved = self.sampling
            self.version = version

    def _sampler_error(self, state, prompt: list[int], samples: int = 4, tokens: int = 8) -> float:
        """Mean |log μ − log π| over tokens vLLM samples from the probe prompt at the run's
        temperature and top-p: μ as its sampler reports it (processed log-probs), π as the
        trainer computes it for the same tokens. A sampler that applies top-p (or the
        temperature) otherwise than the trainer shows here; a token outside the trainer's
        nucleus is an infinite error."""
        tokens_, mu = self._sample_probe(prompt, samples, tokens)
        errors = []
        for completion, lps in zip(tokens_, mu):
            pi = self.reference.logprobs(state, prompt, completion, *self.sampling)
            errors += [abs(a - b) for a, b in zip(lps, pi)]
        return sum(errors) / max(1, len(errors))

    def _sample_probe(self, prompt: list[int], samples: int, tokens: int) -> tuple[list[list[int]], list[list[float]]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        temperature, top_p = self.sampling
        sampling = SamplingParams(n=samples, temperature=temperature, top_p=top_p, max_tokens=tokens, ignore_eos=True,
                                  logprobs=0, detokenize=False, seed=1234)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=prompt)], sampling, use_tqdm=False)[0]
        return [list(c.token_ids) for c in out.outputs], [_sample(c).logprobs for c in out.outputs]

    def _install_adapter(self, version: int, weights: bytes) -> None:
        from vllm.lora.request import LoRARequest

        from echo.lora import adapter_config

        t0 = time.perf_counter()
        meta = check_adapter(version, weights, self.lora, self.version)
        state = load_snapshot(version, weights)
        check_snapshot(version, state, self.lora_expected, self.version)
        self._remove(version)  # the same version again (a resend): a clean slot
        path = self.adapter_dir / f"v{version}"
        path.mkdir(parents=True)
        (path / "adapter_model.safetensors").write_bytes(weights)
        (path / "adapter_config.json").write_text(json.dumps(adapter_config(meta.rank, meta.alpha, meta.targets)))
        request = LoRARequest(f"v{version}", version + 1, str(path))
        t1 = time.perf_counter()
        try:
            self.llm.llm_engine.add_lora(request)
            prompt, completion = self.reference.probe
            error = probe_error(self._score(prompt, completion, 1.0, request), meta)
        except Exception as e:  # vLLM refused the adapter: the old version is untouched
            self._drop(request)
            raise EngineError(f"vLLM failed to load adapter v{version} ({type(e).__name__}: {e}); the engine keeps "
                              f"v{self.version}") from e
        t2 = time.perf_counter()
        self.last_install = {"check_s": t1 - t0, "load_s": t2 - t1, "verify_s": 0.0, "probe_error": error}
        tolerance = adapter_tolerance(LORA_PROBE_TOLERANCE[self.dtype], self.lora)
        if not error <= tolerance:  # `not <=`: NaN fails too
            self._drop(request)
            raise InstallVerificationError(
                f"after loading adapter v{version} the engine's probe log-probs differ from the learner's by "
                f"{error:.3g} per token (tolerance {tolerance}): the adapter is not live as the learner trained it; "
                f"refusing v{version}, the engine keeps v{self.version}")
        self.requests[version] = request
        self.version = version
        while len(self.requests) > self.lora.keep:  # the keep newest: S + 2
            self._remove(next(iter(self.requests)))

    def _remove(self, version: int) -> None:
        request = self.requests.pop(version, None)
        if request is not None:
            self._drop(request)

    def _drop(self, request) -> None:
        with contextlib.suppress(Exception):
            self.llm.llm_engine.remove_lora(request.lora_int_id)
        shutil.rmtree(request.lora_path, ignore_errors=True)

    def generate(self, prompts: list[list[int]], params: GenerationParams) -> list[list[Sample]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        with self._exclusive("generate"):
            if self.version < 0:
                raise EngineError("no snapshot installed yet: install one before generating")
            greedy = params.temperature <= 0  # vLLM wants n = 1 there; the n samples are identical anyway
            sampling = SamplingParams(
                n=1 if greedy else params.n, temperature=max(0.0, params.temperature), top_p=params.top_p,
                max_tokens=params.max_new_tokens,
                # echo's end-of-turn ids (kept in the completion), not the model's guess
                ignore_eos=True, stop_token_ids=list(params.stop_ids),
                logprobs=0,  # the sampled token's log-prob only (processed: log μ)
                detokenize=False,
            )
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling,
                                        use_tqdm=False, lora_request=self.requests.get(self.version))
            if greedy:
                return [[_sample(out.outputs[0]) for _ in range(params.n)] for out in outputs]
            return [[_sample(c) for c in out.outputs] for out in outputs]

    def score(self, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
        with self._exclusive("score"):
            return self._score(prompt, completion, temperature, self.requests.get(self.version))

    def _score(self, prompt: list[int], completion: list[int], temperature: float, lora_request=None) -> list[float]:
        """Teacher-forced log-probs via vLLM's prompt_logprobs (computed at temperature 1)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        rescale = temperature > 0 and temperature != 1.0
        # At T != 1 the whole row is needed to renormalise: log_softmax(z / T) from log_softmax(z).
        sampling = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=-1 if rescale else 0,
                                  detokenize=False)
        seq = prompt + completion
        out = self.llm.generate([TokensPrompt(prompt_token_ids=seq)], sampling, use_tqdm=False,
                                lora_request=lora_request)[0]
        rows = out.prompt_logprobs[len(prompt) :]  # row i scores token i (row 0 is None)
        if not rescale:
            return [row[token].logprob for row, token in zip(rows, completion)]
        result = []
        for row, token in zip(rows, completion):
            scaled = {t: lp.logprob / temperature for t, lp in row.items()}
            top = max(scaled.values())
            norm = top + math.log(sum(math.exp(v - top) for v in scaled.values()))
            result.append(scaled[token] - norm)
        return result

    def close(self) -> None:
        if self.lora is not None:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()


def _lora_names(expected: dict, targets, rank: int) -> dict[str, tuple[int, ...]]:
    """The tensors of an adapter (PEFT's saved names and shapes) for the model's state-dict
    names `expected`: an A and a B for every target linear inside the decoder layers."""
    out = {}
    for name, shape in expected.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and len(shape) == 2 and ".layers." in f".{module}" and module.rsplit(".", 1)[-1] in targets:
            out[f"base_model.model.{module}.lora_A.weight"] = (rank, shape[1])
            out[f"base_model.model.{module}.lora_B.weight"] = (shape[0], rank)
    return out


def _sample(completion) -> Sample:
    tokens = list(completion.token_ids)
    logprobs = [row[token].logprob for row, token in zip(completion.logprobs, tokens)]
    return Sample(tokens=tokens, logprobs=logprobs, finish="stop" if completion.finish_reason == "stop" else "length")
