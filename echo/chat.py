"""Messages → token ids, token-exact across the turns of an episode.

The learner renders an episode's first messages (`first`); after every policy turn the worker
appends the environment's answer as the tokens `observation` gives, and never re-renders the
history: chat templates rewrite earlier turns (Qwen3 drops old `<think>` blocks), and π would
then score a context μ never saw. The learner's replay renders the same observations and
checks them token for token.

An observation is what the template would write after the end of an assistant turn: the
template rendered over a fixed two-message stub plus the new messages, cut after the stub's
end-of-turn token. So `<|im_end|>` (generated, the policy's) is followed by `\\n<|im_start|>user
…<|im_end|>\\n<|im_start|>assistant\\n` (the environment's), exactly as one rendering of the
whole conversation would read.

Without a chat template (`chat_template = "off"`, or a tokenizer that has none) messages are
their contents, concatenated: the first ones with the tokenizer's special tokens, later ones
without.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_STUB = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class ChatError(ValueError):
    """The tokenizer's chat template cannot render turns token-exactly; the message says why."""


class Chat:
    """How a run turns messages into tokens: `[task] chat_template`, `system_prompt` and
    `chat_template_kwargs` (e.g. `{enable_thinking = false}` for Qwen3)."""

    def __init__(self, tokenizer, chat_template: str = "auto", system_prompt: str = "",
                 template_kwargs: dict[str, Any] | None = None, stop_ids: Iterable[int] = ()):
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if chat_template == "on" and not has_template:
            raise ValueError("[task] chat_template = 'on' but the tokenizer has no chat template; "
                             "use 'auto' or 'off', or add one to tokenizer_config.json / chat_template.jinja")
        self.tokenizer, self.system_prompt = tokenizer, system_prompt
        self.kwargs = dict(template_kwargs or {})
        self.templated = chat_template == "on" or (chat_template == "auto" and has_template)
        self.stop_ids = frozenset(stop_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        self._cut: int | None = None  # where the stub's assistant turn ends (computed once)

    def __call__(self, text: str) -> list[int]:
        """A one-turn prompt: `text` as the user's message."""
        return self.first([{"role": "user", "content": text}])

    def first(self, messages: list[dict[str, str]]) -> list[int]:
        """The episode's opening messages, ending where the policy starts its first turn."""
        if not self.templated:
            return list(self.tokenizer("".join(m["content"] for m in messages))["input_ids"])
        if self.system_prompt and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return self._render(messages, generation_prompt=True)

    def observation(self, messages: list[dict[str, str]]) -> list[int]:
        """The environment's answer after a policy turn: what follows the turn's end token."""
        if not self.templated:
            return list(self.tokenizer("".join(m["content"] for m in messages), add_special_tokens=False)["input_ids"])
        base = self._render(_STUB, generation_prompt=False)
        if self._cut is None:
            ends = [i for i, t in enumerate(base) if t in self.stop_ids]
            if not ends:
                raise ChatError("the chat template ends an assistant turn with none of the end-of-turn ids "
                                f"{sorted(self.stop_ids)}; add its end token to generation_config.json's eos_token_id")
            self._cut = ends[-1] + 1
        full = self._render(_STUB + list(messages), generation_prompt=True)
        if full[: self._cut] != base[: self._cut]:
            raise ChatError("the chat template renders earlier turns differently once more messages follow; "
                            "episodes cannot be appended token-exactly with it")
        return full[self._cut :]

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                                 **self.kwargs)
        return list(out["input_ids"] if hasattr(out, "keys") else out)


def stop_ids(tokenizer, model_dir: Path | str | None, stop_tokens: Iterable[str] = ()) -> list[int]:
    """Every id that ends a turn: the generation config's `eos_token_id` (an id or a list: Qwen's
    `<|im_end|>` is one, and not the tokenizer's eos), the tokenizer's eos, and the task's own."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    path = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if path is not None and path.exists():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids.update(int(i) for i in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    for token in stop_tokens:
        tid = tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == tokenizer.unk_token_id:
            raise ChatError(f"the task's stop token {token!r} is not one token of this tokenizer")
        ids.add(int(tid))
    return sorted(ids)
