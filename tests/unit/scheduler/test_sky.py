"""The SkyPilot provider's own logic, without SkyPilot's API server or any cloud: the task it
builds, the state mapping, and the calls it makes (against a stand-in `sky` module recording
them). Whether SkyPilot accepts the task is checked only when SkyPilot is installed."""

from __future__ import annotations

import types

import pytest

from scheduler.market import MarketProvider
from scheduler.sky import SkyMarket, accelerator, cluster_state, task_config


def test_the_task_runs_the_worker_image_with_the_onstart_command():
    cfg = task_config(name="echo-sky-rtx-4090-0", gpu="RTX 4090", image="ghcr.io/echo-rl/echo-worker:latest",
                      onstart="echo-worker join http://x:1 --token t", disk_gb=40, use_spot=True, clouds=["runpod"])
    assert cfg == {"name": "echo-sky-rtx-4090-0", "run": "echo-worker join http://x:1 --token t",
                   "resources": {"accelerators": {"RTX4090": 1}, "image_id": "docker:ghcr.io/echo-rl/echo-worker:latest",
                                 "disk_size": 40, "use_spot": True, "cloud": "runpod"}}
    many = task_config(name="n", gpu="A100 80GB", image="i", onstart="r", disk_gb=40, use_spot=False,
                       clouds=["runpod", "lambda"])
    assert [r["cloud"] for r in many["resources"]["any_of"]] == ["runpod", "lambda"]
    assert accelerator("NVIDIA GeForce RTX 3090") == "RTX3090" and accelerator("A100 80GB") == "A100-80GB"


def test_cluster_states_map_onto_the_markets():
    assert [cluster_state(s) for s in ("UP", "INIT", "STOPPED", "ClusterStatus.UP")] == \
        ["running", "starting", "stopped", "running"]


def test_the_provider_launches_and_downs_clusters_through_the_sdk_calls():
    calls = []

    class Task:
        @staticmethod
        def from_yaml_config(cfg):
            calls.append(("task", cfg))
            return cfg

    fake = types.SimpleNamespace(
        Task=Task, launch=lambda task, cluster_name, down: calls.append(("launch", cluster_name, down)),
        down=lambda name: calls.append(("down", name)),
        status=lambda cluster_names, refresh: [{"name": n, "status": "UP"} for n in cluster_names or []])
    market = SkyMarket(gpus={"RTX 4090": 3.0}, prices={"RTX 4090": 0.4}, clouds=[], image="img", per_gpu=2,
                       sky_module=fake)
    p = MarketProvider(market, url="http://l:1", machine_key="t", gpus={"RTX 4090": 3.0}, onstart="echo-worker join {url}",
                       refresh_s=0.0, background=False)
    p.step()
    assert [m.id for m in p.offers()] == ["sky-rtx-4090-0", "sky-rtx-4090-1"]
    assert p.offers()[0].price_per_hour == 0.4
    machine = p.offers()[0]
    p.launch(machine)
    p.step()
    assert ("launch", "echo-sky-rtx-4090-0", True) in calls
    assert market.states() == {"echo-sky-rtx-4090-0": "running"}
    p.close()
    assert ("down", "echo-sky-rtx-4090-0") in calls


def test_prices_are_required_for_every_gpu():
    with pytest.raises(ValueError, match="prices has no"):
        SkyMarket(gpus={"RTX 4090": 3.0}, prices={}, clouds=[], image="i")


def test_skypilot_accepts_the_task_when_installed():
    sky = pytest.importorskip("sky", reason="SkyPilot is not installed (pip install skypilot): the task is checked "
                                            "only by shape above")
    cfg = task_config(name="n", gpu="RTX 4090", image="img", onstart="echo hi", disk_gb=40, use_spot=False, clouds=[])
    task = sky.Task.from_yaml_config(cfg)
    assert task.run == "echo hi"
