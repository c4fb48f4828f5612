"""Pictures of real runs on the micro model: ``output_dir/plots/summary.png`` at the end of a run
(SFT, DPO, reward model), runs overlaid, a resumed run's repeated steps, ``logging.plot=false``, and
``alignkit plot`` through the CLI (its panels, default output, one-line error for a missing file)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from alignkit.config import load_config
from alignkit.plot import plot_runs, read_metrics
from alignkit.train.runner import run_train
from tests.conftest import REPO, run_cli, write_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SYSTEM = ["loss", "lr", "grad_norm", "tokens_per_s"]


def is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000


def train(tmp_path: Path, cfg: dict[str, Any], *overrides: str) -> Path:
    run_train(load_config(write_config(tmp_path / "c.yaml", cfg), list(overrides)))
    return Path(cfg["output_dir"])


def shipped(config: str, model: Path, out: Path, *extra: str) -> Path:
    """A shipped preference config on the micro model, 4 steps with an evaluation at step 2 and at the end."""
    run_train(load_config(REPO / "configs" / config, [
        f"model.name_or_path={model}", f"output_dir={out}", "data.max_train_examples=32", "data.max_eval_examples=8",
        "data.max_length=64", "training.per_device_batch_size=4", "training.max_steps=4", "training.eval_steps=2",
        "logging.logging_steps=1", "logging.report_to=[jsonl]", "checkpoint.save_final=false", *extra]))
    return out


@pytest.fixture(scope="module")
def preference_runs(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pref")
    return {"dpo": shipped("dpo.yaml", micro_model, root / "dpo"),
            "rm": shipped("rm_helpful.yaml", micro_model, root / "rm_helpful")}


def test_sft_run_ends_with_its_summary_png(sft_config: dict[str, Any], tmp_path: Path) -> None:
    out = train(tmp_path, sft_config)
    assert is_png(out / "plots" / "summary.png")
    path, panels = plot_runs([out], tmp_path / "again.png")
    assert panels == [*SYSTEM, "nll", "peak_mem_mb"] and is_png(path)


def test_no_summary_with_plot_off_or_without_jsonl(sft_config: dict[str, Any], tmp_path: Path) -> None:
    sft_config["training"]["max_steps"] = 2
    out = train(tmp_path, sft_config, "logging.plot=false")
    assert (out / "metrics.jsonl").is_file() and not (out / "plots").exists()
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("alignkit").addHandler(handler)
    try:
        out = train(tmp_path, dict(sft_config, output_dir=str(tmp_path / "console")), "logging.report_to=[console]")
    finally:
        logging.getLogger("alignkit").removeHandler(handler)
    assert not (out / "plots").exists()
    assert any(x.startswith("No plot: logging.report_to has no jsonl") for x in lines)


def test_dpo_and_reward_model_panels(preference_runs: dict[str, Path], tmp_path: Path) -> None:
    dpo, rm = preference_runs["dpo"], preference_runs["rm"]
    assert is_png(dpo / "plots" / "summary.png") and is_png(rm / "plots" / "summary.png")
    _, panels = plot_runs([dpo], tmp_path / "dpo.png")
    rewards = ["rewards/accuracy", "rewards/chosen", "rewards/margin", "rewards/rejected"]
    assert panels[:5] == [*SYSTEM, "eval/loss"]
    assert {"eval/kl", "eval/rewards/accuracy", "eval/rewards/margin", "kl", "logps/chosen", *rewards} <= set(panels)
    assert panels[-1] == "peak_mem_mb"
    assert panels.index("eval/rewards/margin") < panels.index("kl")  # eval panels before the algorithm's
    _, panels = plot_runs([rm], tmp_path / "rm.png")
    assert panels == [*SYSTEM, "eval/loss", "eval/accuracy", "eval/margin", "eval/score/chosen", "eval/score/rejected",
                      "accuracy", "margin", "score/chosen", "score/rejected", "peak_mem_mb"]
    _, panels = plot_runs([dpo], tmp_path / "sel.png", metrics=["rewards/*", "loss"])
    assert panels == [*rewards, "loss"]


def test_two_runs_overlaid(preference_runs: dict[str, Path], tmp_path: Path) -> None:
    dpo, rm = preference_runs["dpo"], preference_runs["rm"]
    path, panels = plot_runs([dpo, rm], tmp_path / "both.png")
    assert is_png(path)
    assert panels[:4] == SYSTEM and {"rewards/accuracy", "accuracy", "eval/accuracy", "eval/rewards/accuracy"} <= set(panels)
    one = path.stat().st_size
    plot_runs([dpo], tmp_path / "one.png", metrics=panels[:4])
    assert one > (tmp_path / "one.png").stat().st_size


def test_resumed_run_plots_each_step_once(sft_config: dict[str, Any], tmp_path: Path) -> None:
    """A resume drops the rows the interrupted run logged after its checkpoint, so the picture shows the
    resumed values (a file with repeated steps, e.g. from an older alignkit, keeps the last of each: unit test)."""
    sft_config["checkpoint"] = {"save_final": False, "save_steps": 2}
    out = train(tmp_path, sft_config)  # steps 1-4, checkpoints at 2 and 4
    first = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train(tmp_path, sft_config, f"checkpoint.resume_from={out / 'checkpoint-2'}")  # logs steps 3 and 4 again
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[:2] == first[:2]
    steps, values = read_metrics(out / "metrics.jsonl").series["tokens_per_s"]
    assert steps == [1, 2, 3, 4] and values == [r["tokens_per_s"] for r in rows]
    assert is_png(out / "plots" / "summary.png")


def write_metrics(run: Path, n: int) -> Path:
    run.mkdir(parents=True)
    rows = [{"time": 0.0, "epoch": s / n, "loss": 2.0 / s, "lr": 1e-4, "grad_norm": 1.0, "tokens_per_s": 900.0 + s,
             "rewards/accuracy": 0.5, "rewards/margin": 0.1 * s, "step": s} for s in range(1, n + 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return run


def test_cli_plot(tmp_path: Path) -> None:
    a, b = write_metrics(tmp_path / "a" / "run", 12), write_metrics(tmp_path / "b" / "run", 8)
    proc = run_cli(["plot", str(a), str(b), "--out", str(tmp_path / "curves.png"), "--metrics", "rewards/*", "loss"],
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"wrote 3 panels (rewards/accuracy, rewards/margin, loss) to {tmp_path / 'curves.png'}"
    assert is_png(tmp_path / "curves.png")
    proc = run_cli(["plot", str(a)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(f"to {a / 'plots' / 'summary.png'}") and is_png(a / "plots" / "summary.png")


def test_cli_missing_metrics_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    proc = run_cli(["plot", str(tmp_path / "run")], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"alignkit: error: {tmp_path / 'run' / 'metrics.jsonl'} not found "
                                                "(a run writes it when logging.report_to has jsonl)"]


def test_flow_runs_plot_reward_terms_kl_clipping_and_image_panels(micro_sd3: Path, tmp_path: Path) -> None:
    """A real flow_grpo run (1 iteration of 2 updates on the micro SD3 pipeline) ends with its summary: the reward
    and its terms, then KL, clipping and ratio, the advantages, the timings; no token-throughput panels (images). A
    flow_rtpo run's image policy metrics (``image/``) follow the attacker's in the same order."""
    pytest.importorskip("diffusers")
    from alignkit.data.synth_vlm import generate_vlm

    train = generate_vlm(8, 0, tmp_path / "captions.json", stage="pretrain", split="train")
    out = tmp_path / "flow"
    run_train(load_config(REPO / "configs" / "flow_grpo.yaml", [
        f"model.name_or_path={micro_sd3}", f"data.train={train}", f"output_dir={out}", "training.max_steps=2",
        "training.global_batch_size=4", "training.per_device_batch_size=4", "rollout.num_generations=2",
        "rollout.update_epochs=2", "flow_grpo.num_inference_steps=2", "checkpoint.save_steps=null",
        "checkpoint.save_final=false", "logging.report_to=[jsonl]"]))
    assert is_png(out / "plots" / "summary.png")
    _, panels = plot_runs([out], tmp_path / "flow.png")
    # one scorer, w_cvar 0: reward_mean = reward/main = reward/main/shapes_colour, one panel; update_s = time/update_s
    assert panels[:7] == ["loss", "lr", "grad_norm", "reward_mean", "cvar_bonus_mean", "var", "kl"]
    assert panels.index("kl") < panels.index("clip_fraction") < panels.index("ratio") < panels.index("advantage_std")
    times = panels[panels.index("rollout_s"):]
    assert times[:5] == ["rollout_s", "update_s", "time/sample_s", "time/score_s", "time/rollout_other_s"]
    assert times[-1] == "peak_mem_mb" and "time/update_s" not in times
    assert not {"tokens_per_s", "train_tokens_per_s", "sample_s"} & set(panels)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert not any("tokens_per_s" in key for row in rows for key in row)  # images: no token throughput logged
    # flow_rtpo: the attacker's metrics unprefixed, the image policy's under image/
    rtpo = tmp_path / "rtpo"
    rtpo.mkdir()
    (rtpo / "config.yaml").write_text("algorithm: flow_rtpo\n", encoding="utf-8")
    flow = ("reward_mean", "kl", "clip_fraction", "reward/main/shapes_colour")
    mixed = [{"step": r["step"], "loss": r["loss"], "tokens_per_s": 50.0, "reward_mean": r["reward_mean"],
              "kl": 0.1, "loss/image_policy": 2 * r["loss"], "image/sample_s": r["rollout_s"],
              **{f"image/{k}": r[k] for k in flow}} for r in rows]
    (rtpo / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mixed), encoding="utf-8")
    path, panels = plot_runs([rtpo], tmp_path / "rtpo.png")
    assert is_png(path)
    assert panels == ["loss", "tokens_per_s", "reward_mean", "kl", "image/reward_mean",  # = image/reward/main/...
                      "image/kl", "image/clip_fraction", "loss/image_policy", "image/sample_s"]
