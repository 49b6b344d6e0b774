"""The learner's metrics: Prometheus series at /metrics and one JSON line per step in the run log.

Metric names are grouped by concern (`echo_buffer_*`, `echo_off_policy_*`, `echo_workers_*`).
Reading them has no side effects.
"""

from __future__ import annotations

import json
import math
import numbers
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class LearnerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.version = Gauge("echo_learner_version", "Updates applied by the trainer", registry=r)
        self.published = Gauge("echo_published_version", "Newest published snapshot version", registry=r)
        self.accepted = Counter("echo_trajectories_accepted", "Groups accepted into the buffer", registry=r)
        self.rejected = Counter("echo_trajectories_rejected", "Uploads refused, by reason", ["reason"], registry=r)
        self.joins_refused = Counter("echo_joins_refused", "Joins refused, by reason (network, full, rate)", ["reason"],
                                     registry=r)
        self.auth_refused = Counter("echo_auth_refused", "Requests refused before they were served: a missing or "
                                    "wrong run token or worker credential, the run token for weights (weights-token), an "
                                    "address throttled for them, or a worker past its request rate (rate-limited)", ["credential"], registry=r)
        self.rewards_checked = Counter("echo_verify_rewards_checked", "Sample rewards the learner recomputed", registry=r)
        self.rewards_mismatched = Counter("echo_verify_rewards_mismatched", "Recomputed rewards that differed from "
                                          "the worker's claim", registry=r)
        self.flagged = Counter("echo_verify_flagged", "Verdicts against a worker, by evidence (rewards, logprobs)",
                               ["reason"], registry=r)
        self.quarantined = Counter("echo_workers_quarantined", "Workers quarantined, by evidence", ["reason"], registry=r)
        self.relays_probed = Counter("echo_broadcast_relays_probed", "Relay reachability probes at join, by result",
                                     ["result"], registry=r)
        self.claims_clamped = Counter("echo_verify_claims_clamped", "Heartbeat claims capped at what was measured "
                                      "or published, by what (capacity, upload, download, link-sample, version)",
                                      ["what"], registry=r)
        self.claims_checked = Counter("echo_verify_claims_checked", "Stale groups whose log-probs and tokens were "
                                      "checked against the very version they claim (`[verify] stale_check_fraction`)",
                                      registry=r)
        self.improbable_windows = Counter("echo_verify_improbable_windows", "Runs of tokens the policy gives at most "
                                          "e^-repeat_nats, from groups checked under the version that sampled them: "
                                          "first seen, or seen again (written, not sampled, by its third time)",
                                          ["seen"], registry=r)
        self.receipts = Counter("echo_broadcast_receipts", "Pushes relays reported their children took whole, by "
                                "the child's receipt: valid, none, or invalid (forged, or a child's garbage)",
                                ["receipt"], registry=r)
        self.queue = Gauge("echo_buffer_queue_groups", "Groups waiting in the buffer", registry=r)
        self.recycled = Gauge("echo_buffer_recycled_groups", "Groups dropped for exceeding max staleness", registry=r)
        self.overflow = Gauge("echo_buffer_overflow_groups", "Groups dropped by queue-drop's capacity", registry=r)
        self.uniform = Gauge("echo_buffer_skipped_uniform_groups",
                             "Groups of equal rewards not trained ([buffer] dynamic_sampling)", registry=r)
        self.staleness_avg = Gauge("echo_off_policy_staleness_avg", "Mean staleness of the last batch", registry=r)
        self.staleness_max = Gauge("echo_off_policy_staleness_max", "Max staleness of the last batch", registry=r)
        self.mismatch_kl = Gauge("echo_off_policy_mismatch_kl", "E_mu[log mu - log pi] of the last batch", registry=r)
        self.reward = Gauge("echo_reward_mean", "Mean reward of the last batch", registry=r)
        self.eval_accuracy = Gauge("echo_eval_accuracy", "Greedy eval accuracy (last evaluation)", registry=r)
        self.idle = Gauge("echo_learner_idle_ratio", "Fraction of wall time the trainer waited for data", registry=r)
        self.workers = Gauge("echo_workers_alive", "Workers heard from within the liveness window", registry=r)
        self.t_bcast = Gauge("echo_broadcast_seconds", "Learner-visible broadcast time of the last completed version", registry=r)
        self.link_mbit = Gauge("echo_broadcast_link_mbit", "Link estimate used for planning (Mbit/s): declared "
                               "until measured", ["peer", "direction"], registry=r)
        self.link_rtt = Gauge("echo_broadcast_link_rtt_ms", "Heartbeat round trip per worker (ms)", ["peer"], registry=r)
        self.leases_expired = Counter("echo_leases_expired", "Leases expired (their prompts re-issued)", registry=r)

    def links(self, table: dict) -> None:
        """Export `broadcast.links.LinkTable.to_dict()` (the learner's uplink is peer "learner").
        Only the peers in it now: a forgotten worker's series go (else every worker that ever
        joined stays in the exposition and in memory)."""
        self.link_mbit.clear()
        self.link_rtt.clear()
        self.link_mbit.labels("learner", "up").set(table["uplink"]["mbit"])
        for peer, link in table["peers"].items():
            self.link_mbit.labels(peer, "down").set(link["down"]["mbit"])
            self.link_mbit.labels(peer, "up").set(link["up"]["mbit"])
            if link["rtt_ms"] is not None:
                self.link_rtt.labels(peer).set(link["rtt_ms"])

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def strict(obj: Any) -> Any:
    """`obj` with numpy numbers as Python ones and every non-finite number as None: what
    `json.dumps` writes then is JSON (it wrote `Infinity` for an infeasible R_req, which strict
    parsers refuse, e.g. JavaScript's JSON.parse)."""
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        value = float(obj)
        return value if math.isfinite(value) else None
    return obj


def dumps(record: Any, **kwargs: Any) -> str:
    """Strict JSON of a record (`strict`)."""
    return json.dumps(strict(record), allow_nan=False, **kwargs)


class RunLog:
    """Append-only JSONL; one record per step plus events (`"event": ...`)."""

    def __init__(self, path: Path):
        self.path = path
        self._file = path.open("a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()
