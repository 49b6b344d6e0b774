"""XOR+zstd deltas: round trip, per-chunk choice, exact base, late joiner gets the full version."""

import numpy as np
import pytest

from broadcast.delta import BaseMismatch, decode, encode_delta, join_payloads
from broadcast.manifest import MIB, build_manifest
from broadcast.signing import ChunkCorrupt, verify_chunk

CHUNK = 1 * MIB


def weights(n_floats: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n_floats) * 0.02).astype(np.float32)


def update(w: np.ndarray, frac: float, seed: int = 1) -> np.ndarray:
    """Change `frac` of the elements by ~1% of their value (a synthetic optimizer step)."""
    rng = np.random.default_rng(seed)
    out = w.copy()
    idx = rng.random(w.size) < frac
    out[idx] *= (1 + 0.01 * rng.standard_normal(idx.sum())).astype(np.float32)
    return out


def test_delta_roundtrip_is_small_and_exact():
    base_w = weights(4 * CHUNK // 4 + 100)  # 4 chunks and a short tail
    new_w = update(base_w, 0.01)
    noise = np.random.default_rng(9).integers(0, 256, CHUNK, dtype=np.uint8).view(np.float32)
    new_w[CHUNK // 4: 2 * CHUNK // 4] = noise  # chunk 1 rewritten with random bits: incompressible
    base_m, full_m = build_manifest(base_w, 6, chunk_size=CHUNK), build_manifest(new_w, 7, chunk_size=CHUNK)
    delta_m, payloads = encode_delta(new_w, base_w, full_m, base_m)
    assert delta_m.key == "v7-d6" and delta_m.root == full_m.root
    assert [c.encoding for c in delta_m.chunks] == ["xor-zstd", "raw", "xor-zstd", "xor-zstd", "xor-zstd"]
    assert delta_m.wire_size < 0.35 * full_m.total_size
    wire = join_payloads(delta_m, payloads)
    for i in range(delta_m.num_chunks):
        verify_chunk(delta_m, i, delta_m.wire_view(wire, i))
    out = decode(delta_m, wire, base_w, base_m)
    assert bytes(out) == new_w.tobytes()
    # a raw version decodes to the wire buffer itself, no copy
    assert decode(full_m, new_w).obj is not None


def test_delta_needs_exact_base_and_late_joiner_gets_full():
    base_w = weights(2 * CHUNK // 4)
    new_w = update(base_w, 0.03)
    base_m, full_m = build_manifest(base_w, 1, chunk_size=CHUNK), build_manifest(new_w, 2, chunk_size=CHUNK)
    delta_m, payloads = encode_delta(new_w, base_w, full_m, base_m)
    wire = join_payloads(delta_m, payloads)
    with pytest.raises(BaseMismatch, match="fetch the full version v2"):
        decode(delta_m, wire, None, None)  # late joiner: no base
    older = build_manifest(weights(2 * CHUNK // 4, seed=5), 0, chunk_size=CHUNK)
    with pytest.raises(BaseMismatch, match="needs base v1"):
        decode(delta_m, wire, base_w, older)
    # right manifest, wrong bytes: caught chunk by chunk against the signed content hashes
    with pytest.raises(ChunkCorrupt, match="wrong base"):
        decode(delta_m, wire, weights(2 * CHUNK // 4, seed=5), base_m)
    # the late joiner path: the full version (key v2) installs with no base at all
    assert full_m.key == "v2" and full_m.root == delta_m.root
    assert bytes(decode(full_m, new_w)) == new_w.tobytes()


def test_delta_not_worth_it_returns_none():
    a, b = weights(CHUNK // 4, seed=1), weights(CHUNK // 4, seed=2)
    ma, mb = build_manifest(a, 1, chunk_size=CHUNK), build_manifest(b, 2, chunk_size=CHUNK)
    assert encode_delta(b, a, mb, ma) is None


@pytest.mark.parametrize("frac,floor", [(0.01, 15), (0.03, 8), (0.20, 2.5)])
def test_delta_ratio_on_synthetic_updates(frac, floor):
    base_w = weights(2 * CHUNK // 4)
    new_w = update(base_w, frac)
    base_m, full_m = build_manifest(base_w, 1, chunk_size=CHUNK), build_manifest(new_w, 2, chunk_size=CHUNK)
    delta_m, _ = encode_delta(new_w, base_w, full_m, base_m)
    assert full_m.total_size / delta_m.wire_size > floor
