"""The red-team ``t2i_vlm`` pieces: the deterministic ``builtin:shapes`` renderer, the diffusers renderer's
calls and missing-package error, and the ``clip_quality`` scorer (a tiny random CLIP)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from alignkit.algorithms.redteam import RedTeamConfig, RedTeamScorerConfig, RedTeamTargetConfig
from alignkit.config.schema import ModelConfig
from alignkit.errors import ConfigError, ModelError
from alignkit.models.diffusion_render import DiffusersRenderer, build_renderer, seed_of, shapes_scene
from alignkit.rewards.scorers import Judged, build_scorer
from alignkit.rollout.redteam_targets import T2IVLMTarget, build_target
from tests.plugins.redteam_parts import build_clip, build_tiny_sd

CPU = torch.device("cpu")


def pixels(img: object) -> np.ndarray:
    return np.asarray(img)


def test_shapes_renderer_is_a_deterministic_function_of_the_words() -> None:
    render = build_renderer(RedTeamTargetConfig(name="t2i_vlm", model="m"))
    texts = ["a red circle next to a blue square", "a red circle next to a blue square",
             "a green circle next to a blue square", "no colour named here", "no colour named here"]
    imgs = render(texts, CPU)
    assert all(img.size == (32, 32) and img.mode == "RGB" for img in imgs)
    assert (pixels(imgs[0]) == pixels(imgs[1])).all() and (pixels(imgs[3]) == pixels(imgs[4])).all()
    assert (pixels(imgs[0]) != pixels(imgs[2])).any()  # another colour word, another image
    assert shapes_scene(texts[0]) == [{"shape": "circle", "colour": "red", "position": "top left"},
                                      {"shape": "square", "colour": "blue", "position": "top right"}]
    assert shapes_scene("Red triangles!")[0] == {"shape": "triangle", "colour": "red", "position": "top left"}
    assert shapes_scene("just yellow") == [{"shape": "square", "colour": "yellow", "position": "top left"}]
    # a red pixel where the red circle is drawn, a green one in the other image
    assert tuple(pixels(imgs[0])[:16, :16].reshape(-1, 3).max(0)) == (230, 30, 30)
    assert tuple(pixels(imgs[2])[:16, :16].reshape(-1, 3).max(0)) == (30, 200, 30)
    big = build_renderer(RedTeamTargetConfig(name="t2i_vlm", model="m", height=48, width=64))(texts[:1], CPU)[0]
    assert big.size == (64, 48)


def test_diffusers_renderer_calls_the_pipeline_and_names_the_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = RedTeamTargetConfig(name="t2i_vlm", model="m", renderer="some/pipeline", num_inference_steps=3,
                              guidance_scale=2.0, height=16, render_batch_size=2)
    monkeypatch.setitem(sys.modules, "diffusers", None)
    with pytest.raises(ModelError, match=r"needs diffusers \(pip install 'alignkit\[image\]'\)"):
        build_renderer(cfg)(["x"], CPU)
    calls: list[dict] = []

    class Pipe:
        def set_progress_bar_config(self, **_: object) -> None:
            pass

        def to(self, device: torch.device) -> "Pipe":
            return self

        def __call__(self, **kw: object) -> SimpleNamespace:
            calls.append(kw)
            return SimpleNamespace(images=[f"img:{p}" for p in kw["prompt"]])

    loaded: list[str] = []
    fake = SimpleNamespace(AutoPipelineForText2Image=SimpleNamespace(from_pretrained=lambda p: loaded.append(p) or Pipe()))
    monkeypatch.setitem(sys.modules, "diffusers", fake)
    # the made-up hub id would be probed on the Hub before loading (models/sources.check_hub, tested in
    # test_hub_probe.py); the fake loader stands in for the Hub here
    import alignkit.models.sources as sources

    monkeypatch.setattr(sources, "check_hub", lambda source: None)
    render = build_renderer(cfg)
    assert isinstance(render, DiffusersRenderer)
    assert render(["a", "b", "c"], CPU) == ["img:a", "img:b", "img:c"] and loaded == ["some/pipeline"]
    assert [c["prompt"] for c in calls] == [["a", "b"], ["c"]]
    assert all(c["num_inference_steps"] == 3 and c["guidance_scale"] == 2.0 and c["height"] == 16 and "width" not in c
               for c in calls)
    assert calls[0]["generator"][1].initial_seed() == seed_of("b")  # one seeded generator per attack


def test_diffusers_renderer_on_a_tiny_random_pipeline(micro_llava: Path, tmp_path: Path) -> None:
    """Where diffusers is installed (the ``image`` extra): a saved pipeline loads by path, renders each attack
    at the asked size, and the same attack gives the same image (its generator seeded from its text)."""
    pytest.importorskip("diffusers")
    path = build_tiny_sd(str(tmp_path / "sd"), build_clip(str(tmp_path / "clip"), str(micro_llava)))
    cfg = RedTeamTargetConfig(name="t2i_vlm", model="m", renderer=path, num_inference_steps=2, height=16, width=16,
                              render_batch_size=2)
    imgs = build_renderer(cfg)(["a red circle", "blue", "a red circle"], CPU)
    assert [im.size for im in imgs] == [(16, 16)] * 3
    assert (pixels(imgs[0]) == pixels(imgs[2])).all() and (pixels(imgs[0]) != pixels(imgs[1])).any()


def test_t2i_target_is_a_frozen_vlm_role_and_clip_quality_needs_it() -> None:
    target = build_target(RedTeamTargetConfig(name="t2i_vlm", model="vlm-dir"))
    assert isinstance(target, T2IVLMTarget)
    assert [(s.role, s.source, s.kind, s.trainable) for s in target.specs()] == [("target", "vlm-dir", "vlm", False)]
    clip = RedTeamScorerConfig(name="clip_quality", use="quality", model="clip")
    tox = RedTeamScorerConfig(name="unsafe")
    with pytest.raises(ConfigError, match="clip_quality scores rendered images: it needs redteam.target.name: t2i_vlm"):
        RedTeamConfig(scorers=[tox, clip])
    RedTeamConfig(target=RedTeamTargetConfig(name="t2i_vlm", model="m"), scorers=[tox, clip])


def test_clip_quality_is_clip_logits_per_image_over_30(micro_llava: Path, tmp_path: Path) -> None:
    from transformers import CLIPModel, CLIPProcessor

    path = build_clip(str(tmp_path / "clip"), str(micro_llava))
    render = build_renderer(RedTeamTargetConfig(name="t2i_vlm", model="m"))
    attacks = ["a red circle", "two blue squares and a green triangle", "nothing"]
    images = render(attacks, CPU)
    batch = Judged(attacks, ["x", "y", "z"], [None] * 3, [{}] * 3, images)
    scorer = build_scorer(RedTeamScorerConfig(name="clip_quality", use="quality", model=path, batch_size=2), ModelConfig())
    got = scorer(batch, CPU)
    model, proc = CLIPModel.from_pretrained(path).eval(), CLIPProcessor.from_pretrained(path)
    with torch.no_grad():
        want = [float(model(**proc(text=[a], images=[im], return_tensors="pt")).logits_per_image[0, 0]) / 30
                for a, im in zip(attacks, images)]
    assert got == pytest.approx(want, abs=1e-5)
    with pytest.raises(ConfigError, match="clip_quality needs rendered images"):
        scorer(Judged(attacks, ["x"] * 3, [None] * 3, [{}] * 3, [None] * 3), CPU)


def test_vlm_text_puts_one_image_before_the_templated_attack(processor: object) -> None:
    from alignkit.rollout.redteam_targets import vlm_text

    want = "<|im_start|>user\n<image>\nsay: hi<|im_end|>\n<|im_start|>assistant\n"
    assert vlm_text(processor, "say: hi", True) == want
    assert vlm_text(processor, "say: hi", False) == "<image>\nsay: hi"
