"""A reward function that records which process called it (for the test that under ``rollout.placement: separate``
the generators score and the trainers never do): each call appends ``{"rank", "n"}`` (the launched world's rank and
the number of completions scored) as a JSON line to the file named by ``ALIGNKIT_TEST_REWARD_LOG``.

Use: ``reward.functions: [{name: "tests.plugins.recording_reward:characters", weight: 0.01}]``.
"""

from __future__ import annotations

import json
import os
from typing import Any


def characters(prompts: list[Any], completions: list[str], **_: Any) -> list[float]:
    """The completion's length in characters; the call is recorded (module docstring)."""
    with open(os.environ["ALIGNKIT_TEST_REWARD_LOG"], "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"rank": int(os.environ.get("RANK", "0")), "n": len(completions)}) + "\n")
    return [float(len(c)) for c in completions]
