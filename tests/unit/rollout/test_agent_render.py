"""Token in, token out (issue 48, B): a trajectory is the policy's ids as generated plus the chat template's
rendering of each environment reply (``MessageRenderer.reply_ids``), never a re-tokenisation of the history.

What the tests show, for the shipped tiny tokenizer (ChatML) and a Qwen2.5-style template written into it:

* when the policy's ids happen to be the tokenizer's own encoding of its text, the trajectory equals the
  rendering of the whole conversation, token for token (plus the final separator the policy never writes);
* when they are not (a model may well sample "5", "6", "0" where the tokenizer would write "560"), re-rendering
  the whole conversation gives OTHER ids for that turn than the ones the policy sampled, and their log-probs,
  while the trajectory keeps the sampled ones: trust the trajectory;
* the naive delta, ``render(history + new)`` minus ``render(history)``, drops the newline the template puts
  after the assistant's end-of-turn (part of the assistant message, never generated): the Qwen bug of verl
  #6719 / #6501. The anchor method keeps it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from alignkit.rollout.agents.calculator import CalculatorEnv
from alignkit.rollout.agents.render import MessageRenderer

# Qwen2.5-Instruct's chat template (tools in the system prompt, tool results as <tool_response> in a user turn),
# as written in its tokenizer_config.json, reproduced here without a download
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.' }}{%- endif %}{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user "
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "347*829"}}</tool_call>'
USER = {"role": "user", "content": "What is 347*829?"}


@pytest.fixture(scope="module", params=["chatml", "qwen2.5"])
def tokenizer(request: pytest.FixtureRequest, micro_model: Path) -> Any:
    tok = AutoTokenizer.from_pretrained(micro_model)
    if request.param == "qwen2.5":
        tok.chat_template = QWEN25_TEMPLATE
    return tok


def encode(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def piecewise(tok: Any, text: str) -> list[int]:
    """``text`` as a policy might sample it: one character at a time (valid ids, not the tokenizer's choice)."""
    return [i for ch in text for i in encode(tok, ch)]


def conversation(renderer: MessageRenderer, turns: list[list[int]]) -> tuple[list[int], list[dict[str, str]]]:
    """Two policy turns (a call, then the answer) with the calculator's reply between them, token in, token out."""
    tok = renderer.tokenizer
    ids, messages = renderer.prompt_ids([USER]), [USER]
    texts = [tok.decode(t, skip_special_tokens=True) for t in turns]
    ids += turns[0]
    tool = [{"role": "tool", "content": "287663"}]
    ids += renderer.reply_ids(tool, turns[0])
    ids += turns[1]
    messages += [{"role": "assistant", "content": texts[0]}, *tool, {"role": "assistant", "content": texts[1]}]
    return ids, messages


def test_trajectory_equals_whole_render_when_the_policy_writes_canonical_ids(tokenizer: Any) -> None:
    r = MessageRenderer(tokenizer, CalculatorEnv().schemas())
    eos = tokenizer.eos_token_id
    ids, messages = conversation(r, [encode(tokenizer, CALL) + [eos], encode(tokenizer, "287663") + [eos]])
    whole = encode(tokenizer, r.render(messages, generation_prompt=False))
    assert ids + encode(tokenizer, r.separator) == whole
    assert r.separator == "\n"
    if tokenizer.chat_template == QWEN25_TEMPLATE:  # Qwen puts tool results in a user turn, tools in the system
        assert "<|im_start|>user\n<tool_response>\n287663\n</tool_response>" in tokenizer.decode(ids)
        assert '"name": "calculator"' in tokenizer.decode(ids[:20 + len(r.prompt_ids([USER]))])


def test_reretokenising_changes_the_sampled_ids(tokenizer: Any) -> None:
    r = MessageRenderer(tokenizer, CalculatorEnv().schemas())
    eos = tokenizer.eos_token_id
    sampled = piecewise(tokenizer, CALL) + [eos]
    assert sampled != encode(tokenizer, CALL) + [eos]  # the tokenizer merges what the policy sampled apart
    ids, messages = conversation(r, [sampled, encode(tokenizer, "287663") + [eos]])
    whole = encode(tokenizer, r.render(messages, generation_prompt=False))
    assert tokenizer.decode(ids) + r.separator == tokenizer.decode(whole)  # the same text ...
    assert ids + encode(tokenizer, r.separator) != whole  # ... but other ids than the policy sampled
    start = len(r.prompt_ids([USER]))
    first = next(i for i, (a, b) in enumerate(zip(ids, whole)) if a != b)
    assert start <= first < start + len(sampled)  # they part inside the policy's turn, not in the template's text
    assert ids[start:start + len(sampled)] == sampled  # the trajectory keeps what was sampled


def test_naive_history_delta_drops_the_separator(tokenizer: Any) -> None:
    r = MessageRenderer(tokenizer, CalculatorEnv().schemas())
    eos = tokenizer.eos_token_id
    turn = encode(tokenizer, CALL) + [eos]
    history = [USER, {"role": "assistant", "content": CALL}]
    tool = [{"role": "tool", "content": "287663"}]
    before = r.render(history, generation_prompt=False)
    after = r.render(history + tool, generation_prompt=True)
    naive = r.prompt_ids([USER]) + turn + encode(tokenizer, after[len(before):])
    ours = r.prompt_ids([USER]) + turn + r.reply_ids(tool, turn)
    truth = encode(tokenizer, after)
    assert ours == truth
    assert naive != truth and len(naive) == len(truth) - 1  # one id short: the separator newline
    assert "<|im_end|><|im_start|>" in tokenizer.decode(naive) and "<|im_end|><|im_start|>" not in tokenizer.decode(ours)


def test_a_cut_turn_is_closed_by_the_environment(tokenizer: Any) -> None:
    """A turn cut by max_new_tokens has no eos: the reply starts with the whole turn end (environment ids)."""
    r = MessageRenderer(tokenizer, None)
    cut = encode(tokenizer, CALL)[:5]
    reply = r.reply_ids([{"role": "tool", "content": "x"}], cut)
    assert tokenizer.decode(reply).startswith("<|im_end|>\n<|im_start|>")
    assert tokenizer.decode(reply).endswith("<|im_start|>assistant\n")
