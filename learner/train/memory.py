"""Predict a training step's memory per rank from the model's config, before loading anything.

Per rank, for `P` parameters sharded over `N` ranks and a micro-batch of `T` padded tokens:

    state        16·P/N            fp32 master weights 4, gradients 4, AdamW m and v 8
    reference    b·P/N             the frozen KL reference in the compute dtype (kl_coef > 0)
    eval_copy    b·P/N             the weights of the version evaluated on workers, held to check
                                   their greedy answers against ([eval] where = "workers")
    gathered     8·(P_root + 2·P_layer)  while computing (N > 1): the FSDP root (embeddings,
                                   norm, head) and two layers (one prefetched) unsharded in
                                   fp32, with their unsharded gradients before reduce-scatter;
                 (2b+4)·(…)         in bf16 mixed precision (any N): gathered and differentiated
                                   in b, the gradient reduced in fp32
    activations  T·(k·L·r·H + A)   checkpointed: each layer's input kept (k = 1 on a GPU, 7 on a
                                   CPU: glibc's heap), one layer's saved tensors A recomputed
                 or 1.55·T·L·A      without: every layer's A, its gradients and allocator slack
                 + 128·T·H          outside the layers: embeddings, final norm, the head's inputs
    head         c·V·(8 [+16])     one chunk of c tokens: fp32 logits, then their gradient (+ top-p's
                 + 2.5·b·V·H        sort: values and int64 order); the head's weight gradient of a
                                   chunk and autograd's sum of it over chunks (not in LoRA)
    runtime      1 GiB on a GPU    CUDA context and workspaces; 0.4 GiB on a CPU (the
                                   interpreter with torch and transformers imported, 0.25 GiB, and
                                   what the allocator keeps between steps)

with `A = 8·H + b·(6·H + 2·H_kv + 4·I)` bytes per token for a pre-norm decoder layer with SwiGLU
in compute dtype `b` (`saved_per_token_layer`), counted with saved-tensor hooks on a Qwen2 layer
in fp32 and bf16: the two RMSNorms' fp32 copies of their input, six hidden-sized tensors, rotary
k and v, four intermediate-sized ones; SDPA keeps no attention matrix. `r`: the residual stream's
bytes (4, or b in bf16 mixed precision). The factors beyond the tensor counts were fitted to the
peaks `echo-rl bench learner --only memory` measures on this CPU (table 8 of docs/benchmarks.md,
the points in tests/unit/learner/test_memory_model.py): never below a measured peak, within 5%
of ten of twelve, 7% of all. Not measured on a GPU: its allocator will move the fitted factors.

Loading adds no term: a sharded rank allocates its shards and reads its rows of each tensor into
them (`learner.train.load`), one tensor's rows in transit; one plain rank loads the model whole,
which its state then holds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

GiB = float(1 << 30)


@dataclass
class ModelShape:
    params: int
    root_params: int  # embeddings, final norm, head: everything outside the decoder layers
    layer_params: int  # one decoder layer
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv_dim: int
    tied: bool
    linears: tuple[tuple[str, int, int], ...] = ()  # one decoder layer's linears: (leaf name, in, out)

    def adapter_params(self, rank: int, targets) -> int:
        """Parameters of a rank-`rank` LoRA adapter on the `targets` linears of every layer."""
        return self.layers * sum(rank * (i + o) for name, i, o in self.linears if name in set(targets))

    @classmethod
    def of(cls, model_dir: Path) -> ModelShape:
        """From the config alone: the model is built on the meta device (no memory, no weights)."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from learner.train.model import decoder_layers

        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        layers = decoder_layers(model)
        total = sum(p.numel() for p in model.parameters())
        per_layer = sum(p.numel() for p in layers[0].parameters())
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(params=total, root_params=total - per_layer * len(layers), layer_params=per_layer,
                   layers=len(layers), hidden=text.hidden_size,
                   intermediate=getattr(text, "intermediate_size", 4 * text.hidden_size),
                   vocab=model.get_output_embeddings().weight.shape[0],
                   kv_dim=head_dim * getattr(text, "num_key_value_heads", heads),
                   tied=bool(getattr(config, "tie_word_embeddings", False)),
                   linears=tuple((n.rsplit(".", 1)[-1], m.in_features, m.out_features)
                                 for n, m in layers[0].named_modules() if isinstance(m, torch.nn.Linear)))


# Coefficients, re-fitted to the peaks `echo-rl bench learner --only memory` measures (table 8 of
# docs/benchmarks.md; tests/unit/learner/test_memory_model.py holds the points): every measured
# peak ≤ the prediction ≤ 1.05× it. Each is a count of tensors autograd or the head really keep,
# times what this CPU's resident set shows above that count (the allocator keeps freed blocks).
ACTIVATION_FACTOR = 1.55  # × `saved_per_token_layer`, no checkpointing: the peak is the start of the
#   backward, every layer's saved tensors held, plus one layer's gradients and allocator slack
CHECKPOINTED_INPUT = 1  # × a layer's input (r·H per token), kept per layer when checkpointing: the tensor count
CHECKPOINTED_INPUT_CPU = 7  # the same on a CPU: glibc's heap keeps each layer's freed forward temporaries
#   between the inputs kept (measured: 5-9× the input per layer; 1.0× with MALLOC_MMAP_THRESHOLD_=65536)
RECOMPUTED_LAYER = 1  # × `saved_per_token_layer`: the one layer recomputed in the backward, its saved tensors
OUTSIDE_LAYERS = 128  # bytes × H per token outside the layers: embeddings' output, the final norm (fp32
#   statistics), the completions' hidden states gathered for the head, their gradients, allocator slack
HEAD_CHUNK = 8  # bytes per logit of one chunk (c × V): the fp32 logits, then their gradient
TOP_P_SORT = 16  # more per logit with top-p < 1: the sorted values (4) and their int64 order (8), then
#   the softmax/cumsum over them (4) — all freed before the chunk's backward
HEAD_GRAD = 2.5  # × b·V·H: each chunk's gradient of the head's weight, and autograd's running sum of it
#   over the chunks, beside the gradient held in the state (the head's weight is an input of every chunk)
CPU_RUNTIME = 0.4  # GiB: the interpreter with torch, transformers and the model's code (0.25 GiB measured
#   before the model loads) and what the allocator keeps between steps


def saved_per_token_layer(shape: ModelShape, b: int) -> int:
    """Bytes autograd keeps per token for one pre-norm SwiGLU decoder layer in compute dtype `b`,
    counted with saved-tensor hooks on a Qwen2 layer (fp32 and bf16 alike): the two RMSNorms
    each keep an fp32 copy of their input (8·H, whatever `b`); six hidden-sized tensors in `b`
    (each norm's normalized value and output, the rotary q, attention's output and o_proj's
    input); rotary k and v (2·kv); four intermediate-sized (gate, up, silu(gate), their product).
    SDPA keeps no attention matrix."""
    return 8 * shape.hidden + b * (6 * shape.hidden + 2 * shape.kv_dim + 4 * shape.intermediate)


@dataclass
class MemoryPlan:
    """Predicted bytes per rank, by component."""

    state: float
    reference: float
    eval_copy: float
    gathered: float
    activations: float
    head: float
    runtime: float

    @property
    def total(self) -> float:
        return self.state + self.reference + self.eval_copy + self.gathered + self.activations + self.head + self.runtime

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in vars(self).items() if v)
        return f"{self.total / GiB:.2f} GiB per rank ({parts})"


def predict(shape: ModelShape, *, ranks: int, micro_batch_tokens: int, compute_bytes: int, checkpointing: bool,
            reference: bool, chunk_tokens: int, top_p: float, gpu: bool = False, eval_copy: bool = False,
            mixed: bool = False, adapter_params: int = 0) -> MemoryPlan:
    """`mixed`: bf16 through FSDP2's mixed precision (any rank count): units gathered in the
    compute dtype, gradients reduced in fp32, the residual stream in the compute dtype.
    `adapter_params` > 0: LoRA mode. The frozen base costs b·P/N (no gradient, no optimizer
    state), the adapter 16·P_a/N; sharded layers are gathered in the compute dtype without
    gradients; activations are as in full training (the backward still runs through every
    layer to reach the adapters below it)."""
    P, N, T, H = shape.params, ranks, micro_batch_tokens, shape.hidden
    b = compute_bytes
    r = b if mixed else 4  # bytes of one residual-stream value: fp32 under autocast or fp32 compute
    saved = saved_per_token_layer(shape, b)
    if checkpointing:  # every layer's input kept; one layer recomputed and differentiated at a time
        kept = CHECKPOINTED_INPUT if gpu else CHECKPOINTED_INPUT_CPU
        activations = T * (kept * shape.layers * r * H + RECOMPUTED_LAYER * saved)
    else:
        activations = T * shape.layers * ACTIVATION_FACTOR * saved
    activations += T * OUTSIDE_LAYERS * H  # embeddings, final norm, the completions' hidden states, their gradients
    unit = shape.root_params + 2 * shape.layer_params  # unsharded at once: the root and two layers (one prefetched)
    lora = adapter_params > 0
    return MemoryPlan(
        state=(b * P + 16 * adapter_params) / N if lora else 16 * P / N,
        reference=b * P / N if reference else 0.0,
        eval_copy=b * P / N if eval_copy else 0.0,
        # fp32: the unit's parameters and gradients; mixed: both in the compute dtype plus the fp32 gradient
        # reduced; LoRA: the frozen base's unit in the compute dtype, no gradient
        gathered=(b * unit if lora and (mixed or N > 1) else (2 * b + 4) * unit if mixed
                  else 8 * unit if N > 1 else 0.0),
        activations=float(activations),
        head=float(chunk_tokens * shape.vocab * (HEAD_CHUNK + (TOP_P_SORT if top_p < 1 else 0))
                   + (0 if lora else HEAD_GRAD * b * shape.vocab * H)),
        runtime=GiB if gpu else CPU_RUNTIME * GiB,
    )


def available_bytes(device: str, ranks_per_node: int) -> tuple[float, str]:
    """What one rank may use: free memory of its GPU, or this machine's available RAM shared by
    the ranks on it; and a description."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return float("inf"), "no GPU on this machine: a prediction only"
        free, total = torch.cuda.mem_get_info(torch.device(device))
        return float(free), f"{free / GiB:.1f} GiB free of {total / GiB:.1f} GiB on {torch.cuda.get_device_name(device)}"
    available = _meminfo_available()
    return available / ranks_per_node, (f"{available / GiB:.1f} GiB available RAM / {ranks_per_node} ranks"
                                        if ranks_per_node > 1 else f"{available / GiB:.1f} GiB available RAM")


def _meminfo_available() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
