"""What crosses the learner/worker boundary, and how it is checked.

Trajectory uploads are msgpack, zstd-compressed (`application/x-echo-trajectories`). Token ids
travel as little-endian int32 bytes, behaviour log-probs as float32 bytes and an episode's loss
mask as one byte per token (1: the policy's token, 0: the environment's; absent: all 1, a
one-turn completion): compact, and decoded without a Python object per token. Everything from a worker is untrusted:
`decode_submission` checks structure, sizes, token range and finiteness, and raises
`Rejected` with a reason code (also the Prometheus label) and an HTTP status.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Sequence

import msgpack
import numpy as np
import zstandard

CONTENT_TYPE = "application/x-echo-trajectories"
MAX_DECOMPRESSED = 64 << 20  # a zip bomb stops here, whatever the declared size
MAX_GROUPS = 1024  # groups in one upload: a lease holds at most this many prompts (echo.protocol.LeaseRequest)
MAX_ID_BYTES = 512  # worker, lease and prompt ids (echo.protocol.Id: 128 characters of UTF-8)


class Rejected(Exception):
    """An upload the learner refuses. `reason` is a stable code; the message says what to fix."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


@dataclass
class SampleMsg:
    """One episode: its tokens after the prompt, μ per token (0 on the environment's), its return."""

    tokens: list[int]
    logprobs: list[float]
    reward: float
    mask: list[int] | None = None  # None: every token is the policy's (one turn)
    truncated: bool = False  # cut at the run's turn or token budget


@dataclass
class GroupMsg:
    prompt_id: str
    version: int
    samples: list[SampleMsg]


@dataclass
class Submission:
    worker_id: str
    lease_id: str
    groups: list[GroupMsg]


def encode_submission(sub: Submission) -> bytes:
    obj = {
        "worker_id": sub.worker_id,
        "lease_id": sub.lease_id,
        "groups": [
            {
                "prompt_id": g.prompt_id,
                "version": g.version,
                "samples": [_encode_sample(s) for s in g.samples],
            }
            for g in sub.groups
        ],
    }
    return zstandard.ZstdCompressor(level=3).compress(msgpack.packb(obj, use_bin_type=True))


def _encode_sample(s: SampleMsg) -> dict:
    out = {"tokens": np.asarray(s.tokens, dtype="<i4").tobytes(),
           "logprobs": np.asarray(s.logprobs, dtype="<f4").tobytes(), "reward": float(s.reward)}
    if s.mask is not None and not all(s.mask):
        out["mask"] = np.asarray(s.mask, dtype="u1").tobytes()
    if s.truncated:
        out["truncated"] = True
    return out


# No sampled token has a log-probability below this: e^-1000 is 0 in every float format, so a token
# that unlikely is never drawn (a bound, not a tolerance: raw log-probs at a high temperature can lie
# far below float32's -104). A claimed -3e38 was taken (finite, <= 0), and sums of π - μ (the drift
# the verifier measures) overflowed on it; the importance weight is taken in log space whatever μ
# (`learner.train.losses.grpo_loss`).
LOGPROB_FLOOR = -1000.0


def decode_submission(body: bytes, *, vocab_size: int, max_tokens: int, group_size: int,
                      max_groups: int = MAX_GROUPS, stop_ids: Sequence[int] = (), turn_tokens: int | None = None) -> Submission:
    """Decode and validate an upload of at most `max_groups` groups (the prompts its sender
    holds); every problem raises `Rejected`. `stop_ids` end a policy turn: none may be followed
    by more of the policy's tokens in the same turn (an engine stops at the first), and with
    `turn_tokens` (the run's max_new_tokens) a turn that ends on none must end at its budget.

    Nothing the body declares is believed: the decompressed size is capped while reading at what
    `max_groups` full groups can be (a frame that declares more is refused before anything is
    allocated; one that declares nothing is read no further: a 3 KiB bomb costs what an honest
    upload of that many groups does, not 64 MiB of inflating), and msgpack is held to the
    protocol's bounds per field, so a few KiB cannot expand into millions of objects."""
    max_groups = max(1, min(max_groups, MAX_GROUPS))
    stops = np.array(sorted(set(stop_ids)), dtype=np.int32)
    obj = _unpack(_decompress(body, _max_raw(max_tokens, group_size, max_groups)), max_tokens, group_size, max_groups)

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise Rejected(400, "malformed", f"malformed trajectory upload: {what}")

    need(isinstance(obj, dict), "top level must be a map")
    _known(obj, TOP_KEYS, "the upload")
    need(isinstance(obj.get("worker_id"), str) and isinstance(obj.get("lease_id"), str), "worker_id and lease_id must be strings")
    groups = obj.get("groups")
    need(isinstance(groups, list) and len(groups) > 0, "groups must be a non-empty list")
    out: list[GroupMsg] = []
    for gi, g in enumerate(groups):
        need(isinstance(g, dict), f"groups[{gi}] must be a map")
        _known(g, GROUP_KEYS, f"groups[{gi}]")
        need(isinstance(g.get("prompt_id"), str), f"groups[{gi}].prompt_id must be a string")
        need(isinstance(g.get("version"), int) and not isinstance(g.get("version"), bool), f"groups[{gi}].version must be an integer")
        samples = g.get("samples")
        need(isinstance(samples, list), f"groups[{gi}].samples must be a list")
        if len(samples) != group_size:
            raise Rejected(422, "wrong-group-size", f"groups[{gi}] has {len(samples)} samples; this run's group_size is {group_size}")
        parsed = [_sample(s, f"groups[{gi}].samples[{si}]", vocab_size, max_tokens, stops, turn_tokens)
                  for si, s in enumerate(samples)]
        out.append(GroupMsg(g["prompt_id"], g["version"], parsed))
    return Submission(obj["worker_id"], obj["lease_id"], out)


def _max_raw(max_tokens: int, group_size: int, groups: int) -> int:
    """The largest msgpack body an honest upload of `groups` groups can be: every sample at the
    token limit (4 bytes of id + 4 of log-prob each), plus the keys and ids around them."""
    per_sample = 9 * max_tokens + 96  # ids, log-probs, mask
    return min(MAX_DECOMPRESSED, groups * (group_size * per_sample + MAX_ID_BYTES + 64) + 2 * MAX_ID_BYTES + 64)


def max_body(max_tokens: int, group_size: int, groups: int) -> int:
    """The largest compressed body an honest upload of `groups` groups can be: zstd's worst case
    (incompressible input: a few bytes per 255 more, and a frame header) over `_max_raw`. What a
    request declares beyond it is refused before a byte of it is read."""
    raw = _max_raw(max_tokens, group_size, max(1, min(groups, MAX_GROUPS)))
    return raw + raw // 255 + 1024


def _decompress(body: bytes, cap: int) -> bytes:
    try:
        declared = zstandard.frame_content_size(body)
    except zstandard.ZstdError as e:
        raise Rejected(400, "malformed", f"body is not zstd-compressed msgpack ({e}); use echo.wire.encode_submission") from None
    if declared > cap:  # -1: not declared; the read below stops at the cap either way
        raise Rejected(413, "oversized", f"the upload declares {declared} bytes decompressed; at most {cap} "
                                         "fit this run's group_size and episode token budget for the prompts "
                                         "this worker holds")
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body), read_across_frames=True) as reader:
            raw = reader.read(cap + 1)
    except zstandard.ZstdError as e:
        raise Rejected(400, "malformed", f"body is not zstd-compressed msgpack ({e}); use echo.wire.encode_submission") from None
    if len(raw) > cap:
        raise Rejected(413, "oversized", f"the upload decompresses past {cap} bytes, more than this run's "
                                         "group_size and episode token budget allow for the prompts this "
                                         "worker holds")
    return raw


class _TooMany(ValueError):
    pass


def _counter(limit: int, what: str):
    """A msgpack hook that refuses the (limit+1)-th container: per-field length limits alone let
    nested empty arrays turn a few MiB into tens of millions of objects."""
    seen = 0

    def hook(value):
        nonlocal seen
        seen += 1
        if seen > limit:
            raise _TooMany(f"more than {limit} {what}")
        return value

    return hook


def _beyond(groups: int) -> str:
    return f"body exceeds the protocol's bounds for an upload of at most {groups} groups (the prompts this worker holds)"


def _unpack(raw: bytes, max_tokens: int, group_size: int, groups: int) -> object:
    # The shape of an honest upload: one map, one list of groups, a map and a list per group,
    # a map per sample. Anything beyond that many containers is not an upload.
    lists, maps = groups + 1, 1 + groups * (1 + group_size)
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True, max_str_len=MAX_ID_BYTES,
                               max_bin_len=4 * max_tokens, max_array_len=max(groups, group_size),
                               max_map_len=8, max_ext_len=0, list_hook=_counter(lists, "lists"),
                               object_hook=_counter(maps, "maps"))
    except _TooMany as e:
        raise Rejected(400, "malformed", f"{_beyond(groups)}: {e}") from None
    except ValueError as e:
        if "max_bin_len" in str(e):  # token or log-prob bytes beyond the episode budget
            raise Rejected(413, "oversized", f"a sample holds more than {max_tokens} completion tokens "
                                             "(rollout.max_episode_tokens)") from None
        if "exceeds" in str(e):  # msgpack's own words for a length beyond the limits given
            raise Rejected(400, "malformed", f"{_beyond(groups)}: {e}") from None
        raise Rejected(400, "malformed", f"body is not valid msgpack: {e}") from None
    except Exception as e:  # msgpack raises several unrelated types on garbage (and on deep nesting)
        raise Rejected(400, "malformed", f"body is not valid msgpack: {e}") from None


TOP_KEYS = frozenset({"worker_id", "lease_id", "groups"})
GROUP_KEYS = frozenset({"prompt_id", "version", "samples"})
SAMPLE_KEYS = frozenset({"tokens", "logprobs", "reward", "mask", "truncated"})


def _known(obj: dict, keys: frozenset, where: str) -> None:
    """Unknown keys are refused at every level, as on the JSON routes, and named (a few, cut short)."""
    if unknown := set(obj) - keys:
        names = sorted(str(k)[:64] for k in unknown)[:8]
        raise Rejected(400, "malformed", f"{where}: unknown keys {names} (known: {sorted(keys)})")


def turn_budget(start: int, max_new_tokens: int, max_tokens: int) -> int:
    """The tokens a policy turn starting `start` tokens into its episode may write: an engine cuts
    a turn there unless a stop id ends it first. `echo.episodes.play` gives each turn this;
    `decode_submission` holds every uploaded turn to it."""
    return min(max_new_tokens, max_tokens - start)


def _sample(s: object, where: str, vocab_size: int, max_tokens: int, stops: np.ndarray,
            turn_tokens: int | None = None) -> SampleMsg:
    if not (isinstance(s, dict) and isinstance(s.get("tokens"), bytes) and isinstance(s.get("logprobs"), bytes)):
        raise Rejected(400, "malformed", f"malformed trajectory upload: {where} needs bytes 'tokens' and 'logprobs'")
    _known(s, SAMPLE_KEYS, where)
    tb, lb, reward = s["tokens"], s["logprobs"], s.get("reward")
    if len(tb) % 4 or len(lb) % 4:
        raise Rejected(400, "malformed", f"{where}: token/logprob byte lengths must be multiples of 4 (int32/float32)")
    tokens = np.frombuffer(tb, dtype="<i4")
    logprobs = np.frombuffer(lb, dtype="<f4")
    if len(tokens) != len(logprobs):
        raise Rejected(400, "malformed", f"{where}: {len(tokens)} tokens but {len(logprobs)} log-probs")
    if not len(tokens):
        raise Rejected(422, "empty-completion", f"{where}: no completion tokens; a sample has at least one (EOS counts)")
    if len(tokens) > max_tokens:
        raise Rejected(413, "oversized", f"{where}: {len(tokens)} episode tokens; allowed 1..{max_tokens} "
                                         "(rollout.max_episode_tokens)")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise Rejected(422, "bad-token", f"{where}: token ids must lie in [0, {vocab_size})")
    if not np.isfinite(logprobs).all() or (logprobs > 1e-4).any() or (logprobs < LOGPROB_FLOOR).any():
        raise Rejected(422, "bad-logprobs", f"{where}: behaviour log-probs must be finite, <= 0 and >= {LOGPROB_FLOOR:g} "
                                            "(the sampled tokens' log-probabilities under the policy that sampled them)")
    if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
        raise Rejected(422, "bad-reward", f"{where}: reward must be a finite number")
    mask = None
    if "mask" in s:
        mb = s["mask"]
        if not isinstance(mb, bytes) or len(mb) != len(tokens):
            raise Rejected(400, "malformed", f"{where}: the mask needs one byte per token ({len(tokens)})")
        values = np.frombuffer(mb, dtype="u1")
        if values.max() > 1 or values[0] != 1:
            raise Rejected(422, "bad-mask", f"{where}: mask values are 0 (environment) or 1 (policy), and an "
                                            "episode starts with the policy's turn")
        mask = values.tolist()
    if len(stops):
        policy = np.ones(len(tokens), dtype=bool) if mask is None else values.astype(bool)
        goes_on = np.isin(tokens[:-1], stops) & policy[:-1] & policy[1:]
        if goes_on.any():
            i = int(np.argmax(goes_on))
            raise Rejected(422, "after-stop", f"{where}: token {i} is a stop id, which ends the policy's turn, yet the "
                                              f"turn goes on at token {i + 1}; an engine stops at the first stop id")
        if turn_tokens:  # and a turn ends only at a stop id or at its budget: a stop id dropped is a forgery
            edges = np.flatnonzero(np.diff(np.concatenate(([0], policy.view(np.int8), [0]))))
            starts, ends = edges[0::2], edges[1::2]
            for k in np.flatnonzero(~np.isin(tokens[ends - 1], stops)):  # turns cut, not stopped
                start, length = int(starts[k]), int(ends[k] - starts[k])
                if length != (budget := turn_budget(start, turn_tokens, max_tokens)):
                    raise Rejected(422, "cut-short", f"{where}: the policy's turn at token {start} ends after {length} "
                                                     f"tokens on no stop id, short of its budget of {budget}; an engine "
                                                     "ends a turn only at a stop id or at the budget")
    truncated = s.get("truncated", False)
    if not isinstance(truncated, bool):
        raise Rejected(400, "malformed", f"{where}: truncated must be true or false")
    # Arrays, copied out of the body: Python lists of the same numbers took ~1 GB and a 141 ms
    # garbage-collection pass for a buffer of 768 groups of 8 × 2,048 tokens (one per object).
    return SampleMsg(np.array(tokens, dtype=np.int32), np.array(logprobs, dtype=np.float32), float(reward), mask,
                     truncated)
