"""The engine contract, run here against the transformers engine (main venv).

The `check_*` helpers are the contract itself; tests/unit/worker/test_engine_vllm.py runs the same ones
against the vLLM engine in .venv-vllm. Every check compares an engine with the trainer: a
transformers model holding the same version, scored with `echo.hf.completion_logprobs`.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from echo.hf import completion_logprobs
from learner.train.dist import full_tensor
from learner.train.load import write_whole
from worker.engines.base import (
    EngineBusy,
    EngineError,
    GenerationParams,
    InstallVerificationError,
    Reference,
    SnapshotMismatch,
    make_engine,
    mismatch_kl,
)

EOS, PAD = 2, 0
PROMPTS = [[1, 5, 6, 17, 7, 18], [1, 9, 9, 17, 8, 18], [1, 4, 15, 12, 18]]
KL_BOUND = {"transformers": 1e-5, "vllm": 1e-3}  # |mismatch_kl| in fp32, same version and tokens


# --- models, versions and the trainer's numbers ---------------------------------------------------

def build_model_dir(out: Path, *, tied: bool, hidden: int = 64, layers: int = 1, heads: int = 2) -> Path:
    """A tiny Qwen2 model dir, built locally. heads=2 gives head_dim 32, which vLLM's CPU
    attention supports (it refuses 16)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.tinymodel import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=1,
                         max_position_embeddings=128, tie_word_embeddings=tied, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    Qwen2ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


class Trainer:
    """What the learner holds: a transformers model of the dir, set to one version's weights."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.base = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.tied = self.model.config.tie_word_embeddings

    def state(self, version: int) -> dict[str, torch.Tensor]:
        """Version k: the base weights moved by seeded noise, large enough to change every
        log-prob visibly. Tied models keep head == embedding, as the trainer's clone does."""
        g = torch.Generator().manual_seed(version)
        state = {k: v + 0.3 * v.std().nan_to_num(0.02) * torch.randn(v.shape, generator=g) if version else v.clone()
                 for k, v in self.base.items()}
        if self.tied:
            state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
        return state

    def snapshot(self, version: int, drop: str | None = None) -> bytes:
        """Bytes as `learner.train.trainer.Trainer.snapshot()` writes them (optionally one tensor short)."""
        from safetensors.torch import save

        return save({k: v.contiguous() for k, v in self.state(version).items() if k != drop},
                    metadata={"version": str(version)})

    @torch.no_grad()
    def logprobs(self, version: int, prompt: list[int], completion: list[int], temperature: float = 1.0,
                 top_p: float = 1.0) -> list[float]:
        """π of `completion` under `version`; with top_p < 1, echo's μ (renormalised nucleus)."""
        self.model.load_state_dict(self.state(version))
        logp, _ = completion_logprobs(self.model, [prompt], [completion], pad_id=PAD, temperature=temperature,
                                      top_p=top_p)
        return logp[0, : len(completion)].tolist()


def params(n: int = 4, max_new_tokens: int = 8, temperature: float = 1.0, top_p: float = 1.0, eos: int = EOS):
    return GenerationParams(n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                            stop_ids=(eos,), pad_id=PAD)


def engine_vs_trainer(engine, trainer: Trainer, version: int, p: GenerationParams) -> tuple[float, float]:
    """Generate with `engine`; (mismatch_kl, max |Δ|) of its log-probs against `version`'s trainer."""
    groups = engine.generate(PROMPTS, p)
    assert [len(g) for g in groups] == [p.n] * len(PROMPTS)
    behaviour, reference = [], []
    for prompt, group in zip(PROMPTS, groups):
        for s in group:
            assert 1 <= len(s.tokens) == len(s.logprobs) <= p.max_new_tokens
            behaviour.append(s.logprobs)
            reference.append(trainer.logprobs(version, prompt, s.tokens, p.temperature, p.top_p))
    worst = max(abs(b - r) for bs, rs in zip(behaviour, reference) for b, r in zip(bs, rs))
    return mismatch_kl(behaviour, reference), worst


# --- the contract ---------------------------------------------------------------------------------

def check_follows_installs(engine, trainer: Trainer, first: int, second: int) -> None:
    """generate → install another version → generate: log-probs follow the installed weights."""
    bound = KL_BOUND[engine.name]
    engine.install(first, trainer.snapshot(first))
    assert engine.version == first
    kl, worst = engine_vs_trainer(engine, trainer, first, params())
    assert abs(kl) < bound and worst < 10 * bound, (kl, worst)
    engine.install(second, trainer.snapshot(second))
    assert engine.version == second
    kl, worst = engine_vs_trainer(engine, trainer, second, params())
    assert abs(kl) < bound and worst < 10 * bound, (kl, worst)
    # ...and the two versions really differ, so the check above has teeth
    probe = PROMPTS[0], [5, 6, 2]
    assert max(abs(a - b) for a, b in zip(trainer.logprobs(first, *probe), trainer.logprobs(second, *probe))) > 0.05


def check_refuses_incomplete(engine, trainer: Trainer, good: int, bad: int) -> None:
    """A snapshot missing a tensor, with a misshapen one, or unreadable, is refused; the engine
    keeps the version it had and still generates from it."""
    engine.install(good, trainer.snapshot(good))
    with pytest.raises(SnapshotMismatch, match="missing.*o_proj"):
        engine.install(bad, trainer.snapshot(bad, drop="model.layers.0.self_attn.o_proj.weight"))
    from safetensors.torch import save

    state = trainer.state(bad)
    state["model.norm.weight"] = state["model.norm.weight"][:-1].contiguous()
    with pytest.raises(SnapshotMismatch, match="shape"):
        engine.install(bad, save(state))
    with pytest.raises(SnapshotMismatch, match="readable"):
        engine.install(bad, b"\x00" * 64)
    assert engine.version == good
    kl, worst = engine_vs_trainer(engine, trainer, good, params())
    assert abs(kl) < KL_BOUND[engine.name] and worst < 10 * KL_BOUND[engine.name]


def check_score_matches_trainer(engine, trainer: Trainer, version: int) -> None:
    """Teacher-forced scores equal the trainer's (after an install that moved embedding and,
    for a tied model, the head with it), at T = 1 and T = 0.7."""
    engine.install(version, trainer.snapshot(version))
    prompt, completion = PROMPTS[1], [5, 13, 9, 2]
    for t in (1.0, 0.7):
        got, want = engine.score(prompt, completion, t), trainer.logprobs(version, prompt, completion, t)
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, (t, got, want)


def check_version_stamps(engine, trainer: Trainer, old: int, new: int) -> None:
    """The rollout loop's pattern: stamp, generate in a thread, install after it returns. Each
    batch is generated by exactly the version it was stamped with; an install attempted while a
    generate runs is refused instead of mixing versions."""
    engine.install(old, trainer.snapshot(old))
    batches: list[tuple[int, list]] = []

    def rollout():
        stamp = engine.version
        batches.append((stamp, engine.generate(PROMPTS, params())))

    worker = threading.Thread(target=rollout)
    worker.start()
    worker.join()
    engine.install(new, trainer.snapshot(new))
    rollout()
    assert [stamp for stamp, _ in batches] == [old, new]
    for stamp, groups in batches:
        other = new if stamp == old else old
        for prompt, group in zip(PROMPTS, groups):
            for s in group:
                mine = trainer.logprobs(stamp, prompt, s.tokens)
                assert max(abs(a - b) for a, b in zip(s.logprobs, mine)) < 10 * KL_BOUND[engine.name]
                assert s.logprobs != pytest.approx(trainer.logprobs(other, prompt, s.tokens), abs=1e-3)
    with engine._exclusive("generate"), pytest.raises(EngineBusy, match="between generation batches"):
        engine.install(old, trainer.snapshot(old))  # as if a generate were in flight
    assert engine.version == new


def check_sampling_semantics(engine, trainer: Trainer, version: int) -> None:
    """Behaviour log-probs are those of the distribution sampled from: temperature-scaled and
    top-p renormalised (echo.hf's definition); greedy log-probs are at temperature 1; the
    end-of-sequence token ends a completion and is kept in it."""
    engine.install(version, trainer.snapshot(version))
    kl, worst = engine_vs_trainer(engine, trainer, version, params(temperature=0.7, top_p=0.8, n=6))
    assert abs(kl) < KL_BOUND[engine.name] and worst < 10 * KL_BOUND[engine.name], (kl, worst)
    greedy = engine.generate(PROMPTS, params(temperature=0.0, n=2))
    for prompt, (a, b) in zip(PROMPTS, greedy):
        assert a.tokens == b.tokens  # greedy is deterministic
        want = trainer.logprobs(version, prompt, a.tokens)
        assert max(abs(x - y) for x, y in zip(a.logprobs, want)) < 10 * KL_BOUND[engine.name]
    eos = 5  # a frequent token under these weights, so that some samples stop early
    for group in engine.generate(PROMPTS, params(n=8, max_new_tokens=12, eos=eos)):
        for s in group:
            assert eos not in s.tokens[:-1]
            if s.finish == "stop":
                assert s.tokens[-1] == eos
            else:
                assert len(s.tokens) == 12 and s.tokens[-1] != eos
    assert any(s.finish == "stop" for g in engine.generate(PROMPTS, params(n=8, max_new_tokens=12, eos=eos)) for s in g)


# --- the transformers engine ----------------------------------------------------------------------

@pytest.fixture(scope="module", params=["untied", "tied"])
def setup(request, tmp_path_factory):
    torch.set_num_threads(1)
    model_dir = build_model_dir(tmp_path_factory.mktemp(request.param), tied=request.param == "tied")
    engine = make_engine("transformers", model_dir, "cpu", "float32", 1, 0)
    yield engine, Trainer(model_dir)
    engine.close()


def test_follows_installs(setup):
    check_follows_installs(*setup, 1, 2)


def test_refuses_incomplete_snapshots(setup):
    check_refuses_incomplete(*setup, 3, 4)


def test_score_matches_trainer(setup):
    check_score_matches_trainer(*setup, 5)


def test_version_stamps_across_installs(setup):
    check_version_stamps(*setup, 6, 7)


def test_sampling_semantics(setup):
    check_sampling_semantics(*setup, 8)


def test_generate_before_any_install_is_refused(tmp_path):
    engine = make_engine("transformers", build_model_dir(tmp_path, tied=False), "cpu", "float32", 1, 0)
    with pytest.raises(EngineError, match="no snapshot installed"):
        engine.generate(PROMPTS, params())


def test_reference_is_the_trainers_logprobs(tmp_path):
    """`Reference` wraps snapshot tensors without copying them and scores like the trainer;
    its expected names are exactly what a snapshot carries (tied head included)."""
    model_dir = build_model_dir(tmp_path, tied=True)
    trainer, ref = Trainer(model_dir), Reference(model_dir)
    state = trainer.state(3)
    assert set(ref.expected) == set(state) and "lm_head.weight" in ref.expected
    prompt, completion = ref.probe
    assert len(prompt) == len(completion) == Reference.PROBE_LEN
    got = ref.logprobs(state, prompt, completion, 0.7)
    assert got == pytest.approx(trainer.logprobs(3, prompt, completion, 0.7), abs=1e-6)


def test_vllm_engine_unavailable_says_how_to_get_it(tmp_path):
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001  any failure to import is the case under test
        with pytest.raises(EngineError, match="make vllm-venv"):
            make_engine("vllm", build_model_dir(tmp_path, tied=False), "cpu", "float32", 1, 0)
    else:
        pytest.skip("vllm is importable here: tests/unit/worker/test_engine_vllm.py covers it")


# --- LoRA: versions are adapters on the base (echo.lora), checked against the learner itself --------

class LoraLearner:
    """The real learner in LoRA mode (`learner.train.trainer.Trainer` with `[trainer.lora]`) on a
    model dir: version k sets the adapter to seeded values (0: PEFT's initial adapter, B = 0, the
    base's function) and publishes `Trainer.snapshot()`; `logprobs` is the trainer's π of version k."""

    RANK, ALPHA = 4, 8.0

    def __init__(self, model_dir: Path, *overrides: str):
        from learner.config import load_learner_config
        from learner.train.lora import adapter_parameters
        from learner.train.trainer import Trainer as LearnerTrainer

        cfg = load_learner_config(None, ["--model.path", str(model_dir), "--rollout.group_size", "4",
                                         "--trainer.lora", f"{{rank={self.RANK}, alpha={self.ALPHA}}}", *overrides])
        self.trainer = LearnerTrainer(cfg)
        self.params = adapter_parameters(self.trainer.hf)
        self.initial = {k: full_tensor(p.detach()).clone() for k, p in self.params}  # bf16: sharded (FSDP2)
        self.current: int | None = None

    def info(self, keep: int = 3):
        return self.trainer.lora_info(keep)

    @torch.no_grad()
    def set(self, version: int) -> None:
        if self.current == version:
            return
        g = torch.Generator().manual_seed(version)
        for k, p in self.params:
            write_whole(p, self.initial[k] + (0.5 * torch.randn(p.shape, generator=g) if version else 0))
        self.current = version

    def snapshot(self, version: int) -> bytes:
        self.set(version)
        return bytes(self.trainer.snapshot())

    def tensors(self, version: int) -> dict[str, torch.Tensor]:
        self.set(version)
        return {k: full_tensor(p.detach()).clone() for k, p in self.params}

    @torch.no_grad()
    def logprobs(self, version: int, prompt: list[int], completion: list[int], temperature: float = 1.0,
                 top_p: float = 1.0) -> list[float]:
        self.set(version)
        logp, _ = completion_logprobs(self.trainer.hf, [prompt], [completion], pad_id=PAD, temperature=temperature,
                                      top_p=top_p)
        return logp[0, : len(completion)].tolist()


def lora_blob(tensors: dict[str, torch.Tensor], meta) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta.metadata())


def check_lora_pi_equals_mu_across_versions(engine, learner: LoraLearner, first: int, second: int) -> None:
    """π = μ in fp32 (|mismatch_kl| < 1e-6 with transformers) on the initial adapter and across a
    version change; the two versions differ (the check has teeth), and v0 is the base's function."""
    bound = KL_BOUND[engine.name] if engine.name != "transformers" else 1e-6
    for v in (0, first, second):
        engine.install(v, learner.snapshot(v))
        assert engine.version == v
        kl, worst = engine_vs_trainer(engine, learner, v, params())
        assert abs(kl) < bound and worst < 100 * bound, (v, kl, worst)
    probe = PROMPTS[0], [5, 6, 2]
    assert max(abs(a - b) for a, b in zip(learner.logprobs(first, *probe), learner.logprobs(second, *probe))) > 0.05
    assert max(abs(a - b) for a, b in zip(learner.logprobs(0, *probe), learner.logprobs(first, *probe))) > 0.05


def check_lora_batch_keeps_its_version(engine, learner: LoraLearner, old: int, new: int) -> None:
    """The rollout loop's pattern with adapters: a batch stamped `old` is generated with old's
    adapter while `new` is waiting (an install during generate is refused, never mixed); after
    `new` installs, old's adapter stays loaded (the keep newest) and each batch is its own version's."""
    engine.install(old, learner.snapshot(old))
    batches: list[tuple[int, list]] = []
    pending = learner.snapshot(new)

    def rollout():
        stamp = engine.version
        batches.append((stamp, engine.generate(PROMPTS, params())))

    worker = threading.Thread(target=rollout)
    worker.start()
    worker.join()
    with engine._exclusive("generate"), pytest.raises(EngineBusy):
        engine.install(new, pending)  # as if the batch were still in flight
    assert engine.version == old
    engine.install(new, pending)
    rollout()
    assert [stamp for stamp, _ in batches] == [old, new]
    for stamp, groups in batches:
        other = new if stamp == old else old
        for prompt, group in zip(PROMPTS, groups):
            for s in group:
                mine = learner.logprobs(stamp, prompt, s.tokens)
                assert max(abs(a - b) for a, b in zip(s.logprobs, mine)) < 10 * KL_BOUND[engine.name]
                assert s.logprobs != pytest.approx(learner.logprobs(other, prompt, s.tokens), abs=1e-3)


def check_lora_refuses_what_did_not_load(engine, learner: LoraLearner, good: int, bad: int) -> None:
    """Full weights, an adapter of another base or shape, a corrupted blob, a wrong adapter (the
    tensors of one version under another's probe) are refused; the engine keeps `good` and
    generates from it, never from the base or the refused adapter."""
    import dataclasses

    from echo.lora import read_adapter_meta

    engine.install(good, learner.snapshot(good))
    blob = learner.snapshot(bad)
    meta = read_adapter_meta(blob)
    full = Trainer(engine.model_dir).snapshot(1)
    with pytest.raises(SnapshotMismatch, match="not a LoRA adapter"):
        engine.install(bad, full)
    with pytest.raises(SnapshotMismatch, match="base"):
        engine.install(bad, lora_blob(learner.tensors(bad), dataclasses.replace(meta, base="0" * 64)))
    with pytest.raises(SnapshotMismatch, match="rank"):
        engine.install(bad, lora_blob(learner.tensors(bad), dataclasses.replace(meta, rank=meta.rank * 2)))
    short = learner.tensors(bad)
    name = next(k for k in short if "lora_B" in k)
    short[name] = short[name][:-1].contiguous()
    with pytest.raises(SnapshotMismatch, match="shape"):
        engine.install(bad, lora_blob(short, meta))
    with pytest.raises(SnapshotMismatch):
        engine.install(bad, blob[: len(blob) // 2])
    with pytest.raises(InstallVerificationError, match="probe"):
        engine.install(bad, lora_blob(learner.tensors(bad + 1), meta))  # tensors of another version
    assert engine.version == good
    kl, worst = engine_vs_trainer(engine, learner, good, params())
    assert abs(kl) < KL_BOUND[engine.name] and worst < 10 * KL_BOUND[engine.name]


# --- LoRA on the transformers engine --------------------------------------------------------------

@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    torch.set_num_threads(1)
    model_dir = build_model_dir(tmp_path_factory.mktemp("lora"), tied=False)
    learner = LoraLearner(model_dir)
    engine = make_engine("transformers", model_dir, "cpu", "float32", 1, 0, lora=learner.info(keep=3))
    yield engine, learner
    engine.close()


def test_lora_pi_equals_mu_across_versions(lora_setup):
    check_lora_pi_equals_mu_across_versions(*lora_setup, 1, 2)


def test_lora_batch_keeps_its_version_and_the_newest_adapters_stay(lora_setup):
    engine, learner = lora_setup
    check_lora_batch_keeps_its_version(engine, learner, 3, 4)
    engine.install(5, learner.snapshot(5))
    assert engine.adapters == [3, 4, 5]  # keep = 3 (S + 2 with S = 1)
    engine.install(6, learner.snapshot(6))
    assert engine.adapters == [4, 5, 6] and set(engine.peft.peft_config) == {"v4", "v5", "v6"}


def test_lora_refuses_what_did_not_load(lora_setup):
    check_lora_refuses_what_did_not_load(*lora_setup, 7, 8)


def test_lora_a_silent_no_op_load_is_caught_and_the_worker_takes_no_work(tmp_path, monkeypatch):
    """verl #7495: the adapter silently never arrives, the run samples the initial policy. Here
    the load does nothing (the slot keeps PEFT's B = 0); the probe disagrees with the learner's,
    the install raises, and the engine generates nothing: never the base model."""
    torch.set_num_threads(1)
    model_dir = build_model_dir(tmp_path, tied=False)
    learner = LoraLearner(model_dir)
    engine = make_engine("transformers", model_dir, "cpu", "float32", 1, 0, lora=learner.info())
    monkeypatch.setattr(engine, "_load", lambda params, state: None)
    with pytest.raises(InstallVerificationError, match="not live"):
        engine.install(1, learner.snapshot(1))
    assert engine.version == -1
    with pytest.raises(EngineError, match="no snapshot installed"):
        engine.generate(PROMPTS, params())  # the rollout loop leases nothing while version < 0
    monkeypatch.undo()
    engine.install(1, learner.snapshot(1))  # a load that works: live, and it is v1's function
    kl, _ = engine_vs_trainer(engine, learner, 1, params())
    assert abs(kl) < 1e-6


def test_lora_a_bf16_learners_adapters_install_on_an_fp32_worker(tmp_path, monkeypatch):
    """A learner computing in bf16 (`[trainer] compute_dtype`, the GPU setting) publishes probes
    as exact as bf16; the demo's fp32 worker refused every version of such a run at its fp32
    tolerance, v0 included, and the run waited for rollouts forever. The join says the probe's
    dtype and the worker allows for it; a silent no-op load is still caught."""
    torch.set_num_threads(1)
    model_dir = build_model_dir(tmp_path, tied=False)
    learner = LoraLearner(model_dir, "--trainer.compute_dtype", "bfloat16")
    engine = make_engine("transformers", model_dir, "cpu", "float32", 1, 0, lora=learner.info())
    for v in (0, 1):
        engine.install(v, learner.snapshot(v))
        assert engine.version == v and 0 < engine.last_install["probe_error"] <= 0.1
    assert learner.info().probe_dtype == "bfloat16"
    monkeypatch.setattr(engine, "_load", lambda params, state: None)
    with pytest.raises(InstallVerificationError, match="not live"):
        engine.install(2, learner.snapshot(2))
    assert engine.version == 1


def test_lora_engine_refuses_a_different_base(tmp_path):
    a = build_model_dir(tmp_path / "a", tied=False)
    learner = LoraLearner(a)
    b = build_model_dir(tmp_path / "b", tied=False, hidden=32)
    with pytest.raises(EngineError, match="digest"):
        make_engine("transformers", b, "cpu", "float32", 1, 0, lora=learner.info())


def test_a_snapshot_is_read_as_views_of_the_buffer_it_arrived_in():
    """A worker copied each version (`bytes()`) and safetensors copied each tensor out of the
    copy: three snapshots in RAM at once, 48 GB at 8B (`echo-rl bench install-memory`: +2.0x the
    snapshot above the relay's buffer, now +0.002x). The tensors are the blob's own bytes, equal to
    what safetensors reads; a header that points past the blob, or at too few bytes, is refused."""
    import json
    import mmap
    import struct

    import torch
    from safetensors.torch import load, save

    from worker.engines.base import load_snapshot

    blob = save({"a": torch.randn(3, 5, dtype=torch.bfloat16), "b": torch.arange(7, dtype=torch.int64),
                 "empty": torch.zeros(0, 4), "c": torch.randn(2, 2)}, metadata={"format": "pt"})
    buffer = mmap.mmap(-1, len(blob))
    buffer[:] = blob
    view = memoryview(buffer)
    state, want = load_snapshot(1, view), load(blob)
    assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)
    start = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
    assert all(start <= t.data_ptr() < start + len(blob) for t in state.values() if t.numel())  # no copy
    assert torch.equal(load_snapshot(1, blob)["a"], want["a"])  # bytes (a star download) too
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header["c"]["data_offsets"] = [header["c"]["data_offsets"][0], 10 ** 12]
    forged = json.dumps(header).encode()
    with pytest.raises(SnapshotMismatch, match="do not hold"):
        load_snapshot(2, struct.pack("<Q", len(forged)) + forged + blob[8 + n:])
    with pytest.raises(SnapshotMismatch, match="readable"):
        load_snapshot(3, struct.pack("<Q", 1 << 40) + b"{}")


def test_the_install_memory_bench_shows_the_copies_gone(capsys):
    """`echo-rl bench install-memory`, small: staging a copy and copying tensors out of it peaks
    at about twice the snapshot above the relay's buffer; views of the buffer at a sliver."""
    from worker.bench.install_memory import cli

    assert cli(["--size-mib", "64"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if "(before)" in line or "(now)" in line]
    before, now = (float(r[-1]) for r in rows)
    assert before > 1.5 and now < 0.3, rows
