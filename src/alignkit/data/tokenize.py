"""Text / chat -> token ids plus a loss mask (1 where the model is trained to predict)."""

from __future__ import annotations

from typing import Any

from alignkit.data.io import DataError, Row


def _ids(tokenizer: Any, text: str, *, add_special_tokens: bool = False,
         memo: dict[str, list[int]] | None = None) -> list[int]:
    """Token ids of ``text``; ``memo`` (text -> ids) skips texts already tokenised for the same row:
    a chat's renderings repeat (the whole chat is also its last prefix; the prompt prefix is shared by
    both sides of a pair), and tokenising is most of the cost of preparing a data set."""
    if memo is not None and text in memo:
        return memo[text]
    ids = list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    if memo is not None:
        memo[text] = ids
    return ids


def render_chat(tokenizer: Any, messages: list[dict[str, str]], *, add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def encode_chat(tokenizer: Any, messages: list[dict[str, str]], row: Row,
                memo: dict[str, list[int]] | None = None) -> tuple[list[int], list[int]]:
    """Tokens of the whole chat and a mask that is 1 on assistant turns (their end token included).

    Assistant spans are found by rendering the template on prefixes of the chat: the tokens
    between ``template(messages[:i], add_generation_prompt=True)`` and
    ``template(messages[:i+1])`` belong to assistant message i. This works for any template
    whose rendering of a prefix is a prefix of the rendering of the whole chat, which we check.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{row.where('messages')}: the tokenizer has no chat template; use prompt/completion rows")
    memo = {} if memo is None else memo
    ids = _ids(tokenizer, render_chat(tokenizer, messages), memo=memo)
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = (_ids(tokenizer, render_chat(tokenizer, messages[:i], add_generation_prompt=True), memo=memo)
                  if i else [])
        through = _ids(tokenizer, render_chat(tokenizer, messages[: i + 1]), memo=memo)
        if ids[: len(through)] != through or through[: len(before)] != before:
            raise DataError(
                f"{row.where('messages')}: the chat template does not render prefixes consistently, "
                "so assistant tokens cannot be located"
            )
        for j in range(len(before), len(through)):
            mask[j] = 1
    return ids, mask


def encode_prompt_completion(tokenizer: Any, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """Plain text: prompt (with the tokenizer's own special prefix, e.g. BOS) then completion + EOS."""
    p = _ids(tokenizer, prompt, add_special_tokens=True)
    c = _ids(tokenizer, completion)
    if tokenizer.eos_token_id is not None:
        c.append(tokenizer.eos_token_id)
    return p + c, [0] * len(p) + [1] * len(c)


def encode_prompt_response(tokenizer: Any, prompt: Any, response: Any, row: Row,
                           memo: dict[str, list[int]] | None = None) -> tuple[list[int], list[int]]:
    """A (prompt, response) pair as strings or as message lists; mask = 1 on the response.

    Message lists go through the chat template; plain strings are concatenated (with EOS). ``memo``:
    see :func:`_ids` (one per row).
    """
    if isinstance(prompt, list) or isinstance(response, list):
        msgs = (prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]) + (
            response if isinstance(response, list) else [{"role": "assistant", "content": response}]
        )
        n_prompt = len(prompt) if isinstance(prompt, list) else 1
        memo = {} if memo is None else memo
        ids, mask = encode_chat(tokenizer, msgs, row, memo)
        # only the response turns are trained, not assistant turns inside the prompt
        prefix = _ids(tokenizer, render_chat(tokenizer, msgs[:n_prompt], add_generation_prompt=True), memo=memo)
        return ids, [0] * len(prefix) + mask[len(prefix) :]
    return encode_prompt_completion(tokenizer, prompt, response)
