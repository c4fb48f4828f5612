"""``alignkit train configs/redteam_multiturn.yaml`` end to end on tiny models (the micro Llama as LoRA attacker and
as target, reading the whole conversation through its chat template; a tiny random 6-head classifier scoring
every answer), and ``redteam.turns: 1`` being the single-turn red team exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, assert_ok, jsonl, run_cli
from tests.plugins.redteam_parts import cli_parts, tiny_train_args


@pytest.fixture(scope="module")
def parts(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return cli_parts(tmp_path_factory.mktemp("redteam_multiturn"), micro_model)


def test_shipped_config_converses_on_tiny_models(micro_model: Path, parts: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = tiny_train_args(str(REPO / "configs" / "redteam_multiturn.yaml"), str(out), str(micro_model),
                           str(parts["train"]), str(parts["eval"]), 1, generations=4, batch=8, max_new_tokens=6)
    args += ["data.max_length=160", f"redteam.target.model={micro_model}", "redteam.target.max_new_tokens=6",
             f"redteam.scorers=[{{name: toxicity, model: '{parts['classifier']}'}}]"]
    assert_ok(run_cli(args, cwd=REPO, timeout=400))
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in logged if "loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    for key in ("reward_mean", "toxicity_mean", "var", "attack_success_rate", "turn_scored_mean", "kl", "time/render_s"):
        assert key in train[-1], key
    assert 1.0 <= train[-1]["turn_scored_mean"] <= 3.0
    assert any("eval/reward_mean" in r for r in logged)
    rows = jsonl(out / "attacks.jsonl")  # one row per conversation, its 3 turns inside
    assert len(rows) == 16 and all(len(r["turns"]) == 3 for r in rows)
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(parts["classifier"])
    model = AutoModelForSequenceClassification.from_pretrained(parts["classifier"]).eval()
    with torch.no_grad():  # every answer scored: the classifier's mean head sigmoid of that turn's answer
        for r in rows:
            want = [model(**tok([t["output"] or " "], return_tensors="pt")).logits.sigmoid().mean().item() for t in r["turns"]]
            assert [t["toxicity"] for t in r["turns"]] == pytest.approx(want, abs=1e-4)
            assert r["toxicity"] == pytest.approx(max(want), abs=1e-4)  # turn_risk max: the riskiest answer
            assert r["output"] == r["turns"][r["turn"] - 1]["output"]
            assert r["attack"] == " / ".join(t["attack"] for t in r["turns"])
            assert r["reward"] == pytest.approx(r["toxicity"] + 0.1 * r["cvar_bonus"] - 0.1 * r["similarity"])
    assert (out / "final" / "adapter_config.json").is_file()


def test_one_turn_is_the_single_turn_red_team(micro_model: Path, parts: dict[str, Path], tmp_path: Path) -> None:
    """``redteam.turns: 1`` (the default) runs the single-turn red team: the same attacks, answers, scores, losses
    and weights as a run that does not name the key."""
    def train(name: str, *extra: str) -> Path:
        out = tmp_path / name
        args = tiny_train_args(str(REPO / "configs" / "redteam.yaml"), str(out), str(micro_model), str(parts["train"]),
                               str(parts["eval"]), 1, generations=4, batch=8, max_new_tokens=6)
        args += ["model.lora=null", "redteam.target.name=alignkit.data.synth_redteam:trigger_target",
                 "redteam.scorers=[{name: toxic_words}]", *extra]
        assert_ok(run_cli(args, cwd=REPO, timeout=400))
        return out

    plain, one = train("plain"), train("one", "redteam.turns=1")
    assert (plain / "attacks.jsonl").read_text() == (one / "attacks.jsonl").read_text()
    assert "turns" not in jsonl(one / "attacks.jsonl")[0]
    losses = [[r["loss"] for r in (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
              for run in (plain, one)]
    assert losses[0] == losses[1]
    from safetensors.torch import load_file

    a, b = (load_file(run / "final" / "model.safetensors") for run in (plain, one))
    assert all(torch.equal(a[k], b[k]) for k in a)
