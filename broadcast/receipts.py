"""Receipts: a child's proof, to the learner, that a relay's push reached it whole.

The learner sees who pulls from its source, not what relays pushed to each other, so a child
that took its parent's push and then pulled anyway had the parent blamed for forwarding nothing
(`broadcast.forwarding`): a tail pulling one chunk of each version demoted two honest relays 44
times over 1,000 versions (a tester, 2026-11-28). Now a relay answers a push it took whole with
a receipt, an HMAC over (version key, tree, sender, itself) keyed by the hash of its own
credential's secret, which the learner holds and its parent does not. The parent reports the
receipts it got (`echo.protocol.Delivery`), and a child that pulls what it gave a receipt for is
blamed itself, as one that acknowledged the source's own push is.

A child that withholds its receipt leaves its parent only its word, which the learner weighs
against the child's pull as a dispute (`broadcast.forwarding`).
"""

from __future__ import annotations

import hashlib
import hmac
import json

RECEIPT_CONTEXT = b"echo-receipt-v1\0"
RECEIPT_CHARS = 32  # hex: 128 bits of the HMAC-SHA256


def receipt_key(secret: str) -> bytes:
    """The key a worker signs its receipts with: the hash of its credential's secret (what the
    learner keeps of it, `learner.api.http.secret_hash`)."""
    return hashlib.sha256(secret.encode()).digest()


def receipt(key: bytes, version_key: str, tree: int, sender: str, holder: str) -> str:
    """`holder`'s receipt for tree `tree` of `version_key`, pushed to it whole by `sender`."""
    message = RECEIPT_CONTEXT + json.dumps([version_key, tree, sender, holder]).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()[:RECEIPT_CHARS]


def valid(key: bytes, presented: str, version_key: str, tree: int, sender: str, holder: str) -> bool:
    return bool(key) and len(presented) == RECEIPT_CHARS and hmac.compare_digest(
        presented, receipt(key, version_key, tree, sender, holder))
