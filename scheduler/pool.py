"""Pool files: the candidate workers a run may rent, one TOML entry per kind of machine.

    name = "consumer-gpus"
    description = "rented consumer GPUs for a 1.5B model"

    [[workers]]
    name = "rtx4090"            # ids become rtx4090-0 .. rtx4090-7
    gpu = "RTX 4090"
    count = 8
    price_per_hour = 0.35       # $/h
    rollouts_per_s = 2.4        # expected completed, rewarded rollouts/s of one machine
    slots = 64                  # concurrent generations (sets pre-queue staleness)
    download_mbps = 500
    upload_mbps = 100
    rtt_ms = 40

`load_pool(path)` validates it (unknown keys are errors naming the key and the file) and
`Pool.candidates()` expands each entry into `count` activation candidates.
"""

from __future__ import annotations

from pathlib import Path

import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from scheduler.activation import Candidate
from scheduler.errors import PoolError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkerKind(_Strict):
    """One `[[workers]]` entry: `count` identical machines."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=64,
                      description="[[workers]] name: id prefix of these machines (letters, digits, . _ -)")
    gpu: str = Field("cpu", max_length=64, description="[[workers]] gpu: accelerator model, e.g. 'RTX 4090' or 'cpu'")
    count: int = Field(1, ge=1, le=100_000, description="[[workers]] count: how many identical machines of this kind can be rented")
    price_per_hour: float = Field(ge=0.0, le=1000.0, description="[[workers]] price_per_hour: rental price of one machine ($/h)")
    rollouts_per_s: float = Field(gt=0.0, le=1e6, description="[[workers]] rollouts_per_s: expected completed, rewarded rollouts/s of one machine (the scheduler's prior before it measures)")
    slots: int = Field(32, ge=1, le=100_000, description="[[workers]] slots: concurrent generations on one machine (sampling concurrency; raises pre-queue staleness)")
    download_mbps: float = Field(1000.0, gt=0.0, le=1e6, description="[[workers]] download_mbps: downlink bandwidth (Mbit/s) snapshots arrive over")
    upload_mbps: float = Field(1000.0, gt=0.0, le=1e6, description="[[workers]] upload_mbps: uplink bandwidth (Mbit/s) used to relay snapshots down a chain")
    rtt_ms: float = Field(1.0, ge=0.0, le=10_000.0, description="[[workers]] rtt_ms: round-trip time to the learner (ms)")
    dollars_per_gb_down: float = Field(0.0, ge=0.0, le=100.0, description="[[workers]] dollars_per_gb_down: what the market bills per GB downloaded ($/GB)")
    dollars_per_gb_up: float = Field(0.0, ge=0.0, le=100.0, description="[[workers]] dollars_per_gb_up: what the market bills per GB uploaded ($/GB; relays upload)")

    @property
    def unit_cost(self) -> float:
        return self.price_per_hour / self.rollouts_per_s

    def ids(self) -> list[str]:
        return [self.name] if self.count == 1 else [f"{self.name}-{k}" for k in range(self.count)]


class Pool(_Strict):
    """A whole pool file."""

    name: str = Field("pool", max_length=128, description="name: what this pool is called in reports")
    description: str = Field("", max_length=4096, description="description: where the numbers come from")
    workers: list[WorkerKind] = Field(min_length=1, description="[[workers]]: the machine kinds (at least one)")

    @model_validator(mode="after")
    def _unique_names(self) -> Pool:
        names = [w.name for w in self.workers]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"worker names must be unique; repeated: {', '.join(dup)}")
        ids = [i for w in self.workers for i in w.ids()]
        if len(set(ids)) != len(ids):
            raise ValueError("expanded worker ids collide (a name like 'a-0' next to 'a' with count > 1); rename one")
        return self

    @property
    def size(self) -> int:
        return sum(w.count for w in self.workers)

    def candidates(self) -> list[Candidate]:
        """Every machine as an activation candidate (`count` expanded; ids `name-k`)."""
        return [Candidate(i, w.rollouts_per_s, w.price_per_hour) for w in self.workers for i in w.ids()]

    def kind_of(self, worker_id: str) -> WorkerKind:
        """The entry a candidate id came from."""
        for w in self.workers:
            if worker_id in w.ids():
                return w
        raise KeyError(worker_id)


def parse_pool(data: dict, source: str = "<pool>") -> Pool:
    """Validate already-parsed TOML; errors name the key and `source`."""
    try:
        return Pool.model_validate(data)
    except ValidationError as e:
        lines = [f"invalid pool file {source}:"]
        for err in e.errors():
            key = ".".join(str(p) for p in err["loc"]) or "(top level)"
            if err["type"] == "extra_forbidden":
                lines.append(f"  {key}: unknown key (allowed in [[workers]]: {', '.join(WorkerKind.model_fields)}; top level: {', '.join(Pool.model_fields)})")
            else:
                lines.append(f"  {key}: {err['msg']} (got {err.get('input')!r})")
        raise PoolError("\n".join(lines)) from None


def load_pool(path: str | Path) -> Pool:
    """Read and validate a pool file; raises `PoolError` saying what to fix."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        # A relative path is read from the current directory, not the package's: say both, or the
        # message listed the very file it said was missing (run from another directory).
        where = "" if path.is_absolute() else f" (relative to the current directory, {Path.cwd()})"
        pools = Path(__file__).resolve().parent.parent / "configs" / "pools"
        shipped = sorted(p.name for p in pools.glob("*.toml"))
        hint = f"; shipped pools in {pools}/: {', '.join(shipped)}" if shipped else ""
        raise PoolError(f"pool file {path} does not exist{where}{hint}") from None
    except tomllib.TOMLDecodeError as e:
        raise PoolError(f"pool file {path} is not valid TOML: {e}") from None
    return parse_pool(data, str(path))
