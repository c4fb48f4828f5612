"""``model.freeze``: parameters named by a pattern keep their start values through training, alone and under DDP
(2 processes == 1 on the same global batch), and a pattern that names nothing is one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, assert_ok, run_cli

FREEZE = r"model.freeze=[embed_tokens, 'layers\.0\.']"


def sft(model: Path, out: Path, *extra: str) -> list[str]:
    return ["train", str(REPO / "configs" / "sft.yaml"), f"model.name_or_path={model}", f"output_dir={out}",
            "data.max_train_examples=32", "data.eval=null", "training.eval_steps=null", "training.max_steps=3",
            "training.learning_rate=1e-3", "checkpoint.save_steps=null", "logging.report_to=[jsonl]",
            "logging.plot=false", *extra]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(next(path.glob("*.safetensors"))))


def frozen(name: str) -> bool:
    return "embed_tokens" in name or ".layers.0." in name


def test_frozen_parameters_keep_their_values_alone_and_under_ddp(micro_model: Path, tmp_path: Path) -> None:
    start = weights(micro_model)
    one, two = tmp_path / "one", tmp_path / "two"
    assert_ok(run_cli(sft(micro_model, one, FREEZE, "training.per_device_batch_size=4")))
    assert_ok(run_cli(sft(micro_model, two, FREEZE, "training.per_device_batch_size=2"), nproc=2))
    a, b = weights(one / "final"), weights(two / "final")
    assert set(a) == set(start) and any(frozen(n) for n in a) and any(not frozen(n) for n in a)
    for name, w in a.items():
        if frozen(name):
            assert torch.equal(w, start[name]), name
            assert torch.equal(b[name], start[name]), name
        else:  # the rest trained, the same on 2 processes as on 1
            assert not torch.equal(w, start[name]), name
            torch.testing.assert_close(b[name], w, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(("extra", "message"), [
    (["model.freeze=[vision_tower]"], "model.freeze: 'vision_tower' matches no parameter of this LlamaForCausalLM"),
    (["model.freeze=['.']"], "model.freeze: the expressions freeze every parameter"),
    (["model.freeze=[embed_tokens]", "model.lora={r: 4}"], "model.freeze: not with model.lora"),
])
def test_a_freeze_that_cannot_apply_is_one_line(micro_model: Path, tmp_path: Path, extra: list[str],
                                                message: str) -> None:
    proc = run_cli(sft(micro_model, tmp_path / "run", *extra))
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
