"""How a step's samples are divided: across ranks by tokens, then into micro-batches that fit a
token budget. Plain functions of sequence lengths (no torch), deterministic, so every rank
computes every rank's share and nobody has to send it.
"""

from __future__ import annotations


def split_by_tokens(lengths: list[int], parts: int) -> list[list[int]]:
    """Indices of `lengths` in `parts` shares of nearly equal total length: longest first, each
    to the share with the fewest tokens so far (LPT: within 4/3 of the best split)."""
    shares: list[list[int]] = [[] for _ in range(parts)]
    totals = [0] * parts
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = min(range(parts), key=lambda k: (totals[k], k))
        shares[k].append(i)
        totals[k] += lengths[i]
    return [sorted(s) for s in shares]


def pack(lengths: list[int], budget: int, padded: bool = True) -> list[list[int]]:
    """Micro-batches of indices whose computed size (rows × longest sequence) stays within
    `budget`: padded, one sequence per row; packed, rows filled first-fit with as many
    sequences as fit in the longest one's width (`echo.hf.TokenBatch.pack` builds the same rows).

    Longest first, so each micro-batch's width is its own longest sequence; a sequence longer
    than the budget goes alone (it cannot be split without changing what the model sees).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    if not padded:
        room: list[int] = []  # the current micro-batch's rows: tokens left in each
        width = 0
        for i in order:
            k = next((k for k, r in enumerate(room) if lengths[i] <= r), None) if batches else None
            if k is not None:
                batches[-1].append(i)
                room[k] -= lengths[i]
            elif batches and (len(room) + 1) * width <= budget:
                batches[-1].append(i)
                room.append(width - lengths[i])
            else:
                batches.append([i])
                width, room = lengths[i], [0]
        return batches
    width = 0
    for i in order:
        if batches and (len(batches[-1]) + 1) * width <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
            width = lengths[i]
    return batches
