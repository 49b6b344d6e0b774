"""The one table printer of the benchmarks: right-aligned columns under a rule."""

from __future__ import annotations

from typing import Any, Sequence


def fmt(v: Any, spec: str = ".1f") -> str:
    """A cell: `-` for None, numbers by `spec`, anything else as text."""
    return "-" if v is None else format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    cells = [list(header)] + [list(r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  " + "  ".join("-" * w for w in widths))
    return "\n".join(lines)
