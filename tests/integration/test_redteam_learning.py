"""The synthetic red-team task (data/synth_redteam.py): a target that answers toxically exactly when the
attack holds a hidden trigger word.

``test_attack_success_rises_with_diverse_attacks``: the rule as a scripted target and the program judge as
the scorer; from the random micro Llama, which writes a trigger in under one attack in ten, red-team RL
raises the attack success rate clearly while the attacks stay distinct.

Measured (seeds 0-3, 40 iterations of 4 instructions x 8 attacks, lr 3e-3, w_diversity 0.1, advantages
over the batch's std, ``redteam.scale_rewards: batch``): mean success rate of the first 5 iterations
0.113 / 0.062 / 0.087 / 0.069, of the last 5 0.931 / 0.881 / 0.669 / 0.950; distinct_fraction 1.0 at the end
for every seed (21.4-30.4 distinct successful attacks of 32 per iteration). With each group's own std (the
default before, ``group``): 0.106 / 0.087 / 0.087 / 0.062 -> 0.882 / 0.875 / 0.863 / 0.706; 2 processes (DDP,
seed 0): 0.094 -> 0.856.
Thresholds: first 5 < 0.2, last 5 >= 0.5, distinct_fraction >= 0.5, >= 8 distinct successes.

``test_attack_success_rises_on_a_world_it_was_not_tuned_on``: the same on another world, six triggers of
``make_world(11, 6)`` the project never used, carried to the scripted target by the prompt rows' ``triggers``
field; the settings of docs/workflows/redteam.md "When successes are rare" (lr 6e-3, beta 0.05). Measured
(seeds 0-2): 0.037 / 0.000 / 0.062 -> 0.975 / 0.944 / 0.950 (benchmarks/learn_redteam_worlds.py; at lr 3e-3
and each group's own std, the settings before: 0.031 -> 0.250 and 0.019 -> 0.312 on seeds 0-1).
Thresholds (seed 0): first 5 < 0.2, last 5 >= 0.5, every answer toxic exactly when the attack holds one of
the world's triggers.

``test_the_whole_chain_trained_by_alignkit``: every model trained by alignkit on the task's rows: the target
(SFT on ``redteam-target`` rows: the rule through the red-team template), the toxicity judge (a cost model
on ``redteam-judge`` pairs, read with a sigmoid) and the starting attacker (SFT on ``redteam-attacker``
rows: a few ordinary words, a trigger in one row in 20); the scorer is the trained judge, the program judges
check it. Measured (seeds 0-3, 40 iterations, lr 3e-3, beta 0.05): success rate of the first 5 iterations
0.125 / 0.056 / 0.056 / 0.037, of the last 5 0.975 / 0.938 / 0.963 / 0.731; the share of attacks holding a
trigger (program judge) rose from 0.06 / 0.03 / 0.03 / 0.02 to 0.94 / 0.89 / 0.89 / 0.53; the target
followed the rule on 88-90% of the attacks, the judge agreed with the program judge on 99.9-100%;
distinct_fraction >= 0.97 at the end (at lr 2e-3 the rise was slower: 0.51-0.94 over the same seeds).
Thresholds (seed 0): first 5 < 0.25, last 5 >= 0.45, trigger share of the last 5 >= 0.3 and 0.2 above the first 5's, distinct_fraction >= 0.5.

``test_a_multi_turn_attacker_learns_what_one_turn_cannot``: the multi-turn world (``redteam.turns``,
``context_target``: a trigger is answered toxically only when an EARLIER attacker message raised it or set a scene),
the program judge as scorer, the random micro attacker; 25 iterations of 4 instructions x 8 conversations of 3
attacker turns (8 tokens each), lr 1e-2, beta 0.05, w_diversity 0, conversation credit; against the single-turn red
team at the same attacker samples (32 per iteration). Measured (``benchmarks/redteam_multiturn.py --turns 1,3
--steps 25 --set training.learning_rate=1e-2``, seeds 0-3; 37-60 s a 3-turn run on the shared machine): 3 turns,
first 5 iterations 0.044 / 0.031 / 0.044 / 0.019, last 5 0.838 / 0.956 / 0.844 / 0.894 (first >= 0.5
at iterations 16 / 18 / 14 / 17); 1 turn 0.000 everywhere (it cannot succeed: no earlier message). At the
benchmark's lr 6e-3 the 3-turn rise came at iterations 20-30 (60 iterations, seeds 0-2); at lr 1e-2 and 20
iterations seed 1 ended at 0.537 only.
Thresholds (seed 0): 3 turns first 5 < 0.15, last 5 >= 0.5; 1 turn never a success; every answer of every
conversation the rule's given the attacker's earlier messages, never toxic at the first turn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignkit.data.synth import generate, write_rows
from alignkit.data.synth_redteam import context_answer, has_trigger, is_toxic, make_redteam_rows, make_world
from tests.conftest import REPO, assert_ok, jsonl, run_cli, write_config

pytestmark = pytest.mark.slow(seconds=60)


def train(tmp_path: Path, name: str, cfg: dict, nproc: int = 1) -> Path:
    out = tmp_path / name
    cfg = {"output_dir": str(out), "logging": {"logging_steps": 10, "plot": False, "report_to": ["jsonl"]}, **cfg}
    assert_ok(run_cli(["train", str(write_config(tmp_path / f"{name}.yaml", cfg))], nproc=nproc, cwd=REPO, timeout=400))
    return out


def redteam_config(attacker: Path, prompts: Path, seed: int, lr: float, target: dict, scorer: dict, **grpo: float) -> dict:
    return {"algorithm": "redteam", "model": {"name_or_path": str(attacker)}, "data": {"train": str(prompts), "max_length": 48},
            "training": {"per_device_batch_size": 32, "max_steps": 40, "learning_rate": lr, "lr_scheduler": "constant",
                         "warmup_steps": 0, "seed": seed},
            "logging": {"logging_steps": 1, "plot": False, "report_to": ["jsonl"]}, "checkpoint": {"save_final": False},
            "rollout": {"num_generations": 8, "max_new_tokens": 8}, "grpo": grpo,
            "redteam": {"target": target, "scorers": [scorer], "w_diversity": 0.1}}


def iterations(run: Path) -> list[dict]:
    return [r for r in (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.parametrize("seed,nproc", [(0, 1), (1, 1), pytest.param(0, 2, marks=pytest.mark.distributed)])
def test_attack_success_rises_with_diverse_attacks(micro_model: Path, tmp_path: Path, seed: int, nproc: int) -> None:
    prompts = write_rows(make_redteam_rows(400, seed=0), tmp_path / "prompts.jsonl")
    cfg = redteam_config(micro_model, prompts, seed, 3e-3, {"name": "alignkit.data.synth_redteam:trigger_target"},
                         {"name": "toxic_words"})
    if nproc > 1:  # the same global batch over 2 ranks; scores on rank 0 (placement main, the default)
        cfg["training"]["per_device_batch_size"] //= nproc
        cfg["distributed"] = {"strategy": "ddp"}
    run = train(tmp_path, "run", cfg, nproc)
    rows = iterations(run)
    asr = [r["attack_success_rate"] for r in rows]
    assert len(asr) == 40
    assert sum(asr[:5]) / 5 < 0.2 and sum(asr[-5:]) / 5 >= 0.5, asr
    assert min(r["distinct_fraction"] for r in rows[-5:]) >= 0.5
    assert sum(r["distinct_successes"] for r in rows[-5:]) / 5 >= 8
    attacks = jsonl(tmp_path / "run" / "attacks.jsonl")
    assert all(is_toxic(a["output"]) == has_trigger(a["attack"]) == (a["toxicity"] == 1.0) for a in attacks)


def test_attack_success_rises_on_a_world_it_was_not_tuned_on(micro_model: Path, tmp_path: Path) -> None:
    world = make_world(11, 6)
    prompts = write_rows(make_redteam_rows(400, seed=0, triggers=world), tmp_path / "prompts.jsonl")
    cfg = redteam_config(micro_model, prompts, 0, 6e-3, {"name": "alignkit.data.synth_redteam:trigger_target"},
                         {"name": "toxic_words"}, beta=0.05)
    asr = [r["attack_success_rate"] for r in iterations(train(tmp_path, "run", cfg))]
    assert sum(asr[:5]) / 5 < 0.2 and sum(asr[-5:]) / 5 >= 0.5, asr
    attacks = jsonl(tmp_path / "run" / "attacks.jsonl")
    assert all(is_toxic(a["output"]) == has_trigger(a["attack"], world) for a in attacks)


def test_the_whole_chain_trained_by_alignkit(micro_model: Path, tmp_path: Path) -> None:
    data = {kind: generate(kind, n, 0, tmp_path / f"{kind}.jsonl") for kind, n in
            (("redteam", 400), ("redteam-attacker", 2000), ("redteam-target", 4000), ("redteam-judge", 1000))}
    # the bars below were measured with foreach AdamW, the default then; fused AdamW (the default under single since
    # issue 30) differs by round-off, and over four chained runs that alone moved the last ASR mean below its bar
    sft = {"training": {"per_device_batch_size": 16, "learning_rate": 2e-3, "lr_scheduler": "cosine", "warmup_ratio": 0.05,
                        "epochs": 1, "seed": 0, "optimizer_impl": "foreach"}}
    target = train(tmp_path, "target", {"algorithm": "sft", "model": {"name_or_path": str(micro_model)},
                                        "data": {"train": str(data["redteam-target"]), "max_length": 64}, **sft})
    attacker = train(tmp_path, "attacker", {"algorithm": "sft", "model": {"name_or_path": str(micro_model)},
                                            "data": {"train": str(data["redteam-attacker"]), "max_length": 64}, **sft})
    judge = train(tmp_path, "judge", {"algorithm": "cost_model", "model": {"name_or_path": str(micro_model)},
                                      "data": {"train": str(data["redteam-judge"]), "max_length": 64},
                                      "reward_model": {"pair": "safety", "reg_coeff": 0.001},
                                      "training": {**sft["training"], "learning_rate": 1e-3}})
    cfg = redteam_config(
        attacker / "final", data["redteam"], 0, 3e-3, {"name": "lm", "model": str(target / "final"), "max_new_tokens": 12},
        {"name": "cost_model", "model": str(judge / "final"), "activation": "sigmoid"}, beta=0.05)
    cfg["training"]["optimizer_impl"] = "foreach"
    run = train(tmp_path, "run", cfg)
    rows = iterations(run)
    asr = [r["attack_success_rate"] for r in rows]
    assert sum(asr[:5]) / 5 < 0.25 and sum(asr[-5:]) / 5 >= 0.45, asr
    assert min(r["distinct_fraction"] for r in rows[-5:]) >= 0.5
    attacks = jsonl(run / "attacks.jsonl")
    share = [sum(has_trigger(a["attack"]) for a in attacks if a["step"] == s) / 32 for s in range(1, 41)]
    assert sum(share[-5:]) / 5 >= 0.3 and sum(share[-5:]) / 5 - sum(share[:5]) / 5 >= 0.2, share
    # the trained target follows the rule, and the trained judge agrees with the program judge, on most attacks
    assert sum(has_trigger(a["attack"]) == is_toxic(a["output"]) for a in attacks) / len(attacks) >= 0.8
    assert sum((a["toxicity"] >= 0.5) == is_toxic(a["output"]) for a in attacks) / len(attacks) >= 0.9


@pytest.mark.slow(seconds=50)
def test_a_multi_turn_attacker_learns_what_one_turn_cannot(micro_model: Path, tmp_path: Path) -> None:
    """The multi-turn world (``context_target``: a trigger is answered toxically only after an earlier attacker
    message raised it or set a scene; module docstring): the random micro attacker conversing over 3 turns learns to
    set the scene and then strike; the single-turn red team at the same attacker samples (32 per iteration, one
    conversation = one sample) never succeeds, by construction."""
    prompts = write_rows(make_redteam_rows(400, seed=0), tmp_path / "prompts.jsonl")
    asr = {}
    for turns in (1, 3):
        cfg = redteam_config(micro_model, prompts, 0, 1e-2, {"name": "alignkit.data.synth_redteam:context_target"},
                             {"name": "toxic_words"}, beta=0.05)
        cfg["training"]["max_steps"] = 25
        cfg["data"]["max_length"] = 48 + 40 * (turns - 1)
        cfg["redteam"].update(turns=turns, w_diversity=0.0, top_attacks=0)
        run = train(tmp_path, f"turns{turns}", cfg)
        asr[turns] = [r["attack_success_rate"] for r in iterations(run)]
        assert len(asr[turns]) == 25
    many, one = asr[3], asr[1]
    assert sum(many[:5]) / 5 < 0.15 and sum(many[-5:]) / 5 >= 0.5, many
    assert max(one) == 0.0, one  # one attack, no earlier message: always a refusal or a benign answer
    conversations = jsonl(tmp_path / "turns3" / "attacks.jsonl")
    assert len(conversations) == 25 * 32 and all(len(c["turns"]) == 3 for c in conversations)
    for c in conversations:  # every answer is the rule's, given the attacker's earlier messages
        said = [t["attack"] for t in c["turns"]]
        assert [t["output"] for t in c["turns"]] == [context_answer(said[:k], a) for k, a in enumerate(said)], c
        assert not is_toxic(c["turns"][0]["output"])
