"""Prompt sets of the online algorithms: rows ``{"prompt": ..., <any other fields>}``.

``prompt`` is a string (rendered with the tokenizer's chat template as one user turn, exactly as SFT
renders it, when the tokenizer has a template) or a message list. Every other field of the row
(``answer``, ...) travels with the prompt to the reward functions. A prompt longer than
``data.max_length - rollout.max_new_tokens`` tokens keeps its last tokens and is counted.

The rows come from files, ``load_from_disk`` folders or Hub names (``openai/gsm8k`` with ``data.train_config:
main``); ``data.prompt_column`` names the prompt's column when it is not ``prompt`` (GSM8K: ``question``), and
``data.system_prompt`` puts a system turn before each string prompt.
"""

from __future__ import annotations

from typing import Any

from alignkit.config.schema import DataConfig
from alignkit.data.io import Row, RowCounts, convert_rows, read_rows, require_field, require_messages
from alignkit.data.sources import open_typed, resolve_source
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
        #: fields every row needs besides the prompt (an agent environment's ``row_fields``): checked per row
        self.required: tuple[str, ...] = ()

    def convert(self, row: Row) -> dict[str, Any]:
        column = self.cfg.prompt_column
        prompt = require_field(row, column)
        for name in self.required:
            require_field(row, name)
        if isinstance(prompt, list):
            prompt = require_messages(row, column)
        elif not isinstance(prompt, str) or not prompt.strip():
            raise DataError(f"{row.where(column)}: expected a non-empty string or a list of messages")
        try:
            text = prompt_text(self.tokenizer, self._with_system(prompt))
        except DataError as e:
            raise DataError(f"{row.where(column)}: {e}") from None
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > self.max_prompt:
            ids = ids[-self.max_prompt :]
            row.note(PROMPT_TRUNCATED, warn=True)
        fields = {k: v for k, v in row.data.items() if k != column}
        return {"prompt": prompt, "prompt_ids": ids, "fields": fields}

    def _with_system(self, prompt: str | list[dict[str, str]]) -> str | list[dict[str, str]]:
        system = self.cfg.system_prompt
        if system is None or not isinstance(prompt, str):
            return prompt
        if getattr(self.tokenizer, "chat_template", None):
            return [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
        return f"{system}\n\n{prompt}"

    def _reader(self, split: str) -> Any:
        """Rows of a file, a ``load_from_disk`` folder or a Hub name, with the split's data.*_split / *_config."""
        s, c = (self.cfg.train_split, self.cfg.train_config) if split == "train" else \
            (self.cfg.eval_split, self.cfg.eval_config)

        def read(spec: str, on_bad: Any = None) -> list[Row]:
            src = resolve_source(spec, split=s, config=c)
            if src.kind not in ("folder", "hub"):
                return read_rows(spec, on_bad=on_bad)
            return [Row(dict(r), src.name, i) for i, r in enumerate(open_typed(src), start=1)]

        return read

    def build_dataset(self, specs: list[str], split: str) -> list[dict[str, Any]]:
        limit = self.cfg.max_train_examples if split == "train" else self.cfg.max_eval_examples
        examples, counts = convert_rows(specs, self.convert, skip_invalid=self.cfg.skip_invalid, limit=limit,
                                        read=self._reader(split))
        self.row_counts[split], self.skipped[split] = counts, counts.total_dropped
        return examples
