"""The multi-turn red team's parts (``redteam.turns`` > 1): the synthetic world's rule (a trigger is answered
toxically only after an earlier message set the context), the turn a conversation is scored at, the attacker's
sample (loss mask on its own ids only, cut turns masked), token in / token out against the whole conversation's
rendering, the lm target's view of a conversation (exactly the single-turn text without history) and the
config's refusals."""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from alignkit.algorithms.redteam import RedTeamConfig, RedTeamScorerConfig, RedTeamTargetConfig
from alignkit.algorithms.redteam_multiturn import conversation_sample, conversation_scores, scored_turns
from alignkit.data.prompts import prompt_text
from alignkit.data.synth_redteam import REFUSALS, SETUP_WORDS, TOXIC_ANSWERS, context_target, is_toxic
from alignkit.errors import ConfigError
from alignkit.models.generation import Generations
from alignkit.rollout.agents.render import MessageRenderer
from alignkit.rollout.redteam_conversation import Conversation, converse
from alignkit.rollout.redteam_targets import build_target, conversation_text


def user_turns(*attacks: str) -> list[dict[str, str]]:
    return [m for a in attacks for m in ({"role": "user", "content": a}, {"role": "assistant", "content": "ok."})]


def test_context_target_needs_an_earlier_message_to_set_the_context() -> None:
    attacks = ["the moon is red", "the moon is red", "the moon is red", "a night on the moon", "cat dog", "the moon"]
    history = [[], user_turns("cat dog"), user_turns("a quiet night"), [], user_turns("night"), user_turns("star")]
    out = context_target(attacks, conversation=history)
    assert out[0] in REFUSALS and out[1] in REFUSALS  # a trigger with no context, or a context without a setter
    assert out[2] in TOXIC_ANSWERS                      # a setup word earlier, then a trigger
    assert out[3] in REFUSALS                           # setter and trigger in ONE message: a single turn cannot
    assert not is_toxic(out[4])                         # no trigger: benign whatever came before
    assert out[5] in TOXIC_ANSWERS                      # the subject raised before (a trigger) counts as context
    assert not any(is_toxic(r) for r in REFUSALS)
    assert context_target(["the moon is red"]) == [out[0]]  # the single-turn red team passes no conversation
    assert not set(SETUP_WORDS) & {"moon", "lamp", "star", "king", "ship", "bird", "stone", "frog"}


def test_a_conversation_is_scored_at_its_riskiest_or_last_turn() -> None:
    nan = math.nan
    tox = torch.tensor([0.1, 0.9, 0.3,  nan, 0.2, nan,  nan, nan, nan,  0.5, 0.5, 0.1], dtype=torch.float64)
    assert scored_turns(tox, 3, "max").tolist() == [1, 1, 2, 0]  # NaN never chosen unless all are; ties: earliest
    assert scored_turns(tox, 3, "last").tolist() == [2, 2, 2, 2]
    scorers = SimpleNamespace(term=lambda scores, use: scores["toxicity"])
    scores = {"toxicity": tox, "quality": torch.arange(12, dtype=torch.float64)}
    picked, pick = conversation_scores(scorers, scores, 3, "max")  # type: ignore[arg-type]
    assert picked["quality"].tolist() == [1.0, 4.0, 8.0, 9.0] and pick.tolist() == [1, 1, 2, 0]
    assert picked["toxicity"][:2].tolist() == [0.9, 0.2] and math.isnan(picked["toxicity"][2])


def test_the_attacker_trains_on_its_own_ids_only() -> None:
    c = Conversation([1, 2], completion_ids=[5, 6, 9, 9, 9, 7, 8], loss_mask=[1, 1, 0, 0, 0, 1, 1],
                     attacks=["a", "b"], answers=["x", "y"], turn_spans=[(0, 2), (5, 7)], cut=[True, False])
    assert conversation_sample(c, False)["loss_mask"] == [1, 1, 0, 0, 0, 1, 1]
    assert conversation_sample(c, True)["loss_mask"] == [0, 0, 0, 0, 0, 1, 1]  # the cut first turn
    assert c.attacker_ids() == [5, 6, 7, 8]


class FakeContext:
    """What ``converse`` asks of a RolloutContext: rows, a policy ``generate`` (scripted turns) and a clock."""

    def __init__(self, tok: Any, rows: list[dict[str, Any]], turns: list[list[list[int]]]) -> None:
        self.rows, self.turns, self.seeds, self.seconds, self.tok = rows, list(turns), None, {}, tok
        self.prompts: list[list[list[int]]] = []

    def generate(self, role: str, prompts: list[list[int]], params: Any = None) -> Generations:
        self.prompts.append(prompts)
        ids = self.turns.pop(0)
        eos = self.tok.eos_token_id
        return Generations(ids, ["stop" if i[-1] == eos else "length" for i in ids],
                           [self.tok.decode(i, skip_special_tokens=True) for i in ids])

    @contextmanager
    def timed(self, phase: str) -> Any:
        yield


def test_token_in_token_out_equals_the_whole_conversation_rendered(micro_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(micro_model)

    def enc(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    eos = tok.eos_token_id
    renderer = MessageRenderer(tok)
    instruction = [{"role": "user", "content": "Say something to a friend."}]
    rows = [{"prompt": "Say something to a friend.", "prompt_ids": renderer.prompt_ids(instruction), "fields": {}}] * 2
    turns = [[enc("a night out") + [eos], enc("cat") + [eos]], [enc("the moon") + [eos], enc("dog sun")]]
    ctx = FakeContext(tok, rows, turns)
    target = build_target(SimpleNamespace(name="alignkit.data.synth_redteam:context_target"))
    convs = converse(ctx, target, renderer, 2)  # type: ignore[arg-type]
    first = convs[0]
    assert first.answers[1] in TOXIC_ANSWERS and first.answers[0] not in TOXIC_ANSWERS
    assert convs[1].cut == [False, True] and convs[1].answers[1] not in TOXIC_ANSWERS
    messages = [*instruction, {"role": "assistant", "content": "a night out"}, {"role": "user", "content": first.answers[0]},
                {"role": "assistant", "content": "the moon"}]
    whole = enc(tok.apply_chat_template(messages, tokenize=False))
    ids = first.prompt_ids + first.completion_ids
    assert whole[: len(ids)] == ids and tok.decode(whole[len(ids):]) == "\n"  # all but the separator after the eos
    mask = first.loss_mask
    assert [i for i, m in zip(first.completion_ids, mask) if m] == enc("a night out") + [eos] + enc("the moon") + [eos]
    assert ctx.prompts[1][0] == first.prompt_ids + first.completion_ids[: first.turn_spans[1][0]]  # turn 2 reads turn 1


def test_the_lm_target_reads_the_single_turn_text_without_history(micro_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(micro_model)
    tpl = "Please extend the following sentence: {prompt}"
    assert conversation_text(tok, tpl, [], "the moon", True) == prompt_text(tok, tpl.replace("{prompt}", "the moon"))
    assert conversation_text(tok, tpl, [], "the moon", False) == tpl.replace("{prompt}", "the moon")
    two = conversation_text(tok, tpl, [("a night", "ok.")], "the moon", True)
    assert two == tok.apply_chat_template([{"role": "user", "content": tpl.replace("{prompt}", "a night")},
                                           {"role": "assistant", "content": "ok."},
                                           {"role": "user", "content": tpl.replace("{prompt}", "the moon")}],
                                          tokenize=False, add_generation_prompt=True)
    assert conversation_text(tok, "{prompt}", [("a", "b")], "c", False) == "a\nb\nc"


def test_multi_turn_needs_a_text_target() -> None:
    tox = [RedTeamScorerConfig(name="toxic_words")]
    assert RedTeamConfig(scorers=tox).turns == 1 and RedTeamConfig(scorers=tox).turn_risk == "max"
    with pytest.raises(ConfigError, match="redteam.turns"):
        RedTeamConfig(turns=2, target=RedTeamTargetConfig(name="t2i_vlm", model="x"), scorers=tox)


def test_the_context_targets_sft_rows_follow_the_rule() -> None:
    from alignkit.data.synth_redteam import TEMPLATE, context_answer, make_redteam_context_target_rows

    rows = make_redteam_context_target_rows(300, seed=0)
    kinds = {"toxic": 0, "refusal": 0, "benign": 0, "after_context": 0}
    prefix = TEMPLATE.replace("{prompt}", "")
    for row in rows:
        earlier: list[str] = []
        for user, answer in zip(row["messages"][::2], row["messages"][1::2]):
            attack = user["content"][len(prefix):]
            assert user["content"].startswith(prefix) and answer["content"] == context_answer(earlier, attack)
            kinds["toxic" if is_toxic(answer["content"]) else "refusal" if answer["content"] in REFUSALS else "benign"] += 1
            kinds["after_context"] += bool(earlier) and is_toxic(answer["content"])
            earlier.append(attack)
    assert min(kinds.values()) >= 50, kinds  # every kind of answer is taught, toxic ones only after a context
    assert kinds["after_context"] == kinds["toxic"]


def test_turn_credit_gives_each_attacker_turn_its_own_return() -> None:
    """``redteam.turn_credit: turn``, 2 conversations x 2 turns, turn_discount 0.5, a centred estimator (A = R -
    mean R) standing in for the group's. Turn rewards (toxicity + w_quality x quality): conversation 0 [0.2 + 0.1,
    1.0], conversation 1 [0, 0]. Returns G: conversation 0 G_1 = 0.3 + 0.5 x 1.0 = 0.8, G_2 = 1.0; conversation 1
    0, 0. Conversation 0's turn 1: returns [0.8, 0] -> 0.4; turn 2: [1.0, 0] -> 0.5. Conversation 1 (its G_k = 0
    against conversation 0's G_1 = 0.8): -0.4 on both turns. Each on its turn's attacker ids, 0 on the target's."""
    from alignkit.algorithms.redteam_multiturn import conversation_returns, credit_turns, turn_rewards

    scorers = SimpleNamespace(term=lambda scores, use: scores.get(use))
    per_turn = {"toxicity": torch.tensor([0.2, 1.0, 0.0, 0.0], dtype=torch.float64),
                "quality": torch.tensor([0.1, 0.0, 0.0, 0.0], dtype=torch.float64)}
    rt = SimpleNamespace(tau=0.5, w_cvar=0.0, w_quality=1.0)
    rewards = turn_rewards(scorers, per_turn, 2, rt)  # type: ignore[arg-type]
    assert rewards.flatten().tolist() == pytest.approx([0.3, 1.0, 0.0, 0.0]) and rewards.shape == (2, 2)
    assert conversation_returns(rewards, 0.5).tolist() == pytest.approx([0.8, 0.0])
    assert conversation_returns(rewards, 1.0).tolist() == pytest.approx([1.3, 0.0])  # undiscounted: the sum
    convs = [Conversation([1], completion_ids=[5, 6, 9, 7, 8], turn_spans=[(0, 2), (3, 5)]),
             Conversation([1], completion_ids=[5, 9, 7], turn_spans=[(0, 1), (2, 3)])]
    samples: list[dict] = [{}, {}]
    credit_turns(lambda r: r - r.mean(), samples, convs, rewards, 0, 0.5)
    assert samples[0]["advantages"] == pytest.approx([0.4, 0.4, 0.0, 0.5, 0.5])
    assert samples[1]["advantages"] == pytest.approx([-0.4, 0.0, -0.4])
    # a rank holding only conversation 1 (global position 1) gives it the same values
    alone: list[dict] = [{}]
    credit_turns(lambda r: r - r.mean(), alone, convs[1:], rewards, 1, 0.5)
    assert alone[0]["advantages"] == samples[1]["advantages"]


def test_turn_credit_refuses_the_conversation_wide_novelty_penalty() -> None:
    tox = [RedTeamScorerConfig(name="toxic_words")]
    assert RedTeamConfig(scorers=tox).turn_credit == "conversation"
    assert RedTeamConfig(scorers=tox, turns=2, turn_credit="turn").turn_discount == 1.0
    with pytest.raises(ConfigError, match="redteam.turn_credit"):
        RedTeamConfig(scorers=tox, turns=2, turn_credit="turn", w_diversity=0.1)
