"""LoRA end to end: a real learner trains an adapter on the frozen base, every published version
is the adapter alone (adapter-sized on the wire), a worker installs each through PEFT after its
probe, trains on policy (π = μ), and the run ends with the adapter and the merged model."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("peft")


def test_a_lora_run_publishes_adapters_and_exports_adapter_and_merged_model(learner_factory, tiny_model):
    steps = 6
    lp = learner_factory(run={"steps": steps}, trainer={"batch_prompts": 4, "lr": 1e-2,
                                                         "lora": {"rank": 4, "alpha": 8.0}})
    lp.worker("w0")
    assert lp.finished(240) == 0, lp.output()[-3000:]
    records = lp.records()
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    # On policy the learner's π is the worker's μ: the adapter each batch was sampled with is live.
    fresh = [r["mismatch_kl"] for r in records if max(r["staleness"]) == 0]
    assert fresh and max(abs(k) for k in fresh) < 1e-5, fresh
    full_bytes = (tiny_model / "model.safetensors").stat().st_size
    published = [r["snapshot_bytes"] for r in records if "snapshot_bytes" in r]
    assert published and all(p["raw"] < full_bytes / 4 for p in published), (published, full_bytes)
    adapter = lp.run_dir / "model-adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA"
    assert (adapter / "adapter_model.safetensors").stat().st_size == published[-1]["raw"]
    assert (lp.run_dir / "model" / "model.safetensors").exists()  # the merged model
    # The merged model is the adapted one: its log-probs are the PEFT model's.
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(lp.run_dir / "model", dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                                     adapter).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 6, 17, 7, 18, 9]])
    with torch.no_grad():
        a, b, c = (m(input_ids=ids).logits for m in (merged, peft, base))
    assert torch.allclose(a, b, atol=1e-4)
    # Unless every group of the run had one reward for all (no gradient: B stays at its zero init),
    # the adapter moved the model. A tiny model can draw 6 batches of all-wrong answers.
    trained = any(r["grad_norm"] > 0 for r in records)
    assert torch.allclose(a, c, atol=1e-4) != trained
