"""echo.hf.sample against the installed transformers: no deprecated argument on the way.

transformers 5.x renamed the KV cache's argument (`past_key_values` -> `cache`, the old name
removed in 5.40): sampling passed the old one, which warned on every decoding step of every
episode of a poker run and will stop working at the removal.
"""

from __future__ import annotations

import logging
import warnings

import torch

from echo.hf import sample
from learner.tinymodel import build_model, build_tokenizer


def test_sampling_uses_no_deprecated_cache_argument(caplog):
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, hidden=32, layers=1, heads=2).eval()
    prompt = tokenizer("1+2=", add_special_tokens=False)["input_ids"]
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING):
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        with torch.no_grad():
            out = sample(model, [prompt, prompt], max_new_tokens=4, stop_ids=tokenizer.eos_token_id,
                         pad_id=tokenizer.pad_token_id, generator=torch.Generator().manual_seed(0))
    assert len(out) == 2 and all(1 <= len(s.tokens) <= 4 for s in out)
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()], caplog.text
