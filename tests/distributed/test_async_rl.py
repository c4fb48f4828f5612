"""``rollout.placement: separate`` (generator processes beside the trainers, gloo on CPU).

* k = 0 is synchronous: 1 trainer + 1 generator process give EXACTLY the numbers of 1 colocated process (every
  logged loss, reward and gradient norm, and the final weights), since every completion is sampled from its own
  seed (rollout/seeds.py) by the same weights, and the trainers recompute the experience as colocated;
* k = 1: every iteration after the first trains on samples one version old (``staleness/1``), none dropped,
  weighted by the behaviour log-probs the generator took off its decoding steps (none travel at staleness 0);
* a 2-trainer + 1-generator run killed with SIGKILL after a checkpoint and resumed from it: the same prompts
  in the same iterations as the uninterrupted run (each consumed once), and with k = 0 the same losses and final
  weights.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import assert_ok, child_env, free_port, run_cli
from tests.distributed.runs import final_weights, max_delta

pytestmark = pytest.mark.distributed


def _config(micro_model: Path, tmp_path: Path, steps: int = 4) -> Path:
    from alignkit.data.synth import make_prompt_rows, write_rows

    prompts = tmp_path / "prompts.jsonl"
    write_rows(make_prompt_rows(40, seed=0), prompts)
    cfg = tmp_path / "grpo.yaml"
    cfg.write_text(f"""algorithm: grpo
model: {{name_or_path: {micro_model}}}
data: {{train: {prompts}, max_length: 48}}
rollout: {{num_generations: 4, max_new_tokens: 6, log_samples: 8}}
training: {{per_device_batch_size: 4, gradient_accumulation_steps: 2, learning_rate: 1.0e-3, max_steps: {steps}, seed: 0}}
checkpoint: {{save_steps: 2}}
logging: {{report_to: [jsonl], logging_steps: 1, plot: false}}
reward: {{functions: [{{name: length, weight: 0.1}}]}}
""")
    return cfg


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _prompts(run: Path) -> dict[int, list[str]]:
    """The prompts rank 0 trained on, by step (samples.jsonl: all of rank 0's samples of every iteration); a step
    logged again (by a resumed run after a kill) counts as its last logging."""
    out: dict[int, list[str]] = {}
    last = None
    for line in (run / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["step"] != last:
            out[row["step"]], last = [], row["step"]
        out[row["step"]].append(row["prompt"])
    return out


@pytest.mark.slow(seconds=90)
def test_k0_separate_equals_colocated_and_k1_is_one_version_stale(micro_model: Path, tmp_path: Path) -> None:
    cfg = _config(micro_model, tmp_path)
    common = ["train", str(cfg), "distributed.strategy=single"]
    assert_ok(run_cli([*common, f"output_dir={tmp_path / 'colocated'}"], timeout=300))
    assert_ok(run_cli([*common, f"output_dir={tmp_path / 'k0'}", "rollout.placement=separate"], nproc=2, timeout=300))
    colocated, k0 = _rows(tmp_path / "colocated"), _rows(tmp_path / "k0")
    assert len(colocated) == len(k0) == 4
    for a, b in zip(colocated, k0):
        for key in ("loss", "reward_mean", "grad_norm", "completion_length", "advantage_std"):
            assert a[key] == b[key], (key, a[key], b[key])
        assert b["staleness/0"] == 8 and b["staleness/dropped"] == 0 and b["staleness/max"] == 0
        assert b["async/weight_sync_s"] >= 0 and b["async/generator_generate_s"] > 0
        assert b["async/generator_sample_s"] > 0 and "async/generator_send_s" in b
        # staleness 0: the behaviour policy is the trainer's own, so no behaviour log-probs travel (as colocated)
        assert "sampler_is_ratio" not in b and "sampler_is_ratio" not in a
    assert max_delta(final_weights(tmp_path / "colocated"), final_weights(tmp_path / "k0")) == 0.0
    assert_ok(run_cli([*common, f"output_dir={tmp_path / 'k1'}", "rollout.placement=separate",
                       "rollout.max_staleness=1"], nproc=2, timeout=300))
    k1 = _rows(tmp_path / "k1")
    assert [r["staleness/mean"] for r in k1] == [0.0, 1.0, 1.0, 1.0]  # iteration 0 has only version 0
    assert all(r["staleness/dropped"] == 0 for r in k1)
    # stale samples carry the generator's log-probs, taken off its decoding steps (no forward): weighted
    assert "sampler_is_ratio" not in k1[0] and all(r["sampler_is_ratio"] > 0 for r in k1[1:])
    assert all(r["async/generator_behaviour_logps_s"] < r["async/generator_sample_s"] for r in k1)
    assert k1[0]["loss"] == colocated[0]["loss"] and k1[0]["reward_mean"] == colocated[0]["reward_mean"]
    assert k1[1]["reward_mean"] != colocated[1]["reward_mean"]  # sampled by the weights before update 1


def _launch(args: list[str], nproc: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           "-m", "alignkit", "train", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
                            start_new_session=True)


@pytest.mark.slow(seconds=150)
@pytest.mark.parametrize("k", [0, 1])
def test_killed_and_resumed_async_run(micro_model: Path, tmp_path: Path, k: int) -> None:
    cfg = _config(micro_model, tmp_path, steps=12)
    common = [str(cfg), "distributed.strategy=ddp", "rollout.placement=separate", f"rollout.max_staleness={k}",
              "training.per_device_batch_size=2"]  # 2 trainers x 2 x accumulation 2 = 8 completions, as colocated
    assert_ok(run_cli(["train", *common, f"output_dir={tmp_path / 'straight'}"], nproc=3, timeout=400))
    run = tmp_path / "killed"
    proc = _launch([*common, f"output_dir={run}"], nproc=3)
    deadline = time.time() + 300
    while not (run / "latest").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    # every process of the run, anywhere in its iteration (torchrun starts its workers in sessions of their own)
    for child in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
        child.send_signal(signal.SIGKILL)
    proc.communicate()
    assert (run / "latest").exists() and not (run / "final").exists(), "the run ended before it was killed"
    killed_at = int((run / "latest").read_text().strip().split("-")[-1])
    assert_ok(run_cli(["train", *common, f"output_dir={run}", "checkpoint.resume_from=latest"], nproc=3, timeout=400))
    straight, resumed = _prompts(tmp_path / "straight"), _prompts(run)
    assert resumed == straight  # every iteration's prompts, before and after the kill: each prompt consumed once
    after = {r["step"]: r for r in _rows(run)}  # a step logged twice: the resumed run's
    for row in _rows(tmp_path / "straight"):
        got = after[row["step"]]
        if k == 0:
            assert got["loss"] == row["loss"] and got["reward_mean"] == row["reward_mean"], (row["step"], killed_at)
        elif row["step"] == killed_at + 1:  # sampled by the checkpoint's own weights (module docstring)
            assert got["staleness/mean"] == 0.0 and row["staleness/mean"] == 1.0
        else:
            assert got["staleness/mean"] == row["staleness/mean"]
    if k == 0:
        assert max_delta(final_weights(tmp_path / "straight"), final_weights(run)) == 0.0


@pytest.mark.slow(seconds=90)
def test_reward_model_scores_on_the_generator_and_k0_equals_colocated(micro_model: Path, tmp_path: Path) -> None:
    """``reward.model`` (a tiny scalar model beside a reward function) under ``placement: separate``: the generator
    (global rank 1) loads the ``reward`` role and scores with it (``async/reward_model_rank`` 1, the trainer says it
    does not load it), and with k = 0 every logged loss, reward and model score and the final weights equal the
    colocated run's, where the one process scores."""
    from alignkit.config.schema import ModelConfig
    from alignkit.models.scalar import load_scalar_model

    rm = tmp_path / "rm"
    load_scalar_model(ModelConfig(name_or_path=str(micro_model)), trainable=False).save_pretrained(rm)
    for f in micro_model.glob("tokenizer*"):
        (rm / f.name).write_bytes(f.read_bytes())
    cfg = _config(micro_model, tmp_path, steps=2)
    common = ["train", str(cfg), "distributed.strategy=single", f"reward.model={rm}", "reward.model_weight=2.0"]
    assert_ok(run_cli([*common, f"output_dir={tmp_path / 'colocated'}"], timeout=300))
    proc = run_cli([*common, f"output_dir={tmp_path / 'k0'}", "rollout.placement=separate"], nproc=2, timeout=300)
    assert_ok(proc)
    assert "reward model roles reward score on the generators, not loaded on the trainers" in proc.stderr
    colocated, k0 = _rows(tmp_path / "colocated"), _rows(tmp_path / "k0")
    assert len(colocated) == len(k0) == 2
    for a, b in zip(colocated, k0):
        assert "async/reward_model_rank" not in a and b["async/reward_model_rank"] == 1
        for key in ("loss", "reward_mean", "reward/model", "reward/length", "grad_norm", "advantage_std"):
            assert a[key] == b[key], (key, a[key], b[key])
    assert colocated[0]["reward/model"] != 0.0  # the model scored something
    assert max_delta(final_weights(tmp_path / "colocated"), final_weights(tmp_path / "k0")) == 0.0
