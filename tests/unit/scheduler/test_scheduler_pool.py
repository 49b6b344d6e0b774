"""Pool files: every shipped one loads; mistakes give errors naming the key and the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.errors import PoolError
from scheduler.pool import load_pool

POOLS = sorted((Path(__file__).resolve().parents[3] / "configs" / "pools").glob("*.toml"))


def test_pools_are_shipped() -> None:
    assert {p.name for p in POOLS} >= {"demo-local.toml", "consumer-gpus.toml"}


@pytest.mark.parametrize("path", POOLS, ids=lambda p: p.name)
def test_every_shipped_pool_loads(path: Path) -> None:
    pool = load_pool(path)
    cands = pool.candidates()
    assert len(cands) == pool.size == sum(w.count for w in pool.workers)
    assert len({x.id for x in cands}) == len(cands)
    for x in cands:
        assert pool.kind_of(x.id).rollouts_per_s == x.rate


def test_demo_local_has_distinct_prices_and_speeds() -> None:
    pool = load_pool(POOLS[[p.name for p in POOLS].index("demo-local.toml")])
    assert 3 <= pool.size <= 4
    rates = [w.rollouts_per_s for w in pool.workers]
    unit_costs = [w.unit_cost for w in pool.workers]
    assert len(set(rates)) == len(rates) and len(set(unit_costs)) == len(unit_costs)  # a real choice to make


def test_count_expands_ids(tmp_path: Path) -> None:
    f = tmp_path / "p.toml"
    f.write_text('[[workers]]\nname = "rtx4090"\ncount = 3\nprice_per_hour = 0.35\nrollouts_per_s = 3\n'
                 '[[workers]]\nname = "solo"\nprice_per_hour = 0.1\nrollouts_per_s = 1\n')
    assert [x.id for x in load_pool(f).candidates()] == ["rtx4090-0", "rtx4090-1", "rtx4090-2", "solo"]


@pytest.mark.parametrize(("body", "needle"), [
    ('[[workers]]\nname = "a"\nprice_per_hour = 0.1\nrollouts_per_s = 1\nspeed = 3\n', "workers.0.speed: unknown key"),
    ('[[workers]]\nname = "a"\nprice_per_hour = -1\nrollouts_per_s = 1\n', "workers.0.price_per_hour"),
    ('[[workers]]\nname = "a"\nprice_per_hour = 0.1\n', "workers.0.rollouts_per_s"),
    (('[[workers]]\nname = "a"\nprice_per_hour = 0.1\nrollouts_per_s = 1\n'
      '[[workers]]\nname = "a"\nprice_per_hour = 0.2\nrollouts_per_s = 2\n'), "repeated: a"),
    ('name = "empty"\n', "workers"),
    ('[[workers]\n', "not valid TOML"),
])
def test_bad_pool_files(tmp_path: Path, body: str, needle: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(body)
    with pytest.raises(PoolError) as e:
        load_pool(f)
    assert needle in str(e.value)
    assert str(f) in str(e.value)


def test_missing_pool_file_lists_shipped_ones(tmp_path: Path) -> None:
    with pytest.raises(PoolError, match="consumer-gpus.toml"):
        load_pool(tmp_path / "nope.toml")


def test_a_missing_relative_pool_file_names_the_directory_it_was_read_from(tmp_path, monkeypatch):
    """Run from another directory, the error listed the very file it said was missing (a new user)."""
    import pytest

    from scheduler.pool import PoolError, load_pool

    monkeypatch.chdir(tmp_path)
    with pytest.raises(PoolError) as e:
        load_pool("configs/pools/demo-2x.toml")
    assert f"relative to the current directory, {tmp_path}" in str(e.value)
    assert "/configs/pools/: " in str(e.value) and "demo-2x.toml" in str(e.value)
