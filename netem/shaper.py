"""A userspace token bucket for asyncio: the rate limit to use where tc is not available.

    up = TokenBucket.mbit(200)               # 200 Mbit/s, ~10 ms of burst
    await write_shaped(writer, payload, up)  # sends at most 200 Mbit/s on average

One bucket may be shared by many streams (a host's uplink shared by its flows); waiters are
served in the order they asked, because each reserves its bytes before it sleeps.
"""

from __future__ import annotations

import asyncio
import time

_MIN_BURST = 64 * 1024


class TokenBucket:
    """Tokens (bytes) refill at `rate` per second up to `burst`; `consume(n)` waits for `n`.

    Invariant: `tokens <= burst`. Tokens may go negative: that is bytes already promised to
    waiters, who sleep until the refill has paid for them, so a request larger than the burst
    is fine and the long-run rate is exact.
    """

    def __init__(self, rate_bytes_per_s: float, burst_bytes: int | None = None) -> None:
        if rate_bytes_per_s <= 0:
            raise ValueError(f"rate must be > 0 bytes/s, got {rate_bytes_per_s}")
        self.rate = float(rate_bytes_per_s)
        # A 10 ms burst keeps the pacing smooth without letting a sender jump far ahead.
        self.burst = int(burst_bytes if burst_bytes is not None else max(_MIN_BURST, self.rate * 0.01))
        if self.burst <= 0:
            raise ValueError(f"burst must be > 0 bytes, got {self.burst}")
        self._tokens = float(self.burst)
        self._stamp = time.monotonic()

    @classmethod
    def mbit(cls, mbit_per_s: float, burst_bytes: int | None = None) -> TokenBucket:
        """A bucket for a link of `mbit_per_s` megabits (10^6 bits) per second."""
        return cls(mbit_per_s * 1e6 / 8, burst_bytes)

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    async def consume(self, n: int) -> None:
        """Wait until `n` bytes may be sent at this rate, then return."""
        if n < 0:
            raise ValueError(f"cannot consume a negative number of bytes ({n})")
        self._refill()
        self._tokens -= n
        if self._tokens < 0:
            await asyncio.sleep(-self._tokens / self.rate)


async def write_shaped(
    writer: asyncio.StreamWriter, data: bytes | memoryview, bucket: TokenBucket, chunk: int = _MIN_BURST
) -> None:
    """Write `data` in pieces of at most `chunk` bytes, each paid for by `bucket`, with drain."""
    view = memoryview(data)
    for start in range(0, len(view), chunk):
        piece = view[start : start + chunk]
        await bucket.consume(len(piece))
        writer.write(piece)
        await writer.drain()


async def read_shaped(reader: asyncio.StreamReader, n: int, bucket: TokenBucket) -> bytes:
    """Read up to `n` bytes, then pay for them; TCP flow control slows a faster sender down."""
    data = await reader.read(n)
    await bucket.consume(len(data))
    return data
