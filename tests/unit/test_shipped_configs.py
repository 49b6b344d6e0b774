"""Every TOML file under configs/ loads with the loader of its kind: a shipped config that no
longer matches its model fails here, not in a user's first run."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").rglob("*.toml"))


def load(path: Path):
    rel = path.relative_to(ROOT / "configs")
    if rel.parts[0] == "wan":
        from netem.scenario import load_scenario
        return load_scenario(path)
    if rel.parts[0] == "pools":
        from scheduler.pool import load_pool
        return load_pool(path)
    if rel.name.startswith("worker"):
        from worker.config import load_worker_config
        return load_worker_config(path)
    from learner.config import load_learner_config  # demo, learner-*, experiments/*: learner configs
    return load_learner_config(path)


def test_configs_are_found() -> None:
    assert len(CONFIGS) >= 10


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_shipped_config_loads(path: Path) -> None:
    assert load(path) is not None
