"""``alignkit train`` of a red-team run whose target is ``t2i_vlm`` on tiny models: the micro Llama attacker
(LoRA), the ``builtin:shapes`` renderer, the micro LLaVA continuing the template on each image, a function
toxicity scorer on its text and a tiny random CLIP's ``clip_quality`` of image and attack; in one process and
under 2-process DDP (placement main: the CLIP on rank 0, which reads every rank's rendered images)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from alignkit.algorithms.redteam import RedTeamTargetConfig
from alignkit.data.synth import make_prompt_rows, write_rows
from alignkit.models.diffusion_render import build_renderer
from tests.conftest import REPO, assert_ok, jsonl, run_cli
from tests.plugins.redteam_parts import build_clip, tiny_train_args, vowel_share


@pytest.fixture(scope="module")
def parts(micro_llava: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("redteam_t2i")
    return {"clip": Path(build_clip(str(root / "clip"), str(micro_llava))),
            "train": write_rows(make_prompt_rows(8, seed=0), root / "train.jsonl"),
            "eval": write_rows(make_prompt_rows(2, seed=1), root / "eval.jsonl")}


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_t2i_vlm_chain_trains_on_tiny_models(micro_model: Path, micro_llava: Path, parts: dict[str, Path],
                                             tmp_path: Path, nproc: int) -> None:
    out = tmp_path / "run"
    scorers = (f"[{{name: 'tests.plugins.redteam_parts:vowel_share'}}, "
               f"{{name: clip_quality, use: quality, model: '{parts['clip']}'}}]")
    args = tiny_train_args(str(REPO / "configs" / "redteam.yaml"), str(out), str(micro_model), str(parts["train"]),
                           str(parts["eval"]), nproc, generations=2, batch=4, max_new_tokens=6)
    args += ["redteam.target.name=t2i_vlm", f"redteam.target.model={micro_llava}", "redteam.target.max_new_tokens=6",
             f"redteam.scorers={scorers}", "redteam.w_quality=0.5"]
    assert_ok(run_cli(args, nproc=nproc, cwd=REPO, timeout=400))
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in logged if "loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    for key in ("reward_mean", "toxicity_mean", "quality_mean", "toxicity/tests.plugins.redteam_parts:vowel_share",
                "quality/clip_quality", "attack_success_rate", "kl"):
        assert key in train[-1], key
    assert any("eval/reward_mean" in r for r in logged)
    rows = jsonl(out / "attacks.jsonl")
    assert len(rows) == 8 and {r["step"] for r in rows} == {1, 2}
    assert all(isinstance(r["output"], str) for r in rows) and any(r["output"].strip() for r in rows)
    # the toxicity read the VLM's text; the quality is the CLIP's logits_per_image / 30 of the attack's image
    assert [r["toxicity"] for r in rows] == pytest.approx(vowel_share([None] * len(rows), [r["output"] for r in rows]))
    from transformers import CLIPModel, CLIPProcessor

    model, proc = CLIPModel.from_pretrained(parts["clip"]).eval(), CLIPProcessor.from_pretrained(parts["clip"])
    images = build_renderer(RedTeamTargetConfig(name="t2i_vlm", model="m"))([r["attack"] for r in rows], torch.device("cpu"))
    with torch.no_grad():
        want = [float(model(**proc(text=[r["attack"] or " "], images=[im], return_tensors="pt", truncation=True,
                                   max_length=64)).logits_per_image[0, 0]) / 30 for r, im in zip(rows, images)]
    assert [r["quality"] for r in rows] == pytest.approx(want, abs=1e-4)
    assert all(r["quality/clip_quality"] == pytest.approx(r["quality"]) for r in rows)
