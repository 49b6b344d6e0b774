"""The engine contract of tests/unit/worker/test_engines.py, against the vLLM engine (run in .venv-vllm:
`make test-vllm`); skipped with the reason where vllm cannot be imported.

One vLLM instance per model (module-scoped; startup is the slow part). The tied model is the
case where a reload could leave the head stale, so the contract runs on it too.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vllm is imported: in-process engine
try:
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001  ImportError, or a vllm whose compiled parts do not load here
    pytest.skip(f"vllm cannot be imported in this interpreter ({type(e).__name__}: {e}); "
                "run `make test-vllm` (creates .venv-vllm with `make vllm-venv`)", allow_module_level=True)

from test_engines import (  # after the skip: these import torch and transformers
    KL_BOUND,
    PROMPTS,
    Trainer,
    build_model_dir,
    check_follows_installs,
    check_refuses_incomplete,
    check_sampling_semantics,
    check_score_matches_trainer,
    check_version_stamps,
    engine_vs_trainer,
    params,
    LoraLearner,
    check_lora_batch_keeps_its_version,
    check_lora_pi_equals_mu_across_versions,
    check_lora_refuses_what_did_not_load,
)

from worker.engines.base import EngineError, InstallVerificationError, make_engine


@pytest.fixture(scope="module", params=["tied", "untied"])
def setup(request, tmp_path_factory):
    model_dir = build_model_dir(tmp_path_factory.mktemp(request.param), tied=request.param == "tied")
    trainer = Trainer(model_dir)
    # The worker's model dir has config and tokenizer but no weights: they come as snapshots.
    (model_dir / "model.safetensors").unlink()
    engine = make_engine("vllm", model_dir, "cpu", "float32", 1, 0)
    assert engine.name == "vllm"
    yield engine, trainer
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


def test_mismatch_kl_bound(setup):
    """Behaviour log-probs from vLLM vs the trainer's π, same version and tokens, many samples."""
    engine, trainer = setup
    engine.install(9, trainer.snapshot(9))
    kl, worst = engine_vs_trainer(engine, trainer, 9, params(n=16, max_new_tokens=16))
    print(f"vllm mismatch_kl={kl:.2e} max|Δ|={worst:.2e} probe_error={engine.last_install['probe_error']:.2e}")
    assert abs(kl) < KL_BOUND["vllm"] and worst < 10 * KL_BOUND["vllm"]


STALE = {"model.embed_tokens.weight", "lm_head.weight"}


def test_a_reload_that_leaves_a_tensor_stale_is_caught(setup, monkeypatch):
    """Simulate a reload that silently leaves the embedding and head stale (vLLM loads a tied
    head through either name, so both are held back): the post-install probe disagrees with the
    trainer, the install is refused, and the engine stops generating until a snapshot installs
    cleanly."""
    engine, trainer = setup
    engine.install(10, trainer.snapshot(10))
    reload = engine.llm.collective_rpc

    def lossy(method, *args, kwargs=None, **kw):
        if method == "reload_weights":
            kwargs = {**kwargs, "weights_iterator": ((n, t) for n, t in kwargs["weights_iterator"]
                                                     if n not in STALE)}
        return reload(method, *args, kwargs=kwargs, **kw)

    monkeypatch.setattr(engine.llm, "collective_rpc", lossy)
    with pytest.raises(InstallVerificationError, match="differ from the trainer"):
        engine.install(11, trainer.snapshot(11))
    assert engine.version == -1
    with pytest.raises(EngineError, match="no snapshot installed"):
        engine.generate(PROMPTS, params())
    monkeypatch.undo()
    engine.install(11, trainer.snapshot(11))
    assert engine.version == 11 and engine.last_install["probe_error"] < 1e-5


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """Overrides conftest's model for `learner_factory`: vLLM's CPU attention needs head_dim 32."""
    return build_model_dir(tmp_path_factory.mktemp("loop-model"), tied=False)


def test_a_vllm_worker_trains_a_run_on_policy(learner_factory):
    """A learner and one `echo-worker --engine.type vllm` on loopback with S = 0 and top-p 0.9:
    every trained group is fresh, so the run log's mismatch_kl is the engine's mismatch alone,
    with the trainer's π renormalised over the same nucleus as vLLM's μ (< 1e-6). The eval of
    the first and last version runs on the vLLM worker (greedy eval leases). ~40 s."""
    import json

    steps = 8
    lp = learner_factory(run={"steps": steps}, buffer={"max_staleness": 0}, publish={"every": 1},
                         rollout={"top_p": 0.9})
    lp.worker("vllm", "--engine.type", "vllm", "--engine.device", "cpu")
    assert lp.finished(240) == 0, lp.output()[-3000:]
    summary = json.loads((lp.run_dir / "summary.json").read_text())
    records = lp.records()
    assert summary["steps"] == steps and [w["name"] for w in summary["workers"]] == ["vllm"]
    assert all(s == 0 for r in records for s in r["staleness"])
    print("run-log mismatch_kl per step:", [f"{r['mismatch_kl']:.1e}" for r in records])
    assert all(abs(r["mismatch_kl"]) < 1e-6 and r["outside_nucleus_fraction"] == 0 for r in records), \
        [r["mismatch_kl"] for r in records]
    assert summary["eval_version_end"] == steps
    assert not summary["rejected"]  # every turn ended on a stop id or at its budget, as the learner checks


def test_a_vllm_worker_plays_multi_turn_episodes_on_policy(learner_factory, chat_model):
    """The calculator task (a tool answers between the policy's turns) on a chat model whose turns
    end on <|im_end|>, not its eos: a vLLM worker plays each turn of every live episode as one
    engine call and appends the tool's tokens; with S = 0 and top-p 0.9 the trainer's π on the
    policy's tokens equals vLLM's μ (< 1e-6), and every episode the learner replays is the
    environment's."""
    import json

    steps = 3
    lp = learner_factory(model=chat_model, run={"steps": steps}, buffer={"max_staleness": 0}, publish={"every": 1},
                         task={"name": "calculator", "digits": 1, "turns": 3, "eval_size": 4},
                         rollout={"top_p": 0.9, "max_new_tokens": 8, "max_episode_tokens": 120},
                         eval={"where": "learner"}, verify={"rescore_fraction": 1.0})
    lp.worker("vllm", "--engine.type", "vllm", "--engine.device", "cpu")
    assert lp.finished(240) == 0, lp.output()[-3000:]
    records = lp.records()
    summary = json.loads((lp.run_dir / "summary.json").read_text())
    print("multi-turn mismatch_kl per step:", [f"{r['mismatch_kl']:.1e}" for r in records])
    assert all(r["turns_mean"] > 1 and r["env_token_share"] > 0 for r in records)
    assert all(abs(r["mismatch_kl"]) < 1e-6 for r in records), [r["mismatch_kl"] for r in records]
    assert summary["rewards_mismatched"] == 0 and not summary["quarantined"] and not summary["rejected"]


# --- LoRA: one LoRARequest per version, the keep newest loaded, proved live by the learner's probe --

@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    pytest.importorskip("peft")  # the learner side of the check (LoraLearner) trains with PEFT
    model_dir = build_model_dir(tmp_path_factory.mktemp("lora"), tied=False)
    learner = LoraLearner(model_dir)
    # LoRA mode: the worker's directory holds the base (its digest is the learner's).
    engine = make_engine("vllm", model_dir, "cpu", "float32", 1, 0, lora=learner.info(keep=3))
    yield engine, learner
    engine.close()


def test_lora_pi_equals_mu_across_versions(lora_setup):
    engine, learner = lora_setup
    check_lora_pi_equals_mu_across_versions(engine, learner, 1, 2)
    kl, worst = engine_vs_trainer(engine, learner, 2, params(n=16, max_new_tokens=16))
    print(f"vllm lora mismatch_kl={kl:.2e} max|Δ|={worst:.2e} probe_error={engine.last_install['probe_error']:.2e}")


def test_lora_batch_keeps_its_version_and_the_newest_adapters_stay(lora_setup):
    engine, learner = lora_setup
    check_lora_batch_keeps_its_version(engine, learner, 3, 4)
    engine.install(5, learner.snapshot(5))
    engine.install(6, learner.snapshot(6))
    assert list(engine.requests) == [4, 5, 6]  # keep = 3
    assert engine.llm.llm_engine.list_loras() == {5, 6, 7}  # ids: version + 1


def test_lora_refuses_what_did_not_load(lora_setup):
    check_lora_refuses_what_did_not_load(*lora_setup, 7, 8)


def test_installs_prove_the_sampler_at_the_runs_temperature_and_top_p(setup, monkeypatch):
    """With the run's sampling (T = 0.8, top-p 0.9) an install also samples the probe prompt with
    vLLM's own sampler and compares its processed log-probs with the trainer's π for those
    tokens. A sampler that ignored top-p (simulated: it samples at top-p 1) is caught. It is
    vLLM's code that this proves, not the weights: once proved at a setting, later installs skip
    it (four forwards of the model on the worker's CPU, at 8B)."""
    engine, trainer = setup
    engine.sampling, engine._sampler_proved = (0.8, 0.9), None
    try:
        sample = engine._sample_probe
        monkeypatch.setattr(engine, "_sample_probe", lambda prompt, n, k: (
            (setattr(engine, "sampling", (0.8, 1.0)), sample(prompt, n, k), setattr(engine, "sampling", (0.8, 0.9)))[1]))
        with pytest.raises(InstallVerificationError, match="differ from the trainer"):
            engine.install(12, trainer.snapshot(12))
        monkeypatch.undo()
        engine.install(12, trainer.snapshot(12))
        assert engine.version == 12 and engine.last_install["probe_error"] < 1e-4
        monkeypatch.setattr(engine, "_sample_probe", lambda *a: pytest.fail("the sampler was proved already"))
        engine.install(13, trainer.snapshot(13))
        assert engine.version == 13
    finally:
        engine.sampling, engine._sampler_proved = (1.0, 1.0), None


def test_an_install_is_checked_against_the_learners_own_probe_without_a_forward_on_the_cpu(setup, monkeypatch):
    """The check of an install ran the model on the worker's CPU (the trainer's π from the
    snapshot): an 8B forward per install on a consumer machine. A learner's snapshot now carries
    its own probe log-probs for the version (`echo.lora.weights_metadata`); the engine compares
    its own with those and runs nothing else. Numbers that are not the weights' are caught."""
    from safetensors.torch import save

    from echo.lora import weights_metadata

    engine, trainer = setup
    prompt, completion = engine.reference.probe
    probe = trainer.logprobs(14, prompt, completion)

    def snapshot(values: list[float]) -> bytes:
        return save({k: v.contiguous() for k, v in trainer.state(14).items()}, metadata=weights_metadata(values, "float32"))

    monkeypatch.setattr(engine.reference, "logprobs", lambda *a, **k: pytest.fail("a forward of the model on the CPU"))
    engine.install(14, snapshot(probe))
    assert engine.version == 14 and engine.last_install["probe_error"] < 1e-4
    with pytest.raises(InstallVerificationError, match="differ from the trainer"):
        engine.install(15, snapshot([x - 1.0 for x in probe]))
    monkeypatch.undo()
    engine.install(15, trainer.snapshot(15))  # a snapshot without them: checked on the CPU, as before
    assert engine.version == 15
