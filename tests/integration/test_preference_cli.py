"""Preference learning through the CLI on the micro model: train / eval / score / merge-lora / resume.

- ``alignkit train configs/rm_helpful.yaml`` on PKU-SafeRLHF rows (a malformed row skipped and
  counted), ``alignkit eval`` of output_dir/final (pairwise accuracy + margin, the same numbers
  as the run's last evaluation), ``alignkit score`` (the same accuracy from the written scores).
- ``configs/rm_harmless.yaml`` as a LoRA cost model: the adapter (with its score head) is what is
  saved; ``alignkit merge-lora`` writes a plain HF model that scores exactly like the adapter.
- ``configs/dpo_lora.yaml``: the start-up LoRA line, adapter-only checkpoints, exact resume,
  evaluation of the adapter against its base, merging.
- A malformed row without ``data.skip_invalid`` is a one-line error naming file, line and field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from alignkit.data.io import read_rows
from alignkit.resources import resource_path
from tests.conftest import REPO, assert_ok, run_cli

LORA = "model.lora={r: 4, alpha: 8, dropout: 0.0}"


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def safety_rows(tmp_path: Path, n: int, bad: dict | None = None, name: str = "rows.jsonl") -> Path:
    lines = resource_path("safety_eval.jsonl").read_text().splitlines()[:n]
    if bad is not None:
        lines.insert(2, json.dumps(bad))
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def rm_args(config: str, model: Path, out: Path, *extra: str) -> list[str]:
    return [str(REPO / "configs" / config), f"model.name_or_path={model}", f"output_dir={out}",
            "data.max_train_examples=48", "data.max_length=96", "training.per_device_batch_size=8",
            "training.max_steps=3", "training.eval_steps=100", "logging.report_to=[jsonl]", *extra]


def test_reward_model_train_eval_score(micro_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "rm"
    bad = {"prompt": "How?", "response_0": "", "response_1": "x", "better_response_id": 0, "safer_response_id": 0}
    train_file = safety_rows(tmp_path, 48, bad)
    eval_file = safety_rows(tmp_path, 25, name="eval.jsonl")
    proc = run_cli(["train", *rm_args("rm_helpful.yaml", micro_model, out, f"data.train={train_file}",
                                      f"data.eval={eval_file}", "data.skip_invalid=true")])
    assert_ok(proc)
    assert f"Dropped 1 training row: 1 malformed (first: {train_file}:3 field 'response_0': is empty)" in proc.stderr
    last_eval = [m for m in metrics(out) if "eval/accuracy" in m][-1]

    proc = run_cli(["eval", *rm_args("rm_helpful.yaml", micro_model, out, f"data.eval={eval_file}"),
                    "--out", str(tmp_path / "eval.json")])
    assert_ok(proc)
    assert f"eval of {out / 'final'} (reward_model)" in proc.stdout and "25 examples" in proc.stdout
    got = json.loads((tmp_path / "eval.json").read_text())
    for key in ("accuracy", "margin"):
        assert abs(got[key] - last_eval[f"eval/{key}"]) < 1e-5, key

    proc = run_cli(["score", str(out / "final"), str(eval_file), "--out", str(tmp_path / "scores.jsonl")])
    assert_ok(proc)
    scored = [json.loads(line) for line in (tmp_path / "scores.jsonl").read_text().splitlines()]
    assert len(scored) == 25 and all("response_0_score" in r and "response_1_score" in r for r in scored)
    acc = sum(r[f"response_{r['better_response_id']}_score"] > r[f"response_{1 - r['better_response_id']}_score"]
              for r in scored) / len(scored)
    assert abs(acc - got["accuracy"]) < 1e-9
    assert "scored 25 rows (50 responses)" in proc.stderr


def test_score_uses_the_trained_data_format(micro_model: Path, tmp_path: Path) -> None:
    """A reward model trained on chat-rendered rows is scored on chat-rendered rows by default (read from
    the config.yaml saved beside the model); --no-chat-template overrides it."""
    from alignkit.cli.score_command import score_rows
    from alignkit.models.scalar import load_scorer

    out = tmp_path / "rm"
    proc = run_cli(["train", *rm_args("rm_helpful.yaml", micro_model, out, "data.chat_template=true",
                                      "data.max_length=80", "training.max_steps=2")])
    assert_ok(proc)
    assert (out / "final" / "config.yaml").is_file()
    eval_file = safety_rows(tmp_path, 6, name="eval.jsonl")
    rows = read_rows(str(eval_file))
    model, tok = load_scorer(out / "final")
    chat = score_rows(model, tok, rows, max_length=80, chat_template=True)
    plain = score_rows(model, tok, rows, max_length=80, chat_template=False)
    assert any(abs(a["response_0_score"] - b["response_0_score"]) > 1e-6 for a, b in zip(chat, plain))
    for flags, expected in (([], chat), (["--no-chat-template"], plain)):
        target = tmp_path / f"scores{len(flags)}.jsonl"
        assert_ok(run_cli(["score", str(out / "final"), str(eval_file), "--out", str(target), *flags]))
        got = [json.loads(line) for line in target.read_text().splitlines()]
        for g, e in zip(got, expected):
            assert abs(g["response_0_score"] - e["response_0_score"]) < 1e-5, flags


def test_malformed_row_is_a_one_line_error(micro_model: Path, tmp_path: Path) -> None:
    bad = {"prompt": "How?", "response_0": "ok", "response_1": 7, "better_response_id": 0, "safer_response_id": 0}
    train_file = safety_rows(tmp_path, 10, bad)
    proc = run_cli(["train", *rm_args("rm_helpful.yaml", micro_model, tmp_path / "x", f"data.train={train_file}")])
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()[-1]
    assert err == f"alignkit: error: {train_file}:3 field 'response_1': expected a string or a list of messages, got int"


def test_lora_cost_model_merge(micro_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "cm"
    proc = run_cli(["train", *rm_args("rm_harmless.yaml", micro_model, out, LORA, "data.eval=[]")])
    assert_ok(proc)
    assert "LoRA enabled for cost model:" in proc.stderr
    final = out / "final"
    assert (final / "adapter_model.safetensors").is_file() and not (final / "model.safetensors").exists()
    proc = run_cli(["merge-lora", str(final), str(tmp_path / "merged")])
    assert_ok(proc)
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1

    from alignkit.cli.score_command import score_rows
    from alignkit.models.scalar import load_scorer

    rows = read_rows(str(safety_rows(tmp_path, 6)))
    a = score_rows(*load_scorer(final), rows)
    b = score_rows(*load_scorer(tmp_path / "merged"), rows)
    for ra, rb in zip(a, b):
        assert abs(ra["response_0_score"] - rb["response_0_score"]) < 1e-5
    assert any(abs(r["response_0_score"] - r["response_1_score"]) > 0 for r in a)


def test_dpo_lora_checkpoints_resume_eval_merge(micro_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "dpo"
    base = [str(REPO / "configs" / "dpo_lora.yaml"), f"model.name_or_path={micro_model}", f"output_dir={out}",
            "data.max_train_examples=64", "data.max_eval_examples=20", "data.max_length=96",
            "training.per_device_batch_size=4", "training.learning_rate=5e-3", "training.lr_scheduler=constant",
            "training.warmup_ratio=0", "training.eval_steps=100", "checkpoint.save_steps=2",
            "logging.logging_steps=1", "logging.report_to=[jsonl]", "model.lora.r=4"]
    full = tmp_path / "dpo_straight"
    proc = run_cli(["train", *base, "training.max_steps=4", f"output_dir={full}"])
    assert_ok(proc)
    assert "LoRA enabled for policy model:" in proc.stderr and "Precomputed reference log-probs (lora_base)" in proc.stderr
    ckpt = full / "checkpoint-2"
    assert (ckpt / "policy" / "adapter_model.safetensors").is_file() and not (ckpt / "policy" / "model.safetensors").exists()
    size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    assert size < 3_000_000, f"a LoRA checkpoint should hold the adapter alone, got {size} bytes"

    # stop after step 2, then resume to step 4: the same losses as the straight run
    proc = run_cli(["train", *base, "training.max_steps=2"])
    assert_ok(proc)
    proc = run_cli(["train", *base, "training.max_steps=4", "checkpoint.resume_from=latest"])
    assert_ok(proc)
    assert "Resumed from" in proc.stderr
    straight = [m["loss"] for m in metrics(full) if "loss" in m]
    resumed = [m["loss"] for m in metrics(out) if "loss" in m]
    assert len(straight) == 4 and len(resumed) == 4
    assert max(abs(a - b) for a, b in zip(straight, resumed)) < 1e-5

    proc = run_cli(["eval", *base, "--model", str(out / "final"), "--out", str(tmp_path / "eval.json")])
    assert_ok(proc)
    ev = json.loads((tmp_path / "eval.json").read_text())
    final_eval = [m for m in metrics(out) if "eval/rewards/accuracy" in m][-1]
    assert abs(ev["rewards/accuracy"] - final_eval["eval/rewards/accuracy"]) < 1e-6
    assert abs(ev["kl"] - final_eval["eval/kl"]) < 1e-5 and ev["kl"] != 0.0

    from transformers import AutoModelForCausalLM

    from alignkit.config.schema import ModelConfig
    from alignkit.models.adapters import load_lm, merge_lora

    merged = merge_lora(out / "final", tmp_path / "merged")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(merged)(input_ids=ids).logits
        b = load_lm(ModelConfig(name_or_path=str(out / "final")), trainable=False)(input_ids=ids).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("config", ["rm_helpful.yaml", "rm_harmless.yaml", "dpo.yaml", "dpo_lora.yaml"])
def test_shipped_preference_configs_load(config: str) -> None:
    from alignkit.config import load_config

    cfg = load_config(REPO / "configs" / config)
    assert cfg.model.name_or_path == "runs/tiny-model"
    assert all(s.startswith("builtin:") for s in cfg.data.train + cfg.data.eval)
