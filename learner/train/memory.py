"""Predict a training step's memory per rank from the model's config, before loading anything.

Per rank, for `P` parameters sharded over `N` ranks and a micro-batch of `T` padded tokens:

    state        16·P/N            fp32 master weights 4, gradients 4, AdamW m and v 8
    reference    b·P/N             the frozen KL reference in the compute dtype (kl_coef > 0)
    eval_copy    b·P/N             the weights of the version evaluated on workers, held to check
                                   their greedy answers against ([eval] where = "workers"; not
                                   in LoRA mode, where the held adapter is swapped into the policy)
    claim_copy   b·P/N             the frozen copy stale groups are checked on, loaded with the
                                   version each claims ([verify] stale_check_fraction > 0; not
                                   in LoRA mode, where the adapter is swapped into the policy)
    gathered     8·(P_root + 2·P_layer)  while computing (N > 1): the FSDP root (embeddings,
                                   norm, head) and two layers (one prefetched) unsharded in
                                   fp32, with their unsharded gradients before reduce-scatter;
                 (2b+4)·(…)         in bf16 mixed precision (any N): gathered and differentiated
                                   in b, the gradient reduced in fp32
    activations  T·k·L·r·H         checkpointed: each layer's input kept (k = 1 on a GPU, 8.5 on a
                                   CPU: glibc's heap); the one layer recomputed in the backward,
                 + max(0, T·A − head)  its saved tensors A, only beyond the head's transient: the
                                   head's backward ends before the first layer is recomputed
                 or 1.55·T·L·A      without: every layer's A, held at the head's backward (the
                                   step's peak), and the CPU allocator's slack (1.3 on a GPU)
                 + 128·T·H          outside the layers: embeddings, final norm, the head's inputs
                                   (64 on a GPU)
    head         c·V·(8 [+12])     one chunk of c tokens: fp32 logits, then their gradient (+ top-p's
                 + 2.5·b·V·H        sort: values and int64 order); the head's weight gradient of a
                 [+ 0.5·T·V]        chunk and autograd's sum of it over chunks (not in LoRA); on a
                                   CPU with top-p, the chunks' masks glibc's heap keeps
    runtime      1.3 GiB on a GPU  CUDA context, kernels and NCCL; 0.4 GiB on a CPU (the
                                   interpreter with torch and transformers imported, 0.25 GiB, and
                                   what the allocator keeps between steps)

with `A = 8·H + b·(6·H + 2·H_kv + 4·I)` bytes per token for a pre-norm decoder layer with SwiGLU
in compute dtype `b` (`saved_per_token_layer`), counted with saved-tensor hooks on a Qwen2 layer
in fp32 and bf16: the two RMSNorms' fp32 copies of their input, six hidden-sized tensors, rotary
k and v, four intermediate-sized ones; SDPA keeps no attention matrix. `r`: the residual stream's
bytes (4, or b in bf16 mixed precision). The factors beyond the tensor counts were fitted to the
peaks `echo-rl bench learner --only memory` measures on this CPU (table 8 of docs/benchmarks.md,
the points in tests/unit/learner/test_memory_model.py, each the highest of 2-6 runs). The same
step's peak varies by up to 8% between runs on this CPU (glibc's heap), so the band is against
the highest run: 1.00-1.05 on eleven of twelve points, 0.986 on one (1024 × 8 at 2,048 tokens,
whose saved tensors sit 1.55× their count in the resident set where another model's same bytes
sit 1.15×). On a GPU (an H200, one rank, 0.5B and 1.9B parameters at 4k-16k tokens, fp32, bf16,
top-p, LoRA; `--device cuda`) three factors have their own fit, below: 1.01-1.15× every peak with
the learner's allocator setting (expandable segments). The default allocator reserved up to 12%
more (the 1.9B bf16 step: 45.9 GiB against 40.3), more than this fit covers. More than one rank
has not been measured on a GPU (only one was lent): the gathered term there is counted, not fitted.

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
ACTIVATION_FACTOR = 1.55  # × `saved_per_token_layer`, no checkpointing: every layer's saved tensors, held
#   at the step's peak, which is the head's backward (measured phase by phase on every point tried; the
#   layers' own backward peaks lower). Beyond the count (1.0): glibc's slack between them (resident after
#   the forward, measured 1.0× on the 152k-vocabulary model, 1.15-1.3× on the 32k ones at 4,096 tokens)
#   and what the head's transient holds beyond its count (574 MiB measured at 32k, 4,096 tokens; 412 counted)
CHECKPOINTED_INPUT = 1  # × a layer's input (r·H per token), kept per layer when checkpointing: the tensor count
CHECKPOINTED_INPUT_CPU = 8.5  # the same on a CPU: glibc's heap keeps each layer's freed forward temporaries
#   between the inputs kept (resident after the forward, 512 × 8 at 4,096 tokens: 4.7× the input per layer;
#   the 16-layer peak implies ~7×; 1.0× with MALLOC_MMAP_THRESHOLD_=65536), and the head's transient beyond
#   its count, which coexists with them (fitted: the 16-layer point at 4,096 tokens)
RECOMPUTED_LAYER = 1  # × `saved_per_token_layer`: the one layer recomputed in the backward, its saved tensors;
#   it does not coexist with the head's transient (the head's backward, chunks and weight-gradient sum,
#   ends before the first layer is recomputed), so the step's peak counts the larger of the two
OUTSIDE_LAYERS = 128  # bytes × H per token outside the layers: embeddings' output, the final norm (fp32
#   statistics), the completions' hidden states gathered for the head, their gradients, allocator slack
HEAD_CHUNK = 8  # bytes per logit of one chunk (c × V): the fp32 logits, then their gradient
TOP_P_SORT = 12  # more per logit of a chunk with top-p < 1, at the peak (the chunk's backward, whose
#   recomputed forward sorts): the sorted values (4) and their int64 order (8). The sort's forward alone
#   holds 28 per logit at once (logits, scaled, values, order, softmax, cumsum: 28.3 measured on the head
#   alone, 8.3 without top-p), but not beside the chunk's gradients; the step's peak rose 11.4-12.8 per
#   logit of a chunk with top-p (152k vocabulary, 512 tokens: two chunks; 10-16 pairing any runs)
TOP_P_MASKS_CPU = 0.5  # more per logit of the whole micro-batch (T × V) on a CPU: a chunk's bool masks (c·V
#   bytes, under glibc's 32 MiB ceiling of its mmap threshold) are heap-allocated and their holes stay resident
#   across the chunks: measured 112 MiB after the head's forward at 2 chunks, 797 MiB at 14 (1.3-1.5 bytes per
#   logit of the micro-batch); counted 0.5 because the activation term already over-counts the 152k-vocabulary
#   model at 4,096 tokens by ~400 MiB (measured 4,728-4,760 MiB, predicted 5,176 without top-p)
HEAD_GRAD = 2.5  # × b·V·H: each chunk's gradient of the head's weight, and autograd's running sum of it
#   over the chunks, beside the gradient held in the state (the head's weight is an input of every chunk)
CPU_RUNTIME = 0.4  # GiB: the interpreter with torch, transformers and the model's code (0.25 GiB measured
#   before the model loads) and what the allocator keeps between steps

# On a GPU (fitted to the peaks `echo-rl bench learner --only memory --device cuda` measured on an
# H200, torch 2.11 + CUDA 13, with the learner's expandable segments: table 8b of docs/benchmarks.md,
# the points in tests/unit/learner/test_memory_model.py; every peak ≤ the prediction ≤ 1.15× it).
# A GPU peak is the caching allocator's reservation plus the context: the reservation ran 1.03-1.25×
# the tensors held, and these two terms absorb that, as the CPU's absorb glibc's heap.
ACTIVATION_FACTOR_GPU = 1.3  # × `saved_per_token_layer`, no checkpointing (the CPU's 1.55 over-predicted 12-22%)
OUTSIDE_LAYERS_GPU = 64  # bytes × H per token outside the layers (the CPU's 128 is mostly glibc's slack:
#   128 over-predicted a bf16 LoRA step of 1.9B parameters at 16k tokens by 35%, 4 GiB of its 13.5)
GPU_RUNTIME = 1.3  # GiB outside the allocator: measured 0.74 GiB for a plain process (the CUDA context and
#   kernels) and 1.30 GiB for one with an NCCL group, which every sharded learner has


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
    claim_copy: float = 0.0

    @property
    def total(self) -> float:
        return (self.state + self.reference + self.eval_copy + self.claim_copy + self.gathered + self.activations
                + self.head + self.runtime)

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in vars(self).items() if v)
        return f"{self.total / GiB:.2f} GiB per rank ({parts})"


def predict(shape: ModelShape, *, ranks: int, micro_batch_tokens: int, compute_bytes: int, checkpointing: bool,
            reference: bool, chunk_tokens: int, top_p: float, gpu: bool = False, eval_copy: bool = False,
            mixed: bool = False, adapter_params: int = 0, claim_copy: bool = False) -> MemoryPlan:
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
    lora = adapter_params > 0
    head = (chunk_tokens * shape.vocab * (HEAD_CHUNK + (TOP_P_SORT if top_p < 1 else 0))
            + (0 if lora else HEAD_GRAD * b * shape.vocab * H)
            + (T * shape.vocab * TOP_P_MASKS_CPU if top_p < 1 and not gpu else 0))
    if checkpointing:  # every layer's input kept; then the head's backward, or one layer recomputed, whichever is larger
        kept = CHECKPOINTED_INPUT if gpu else CHECKPOINTED_INPUT_CPU
        activations = T * kept * shape.layers * r * H + max(0, RECOMPUTED_LAYER * saved * T - head)
    else:
        activations = T * shape.layers * (ACTIVATION_FACTOR_GPU if gpu else ACTIVATION_FACTOR) * saved
    # embeddings, final norm, the completions' hidden states, their gradients
    activations += T * (OUTSIDE_LAYERS_GPU if gpu else OUTSIDE_LAYERS) * H
    unit = shape.root_params + 2 * shape.layer_params  # unsharded at once: the root and two layers (one prefetched)
    return MemoryPlan(
        state=(b * P + 16 * adapter_params) / N if lora else 16 * P / N,
        reference=b * P / N if reference else 0.0,
        eval_copy=b * P / N if eval_copy and not lora else 0.0,  # LoRA: the held adapter, swapped in to check
        # fp32: the unit's parameters and gradients; mixed: both in the compute dtype plus the fp32 gradient
        # reduced; LoRA: the frozen base's unit in the compute dtype, no gradient
        gathered=(b * unit if lora and (mixed or N > 1) else (2 * b + 4) * unit if mixed
                  else 8 * unit if N > 1 else 0.0),
        activations=float(activations),
        head=float(head),
        runtime=(GPU_RUNTIME if gpu else CPU_RUNTIME) * GiB,
        claim_copy=b * P / N if claim_copy and not lora else 0.0,
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
