"""On a CUDA device in bf16 (skipped without one; CI has none): the steps that had no gpu test (issue 49,
part 1). GRPO and PPO (rollout with HF generate, then the update steps), KTO, ORPO and Safe-MM-DPO: every
optimizer step after the warm ones makes at most one synchronising CUDA call (the step's read-back of its
losses and gradient norms), the CUDA twin of ``tests/integration/test_host_syncs.py``; the VLM SFT step and
Flow-GRPO train on CUDA in bf16 with finite losses.

Under ``torch.cuda.set_sync_debug_mode("warn")`` each synchronising call warns from the Python line that made
it: a failure names every one (file:line and the op's message), not a count. The rollout's own syncs (HF
generate's stop check, once per token) are not counted: only the update steps are held to one."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from alignkit.config import load_config
from alignkit.train.offline_loop import OfflineTrainer
from alignkit.train.online_loop import OnlineTrainer
from alignkit.train.runner import run_train
from tests.conftest import REPO
from tests.safe_dpo_models import make_scorers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

WARM = 2  # steps before counting: optimizer state and caches are built on the first ones
QUIET = ["training.eval_steps=null", "logging.logging_steps=100", "logging.report_to=[]", "logging.plot=false",
         "checkpoint.save_final=false", "checkpoint.save_steps=null", "model.dtype=bf16"]


def synced_steps(monkeypatch: pytest.MonkeyPatch, config: str | Path, overrides: list[str]) -> list[list[str]]:
    """Run ``config`` (a name in configs/, or a path) in this process; for every optimizer step after the warm ones, the synchronising
    CUDA calls it made, each as "file:line: message"."""
    steps: list[list[str]] = []
    seen = [0]

    def counted(original: Any) -> Any:
        def step(self: Any, arg: Any) -> Any:
            seen[0] += 1
            if seen[0] <= WARM:
                return original(self, arg)
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    out = original(self, arg)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            steps.append([f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "synchroniz" in str(w.message)])
            return out
        return step

    monkeypatch.setattr(OfflineTrainer, "_step", counted(OfflineTrainer._step))
    monkeypatch.setattr(OnlineTrainer, "_step", counted(OnlineTrainer._step))
    run_train(load_config(str(REPO / "configs" / config), overrides))  # an absolute path stays itself
    assert steps, "no step was counted"
    return steps


def assert_one_sync_per_step(steps: list[list[str]]) -> None:
    for i, calls in enumerate(steps):
        assert len(calls) <= 1, f"step {WARM + 1 + i}: {len(calls)} synchronising calls:\n" + "\n".join(calls)


def offline_overrides(micro_model: Path, tmp_path: Path) -> list[str]:
    return [f"model.name_or_path={micro_model}", f"output_dir={tmp_path / 'run'}", "data.max_train_examples=32",
            "data.max_length=64", "training.per_device_batch_size=4", "training.max_steps=5", *QUIET]


@pytest.mark.parametrize("config,extra", [("kto.yaml", ["training.gradient_accumulation_steps=2"]),
                                          ("orpo.yaml", [])], ids=["kto", "orpo"])
def test_preference_steps_in_bf16_do_not_sync(monkeypatch, micro_model: Path, tmp_path: Path, config: str,
                                              extra: list[str]) -> None:
    assert_one_sync_per_step(synced_steps(monkeypatch, config, [*offline_overrides(micro_model, tmp_path), *extra]))


def test_safe_dpo_step_in_bf16_does_not_sync(monkeypatch, micro_model: Path, tmp_path: Path) -> None:
    helpful, cost = make_scorers(micro_model, tmp_path / "scorers")
    assert_one_sync_per_step(synced_steps(monkeypatch, "safe_dpo.yaml", [
        *offline_overrides(micro_model, tmp_path), f"safe_dpo.helpful_model={helpful}",
        f"safe_dpo.cost_model={cost}", "safe_dpo.cost_eval_every=2", "safe_dpo.cost_eval_prompts=2",
        "safe_dpo.cost_max_new_tokens=4"]))


@pytest.mark.parametrize("config", ["grpo.yaml", "ppo.yaml"])
def test_online_rollout_and_update_in_bf16(monkeypatch, micro_model: Path, tmp_path: Path, config: str) -> None:
    """3 iterations of rollout (HF generate) and 2 update steps each; the update steps after the warm ones
    make at most one synchronising call each."""
    assert_one_sync_per_step(synced_steps(monkeypatch, config, [
        f"model.name_or_path={micro_model}", f"output_dir={tmp_path / 'run'}", "rollout.num_generations=4",
        "rollout.max_new_tokens=8", "rollout.update_epochs=2", "training.per_device_batch_size=8",
        "training.gradient_accumulation_steps=2", "training.max_steps=6", *QUIET]))


def logged_losses(run: Path) -> list[float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r["loss"] for r in rows if "loss" in r]


def test_vlm_sft_step_in_bf16(micro_llava: Path, tmp_path: Path) -> None:
    from alignkit.data.synth_vlm import generate_vlm

    data = generate_vlm(16, 0, tmp_path / "sft.json", stage="sft", split="train")
    run_train(load_config(str(REPO / "configs" / "vlm_sft.yaml"), [
        f"model.name_or_path={micro_llava}", f"data.train={data}", "data.image_root=null", "data.eval=[]",
        "vlm.stage=pretrain", f"output_dir={tmp_path / 'run'}", "training.max_steps=4",
        "training.global_batch_size=4", "training.eval_steps=null", "checkpoint.save_steps=null",
        "checkpoint.save_final=false", "logging.logging_steps=1", "logging.report_to=[jsonl]", "logging.plot=false",
        "model.dtype=bf16"]))
    losses = logged_losses(tmp_path / "run")
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), losses


def test_flow_grpo_steps_in_bf16(micro_sd3: Path, tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    from alignkit.data.synth_vlm import generate_vlm

    train = generate_vlm(16, 0, tmp_path / "captions.json", stage="pretrain", split="train")
    run_train(load_config(str(REPO / "configs" / "flow_grpo.yaml"), [
        f"model.name_or_path={micro_sd3}", f"data.train={train}",
        f"output_dir={tmp_path / 'run'}", "training.global_batch_size=8", "training.per_device_batch_size=8",
        "rollout.num_generations=4", "flow_grpo.num_inference_steps=2", "flow_grpo.eval_num_inference_steps=2",
        "training.max_steps=4", "checkpoint.save_steps=null", "checkpoint.save_final=false",
        "logging.report_to=[jsonl]", "logging.plot=false", "model.dtype=bf16"]))
    losses = logged_losses(tmp_path / "run")
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses


# --------------------------------------------------------------------------- training.liger_layers (issue 49, 4)
def _liger_or_skip() -> None:
    from alignkit.models.liger import liger_installed

    if not liger_installed():
        pytest.skip("needs liger-kernel (pip install 'alignkit[liger]')")


def _logits_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits.float()
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    return logits.detach(), [p.grad.float() for p in model.parameters() if p.grad is not None]


def test_liger_layers_match_the_plain_modules_in_bf16(monkeypatch, micro_model: Path) -> None:
    """Liger's RMSNorm, SwiGLU and RoPE (models/liger.py) against the plain Llama modules in bf16: the logits and
    every gradient equal within bf16 round-off. The plain model runs first: Liger's RoPE patch is module-wide."""
    _liger_or_skip()
    import copy

    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    from alignkit.models.liger import apply_liger_layers

    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):  # restored after the test
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))
    plain = AutoModelForCausalLM.from_pretrained(str(micro_model), dtype=torch.bfloat16).cuda()
    patched = copy.deepcopy(plain)
    ids = torch.randint(0, plain.config.vocab_size, (4, 64), device="cuda")
    want_logits, want_grads = _logits_and_grads(plain, ids)
    apply_liger_layers(patched)
    assert patched.model.layers[0].mlp._get_name() == "LigerSwiGLUMLP"  # Liger's instance patch took
    logits, grads = _logits_and_grads(patched, ids)
    assert (logits - want_logits).abs().max() <= 3e-2 * want_logits.abs().max()
    assert len(grads) == len(want_grads)
    worst = max(((g - w).norm() / w.norm().clamp_min(1e-12)).item() for g, w in zip(grads, want_grads))
    assert worst < 5e-2, worst


def test_sft_steps_with_liger_layers_in_bf16(monkeypatch, micro_model: Path, tmp_path: Path) -> None:
    """The runner's wiring on CUDA: training.liger_layers (with the fused head beside it) trains with finite losses."""
    _liger_or_skip()
    from transformers.models.llama import modeling_llama

    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))
    run_train(load_config(str(REPO / "configs" / "sft.yaml"), [
        f"model.name_or_path={micro_model}", f"output_dir={tmp_path / 'run'}", "training.max_steps=3",
        "training.liger_layers=true", "training.liger_kernel=true", "logging.logging_steps=1",
        "logging.report_to=[jsonl]", "logging.plot=false", *[q for q in QUIET if not q.startswith("logging.")]]))
    losses = logged_losses(tmp_path / "run")
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
