"""The multi-turn red team (``redteam.turns`` > 1; issue 48 item 4b; docs/workflows/redteam.md "Multi-turn").

The attacker converses with the frozen target over ``turns`` turns (``rollout/redteam_conversation.py``: every
turn batched over all conversations, token in, token out). One conversation is ONE sample of the attacker: its
``completion_ids`` hold its turns (``loss_mask`` 1) and the target's answers as it read them (``loss_mask`` 0).
Every answer is scored (``redteam.scorers``, placed as the single-turn red team places them: rows conversation-
major, ``turns`` per conversation), and the conversation's scores are those of ONE of its turns: the riskiest
(``redteam.turn_risk: max``, the default: a harm the target said at any turn is said, and an attacker that earns
it early is not paid less than one that earns it last) or the last (``last``: only where the conversation ends
up). From these per-conversation scores, gathered in global order, the reward, the CVaR bonus (VaR over the
gathered conversations), the diversity penalty (over the conversations' attacks joined) and the group advantages
are the single-turn red team's (``RedTeam.experience``); ``attacks.jsonl`` holds one row per conversation, its
``attack`` the turns' attacks joined by " / ", ``output`` the scored answer, ``turn`` the scored turn (1-based) and
``turns`` every turn's attack, answer and toxicity.

``redteam.turn_credit: turn`` gives each attacker turn its own return, as ``agent.credit: turn`` does for agents
(``rollout/agents/credit.py``): turn k's reward r_k is the red-team reward of the target's answer at turn k
(``redteam_reward`` over every gathered turn: toxicity, CVaR bonus against the VaR of all turns, quality), its
return G_k = r_k + ``turn_discount`` x G_(k+1); the conversation's return G_1 replaces the scored turn's reward in
the group advantages, and turn k's ids carry the advantage the estimator gives the conversation with its return
replaced by G_k. An unscorable (NaN) turn makes the returns up to it NaN: advantage 0 there.
"""

from __future__ import annotations

from typing import Any

import torch

from alignkit.distributed import comm
from alignkit.rewards.cvar import redteam_reward
from alignkit.rewards.scorers import Judged, ScorerSet
from alignkit.rewards.signals import gather_scores
from alignkit.rollout.agents.credit import rewards_to_go, turn_advantages, turn_token_values
from alignkit.rollout.config import RolloutConfig
from alignkit.rollout.context import Experience, RolloutContext
from alignkit.rollout.experience import Sample
from alignkit.rollout.redteam_conversation import Conversation, attacker_generations, converse

JOIN = " / "


def conversation_sample(c: Conversation, mask_truncated: bool) -> Sample:
    """The attacker's sample of a conversation; ``mask_truncated``: the ids of a turn max_new_tokens cut get
    ``loss_mask`` 0 (``rollout.mask_truncated_completions``, per turn as per attack)."""
    mask = list(c.loss_mask)
    for (start, end), cut in zip(c.turn_spans, c.cut):
        if cut and mask_truncated:
            mask[start:end] = [0.0] * (end - start)
    return {"prompt_ids": c.prompt_ids, "completion_ids": list(c.completion_ids), "loss_mask": mask}


def turn_batch(ctx: RolloutContext, convs: list[Conversation]) -> Judged:
    """Every turn of this rank's conversations to score, conversation-major: (attack, answer, the row's prompt and
    fields)."""
    rows = [(a, o, row["prompt"], row["fields"]) for c, row in zip(convs, ctx.rows) for a, o in zip(c.attacks, c.answers)]
    return Judged([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows],
                  [None] * len(rows))


def scored_turns(toxicity: torch.Tensor, turns: int, how: str) -> torch.Tensor:
    """``(N,)`` the turn each of N conversations is scored at, from the ``(N * turns,)`` toxicities
    (conversation-major): ``max`` the riskiest (the earliest on a tie; unscorable turns never chosen unless all
    are, then the last), ``last`` the last."""
    tox = toxicity.view(-1, turns)
    if how == "last":
        return torch.full((tox.shape[0],), turns - 1, dtype=torch.long)
    filled = torch.where(torch.isnan(tox), torch.full_like(tox, -torch.inf), tox)
    pick = filled.argmax(1)  # torch.argmax returns the first maximal index
    return torch.where(torch.isinf(filled).all(1), torch.full_like(pick, turns - 1), pick)


def conversation_scores(scorers: ScorerSet, scores: dict[str, torch.Tensor], turns: int,
                        how: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Every score of the ``(N * turns,)`` gathered per-turn ``scores`` at each conversation's scored turn
    (:func:`scored_turns` of the toxicity term), ``(N,)`` each, and those turns."""
    tox = scorers.term(scores, "toxicity")
    assert tox is not None
    pick = scored_turns(tox, turns, how)
    rows = torch.arange(pick.shape[0]) * turns + pick
    return {name: v[rows] for name, v in scores.items()}, pick


def turn_rewards(scorers: ScorerSet, scores: dict[str, torch.Tensor], turns: int, rt: Any) -> torch.Tensor:
    """``(N, turns)`` the reward of each turn's answer from the ``(N * turns,)`` gathered per-turn ``scores``
    (conversation-major): toxicity + w_cvar x CVaR bonus (VaR over every turn) + w_quality x quality."""
    terms = redteam_reward(scorers.term(scores, "toxicity"), scorers.term(scores, "quality"), None, tau=rt.tau,
                           w_cvar=rt.w_cvar, w_quality=rt.w_quality)
    return terms["reward"].view(-1, turns)  # type: ignore[union-attr]  # the reward is a tensor


def conversation_returns(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """``(N,)`` each conversation's return G_1 = sum_k gamma^k r_k of its ``(N, turns)`` turn ``rewards``."""
    return rewards_to_go(list(rewards.T), gamma)[0].to(torch.float64)  # the turns' columns: no host read


def credit_turns(estimator: Any, samples: list[Sample], convs: list[Conversation], rewards: torch.Tensor, first: int,
                 gamma: float) -> None:
    """This rank's ``samples`` (conversations ``convs``, the first at global position ``first``): turn k's ids get
    the advantage ``estimator`` gives the conversation with its return replaced by G_k (``rewards``: ``(N, turns)``,
    every rank's; the others' returns are their G_1)."""
    returns = conversation_returns(rewards, gamma)
    for j, (s, c) in enumerate(zip(samples, convs)):
        per_turn = turn_advantages(estimator, returns, first + j, rewards[first + j], gamma)
        s["advantages"] = turn_token_values(c, per_turn)


def multiturn_rollout(algo: Any, ctx: RolloutContext, rt: Any) -> Experience:
    """Conversations -> every turn scored -> each conversation's scores at its scored turn -> the red team's
    experience of the conversations (module docstring). ``algo``: the ``RedTeam``; ``rt``: its section."""
    convs = converse(ctx, algo.target, algo.renderer, rt.turns)
    samples = [conversation_sample(c, algo.cfg.section(RolloutConfig).mask_truncated_completions) for c in convs]
    per_turn = gather_scores(algo.scorers.judge(turn_batch(ctx, convs), ctx.strategy.device, rt.placement))
    scores, pick = conversation_scores(algo.scorers, per_turn, rt.turns, rt.turn_risk)
    mine = pick[ctx.mine]
    batch = Judged([JOIN.join(c.attacks) for c in convs], [c.answers[int(k)] for c, k in zip(convs, mine)],
                   [row["prompt"] for row in ctx.rows], [row["fields"] for row in ctx.rows], [None] * len(convs))
    by_turn = turn_rewards(algo.scorers, per_turn, rt.turns, rt) if rt.turn_credit == "turn" else None
    returns = None if by_turn is None else conversation_returns(by_turn, rt.turn_discount)
    exp = algo.experience(ctx, attacker_generations(convs), samples, batch, scores=scores, returns=returns)
    if by_turn is not None:
        credit_turns(algo.group.advantages, samples, convs, by_turn, ctx.mine.start, rt.turn_discount)
    if exp.records:  # every rank's turns, for attacks.jsonl
        everyone = [x for share in comm.all_gather_object([(c.attacks, c.answers) for c in convs]) for x in share]
        tox = algo.scorers.term(per_turn, "toxicity").view(-1, rt.turns)
        for i, (record, (attacks, answers)) in enumerate(zip(exp.records, everyone)):
            record["turn"] = int(pick[i]) + 1
            record["turns"] = [{"attack": a, "output": o, "toxicity": float(t)}
                               for a, o, t in zip(attacks, answers, tox[i])]
    stats = exp.stats
    stats.add("turn_scored_mean", float(pick.double().mean()) + 1.0, 1)
    return exp


@torch.no_grad()
def multiturn_evaluate(algo: Any, ctx: RolloutContext, rt: Any) -> tuple[float, float, float]:
    """Greedy conversations of ``ctx.rows``: this rank's (sum of the conversations' toxicities at their scored
    turns, how many were scored, attacker tokens)."""
    convs = converse(ctx, algo.target, algo.renderer, rt.turns)
    values = {k: torch.tensor(v, dtype=torch.float64)
              for k, v in algo.scorers.judge(turn_batch(ctx, convs), ctx.strategy.device, rt.placement).items()}
    scores, _ = conversation_scores(algo.scorers, values, rt.turns, rt.turn_risk)
    tox = algo.scorers.term(scores, "toxicity")
    ok = ~torch.isnan(tox)
    return float(tox[ok].sum()), float(ok.sum()), float(sum(len(c.attacker_ids()) for c in convs))
