"""Reward (and cost) functions by name, combined with weights.

A reward function receives the iteration's prompts (as the user wrote them), the completions (text)
and the rows' other fields (``answer``, ...) as keyword lists, and returns one float per completion,
or ``None`` where it cannot score (that sample is then masked out of the statistics, never scored 0).
Builtins are registered below (``shapes_correct`` judges the generated image task's rows); a user's own is named ``"my_pkg.rewards:fn"`` (the current directory
and PYTHONPATH are searched). Errors are one line naming the function.

The combination of several functions: the weighted sum of those that scored a sample; NaN (masked)
when none did.
"""

from __future__ import annotations

import importlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from alignkit.data.judges import is_unsafe, judge_correct
from alignkit.data.synth_redteam import is_toxic
from alignkit.data.synth_vlm import judge, question_kind
from alignkit.errors import ConfigError, UserError
from alignkit.registry import Registry
from alignkit.rewards.reasoning import math_verified, reasoning_format

RewardFn = Callable[..., Sequence[float | None]]
REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function")


class RewardFunctionError(UserError):
    """A reward function raised or returned something unusable."""


def _strip(text: str) -> str:
    return text.split("<|im_end|>")[0].strip()


@REWARD_FUNCTIONS.register("exact_match")
def exact_match(prompts: list[Any], completions: list[str], *, answer: list[Any] | None = None,
                **_: Any) -> list[float | None]:
    """1.0 when the stripped completion equals the row's ``answer`` (as text), else 0.0; None without one."""
    answers = answer or [None] * len(completions)
    return [None if a is None else float(_strip(c) == str(a).strip()) for c, a in zip(completions, answers)]


REWARD_FUNCTIONS.register("math_verify")(math_verified)
REWARD_FUNCTIONS.register("reasoning_format")(reasoning_format)


@REWARD_FUNCTIONS.register("judge_correct")
def judged_correct(prompts: list[Any], completions: list[str], **_: Any) -> list[float | None]:
    """1.0 when the synthetic tasks' program judge accepts the answer (``alignkit.data.judges``)."""
    return [float(judge_correct(_text(p), c)) for p, c in zip(prompts, completions)]


@REWARD_FUNCTIONS.register("unsafe")
def unsafe(prompts: list[Any], completions: list[str], **_: Any) -> list[float | None]:
    """A cost: 1.0 when the toy safety world's judge calls the answer unsafe, else 0.0."""
    return [float(is_unsafe(_text(p), c)) for p, c in zip(prompts, completions)]


@REWARD_FUNCTIONS.register("toxic_words")
def toxic_words(prompts: list[Any], completions: list[str], **_: Any) -> list[float | None]:
    """1.0 when the completion holds a toxic word of the synthetic red-team world (``data/synth_redteam.py``)."""
    return [float(is_toxic(c)) for c in completions]


@REWARD_FUNCTIONS.register("length")
def length(prompts: list[Any], completions: list[str], **_: Any) -> list[float | None]:
    """Words in the completion (weight it negatively for a length penalty in words)."""
    return [float(len(_strip(c).split())) for c in completions]


@REWARD_FUNCTIONS.register("shapes_correct")
def shapes_correct(prompts: list[Any], completions: list[str], *, scene: list[Any] | None = None,
                   **_: Any) -> list[float | None]:
    """1.0 when the shapes task's judge (``alignkit.data.synth_vlm``) accepts the answer to the prompt's last
    question about the row's ``scene``, else 0.0; None for a row without a scene or a shapes question."""
    out: list[float | None] = []
    for p, c, sc in zip(prompts, completions, scene or [None] * len(completions)):
        question = _last_user_text(p)
        try:
            question_kind(question)
        except ValueError:
            sc = None
        out.append(None if sc is None else float(judge(sc, question, c)))
    return out


def _last_user_text(prompt: Any) -> str:
    if isinstance(prompt, list):
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return str(users[-1].get("content", "")) if users else ""
    return str(prompt)


def _text(prompt: Any) -> str:
    if isinstance(prompt, list):  # a message list: the judges read the text of every turn
        return "\n".join(str(m.get("content", "")) for m in prompt)
    return str(prompt)


@dataclass(frozen=True)
class WeightedFunction:
    name: str
    weight: float
    fn: RewardFn


def resolve(name: str) -> RewardFn:
    """A registered function, or a user's ``module:function`` (cwd and PYTHONPATH searched)."""
    if ":" not in name:
        fn = REWARD_FUNCTIONS.get(name)
        getattr(fn, "requires", lambda: None)()  # an optional extra it needs: one line now, not mid-run
        return fn
    module, _, attr = name.partition(":")
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"reward.functions: cannot load {name!r} ({type(e).__name__}: {e}); expected "
                          "'module:function' importable from the current directory or PYTHONPATH") from None
    if not callable(fn):
        raise ConfigError(f"reward.functions: {name!r} is not callable")
    return fn


def by_field(fields: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Row fields as keyword lists (a field missing in some rows is None there)."""
    names = sorted({k for f in fields for k in f})
    return {k: [f.get(k) for f in fields] for k in names}


def call(fn: WeightedFunction, prompts: list[Any], completions: list[str], fields: dict[str, list[Any]]) -> list[float]:
    """One function's scores as floats (NaN = unscorable); any misbehaviour is one line naming it."""
    try:
        out = fn.fn(prompts, completions, **fields)
    except Exception as e:  # a user's function: say which one and why, without our traceback
        raise RewardFunctionError(f"reward function {fn.name!r} raised {type(e).__name__}: {e}") from e
    try:
        values = list(out)
    except TypeError:
        raise RewardFunctionError(f"reward function {fn.name!r} returned {type(out).__name__}, expected a list of "
                                  f"{len(completions)} floats or None") from None
    if len(values) != len(completions):
        raise RewardFunctionError(f"reward function {fn.name!r} returned {len(values)} values for "
                                  f"{len(completions)} completions")
    scores = []
    for v in values:
        if v is None:
            scores.append(math.nan)
            continue
        try:
            scores.append(float(v))
        except (TypeError, ValueError):
            raise RewardFunctionError(f"reward function {fn.name!r} returned {v!r}, expected a float or None") from None
    return scores


def combine(per_function: dict[str, list[float]], weights: dict[str, float]) -> list[float]:
    """Weighted sum of the functions that scored each sample; NaN when none did."""
    names = list(per_function)
    if not names:
        return []
    out = []
    for i in range(len(per_function[names[0]])):
        scored = [(weights[n], per_function[n][i]) for n in names if not math.isnan(per_function[n][i])]
        out.append(sum(w * v for w, v in scored) if scored else math.nan)
    return out
