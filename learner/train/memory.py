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
    activations  T·(L·4H + A)      checkpointed: each layer's fp32 input kept, one layer's
                 or T·L·A          working set A recomputed at a time; without: every layer's A
    head         c·V·(16 [+16])    one chunk of c tokens: logits, their grad and softmax in
                                   fp32 (+ the sort of top-p)
    runtime      1 GiB on a GPU    CUDA context and workspaces; 0.4 GiB on a CPU (the
                                   interpreter with torch and transformers imported)

with `A = (2r + 16·b)·H + 2·b·H_kv + 8·b·I` bytes per token for a pre-norm decoder layer with
SwiGLU in compute dtype `b`: the residual stream (`r` = 4 in fp32, `b` in bf16 mixed precision:
autocast would keep it fp32), about sixteen hidden-sized tensors
autograd keeps (norm statistics and outputs, q and its rotary copy, attention in and out,
projections), two key/value-sized ones and eight intermediate-sized ones (gate, up, their
activation and product, with allocator slack); SDPA keeps no attention matrix. Counted from a
Qwen2 layer and checked against the peak `echo-rl bench learner` measures on this machine
(fp32, table 1 of the README), where it lands within 10%.

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
    per_token_layer = (2 * r + 16 * b) * H + 2 * b * shape.kv_dim + 8 * b * shape.intermediate
    if checkpointing:
        activations = T * (shape.layers * 4 * H + 2 * per_token_layer)  # the layer's work and its grads
    else:
        activations = T * shape.layers * per_token_layer
    activations += 3 * r * T * H  # final hidden states, normed, and their gradient
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
        head=float(chunk_tokens * shape.vocab * (16 + (16 if top_p < 1 else 0))),
        runtime=GiB if gpu else 0.4 * GiB,
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
