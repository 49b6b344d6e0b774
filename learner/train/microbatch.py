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


def pack(lengths: list[int], budget: int) -> list[list[int]]:
    """Micro-batches of indices whose padded size (rows × longest row) stays within `budget`.

    Rows are taken longest first, so each micro-batch pads to its own longest row; a row longer
    than the budget goes alone (it cannot be split without changing what the model sees).
    """
    batches: list[list[int]] = []
    width = 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if batches and (len(batches[-1]) + 1) * width <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
            width = lengths[i]
    return batches
