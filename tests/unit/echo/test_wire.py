"""Trajectory codec: round trip, and every kind of bad upload refused with its reason."""

import math

import msgpack
import pytest
import zstandard

from echo.wire import GroupMsg, Rejected, SampleMsg, Submission, decode_submission, encode_submission

LIMITS = dict(vocab_size=20, max_tokens=4, group_size=2)


def submission(**over) -> Submission:
    samples = [SampleMsg([4, 5, 2], [-0.5, -0.25, -1.0], 1.0), SampleMsg([7], [-2.0], 0.0)]
    return Submission("w1", "L1", [GroupMsg("p1", 3, over.get("samples", samples))])


def raw(obj) -> bytes:
    return zstandard.ZstdCompressor().compress(msgpack.packb(obj, use_bin_type=True))


def test_round_trip():
    out = decode_submission(encode_submission(submission()), **LIMITS)
    assert out.worker_id == "w1" and out.lease_id == "L1"
    g = out.groups[0]
    assert (g.prompt_id, g.version) == ("p1", 3)
    assert g.samples[0].tokens.tolist() == [4, 5, 2] and g.samples[0].logprobs.tolist() == [-0.5, -0.25, -1.0]
    # compact arrays, owning their memory (a view would keep the whole decompressed body alive)
    assert g.samples[0].tokens.dtype == "int32" and g.samples[0].logprobs.dtype == "float32"
    assert g.samples[0].tokens.base is None and g.samples[0].logprobs.base is None
    assert [s.reward for s in g.samples] == [1.0, 0.0]


@pytest.mark.parametrize("body,reason,status", [
    (b"not zstd at all", "malformed", 400),
    (zstandard.ZstdCompressor().compress(b"\xc1\xc1\xc1"), "malformed", 400),
    (raw([1, 2, 3]), "malformed", 400),
    (raw({"worker_id": "w", "lease_id": "L", "groups": []}), "malformed", 400),
    (raw({"worker_id": "w", "lease_id": "L", "groups": [{"prompt_id": "p", "version": "3", "samples": []}]}), "malformed", 400),
])
def test_malformed_bodies(body, reason, status):
    with pytest.raises(Rejected) as e:
        decode_submission(body, **LIMITS)
    assert (e.value.reason, e.value.status) == (reason, status)


@pytest.mark.parametrize("samples,reason", [
    ([SampleMsg([1], [-1.0], 1.0)], "wrong-group-size"),
    ([SampleMsg([1] * 5, [-1.0] * 5, 1.0)] * 2, "oversized"),
    ([SampleMsg([99], [-1.0], 1.0)] * 2, "bad-token"),
    ([SampleMsg([1], [math.nan], 1.0)] * 2, "bad-logprobs"),
    ([SampleMsg([1], [math.inf], 1.0)] * 2, "bad-logprobs"),
    ([SampleMsg([1], [0.7], 1.0)] * 2, "bad-logprobs"),
    ([SampleMsg([1], [-3e38], 1.0)] * 2, "bad-logprobs"),  # finite and <= 0, but no sampled token's
    ([SampleMsg([1], [-1.0], math.nan)] * 2, "bad-reward"),
])
def test_invalid_samples(samples, reason):
    with pytest.raises(Rejected) as e:
        decode_submission(encode_submission(submission(samples=samples)), **LIMITS)
    assert e.value.reason == reason
    assert 400 <= e.value.status < 500 and e.value.message


@pytest.mark.parametrize("where", ["the upload", "groups[0]", "groups[0].samples[1]"])
def test_unknown_keys_are_refused_at_every_level_and_only_they_are_named(where):
    """An unknown top-level key was taken (200) while a sample's was refused naming every key the
    sample had (the API-only tester, 2026-11-29)."""
    sample = {"tokens": b"\x01\x00\x00\x00", "logprobs": b"\x00\x00\x80\xbf", "reward": 1.0}
    group = {"prompt_id": "p", "version": 0, "samples": [sample, dict(sample)]}
    obj = {"worker_id": "w", "lease_id": "L", "groups": [group]}
    {"the upload": obj, "groups[0]": group, "groups[0].samples[1]": group["samples"][1]}[where]["extra"] = 1
    with pytest.raises(Rejected) as e:
        decode_submission(raw(obj), **LIMITS)
    assert (e.value.status, e.value.reason) == (400, "malformed")
    assert e.value.message.startswith(f"{where}: unknown keys ['extra'] (known: ")


def test_token_and_logprob_counts_must_match():
    body = raw({"worker_id": "w", "lease_id": "L", "groups": [{"prompt_id": "p", "version": 0, "samples": [
        {"tokens": b"\x01\x00\x00\x00" * 2, "logprobs": b"\x00\x00\x80\xbf", "reward": 1.0}] * 2}]})
    with pytest.raises(Rejected, match="2 tokens but 1 log-probs"):
        decode_submission(body, **LIMITS)


def test_decompression_bomb_is_refused():  # 80 MiB of zeros, its size declared in the frame
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (80 << 20))
    with pytest.raises(Rejected) as e:
        decode_submission(bomb, **LIMITS)
    assert (e.value.reason, e.value.status) == ("oversized", 413)


def test_a_frame_declaring_a_huge_size_is_refused_before_decompressing():
    # A few KiB whose frame header declares 1 GiB: believed, it is allocated before anything is checked.
    bomb = zstandard.ZstdCompressor(write_content_size=True).compress(b"\0" * (1 << 30))
    assert len(bomb) < 64 << 10 and zstandard.frame_content_size(bomb) == 1 << 30
    with pytest.raises(Rejected) as e:
        decode_submission(bomb, **LIMITS)
    assert (e.value.reason, e.value.status) == ("oversized", 413)
    assert "declares" in e.value.message


def test_a_frame_without_a_declared_size_stops_at_the_cap():
    stream = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    bomb = stream.compress(b"\0" * (80 << 20)) + stream.flush()
    assert zstandard.frame_content_size(bomb) == -1
    with pytest.raises(Rejected) as e:
        decode_submission(bomb, **LIMITS)
    assert (e.value.reason, e.value.status) == ("oversized", 413)


@pytest.mark.parametrize("obj", [
    {"worker_id": "w", "lease_id": "L", "groups": [[]] * 200_000},  # 200k empty lists in ~200 KiB
    {"worker_id": "w", "lease_id": "L", "groups": [[[]] * 1000] * 100},  # the same, nested under the length limit
    {"worker_id": "w", "lease_id": "L", "groups": [{}] * 1000 * 3},
    {"worker_id": "x" * 10_000, "lease_id": "L", "groups": []},  # an id far beyond any the learner issues
])
def test_msgpack_is_held_to_the_protocols_bounds(obj):
    with pytest.raises(Rejected) as e:
        decode_submission(raw(obj), **LIMITS)
    assert e.value.reason == "malformed" and "bounds" in e.value.message


def test_deep_nesting_is_a_400():
    body = zstandard.ZstdCompressor().compress(b"\x91" * 100_000 + b"\x90")
    with pytest.raises(Rejected) as e:
        decode_submission(body, **LIMITS)
    assert (e.value.reason, e.value.status) == ("malformed", 400)


def test_an_episodes_mask_and_cut_travel_and_a_one_turn_sample_sends_none():
    episode = SampleMsg([4, 5, 6, 2], [-0.5, 0.0, 0.0, -1.0], 0.5, mask=[1, 0, 0, 1], truncated=True)
    body = encode_submission(submission(samples=[episode, SampleMsg([7], [-2.0], 0.0, mask=[1])]))
    a, b = decode_submission(body, **LIMITS).groups[0].samples
    assert (a.mask, a.truncated, a.reward) == ([1, 0, 0, 1], True, 0.5)
    assert (b.mask, b.truncated) == (None, False)  # all the policy's: nothing sent


@pytest.mark.parametrize("mask,reason", [
    (b"\x01\x02", "bad-mask"),  # only 0 and 1
    (b"\x00\x01", "bad-mask"),  # an episode starts with the policy's turn, not with text the worker wrote
    (b"\x01", "malformed"),  # one byte per token
    ("11", "malformed"),
])
def test_a_bad_mask_is_refused(mask, reason):
    sample = {"tokens": bytes(8), "logprobs": bytes(8), "reward": 0.0, "mask": mask}
    body = raw({"worker_id": "w1", "lease_id": "L1", "groups": [{"prompt_id": "p", "version": 0,
                                                                 "samples": [sample, sample]}]})
    with pytest.raises(Rejected) as e:
        decode_submission(body, **LIMITS)
    assert e.value.reason == reason, e.value.message


def test_an_upload_is_bounded_by_the_prompts_its_sender_holds():
    """A worker holding 2 prompts sends at most 2 groups: a third is refused, and a frame that
    declares no size is inflated no further than 2 full groups can be, whatever the run's token
    budget (at 4,096 tokens the global cap let a 3 KiB bomb cost 64 MiB and ~40 ms)."""
    limits = dict(LIMITS, max_tokens=4096)
    two = Submission("w1", "L1", [GroupMsg(f"p{i}", 3, submission().groups[0].samples) for i in range(2)])
    assert len(decode_submission(encode_submission(two), **limits, max_groups=2).groups) == 2
    three = Submission("w1", "L1", two.groups + two.groups[:1])
    with pytest.raises(Rejected) as e:
        decode_submission(encode_submission(three), **limits, max_groups=2)
    assert e.value.reason == "malformed" and "at most 2 groups" in e.value.message
    stream = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    bomb = stream.compress(b"\0" * (80 << 20)) + stream.flush()
    with pytest.raises(Rejected) as e:
        decode_submission(bomb, **limits, max_groups=2)
    assert (e.value.reason, e.value.status) == ("oversized", 413)
    read = int(e.value.message.split("past ")[1].split(" bytes")[0])  # how far the learner inflated it
    assert read < 1 << 20  # 2 groups of 2 samples at 4,096 tokens: ~150 KiB
    with pytest.raises(Rejected) as e:
        decode_submission(bomb, **limits)  # holding the most a lease can: the global cap
    assert int(e.value.message.split("past ")[1].split(" bytes")[0]) > 40 * read


def test_a_policy_turn_ends_at_its_first_stop_id():
    """Tokens after the stop token were accepted and trained under the loss mask; an engine
    stops at the first stop id, so a turn that goes on after one was not sampled."""
    stop = dict(LIMITS, stop_ids=[2])
    ok = [SampleMsg([4, 5, 2], [-0.5] * 3, 1.0), SampleMsg([7], [-2.0], 0.0)]
    assert decode_submission(encode_submission(submission(samples=ok)), **stop)
    # Multi-turn: the stop ends the policy's turn, the environment's tokens (mask 0) follow it.
    turns = [SampleMsg([4, 2, 9, 5], [-0.5, -0.5, 0.0, -0.5], 1.0, mask=[1, 1, 0, 1]), ok[1]]
    assert decode_submission(encode_submission(submission(samples=turns)), **stop)
    for bad in ([SampleMsg([4, 2, 5], [-0.5] * 3, 1.0), ok[1]],
                [SampleMsg([4, 2, 2], [-0.5] * 3, 1.0), ok[1]],
                [SampleMsg([4, 2, 5, 9], [-0.5, -0.5, -0.5, 0.0], 1.0, mask=[1, 1, 1, 0]), ok[1]]):
        with pytest.raises(Rejected) as e:
            decode_submission(encode_submission(submission(samples=bad)), **stop)
        assert (e.value.reason, e.value.status) == ("after-stop", 422) and "token 1 is a stop id" in e.value.message
        decode_submission(encode_submission(submission(samples=bad)), **LIMITS)  # no stop ids: nothing to check


def test_a_policy_turn_ends_only_at_a_stop_id_or_at_its_budget():
    """A worker deleted end-of-turn ids from its uploads (poker's <|im_end|>, arithmetic's eos on
    the right answers only): accepted and trained, no statistical check sees a token that is not
    there, and the arithmetic policy stopped ending its answers within 44 versions (an API-only
    tester, 2026-12-07). An engine ends a turn at a stop id or at the turn's budget, nowhere else."""
    rules = dict(vocab_size=20, max_tokens=12, group_size=2, stop_ids=[2], turn_tokens=3)
    stopped, full = SampleMsg([4, 5, 2], [-0.5] * 3, 1.0), SampleMsg([7, 8, 9], [-2.0] * 3, 0.0)
    assert decode_submission(encode_submission(submission(samples=[stopped, full])), **rules)
    # Multi-turn: each turn ends on a stop id or at its budget; the last one too when the
    # episode's budget (max_tokens 12) leaves it fewer tokens (here 2, after 10).
    turns = SampleMsg([4, 2, 9, 9, 5, 6, 7, 9, 9, 9, 5, 6], [-0.5, -0.5, 0, 0, -0.5, -0.5, -0.5, 0, 0, 0, -0.5, -0.5], 1.0,
                      mask=[1, 1, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1])
    assert decode_submission(encode_submission(submission(samples=[turns, full])), **rules)
    for bad, at in ((SampleMsg([4, 5], [-0.5] * 2, 1.0), "turn at token 0 ends after 2 tokens"),  # its eos deleted
                    (SampleMsg([4, 9, 9, 5, 2], [-0.5, 0, 0, -0.5, -0.5], 1.0, mask=[1, 0, 0, 1, 1]),
                     "turn at token 0 ends after 1 tokens")):  # poker: <|im_end|> deleted, the turn cut short
        with pytest.raises(Rejected) as e:
            decode_submission(encode_submission(submission(samples=[bad, full])), **rules)
        assert (e.value.reason, e.value.status) == ("cut-short", 422) and at in e.value.message, e.value.message
        assert decode_submission(encode_submission(submission(samples=[bad, full])), **{**rules, "turn_tokens": None})
