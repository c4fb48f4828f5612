"""Token in, token out: the environment's new messages as token ids, appended after the policy's own tokens.

A trajectory is the prompt's ids, then per turn the ids the policy generated (kept exactly) and the ids of the
environment's reply; the history is never re-tokenised. The reply's ids are the chat template's rendering of the
NEW messages alone, taken as a text suffix against a fixed anchor conversation (a user message and an assistant
message whose content is a sentinel, with the run's ``tools=``):

    anchor = render([user, assistant(SENTINEL)])
    full   = render([user, assistant(SENTINEL), *new], add_generation_prompt=True)
    reply  = close + full[len(anchor):]

``close`` is what the template writes after an assistant message's content that the policy did not generate: the
template's turn end (``<|im_end|>\n`` in ChatML) minus the eos the policy stopped on (``<|im_end|>``), i.e. the
separator newline. Taking the suffix of ``render(history + new)`` against ``render(history)`` instead would drop
that newline (it is part of the assistant message's rendering, and the policy never wrote it): the bug reported
for Qwen in verl #6719 / #6501. A template that does not extend the anchor (not prefix-preserving, e.g. one that
rewrites earlier turns) is refused at construction with a message, rather than trained on silently.
"""

from __future__ import annotations

from typing import Any

from alignkit.errors import ConfigError

_SENTINEL = "\u2063sentinel\u2063"
_ANCHOR = [{"role": "user", "content": "anchor"}, {"role": "assistant", "content": _SENTINEL}]


class MessageRenderer:
    """Renders a conversation's opening and the environment's replies to token ids with ``tokenizer``'s chat
    template and ``tools`` (JSON schemas, or None)."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("agent: multi-turn rollouts need a tokenizer with a chat template (data.chat_template)")
        self.tokenizer, self.tools = tokenizer, tools
        self.anchor = self.render(_ANCHOR, generation_prompt=False)
        after = self.anchor[self.anchor.rindex(_SENTINEL) + len(_SENTINEL):]
        eos = tokenizer.eos_token or ""
        #: the template's turn end after the content; ``_separator``: the part of it after the policy's eos
        self.turn_end = after
        self.separator = after[len(eos):] if eos and after.startswith(eos) else None
        probe = self.render([*_ANCHOR, {"role": "tool", "content": "x"}], generation_prompt=True)
        if not probe.startswith(self.anchor):
            raise ConfigError("agent: the chat template does not render a conversation as a prefix of its "
                              "continuation, so an environment reply cannot be appended token in, token out")

    def render(self, messages: list[dict[str, Any]], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The opening conversation with the assistant turn opened (what the policy continues)."""
        return self.encode(self.render(messages, generation_prompt=True))

    def reply_ids(self, messages: list[dict[str, Any]], policy_ids: list[int]) -> list[int]:
        """The ids that follow a policy turn (``policy_ids``, as generated) when the environment answers with
        ``messages``: the rest of the assistant turn's end the policy did not write (the separator after its eos;
        the whole turn end when it stopped without one, e.g. cut by max_new_tokens), the new messages, and the
        next assistant turn's opening."""
        full = self.render([*_ANCHOR, *messages], generation_prompt=True)
        stopped = bool(policy_ids) and policy_ids[-1] == self.tokenizer.eos_token_id
        close = self.separator if stopped and self.separator is not None else self.turn_end
        return self.encode(close + full[len(self.anchor):])
