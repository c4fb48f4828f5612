"""Multi-turn red-team conversations, token in, token out (``redteam.turns`` > 1; docs/workflows/redteam.md).

The attacker (the trained ``policy``) and the frozen target take turns ``turns`` times. Turn k: the next attack of
every conversation in ONE policy generation call (its prompt: the row's prompt ids and the conversation's ids so
far), then every conversation's answer in ONE target call (``target.converse``: the target reads its own view of
the whole conversation, rendered afresh: it is frozen, nothing of it is trained). The attacker's ids are the row's
prompt ids, then per turn the ids it generated, kept exactly (``loss_mask`` 1), and before its next turn the
target's answer as a user message, rendered by :class:`~alignkit.rollout.agents.render.MessageRenderer` against a
fixed anchor (``loss_mask`` 0): the history is never re-tokenised. The last answer only goes to the scorers.

Seeds: turn 0 samples with the rows' seeds (the single-turn red team's attacks), turn k > 0 with their stream
``turn{k}`` (``rollout/seeds.py``), so a conversation is the same on any rank. Every conversation runs all
``turns`` turns (no early stop: a harm at any turn is found by the risk over the turns, the algorithm's).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from alignkit.models.generation import Generations
from alignkit.rollout.agents.render import MessageRenderer
from alignkit.rollout.context import RolloutContext
from alignkit.rollout.seeds import with_stream


@dataclass
class Conversation:
    """One attacker-target conversation: the attacker's ``prompt_ids``, then ``completion_ids`` (its turns and the
    target's rendered answers in order) with ``loss_mask`` (1 on the attacker's ids); per turn the ``attacks``
    (stripped text), the target's ``answers``, ``turn_spans`` (start, end) of the attacker's ids in
    ``completion_ids`` and whether max_new_tokens ``cut`` the attack."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    loss_mask: list[float] = field(default_factory=list)
    attacks: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    cut: list[bool] = field(default_factory=list)

    def history(self) -> list[tuple[str, str]]:
        """The answered turns so far, ``(attack, answer)``."""
        return list(zip(self.attacks, self.answers))

    def attacker_ids(self) -> list[int]:
        """The ids the attacker generated, every turn's, in order."""
        return [i for s, e in self.turn_spans for i in self.completion_ids[s:e]]


def turn_context(ctx: RolloutContext, turn: int) -> RolloutContext:
    """``ctx`` with the rows' seeds of ``turn`` (turn 0: the rows' own); it shares ``ctx``'s clock."""
    return ctx if turn == 0 or ctx.seeds is None else replace(ctx, seeds=with_stream(ctx.seeds, f"turn{turn}"))


def converse(ctx: RolloutContext, target: Any, renderer: MessageRenderer, turns: int) -> list[Conversation]:
    """One conversation per row of ``ctx.rows``, ``turns`` turns each, every turn batched (module docstring)."""
    convs = [Conversation(list(row["prompt_ids"])) for row in ctx.rows]
    seeds, fields = [row["prompt"] for row in ctx.rows], [row["fields"] for row in ctx.rows]
    for k in range(turns):
        tctx = turn_context(ctx, k)
        gens = tctx.generate("policy", [c.prompt_ids + c.completion_ids for c in convs])
        for c, ids, text, cut in zip(convs, gens.completion_ids, gens.texts, gens.truncated):
            c.turn_spans.append((len(c.completion_ids), len(c.completion_ids) + len(ids)))
            c.completion_ids += ids
            c.loss_mask += [1.0] * len(ids)
            c.attacks.append(text.strip())
            c.cut.append(cut)
        answers = target.converse(tctx, [c.history() for c in convs], [c.attacks[-1] for c in convs], seeds, fields)
        for c, ids, answer in zip(convs, gens.completion_ids, answers):
            c.answers.append(answer)
            if k < turns - 1:  # what the attacker reads before its next turn
                with ctx.timed("render"):
                    reply = renderer.reply_ids([{"role": "user", "content": answer}], list(ids))
                c.completion_ids += reply
                c.loss_mask += [0.0] * len(reply)
    return convs


def attacker_generations(convs: list[Conversation]) -> Generations:
    """The attacker's own ids of each conversation as one completion (for the length and truncation statistics);
    "length" where max_new_tokens cut any of its turns."""
    return Generations([c.attacker_ids() for c in convs], ["length" if any(c.cut) else "stop" for c in convs],
                       [" / ".join(c.attacks) for c in convs])
