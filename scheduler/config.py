"""`[scheduler]`: the scheduler's table in the learner config (and what `echo-rl plan
--config` reads). The learner embeds `SchedulerSection` as `scheduler`; everything else the
plan needs comes from tables the learner already has (see `scheduler/plan.py`).

The provider is a tagged union picked by `type`:

    [scheduler.provider]
    type = "command"
    launch_command = "mycloud up --name {id} -- echo-worker join {url} --token {token}"

The old flat spelling (`provider = "local"`, `launch_command = ...` beside it in
`[scheduler]`) still loads: a before-validator maps it onto the table."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import Field, field_validator, model_validator

from echo.config import Section
from scheduler.controller import ControllerParams


class _ProviderConfig(Section):
    """Base of the provider variants: `type` names the variant."""

    type: str

    def __eq__(self, other: object) -> bool:
        # `provider == "static"` keeps reading as it did when the provider was its name alone.
        if isinstance(other, str):
            return self.type == other
        return super().__eq__(other)


class StaticProviderConfig(_ProviderConfig):
    """Machines are never brought up or down: only workers that joined by themselves are used."""

    type: Literal["static"] = Field("static", description="[scheduler.provider] type = 'static': use only workers that joined by themselves")


class LocalProviderConfig(_ProviderConfig):
    """A worker process on this machine per candidate ([workers] says how to start it)."""

    type: Literal["local"] = Field("local", description="[scheduler.provider] type = 'local': spawn worker processes here, throttled to the pool's rates")


class CommandProviderConfig(_ProviderConfig):
    """User-given shell commands bring machines up and down (e.g. a cloud CLI)."""

    type: Literal["command"] = Field("command", description="[scheduler.provider] type = 'command': run launch/release commands")
    launch_command: str = Field("", description="[scheduler.provider] launch_command: shell command that brings up machine {id} (placeholders {id} {gpu} {price} {rate} {url} {token})")
    release_command: str = Field("", description="[scheduler.provider] release_command: shell command that tears machine {id} down (same placeholders); empty = never torn down")


DEFAULT_ONSTART = "echo-worker join {url} --token {token} --worker.name {id} --worker.gpu {gpu}"
DEFAULT_IMAGE = "ghcr.io/echo-rl/echo-worker:latest"  # docker/worker.Dockerfile


class _MarketProviderConfig(_ProviderConfig):
    """What every marketplace provider shares: which GPUs, at what expected rate, how to start."""

    gpus: dict[str, float] = Field(default_factory=dict, description="[scheduler.provider] gpus: GPU model → expected rollouts/s of one such GPU, e.g. {\"RTX 4090\" = 3.0}; only offers of these GPUs are candidates")
    image: str = Field(DEFAULT_IMAGE, description="[scheduler.provider] image: the worker container image (docker/worker.Dockerfile)")
    onstart: str = Field(DEFAULT_ONSTART, description="[scheduler.provider] onstart: command the machine runs at boot (placeholders {url} {token} {id} {gpu}, shell-quoted); extra worker flags go at its end")
    learner_url: str = Field("", description="[scheduler.provider] learner_url: the address rented machines reach the learner at (default: the one it listens on)")
    refresh_s: float = Field(30.0, gt=0.0, le=3600.0, description="[scheduler.provider] refresh_s: seconds between offer searches and instance-state checks")
    disk_gb: float = Field(40.0, gt=0.0, le=10_000.0, description="[scheduler.provider] disk_gb: disk of each machine (GB)")


class VastProviderConfig(_MarketProviderConfig):
    """Vast.ai through its `vastai` SDK: live offers are the candidates."""

    type: Literal["vast"] = Field("vast", description="[scheduler.provider] type = 'vast': rent machines on Vast.ai (`pip install 'echo-rl[market]'`)")
    query: str = Field("reliability>0.98 num_gpus=1 inet_down>=200 verified=true", description="[scheduler.provider] query: Vast search filters (`vastai search offers` syntax); gpu_name is added from `gpus`")
    interruptible: bool = Field(False, description="[scheduler.provider] interruptible: rent interruptible (bid) instances: cheaper, preempted when outbid")
    bid_margin: float = Field(0.1, ge=0.0, le=10.0, description="[scheduler.provider] bid_margin: an interruptible bid is the offer's min_bid × (1 + margin)")
    max_offers: int = Field(64, ge=1, le=1000, description="[scheduler.provider] max_offers: offers asked for per search")
    api_url: str = Field("", description="[scheduler.provider] api_url: the Vast API server (default: the SDK's, https://console.vast.ai; $VAST_URL)")
    api_key_env: str = Field("VAST_API_KEY", description="[scheduler.provider] api_key_env: environment variable holding the API key (else the SDK's key file)")


class SkyProviderConfig(_MarketProviderConfig):
    """SkyPilot's Python SDK: one cluster per machine, on whichever cloud SkyPilot picks."""

    type: Literal["skypilot"] = Field("skypilot", description="[scheduler.provider] type = 'skypilot': launch machines with SkyPilot (`pip install skypilot`)")
    clouds: list[str] = Field(default_factory=list, description="[scheduler.provider] clouds: SkyPilot clouds to consider (e.g. [\"runpod\", \"lambda\", \"vast\"]); empty = any enabled")
    prices: dict[str, float] = Field(default_factory=dict, description="[scheduler.provider] prices: GPU model → $/h the controller plans with (SkyPilot picks the cloud; it has no live offer list)")
    use_spot: bool = Field(False, description="[scheduler.provider] use_spot: spot/interruptible instances")
    per_gpu_count: int = Field(4, ge=1, le=64, description="[scheduler.provider] per_gpu_count: candidates per GPU model")
    dollars_per_gb: float = Field(0.0, ge=0.0, le=10.0, description="[scheduler.provider] dollars_per_gb: egress $/GB planned for each machine")


ProviderConfig = Annotated[Union[StaticProviderConfig, LocalProviderConfig, CommandProviderConfig,
                                 VastProviderConfig, SkyProviderConfig],
                           Field(discriminator="type")]
_COMMAND_KEYS = ("launch_command", "release_command")  # the command provider's keys, once flat in [scheduler]


class SchedulerSection(Section):
    pool: Path | None = Field(None, description="[scheduler] pool: pool file of candidate workers (configs/pools/*.toml); none = whoever joins")
    alpha: float = Field(1.2, ge=1.0, le=10.0, description="[scheduler] alpha: safety factor α; activation targets α·R_req")
    rule: Literal["overlapped", "paper"] = Field("overlapped", description="[scheduler] rule: the capacity rule R_req comes from: 'overlapped' (this system: training continues on older snapshots while a new one travels, the broadcast hidden within S) or 'paper' (ECHO-2's sufficient condition I·B/(I·T − T_bcast))")
    activation: Literal["greedy", "exact"] = Field("exact", description="[scheduler] activation: how echo-rl plan chooses workers, 'greedy' by unit cost or 'exact' min-cost ILP (the live controller adds and removes workers greedily, one decision at a time)")
    learner_price_per_hour: float = Field(3.06, ge=0.0, le=1000.0, description="[scheduler] learner_price_per_hour: $/h of the learner node (cost accounting)")
    t_train_s: float = Field(120.0, gt=0.0, le=1e6, description="[scheduler] t_train_s: expected seconds per update until measured (plan + first activation)")
    t_bcast_s: float = Field(60.0, ge=0.0, le=1e6, description="[scheduler] t_bcast_s: expected broadcast seconds (publication until [broadcast] done_fraction of the workers received a version) until measured")
    install_s: float = Field(0.0, ge=0.0, le=1e6, description="[scheduler] install_s: expected engine install seconds until measured")
    length_sigma: float = Field(0.6, ge=0.0, le=3.0, description="[scheduler] length_sigma: tailness σ of the lognormal response-length model used by plan")
    window_s: float = Field(60.0, ge=0.0, description="[scheduler] window_s: a capacity deviation must last this long before workers are (de)activated")
    release_margin: float = Field(0.3, ge=0.0, le=10.0, description="[scheduler] release_margin: release workers only when R_eff > (1 + margin)·α·R_req")
    release_lookback_s: float | None = Field(None, ge=0.0, description="[scheduler] release_lookback_s: a release is judged against the highest target of this many seconds back, so a swinging target does not release a machine it wants again a window later (default: 3 × window_s)")
    heartbeat_timeout_s: float = Field(10.0, gt=0.0, description="[scheduler] heartbeat_timeout_s: a worker silent this long is unavailable")
    ewma: float = Field(0.2, gt=0.0, le=1.0, description="[scheduler] ewma: weight of each throughput report in the smoothed rate r̂")
    warmup_s: float = Field(30.0, ge=0.0, description="[scheduler] warmup_s: a freshly activated worker counts at its declared rate this long")

    provider: ProviderConfig = Field(default_factory=StaticProviderConfig, description="[scheduler] provider: how machines come and go, a table picked by `type`: 'local' spawns worker processes here, 'command' runs launch/release commands, 'static' only uses workers that joined by themselves (`provider = \"local\"` is short for `type = \"local\"`)")
    launch_timeout_s: float = Field(180.0, gt=0.0, description="[scheduler] launch_timeout_s: a launched machine that has not joined by then counts as unavailable")
    max_dollars_per_hour: float = Field(0.0, ge=0.0, le=1e6, description="[scheduler] max_dollars_per_hour: the run's burn-rate cap, learner + workers + bandwidth ($/h); the controller activates nothing past it and releases the dearest workers when prices rise above it (0 = no cap)")
    max_total_dollars: float = Field(0.0, ge=0.0, le=1e9, description="[scheduler] max_total_dollars: the run's budget ($); before a step would pass it, the run checkpoints, releases every machine and stops cleanly (0 = no budget)")
    snapshot_gb: float = Field(0.0, ge=0.0, le=10_000.0, description="[scheduler] snapshot_gb: bytes of one published version on the wire (GB) the bandwidth bill is planned with until measured (0 = the model's size on disk)")
    tick_s: float = Field(1.0, gt=0.0, le=3600.0, description="[scheduler] tick_s: seconds between controller evaluations")

    @model_validator(mode="before")
    @classmethod
    def _old_provider_spelling(cls, data: Any) -> Any:
        """`provider = "command"` with `launch_command`/`release_command` flat in [scheduler]
        (and `--scheduler.provider local`) -> the `[scheduler.provider]` table."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        flat = {k: data.pop(k) for k in _COMMAND_KEYS if k in data}
        provider = data.get("provider")
        if isinstance(provider, str):
            provider = {"type": provider}
        if flat and isinstance(provider, dict) and provider.get("type") == "command":
            provider = {**flat, **provider}  # a key given in the table wins over its flat spelling
        # Flat command keys beside another provider were accepted and unused; they still are.
        if provider is not None:
            data["provider"] = provider
        return data

    @field_validator("pool", mode="before")
    @classmethod
    def _empty_is_none(cls, value):
        return None if value == "" else value  # `--scheduler.pool ""` turns a config's pool off

    @model_validator(mode="after")
    def _pool_readable(self) -> "SchedulerSection":
        """A pool file that is missing or wrong is a config error (`--dry-run` says so), not a
        traceback once the model has loaded."""
        if self.pool is not None:
            from scheduler.pool import PoolError, load_pool

            try:
                load_pool(self.pool)
            except PoolError as e:
                raise ValueError(f"[scheduler] pool: {e}") from None
        return self

    @model_validator(mode="after")
    def _budget_leaves_room(self) -> "SchedulerSection":
        if self.max_dollars_per_hour and self.max_dollars_per_hour <= self.learner_price_per_hour:
            raise ValueError(f"[scheduler] max_dollars_per_hour = {self.max_dollars_per_hour:g} leaves nothing for workers: "
                             f"the learner alone costs learner_price_per_hour = {self.learner_price_per_hour:g} $/h")
        return self

    def controller_params(self) -> ControllerParams:
        cap = self.max_dollars_per_hour - self.learner_price_per_hour if self.max_dollars_per_hour else math.inf
        return ControllerParams(
            alpha=self.alpha, window_s=self.window_s, release_margin=self.release_margin,
            heartbeat_timeout_s=self.heartbeat_timeout_s, ewma=self.ewma, warmup_s=self.warmup_s,
            max_price_per_hour=cap, release_lookback_s=self.release_lookback_s,
        )
