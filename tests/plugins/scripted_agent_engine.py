"""A rollout engine that plays a calculator agent by script, whatever the model (for tests of the agent rollout
that must not depend on sampling): for a prompt whose last message is the question, the k-th copy of it in one
call calls the calculator when k is even and guesses a wrong number when k is odd; after a tool result it answers
with that result. So a group holds successes and failures (nonzero advantages), and the same prompts give the same
trajectories on one process or split over ranks (each group within one rank).

Use: ``plugins: [tests.plugins.scripted_agent_engine]``, ``rollout.engine: scripted_agent``.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from torch import nn

from alignkit.rollout.engine import Generations, HFEngine, Prompt, SamplingParams, as_prompts, register_engine

_QUESTION = re.compile(r"What is (\d+)\*(\d+)\?")
_RESULT = re.compile(r"tool\n(-?\d+)")


@register_engine("scripted_agent")
class ScriptedAgentEngine(HFEngine):
    @classmethod
    def from_settings(cls, tokenizer: Any, settings: Any = None, run: Any = None) -> ScriptedAgentEngine:
        return cls(tokenizer)

    def generate(self, model: nn.Module, prompts: Sequence[Prompt] | Sequence[list[int]], params: SamplingParams,
                 *, synced: bool = False, progress: str | None = None) -> Generations:
        seen: Counter = Counter()
        out = []
        for p in as_prompts(prompts):
            text = self.tokenizer.decode(p.ids)
            k = seen[text]
            seen[text] += 1
            out.append(self.encode(self.reply(text, k))[: params.max_new_tokens])
        reasons = ["stop" if ids and ids[-1] in self.eos else "length" for ids in out]
        return Generations(out, reasons, self.tokenizer.batch_decode(out, skip_special_tokens=True))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [min(self.eos)]

    @staticmethod
    def reply(text: str, k: int) -> str:
        results = _RESULT.findall(text)
        if results:
            return results[-1]
        a, b = _QUESTION.findall(text)[-1]
        if k % 2:
            return str(int(a) * int(b) + 1)
        return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}) + \
            "</tool_call>"
