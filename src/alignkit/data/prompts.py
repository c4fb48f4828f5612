"""Prompt sets of the online algorithms: rows ``{"prompt": ..., <any other fields>}``.

``prompt`` is a string (rendered with the tokenizer's chat template as one user turn, exactly as SFT
renders it, when the tokenizer has a template) or a message list. Every other field of the row
(``answer``, ...) travels with the prompt to the reward functions. A prompt longer than
``data.max_length - rollout.max_new_tokens`` tokens keeps its last tokens and is counted.
"""

from __future__ import annotations

from typing import Any

from alignkit.config.schema import DataConfig
from alignkit.data.io import Row, RowCounts, convert_rows, require_field, require_messages
from alignkit.errors import DataError

PROMPT_TRUNCATED = "prompt truncated to data.max_length - rollout.max_new_tokens (its first tokens dropped)"


def prompt_text(tokenizer: Any, prompt: str | list[dict[str, str]]) -> str:
    """A prompt as the model sees it: chat template with the assistant turn opened, if there is one."""
    if getattr(tokenizer, "chat_template", None):
        msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    if isinstance(prompt, list):
        raise DataError("message-list prompts need a tokenizer with a chat template")
    return prompt


class PromptData:
    """Rows -> ``{"prompt": as written, "prompt_ids": [...], "fields": {other fields}}``."""

    def __init__(self, tokenizer: Any, cfg: DataConfig, *, max_new_tokens: int) -> None:
        self.tokenizer, self.cfg = tokenizer, cfg
        self.max_prompt = cfg.max_length - max_new_tokens
        if self.max_prompt < 1:
            raise DataError(f"data.max_length ({cfg.max_length}) leaves no room for a prompt next to "
                            f"rollout.max_new_tokens ({max_new_tokens})")
        self.skipped: dict[str, int] = {}
        self.row_counts: dict[str, RowCounts] = {}

    def convert(self, row: Row) -> dict[str, Any]:
        prompt = require_field(row, "prompt")
        if isinstance(prompt, list):
            prompt = require_messages(row, "prompt")
        elif not isinstance(prompt, str) or not prompt.strip():
            raise DataError(f"{row.where('prompt')}: expected a non-empty string or a list of messages")
        try:
            text = prompt_text(self.tokenizer, prompt)
        except DataError as e:
            raise DataError(f"{row.where('prompt')}: {e}") from None
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > self.max_prompt:
            ids = ids[-self.max_prompt :]
            row.note(PROMPT_TRUNCATED, warn=True)
        fields = {k: v for k, v in row.data.items() if k != "prompt"}
        return {"prompt": prompt, "prompt_ids": ids, "fields": fields}

    def build_dataset(self, specs: list[str], split: str) -> list[dict[str, Any]]:
        limit = self.cfg.max_train_examples if split == "train" else self.cfg.max_eval_examples
        examples, counts = convert_rows(specs, self.convert, skip_invalid=self.cfg.skip_invalid, limit=limit)
        self.row_counts[split], self.skipped[split] = counts, counts.total_dropped
        return examples
