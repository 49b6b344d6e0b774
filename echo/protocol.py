"""The learner/worker control API's JSON messages: one model per body, shared by both sides.

What a worker sends is untrusted. Every request model refuses unknown keys and bounds every
string, number and list, so a malformed or oversized field is a 400/422 naming the field,
never stored. Replies come from the learner, which the worker trusts; they are typed too, with
bounds a correct learner never reaches, so both ends read attributes, never string keys.

The snapshot announcement names what `broadcast` moves but is defined here: the ground floor
imports no plane, and what it carries is names and numbers only (the digest of a star download,
the stream keys of a chain push, the learner's relay URL, a summary of the plan). Everything a
relay must trust arrives signed in the manifest and route (`broadcast.signing`,
`broadcast.route`), which `broadcast` parses itself; the worker builds `broadcast.star.BlobInfo`
from an `Announcement`.

Trajectory uploads are not JSON: see `echo.wire` (msgpack + zstd, token ids as raw bytes).

Identity: `POST /v1/join` is admitted by the run token and answers a per-worker
`credential`; every later call carries `Authorization: Bearer <credential>`, and the learner
takes the worker's identity from it, never from a body.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationError

MAX_JSON_BYTES = 256 << 10  # a JSON body larger than this is refused before it is parsed

# No control characters and no invisible ones: a worker's name is printed in the learner's log and
# status, where a newline or an ANSI escape forged whole lines ("quarantined <honest worker>"), and
# U+202E shows a name backwards. Judged by Unicode category (control, format, private use,
# surrogate, unassigned, line and paragraph separators), not by a list of ranges: a list of the
# known ones let U+00AD, U+061C and the tag characters (a hidden "evil" after "cpu-a-0") through.
# Lookalikes (a Cyrillic "а") are names like any other: a worker is known by its id.
NAME_MAX = 64
HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Co", "Cs", "Cn", "Zl", "Zp"})


def _hides(text: str) -> bool:
    return any(unicodedata.category(c) in HIDDEN_CATEGORIES for c in text)


def valid_name(name: str) -> bool:
    """Whether `name` could be a worker's `Name` (a machine id from a token becomes one)."""
    return len(name) <= NAME_MAX and not _hides(name)


def _visible(text: str) -> str:
    if _hides(text):
        raise ValueError("must not contain control or invisible characters (Unicode categories "
                         f"{', '.join(sorted(HIDDEN_CATEGORIES))})")
    return text


Name = Annotated[str, StringConstraints(max_length=NAME_MAX), AfterValidator(_visible)]


Id = Annotated[str, StringConstraints(max_length=128)]
Url = Annotated[str, StringConstraints(max_length=256, pattern=r"^(|https?://\S+|p2p:/\S+)$")]
# A worker's relay: where other workers and the learner connect, so nothing but an address and a
# port (no path, query or credentials a request could be aimed with); the learner also requires
# the host to be the address the worker connects from (learner's workers room).
# ASCII digits only: `\d` takes any script's (`http://ip:٨٠` was stored as given and dialled at 80)
_HOST = r"([0-9]{1,3}(\.[0-9]{1,3}){3}|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]{0,252}))"
_PORT = re.compile(r":([0-9]+)/?$|/tcp/([0-9]+)/")


def _port_in_range(url: str) -> str:
    """Nothing can connect to port 0 or to one past 65535."""
    m = _PORT.search(url)
    if m is not None and not 1 <= int(m.group(1) or m.group(2)) <= 65535:
        raise ValueError(f"the port of {url[:80]!r} must be 1 to 65535")
    return url


RelayUrl = Annotated[str, StringConstraints(max_length=256, pattern=(
    rf"^(|https?://{_HOST}:[0-9]{{1,5}}/?"
    r"|p2p:/(ip4|ip6|dns|dns4|dns6)/[A-Za-z0-9.:-]{1,253}/tcp/[0-9]{1,5}/p2p/[1-9A-HJ-NP-Za-km-z]{32,128})$")),
    AfterValidator(_port_in_range)]
Rate = Annotated[float, Field(ge=0.0, le=1e7, allow_inf_nan=False)]
Mbit = Annotated[float, Field(ge=0.0, le=1e5, allow_inf_nan=False)]  # 100 Gbit/s: beyond any rented link
Seconds = Annotated[float, Field(ge=0.0, le=1e7, allow_inf_nan=False)]
Version = Annotated[int, Field(ge=-1, le=1 << 40)]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    max_bytes: ClassVar[int] = MAX_JSON_BYTES  # a body beyond this is refused before it is parsed


class ProtocolError(ValueError):
    """A body that does not match its model; the message names the fields."""


def parse(model: type[Message], data: Any) -> Message:
    """Validate `data` as `model`, or raise ProtocolError saying which fields are wrong."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _protocol_error(model, e) from None


def parse_json(model: type[Message], raw: bytes) -> Message:
    """Parse and validate a JSON body in one pass (pydantic's parser: bounded nesting, no Python
    object for what the model does not keep); an empty body is `{}`. Every failure, a
    100,000-deep array included, is a ProtocolError, never a RecursionError. Strict: a number is
    a number (`"8"`, `true` and `8.0` are no integer, `"1.5"` no float; an integer is a float),
    as every honest client sends it. Of a repeated key the last is taken: one parser reads the
    body, so no two readers can disagree on it."""
    try:
        return model.model_validate_json(raw or b"{}", strict=True)
    except ValidationError as e:
        raise _protocol_error(model, e) from None


def _protocol_error(model: type[Message], e: ValidationError) -> ProtocolError:
    problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg'][:200]}" for err in e.errors()[:5])
    return ProtocolError(f"{model.__name__}: {problems}")


# --- worker → learner ----------------------------------------------------------------------------


class Install(Message):
    """A version the worker installed: seconds ago (clocks differ between machines)."""

    version: Version
    installed_ago: Seconds
    received_ago: Seconds
    install_s: Seconds


class Delivery(Message):
    """A push of one tree of a version this worker's relay made, which the child took whole, with
    the child's receipt ("" if it gave none; `broadcast.receipts`)."""

    key: Annotated[str, StringConstraints(max_length=32)]  # the version's key, e.g. "v12-d11"
    child: Annotated[str, StringConstraints(max_length=24)]  # a worker id the learner gave ("w17")
    tree: Annotated[int, Field(ge=0, le=4096)]
    receipt: Annotated[str, StringConstraints(pattern=r"^([0-9a-f]{32})?$")] = ""


class Report(Message):
    """What a worker says about itself, at join and in every heartbeat. Claims: the learner
    checks rates against what it measures (`learner.verify.Plausibility`)."""

    # The largest honest report is 17 KiB (`tests/unit/echo/test_protocol.py`). pydantic checks a
    # list's length after validating every item: a 240 KiB heartbeat of 120,000 installs took
    # 6.8 ms of the learner's loop to refuse, and eight workers at their request rate a core.
    max_bytes: ClassVar[int] = 40 << 10

    name: Name = ""
    version: Version = -1
    rollouts_per_s: Rate = 0.0  # delivered (accepted) rollouts per wall second
    capacity_per_s: Rate = 0.0  # rollouts per engine-busy second
    expected_rollouts_per_s: Rate = 0.0
    price_per_hour: Annotated[float, Field(ge=0.0, le=1e4, allow_inf_nan=False)] = 0.0
    gpu: Name = ""
    device: Name = ""
    engine: Name = ""
    download_mbit: Mbit = 0.0
    upload_mbit: Mbit = 0.0
    relay_url: RelayUrl = ""
    rtt_ms: Annotated[float, Field(ge=0.0, le=600_000.0, allow_inf_nan=False)] | None = None
    installs: Annotated[list[Install], Field(max_length=64)] = []
    links: Annotated[list[dict[str, Any]], Field(max_length=16)] = []  # broadcast.links.LinkSample, checked there
    deliveries: Annotated[list[Delivery], Field(max_length=32)] = []  # its relay's latest pushes taken whole


class LeaseRequest(Message):
    max_prompts: Annotated[int, Field(ge=1, le=1024)] = 1
    version: Version = -1  # the installed snapshot, which generates the whole lease
    wait_s: Annotated[float, Field(ge=0.0, le=60.0, allow_inf_nan=False)] = 0.0  # long poll: hold the request this long for work


class ReleaseRequest(Message):
    lease_id: Id


class EvalSubmission(Message):
    """An eval lease's answers: the completion token ids per prompt, which the learner scores
    itself, and the worker's own rewards, which it checks against its scores."""

    lease_id: Id
    version: Version
    rewards: Annotated[dict[Id, Annotated[float, Field(allow_inf_nan=False)]], Field(max_length=1024)]
    completions: Annotated[dict[Id, Annotated[list[int], Field(max_length=65536)]], Field(max_length=1024)] = {}


# --- learner → worker ----------------------------------------------------------------------------

Sha256 = Annotated[str, StringConstraints(pattern=r"^([0-9a-f]{64})?$")]


class TaskInfo(Message):
    """The task the run trains, and the digest (`echo.dirfiles.digest`) of each model directory its
    environment reads where it runs (option -> sha256: poker's LLM opponent), which a worker
    holding no copy with that digest fetches from the learner (`GET /v1/task-dirs/<option>`)."""
    name: str
    options: dict[str, Any] = {}
    model_dirs: dict[str, Sha256] = {}


class Announcement(Message):
    """A published version as a star download (`broadcast.star`): fetched whole from the learner,
    checked by size and sha256. (A bare version, size 0, only announces; nothing verifies as it.)"""

    version: Version
    size: Annotated[int, Field(ge=0, le=1 << 42)] = 0
    sha256: Sha256 = ""


class PlanBrief(Message):
    """What the workers are told of one push's plan (`broadcast.planner.Plan.summary`)."""

    kind: Name
    chains: Annotated[int, Field(ge=0, le=100_000)]
    predicted_s: Annotated[float, Field(ge=0.0)]  # inf: no rate known


class PushAnnouncement(Announcement):
    """A version pushed along signed chains (`[broadcast] mode = "chain"`): the full version's
    stream `key`, the XOR delta's (`delta_key`, for workers holding its base), and the learner's
    relay `source`, from which a worker the push missed pulls the full version."""

    key: Id
    delta_key: Id | None = None
    source: Url
    plan: Annotated[dict[Id, PlanBrief], Field(max_length=4)] = {}  # by stream key


#: Either kind; a reply carries the one the learner's broadcast design publishes.
Snapshot = PushAnnouncement | Announcement


class BroadcastInfo(Message):
    """How versions travel in this run (`learner.publisher`): `star` downloads, or `chain`
    pushes signed by `public_key`, pulled from `source` when none arrived within `fallback_s`."""

    mode: Literal["chain", "star"] = "star"
    public_key: Annotated[str, StringConstraints(max_length=256)] = ""  # "ed25519:<base64>" (chain)
    source: Url | None = None  # the learner's relay (chain)
    fallback_s: Annotated[float, Field(gt=0.0, le=1e7)] = 10.0
    # This worker's read ticket (chain; `broadcast.tickets`): presented to the source and every
    # relay, renewed in heartbeat replies.
    read_token: Annotated[str, StringConstraints(max_length=512)] = ""


class RolloutParams(Message):
    """How every worker of a run plays its episodes (the learner's `[rollout]` and `[task]`):
    sampling, the turn and token budgets, the ids that end a turn, and how the environment's
    messages become tokens (`echo.chat.Chat`)."""

    group_size: Annotated[int, Field(ge=2, le=1024)]
    max_new_tokens: Annotated[int, Field(ge=1, le=65536)]  # per turn
    temperature: Annotated[float, Field(gt=0.0, le=10.0)]
    top_p: Annotated[float, Field(gt=0.0, le=1.0)]
    max_turns: Annotated[int, Field(ge=1, le=4096)] = 1
    max_tokens: Annotated[int, Field(ge=0, le=1 << 20)] = 0  # an episode's tokens after its prompt; 0: max_new_tokens
    stop_ids: Annotated[list[int], Field(max_length=64)] = []  # every end-of-turn id (kept in the turn)
    chat_template: Literal["auto", "on", "off"] = "auto"
    chat_template_kwargs: dict[str, Any] = {}
    # The learner scores every episode itself (a one-turn task, `[verify] rescore_fraction = 1`):
    # training prompts come without their answers, and a worker sends reward 0 for every sample.
    scored_by_learner: bool = False


class LoraInfo(Message):
    """LoRA mode (`[trainer.lora]`): every version is an adapter (`echo.lora`) on the frozen base
    whose weight files digest to `base_sha256` (`echo.lora.base_digest`). The worker loads that
    base once, refuses any other, and keeps the `keep` (max_staleness + 2) newest adapters loaded,
    one per version, so a batch finishes on its own version's adapter."""

    rank: Annotated[int, Field(ge=1, le=4096)]
    alpha: Annotated[float, Field(gt=0.0, le=1e6, allow_inf_nan=False)]
    target_modules: Annotated[list[Name], Field(min_length=1, max_length=64)]
    base_sha256: Sha256
    keep: Annotated[int, Field(ge=1, le=1024)] = 4
    # The dtype the learner computes each version's probe in (its [trainer] compute_dtype): a
    # bf16 learner's probe is only as exact as bf16, whatever the worker's own dtype.
    probe_dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class JoinReply(Message):
    worker_id: str
    credential: str  # `Authorization: Bearer <credential>` on every later call
    broadcast: BroadcastInfo
    heartbeat_interval: float
    lease_ttl: float
    long_poll_s: float
    task: TaskInfo
    rollout: RolloutParams
    snapshot: Snapshot | None = None
    lora: LoraInfo | None = None  # versions are LoRA adapters on this base (None: full weights)


class HeartbeatReply(Message):
    state: Literal["active", "idle", "stop", "quarantined"]
    snapshot: Snapshot | None = None
    message: str = ""
    # Could the learner connect to the worker's relay? False: nobody can push to it, so it pulls
    # each version from a parent the route names, following the learner's route feed.
    reachable: bool | None = None
    read_token: Annotated[str, StringConstraints(max_length=512)] = ""  # a renewed read ticket (chain), or ""
    # Is `snapshot` pushed to this worker (chain)? False: its push was planned without it (idle
    # then, or joined since), so none will come and it pulls at once. None: nothing is pushed.
    on_route: bool | None = None


class PromptMsg(Message):
    id: str
    text: str
    answer: str
    prompt_ids: list[int]  # the episode's first messages as the learner renders them (authoritative)
    seed: int = 0  # every episode of the group resets with it


class LeaseReply(Message):
    """Prompts to generate, an eval lease (`eval_version`: greedy, one sample each), or nothing
    (`lease_id` None) with the reason: `wait` (nothing to hand out within the poll), `install`
    (the worker's snapshot is too stale to be trained on: install the announced one first)."""

    lease_id: str | None = None
    prompts: list[PromptMsg] = []
    eval_version: int | None = None
    expires_in: float = 0.0
    snapshot: Snapshot | None = None
    empty: Literal["", "wait", "install"] = ""
    waited_s: float = 0.0  # how long the learner held this request for work (the long poll)
    on_route: bool | None = None  # as in HeartbeatReply


class ReleaseReply(Message):
    released: int


class UploadReply(Message):
    accepted: int
    given_back: int = 0  # groups too stale to train: their prompts go to a fresher snapshot


class EvalReply(Message):
    accepted: int


class ErrorReply(Message):
    error: str  # a stable reason code (also the Prometheus label)
    message: str  # what was wrong and what to do


#: The bodies of the JSON routes (`docs/api.md`): what a client sends, and what it is answered
REQUESTS = (Report, LeaseRequest, ReleaseRequest, EvalSubmission)
REPLIES = (JoinReply, HeartbeatReply, LeaseReply, ReleaseReply, EvalReply, UploadReply, ErrorReply)


def json_schema() -> dict:
    """The JSON Schema of every route's body, bounds included: `docs/api-schema.json`, what a
    client written from the API alone is written against (`python -m echo.protocol` prints it).
    A tester had to learn the fields from a real worker's traffic and from 400 messages."""
    from pydantic.json_schema import models_json_schema

    _, schema = models_json_schema([(m, "validation") for m in REQUESTS] + [(m, "serialization") for m in REPLIES],
                                   title="echo learner API bodies (echo/protocol.py)")
    return schema


if __name__ == "__main__":
    import json
    import sys

    json.dump(json_schema(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
