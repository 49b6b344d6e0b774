"""The learner→worker replies are typed (`echo.protocol`) and keep the wire JSON they had as maps."""

import json

import pytest
from pydantic import ValidationError

from echo import protocol as P

SHA = "ab" * 32
STAR = {"version": 3, "size": 10, "sha256": SHA}
CHAIN = {**STAR, "key": "v3", "delta_key": None, "source": "http://127.0.0.1:9000",
         "plan": {"v3": {"kind": "stripes", "chains": 2, "predicted_s": 1.25}}}


@pytest.mark.parametrize("announced, kind", [(STAR, P.Announcement), (CHAIN, P.PushAnnouncement)])
def test_announcements_parse_to_their_kind_and_keep_their_keys(announced, kind):
    for reply in (P.HeartbeatReply(state="active", snapshot=announced), P.LeaseReply(snapshot=announced)):
        assert type(reply.snapshot) is kind
        wire = json.loads(json.dumps(reply.model_dump()))
        assert wire["snapshot"] == announced  # the same keys as when the announcement was a map
        assert type(type(reply).model_validate(wire).snapshot) is kind


def test_join_reply_reads_as_attributes():
    joined = P.JoinReply.model_validate({
        "worker_id": "w1", "credential": "w1.x", "heartbeat_interval": 2.0, "lease_ttl": 20.0, "long_poll_s": 10.0,
        "task": {"name": "arith"}, "snapshot": CHAIN,
        "broadcast": {"mode": "chain", "public_key": "ed25519:AAAA", "source": "http://127.0.0.1:9000",
                      "fallback_s": 10.0},
        "rollout": {"group_size": 8, "max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0}})
    assert joined.broadcast.mode == "chain" and joined.broadcast.fallback_s == 10.0
    assert joined.rollout.group_size == 8 and joined.snapshot.key == "v3"
    assert P.JoinReply.model_validate({**joined.model_dump(), "broadcast": {}}).broadcast.mode == "star"


@pytest.mark.parametrize("bad", [
    {"snapshot": {**STAR, "sha256": "not hex"}},
    {"snapshot": {**CHAIN, "source": "ftp://x"}},
    {"snapshot": {**STAR, "unknown": 1}},
    {"snapshot": {**STAR, "size": -1}},
])
def test_replies_out_of_bounds_are_refused(bad):
    with pytest.raises(ValidationError):
        P.HeartbeatReply.model_validate({"state": "active", **bad})
    with pytest.raises(ValidationError):
        P.RolloutParams(group_size=8, max_new_tokens=4, temperature=1.0, top_p=0.0)


@pytest.mark.parametrize("url", [
    "", "http://127.0.0.1:8700", "http://198.51.100.7:8700/", "https://relay.example.org:443",
    "http://[2001:db8::1]:8700", "p2p:/ip4/10.0.0.2/tcp/4001/p2p/12D3KooWLRPJAA5o6kHLBNe5MAbSvA9bE6c5fhLiSNBGRxW6hVgQ",
])
def test_a_relay_url_is_an_address_and_a_port(url):
    assert P.parse(P.Report, {"relay_url": url}).relay_url == url


@pytest.mark.parametrize("url", [
    "http://169.254.169.254/latest/meta-data/",  # a path: the cloud metadata service
    "http://127.0.0.1:8650/v1/status?x=1",
    "http://user:pw@10.0.0.1:80",
    "http://10.0.0.1",  # no port
    "file:///etc/passwd", "gopher://10.0.0.1:70",
    "p2p:/ip4/10.0.0.2/tcp/4001/p2p/x/../../etc",
    "http://10.0.0.1:0", "http://10.0.0.1:65536/", "http://[2001:db8::1]:99999",  # nothing can connect there
    "p2p:/ip4/10.0.0.2/tcp/0/p2p/12D3KooWLRPJAA5o6kHLBNe5MAbSvA9bE6c5fhLiSNBGRxW6hVgQ",
    # digits of other scripts: stored as given, dialled at port 80, and urlsplit raises on them
    "http://127.0.0.21:\u0668\u0660", "http://127.0.0.21:\uff18\uff10", "http://\u0661\u0662\u0667.0.0.1:80",
    "p2p:/ip4/127.0.0.23/tcp/\u0668\u0660/p2p/12D3KooWLRPJAA5o6kHLBNe5MAbSvA9bE6c5fhLiSNBGRxW6hVgQ",
])
def test_a_relay_url_with_anything_else_is_refused(url):
    with pytest.raises(P.ProtocolError, match="relay_url"):
        P.parse(P.Report, {"relay_url": url})


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000, b'{"name": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                                 b"not json", b'{"name": "x"'])
def test_any_bad_json_body_is_a_protocol_error(raw):
    with pytest.raises(P.ProtocolError):
        P.parse_json(P.Report, raw)


def test_a_json_body_parses_as_its_model():
    assert P.parse_json(P.Report, b'{"name": "w1", "rollouts_per_s": 2.5}').name == "w1"
    assert P.parse_json(P.LeaseRequest, b"").max_prompts == 1
    assert P.parse_json(P.Report, b'{"rollouts_per_s": 2}').rollouts_per_s == 2.0  # an integer is a float


@pytest.mark.parametrize("raw", [b'{"max_prompts": "8"}', b'{"max_prompts": true}', b'{"max_prompts": 8.0}',
                                 b'{"max_prompts": 8.5}'])
def test_a_number_is_a_number(raw):
    """Lax mode took `"8"`, `true` and `8.0` for an integer (a tester, 2026-11-29): no honest
    client sends them, and each is refused, naming the field."""
    with pytest.raises(P.ProtocolError, match="max_prompts"):
        P.parse_json(P.LeaseRequest, raw)


@pytest.mark.parametrize("field", ["name", "gpu", "device", "engine"])
@pytest.mark.parametrize("text", ["evil\nquarantined honest (w1, 10.0.0.1)", "\x1b[2Jred", "a\rb", "tab\there", "c1\x9bx",
                                  "line\u2028sep", "\u202eevil-backwards", "zero\u200bwidth", "bom\ufeff",
                                  "cpu-a\u00ad-0", "arabic\u061cmark", "cpu-a-0\U000e0065\U000e0076\U000e0069\U000e006c"])
def test_a_report_with_control_characters_is_refused(field, text):
    """A worker's name and hardware strings reach the operator's log and terminal as they are: no
    control characters, and no invisible format ones (a line separator, a right-to-left override)."""
    with pytest.raises(P.ProtocolError, match=field):
        P.parse(P.Report, {field: text})
    assert P.parse(P.Report, {field: "RTX 4090 · node-7 (ünïcode ok)"})


def test_the_largest_honest_report_fits_half_its_body_limit():
    """A heartbeat (a `Report`) is refused past `Report.max_bytes` before it is parsed: pydantic
    checks a list's length only after validating every item, so a 240 KiB body of 120,000
    installs took 6.8 ms of the learner's loop to refuse. The largest report a worker can honestly
    send (every string at its limit, 64 installs, 16 link samples, 32 deliveries, numbers at their longest) fits
    in half of it."""
    import json

    from broadcast.links import LinkSample

    name = "n" * P.NAME_MAX
    installs = [{"version": 1 << 40, "installed_ago": 1234567.123456789, "received_ago": 1234567.123456789,
                 "install_s": 1234567.123456789} for _ in range(64)]
    links = [LinkSample(f"v{1 << 40}-d{(1 << 40) - 1}", 123456789.123, True, 123456789.123, True, "w" * 128).to_dict()
             for _ in range(16)]
    deliveries = [{"key": f"v{1 << 40}-d{(1 << 40) - 1}", "child": f"w{1 << 40}", "tree": 4096, "receipt": "f" * 32}
                  for _ in range(32)]
    report = P.Report(name=name, version=1 << 40, rollouts_per_s=1234.5678901234, capacity_per_s=1234.5678901234,
                      expected_rollouts_per_s=1234.5678901234, price_per_hour=9999.123456789, gpu=name, device=name,
                      engine=name, download_mbit=99999.123456789, upload_mbit=99999.123456789,
                      relay_url="http://" + "h" * 200 + ":65535/", rtt_ms=599999.123456789, installs=installs, links=links,
                      deliveries=deliveries)
    body = json.dumps(report.model_dump()).encode()
    assert len(body) <= P.Report.max_bytes // 2, len(body)
    assert P.Report.max_bytes < P.MAX_JSON_BYTES and P.LeaseRequest.max_bytes == P.MAX_JSON_BYTES


def test_a_relay_reports_no_more_deliveries_than_a_heartbeat_takes():
    from broadcast.relay import MAX_DELIVERIES

    field = P.Report.model_fields["deliveries"]
    assert any(getattr(m, "max_length", None) == MAX_DELIVERIES for m in field.metadata), field.metadata


def test_the_api_schema_in_the_docs_is_the_protocols():
    """A client written from the API alone had to learn `Report`'s and `LeaseRequest`'s fields
    from a real worker's traffic and from 400 messages (an API-only tester, 2026-12-07): the docs
    carry every body's JSON Schema, bounds included, regenerated with `python -m echo.protocol`."""
    import json
    from pathlib import Path

    from echo.protocol import json_schema

    shipped = json.loads((Path(__file__).resolve().parents[3] / "docs" / "api-schema.json").read_text())
    assert shipped == json.loads(json.dumps(json_schema())), \
        "docs/api-schema.json is stale: python -m echo.protocol > docs/api-schema.json"
    lease = shipped["$defs"]["LeaseRequest"]
    assert lease["additionalProperties"] is False and lease["properties"]["max_prompts"]["maximum"] == 1024
    assert {"Report", "JoinReply", "HeartbeatReply", "LeaseReply", "EvalSubmission", "ErrorReply"} <= set(shipped["$defs"])


def test_a_nan_wait_is_refused_as_not_finite():
    """`{"wait_s": NaN}` was refused as "less than or equal to 60" (an API-only tester)."""
    import pytest

    from echo.protocol import LeaseRequest

    with pytest.raises(Exception, match="finite number"):
        LeaseRequest.model_validate_json('{"wait_s": NaN}')
