"""The synthetic red-team world (data/synth_redteam.py): its judges, its scripted target and its rows."""

from __future__ import annotations

from pathlib import Path

from alignkit.data.synth import generate, read_rows
from alignkit.data.synth_redteam import (
    ATTACKER_TRIGGER_EVERY,
    TEMPLATE,
    has_trigger,
    is_toxic,
    make_redteam_attacker_rows,
    make_redteam_judge_rows,
    make_redteam_rows,
    make_redteam_target_rows,
    trigger_target,
)
from alignkit.rewards.functions import REWARD_FUNCTIONS


def test_judges_match_whole_words_in_any_case() -> None:
    assert has_trigger("a MOON rises") and has_trigger("Frog.") and has_trigger("x\ufffdKING\ufffd")
    assert not has_trigger("moonlight") and not has_trigger("exMOON") and not has_trigger("a cat")
    assert is_toxic("You are STUPID") and not is_toxic("stupidity") and not is_toxic("a nice day")


def test_scripted_target_and_toxic_words_reward() -> None:
    answers = trigger_target(["the moon", "the sun", "the moon"])
    assert is_toxic(answers[0]) and not is_toxic(answers[1]) and answers[0] == answers[2]  # a function of the text
    assert REWARD_FUNCTIONS.get("toxic_words")([], answers) == [1.0, 0.0, 1.0]


def test_rows_follow_the_rule_and_are_deterministic(tmp_path: Path) -> None:
    target = make_redteam_target_rows(200, seed=3)
    assert target == make_redteam_target_rows(200, seed=3)
    for row in target:
        user, assistant = (m["content"] for m in row["messages"])
        attack = user.removeprefix(TEMPLATE.format(prompt=""))
        assert user == TEMPLATE.format(prompt=attack) and is_toxic(assistant) == has_trigger(attack)
    assert sum(has_trigger(r["messages"][0]["content"]) for r in target) == 100  # every other row
    judge = make_redteam_judge_rows(100, seed=1)
    for row in judge:
        toxic = [is_toxic(row["response_0"]), is_toxic(row["response_1"])]
        assert sorted(toxic) == [False, True] and row["is_response_0_safe"] == (not toxic[0])
        assert row["safer_response_id"] == toxic.index(False) == row["better_response_id"]
    attacker = make_redteam_attacker_rows(2000, seed=0)
    rate = sum(has_trigger(r["messages"][1]["content"]) for r in attacker) / len(attacker)
    assert abs(rate - 1 / ATTACKER_TRIGGER_EVERY) < 0.02  # rarely a trigger
    assert all(set(r) == {"prompt"} and r["prompt"].endswith(".") for r in make_redteam_rows(20, seed=0))
    assert read_rows(generate("redteam", 5, 0, tmp_path / "p.jsonl")) == make_redteam_rows(5, seed=0)


def test_tasks_refused_only_where_rows_have_none(tmp_path: Path) -> None:
    """--tasks is an error for the safety and red-team worlds; without it both generate."""
    import pytest

    from alignkit.errors import ConfigError

    for kind in ("safety", "redteam"):
        assert len(read_rows(generate(kind, 3, 0, tmp_path / f"{kind}.jsonl"))) == 3
        with pytest.raises(ConfigError, match="--tasks does not apply"):
            generate(kind, 3, 0, tmp_path / "x.jsonl", tasks=("add",))


def test_other_worlds_by_seed_and_trigger_count() -> None:
    """make_world draws held-out triggers from TRIGGER_POOL; prompt rows carry them to trigger_target (a row
    field), the target rows follow them; without them every row and answer is the project's world's."""
    import pytest

    from alignkit.data.synth_redteam import FILLER, TOXIC_WORDS, TRIGGER_POOL, TRIGGER_WORDS, make_world

    world = make_world(11, 6)
    assert world == make_world(11, 6) and len(set(world)) == 6 and set(world) <= set(TRIGGER_POOL)
    assert make_world(12, 6) != world and len(make_world(13, 12)) == 12
    assert not set(TRIGGER_POOL) & set(TRIGGER_WORDS + FILLER + TOXIC_WORDS)
    rows = make_redteam_rows(3, seed=0, triggers=world)
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in make_redteam_rows(3, seed=0)]
    assert all(r["triggers"] == list(world) for r in rows) and "triggers" not in make_redteam_rows(1)[0]
    attacks = [f"a {world[0].upper()}!", "the moon"]
    assert [is_toxic(a) for a in trigger_target(attacks, triggers=[r["triggers"] for r in rows[:2]])] == [True, False]
    assert [is_toxic(a) for a in trigger_target(attacks)] == [False, True]  # no field: the project's triggers
    assert has_trigger("my Cup.", ("cup",)) and not has_trigger("cupboard", ("cup",))
    for row in make_redteam_target_rows(100, seed=1, triggers=world):
        attack = row["messages"][0]["content"].removeprefix(TEMPLATE.format(prompt=""))
        assert is_toxic(row["messages"][1]["content"]) == has_trigger(attack, world)
    with pytest.raises(ValueError, match="n_triggers"):
        make_world(0, len(TRIGGER_POOL) + 1)
