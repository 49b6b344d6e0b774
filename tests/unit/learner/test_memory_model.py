"""The memory model (`learner.train.memory.predict`) against the peaks measured on this machine.

Each point is one step measured by `echo-rl bench learner --only memory` (table 8 of
docs/benchmarks.md): a fresh process, a warm-up step, then two micro-batches, the smaller first,
so the measured one runs with every gradient held; the peak resident set of that step, the
highest of 2-6 runs (the same step's peak varies by up to 8% between runs on this CPU: glibc's
heap). Models are the bench's Qwen2 shapes (`model_config`), fp32 unless said, one rank, CPU.
Nothing is measured here: the prediction is checked against the recorded bytes, so this runs in
a second.
"""

import pytest

from learner.bench.trainer import _predicted as bench_prediction
from learner.bench.trainer import model_config
from learner.train.memory import ModelShape

# (hidden, layers, vocab), micro-batch tokens, checkpointing, top-p, compute dtype, highest measured peak bytes
MEASURED = [
    ((512, 8, 32000), 512, False, 1.0, "float32", 1_825_079_296),  # 3 runs, 1,727-1,741 MiB
    ((512, 8, 32000), 4096, False, 1.0, "float32", 3_877_535_744),  # 3 runs, 3,518-3,698 MiB
    ((512, 8, 32000), 4096, True, 1.0, "float32", 2_570_235_904),  # 6 runs, 2,322-2,451 MiB
    ((512, 8, 32000), 2048, False, 1.0, "bfloat16", 2_630_766_592),  # 2 runs, 2,484-2,509 MiB
    ((1024, 8, 32000), 512, False, 1.0, "float32", 3_774_500_864),  # 2 runs, 3,597-3,600 MiB
    pytest.param(((1024, 8, 32000), 2048, False, 1.0, "float32", 5_897_502_720),  # 3 runs, 5,506-5,624 MiB
                 marks=pytest.mark.xfail(strict=True, reason="0.986 of the highest run: this model's saved tensors "
                                         "sit 1.55x their count in glibc's heap, 512 x 8 at 4,096 tokens' 1.15x")),
    ((1024, 8, 32000), 2048, True, 1.0, "float32", 4_338_302_976),  # 3 runs, 4,021-4,137 MiB
    ((512, 4, 151936), 512, False, 1.0, "float32", 4_178_419_712),  # 3 runs, 3,976-3,985 MiB
    ((512, 4, 151936), 512, False, 0.9, "float32", 4_724_781_056),  # 5 runs, 4,310-4,506 MiB
    ((512, 4, 151936), 4096, False, 0.9, "float32", 6_123_683_840),  # 5 runs, 5,412-5,840 MiB
    ((512, 16, 32000), 4096, True, 1.0, "float32", 3_471_499_264),  # 3 runs, 3,281-3,311 MiB
    ((512, 16, 32000), 512, True, 1.0, "float32", 2_126_327_808),  # 2 runs, 2,026-2,028 MiB
]
POINTS = [p.values[0] if hasattr(p, "values") else p for p in MEASURED]
BAND = (1.00, 1.05)  # never below the highest measured peak, at most 5% above it (one point below: xfail)

# On a GPU: `echo-rl bench learner --only memory --device cuda` on an NVIDIA H200 (torch 2.11 +
# CUDA 13, 2026-11-30), one run each, with the learner's allocator setting (expandable segments).
# The peak is the allocator's reservation plus what lives outside it (context, kernels, NCCL).
# (hidden, layers, vocab), tokens, checkpointing, top-p, dtype, LoRA rank, measured peak bytes
MEASURED_GPU = [
    ((1024, 16, 151936), 4096, False, 1.0, "float32", 0, 17_361_076_224),
    ((1024, 16, 151936), 16384, True, 1.0, "float32", 0, 12_392_923_136),
    ((1024, 16, 151936), 16384, True, 1.0, "bfloat16", 0, 14_427_160_576),
    ((1024, 16, 151936), 16384, True, 0.9, "bfloat16", 0, 14_324_400_128),
    ((1024, 16, 151936), 8192, False, 1.0, "bfloat16", 0, 18_390_777_856),
    ((2048, 28, 151936), 16384, True, 1.0, "bfloat16", 0, 42_235_396_096),  # 48.1 GB with the default allocator
    ((2048, 28, 151936), 16384, True, 1.0, "bfloat16", 16, 10_757_144_576),
]
BAND_GPU = (1.00, 1.15)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    out = {}
    for (hidden, layers, vocab), *_ in POINTS + MEASURED_GPU:
        if (hidden, layers, vocab) not in out:
            path = tmp_path_factory.mktemp(f"h{hidden}-l{layers}-v{vocab}")
            model_config(hidden, layers, vocab).save_pretrained(path)
            out[hidden, layers, vocab] = ModelShape.of(path)
    return out


def _predicted(shape, tokens, checkpointing, top_p, dtype, gpu=False, lora_rank=0):
    """The bench's prediction (what table 8 prints), one rank."""
    return bench_prediction(shape, tokens, checkpointing=checkpointing, top_p=top_p, dtype=dtype, gpu=gpu,
                            lora_rank=lora_rank)


@pytest.mark.parametrize("point", MEASURED, ids=[f"h{p[0][0]}-l{p[0][1]}-v{p[0][2]}-t{p[1]}"
                                                f"{'-ckpt' if p[2] else ''}{'-topp' if p[3] < 1 else ''}-{p[4]}"
                                                for p in POINTS])
def test_prediction_covers_the_measured_peak_within_the_band(shapes, point):
    model, tokens, checkpointing, top_p, dtype, measured = point
    ratio = _predicted(shapes[model], tokens, checkpointing, top_p, dtype) / measured
    assert BAND[0] <= ratio <= BAND[1], f"predicted / measured = {ratio:.3f}"


def test_each_knob_moves_the_prediction_as_it_moved_the_peak(shapes):
    """One knob at a time, the predicted difference against the measured one (within 25%): 8×
    tokens without checkpointing, checkpointing on, twice the layers checkpointed, 8× tokens on a
    152k vocabulary with top-p. (Top-p itself: 12 bytes counted per logit of a chunk, 11.4-12.8
    measured at two chunks.)"""
    by = {(m, t, c, p, d): peak for m, t, c, p, d, peak in POINTS}
    pred = lambda m, t, c, p, d: _predicted(shapes[m], t, c, p, d)  # noqa: E731
    pairs = [(((512, 8, 32000), 512, False, 1.0, "float32"), ((512, 8, 32000), 4096, False, 1.0, "float32")),
             (((512, 8, 32000), 4096, True, 1.0, "float32"), ((512, 8, 32000), 4096, False, 1.0, "float32")),
             (((512, 8, 32000), 4096, True, 1.0, "float32"), ((512, 16, 32000), 4096, True, 1.0, "float32")),
             (((512, 4, 151936), 512, False, 0.9, "float32"), ((512, 4, 151936), 4096, False, 0.9, "float32"))]
    for a, b in pairs:
        measured, predicted = by[b] - by[a], pred(*b) - pred(*a)
        assert predicted == pytest.approx(measured, rel=0.25), (a, b, predicted / measured)


@pytest.mark.parametrize("point", MEASURED_GPU, ids=[f"h{p[0][0]}-l{p[0][1]}-t{p[1]}{'-ckpt' if p[2] else ''}"
                                                    f"{'-topp' if p[3] < 1 else ''}-{p[4]}{f'-lora{p[5]}' if p[5] else ''}"
                                                    for p in MEASURED_GPU])
def test_prediction_covers_the_peak_measured_on_a_gpu_within_the_band(shapes, point):
    model, tokens, checkpointing, top_p, dtype, lora_rank, measured = point
    ratio = _predicted(shapes[model], tokens, checkpointing, top_p, dtype, gpu=True, lora_rank=lora_rank) / measured
    assert BAND_GPU[0] <= ratio <= BAND_GPU[1], f"predicted / measured = {ratio:.3f}"
