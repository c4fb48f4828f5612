"""vlm_sft on a tiny random LLaVA: stage freezing, label masking of image and prompt tokens, bad images
named, packed == padded for image rows, a pretrain projector into sft, save -> transformers -> same logits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from alignkit.config import load_config
from alignkit.config.schema import ModelConfig
from alignkit.constants import IGNORE_INDEX
from alignkit.data.io import Row
from alignkit.data.synth_vlm import generate_vlm
from alignkit.data.vlm import VLMCollator, VLMData, vlm_example
from alignkit.errors import ConfigError, DataError
from alignkit.models.loading import hf_model
from alignkit.models.policy import forward_logps
from alignkit.models.roles import ModelSpec, build_model
from alignkit.models.tiny_vlm import IMAGE_SIZE, PATCH_SIZE
from alignkit.models.vlm import PARTS, part_of, unused_by_llava
from alignkit.train.optim import build_optimizer


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 sft rows of the shapes task (LLaVA JSON) with their images."""
    return generate_vlm(8, 0, tmp_path_factory.mktemp("shapes") / "sft.json", stage="sft", split="train")


def _cfg(micro_llava: Path, data: Path, *over: str) -> Any:
    return load_config(None, ["algorithm=vlm_sft", f"model.name_or_path={micro_llava}", f"data.train={data}",
                              "data.max_length=160", "training.per_device_batch_size=4", *over])


def _rows(path: Path) -> list[Row]:
    return [Row(r, str(path), i) for i, r in enumerate(json.loads(path.read_text()), start=1)]


def _batch(processor: Any, shapes: Path, n: int = 3, packed: bool = False) -> dict[str, torch.Tensor]:
    examples = [vlm_example(processor, r, image_root=None, max_length=160) for r in _rows(shapes)[:n]]
    return VLMCollator(processor, processor.tokenizer.pad_token_id, packed=packed)(examples)


@pytest.mark.parametrize("over, trained", [
    (["vlm.stage=pretrain"], {"projector"}),
    (["vlm.stage=sft"], {"projector", "language_model"}),
    (["vlm.stage=sft", "vlm.train_vision_tower=true"], set(PARTS)),
])
def test_stage_freezing_gradients_and_optimizer(micro_llava: Path, shapes: Path, processor: Any, over: list[str],
                                                trained: set[str]) -> None:
    from alignkit.algorithms import ALGORITHMS

    cfg = _cfg(micro_llava, shapes, *over)
    (spec,) = ALGORITHMS.get("vlm_sft").model_specs(cfg)
    model = build_model(spec, cfg.model, torch.float32, None)
    forward_logps(model, _batch(processor, shapes)).sum().backward()
    unused = {n for n, _ in model.named_parameters() if unused_by_llava(model.hf_model, n.removeprefix("hf_model."))}
    assert unused == {n for n, _ in model.named_parameters() if "post_layernorm" in n}  # vision_feature_layer=-1
    for name, p in model.named_parameters():
        should = part_of(name) in trained and name not in unused
        assert p.requires_grad == should, name
        assert (p.grad is not None) == should, name
    # in every trained part some gradient is non-zero (the image reaches the loss through the projector)
    assert {part_of(n) for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0} == trained
    opt = build_optimizer(model, cfg.training, 1e-3)
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_opt == {id(p) for n, p in model.named_parameters() if part_of(n) in trained and n not in unused}


def test_sft_lora_trains_adapters_and_projector_only(micro_llava: Path, shapes: Path, processor: Any) -> None:
    from alignkit.algorithms import ALGORITHMS

    cfg = _cfg(micro_llava, shapes, "vlm.stage=sft", "model.lora.r=4")
    (spec,) = ALGORITHMS.get("vlm_sft").model_specs(cfg)
    model = build_model(spec, cfg.model, torch.float32, None)
    forward_logps(model, _batch(processor, shapes)).sum().backward()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)
    assert all("lora_" in n or part_of(n) == "projector" for n in trainable)
    assert any("lora_" in n and "language_model" in n for n in trainable)
    assert not any("vision_tower" in n for n in trainable)  # CLIP's q/k/v_proj get no adapters
    with pytest.raises(ConfigError, match="pretrain stage trains the projector only"):
        ALGORITHMS.get("vlm_sft").model_specs(_cfg(micro_llava, shapes, "vlm.stage=pretrain", "model.lora.r=4"))


def test_image_and_prompt_tokens_carry_no_loss(processor: Any, shapes: Path) -> None:
    row = _rows(shapes)[0]
    ex = vlm_example(processor, row, image_root=None, max_length=160)
    assert ex is not None
    ids, labels = ex["input_ids"], ex["labels"]
    image_id = processor.image_token_id
    n_image = (IMAGE_SIZE // PATCH_SIZE) ** 2  # one token per patch
    assert ids.count(image_id) == n_image
    assert all(lab == IGNORE_INDEX for t, lab in zip(ids, labels) if t == image_id)
    tok = processor.tokenizer
    trained = tok.decode([t for t in labels if t != IGNORE_INDEX])
    answers = [c["value"] for c in row.data["conversations"] if c["from"] == "gpt"]
    assert trained == "".join(f"{a}<|im_end|>\n" for a in answers)  # assistant turns (and their end) only
    every = vlm_example(processor, row, image_root=None, max_length=160, loss_on="all")
    assert every is not None and all(lab == IGNORE_INDEX for t, lab in zip(every["input_ids"], every["labels"])
                                     if t == image_id)
    assert sum(lab != IGNORE_INDEX for lab in every["labels"]) == len(ids) - n_image


def test_messages_rows_with_image_parts_match_llava_rows(processor: Any, shapes: Path) -> None:
    row = _rows(shapes)[0]
    conv = row.data["conversations"]
    msgs = [{"role": "user", "content": [{"type": "image", "image": row.data["image"]},
                                         {"type": "text", "text": conv[0]["value"].removeprefix("<image>\n")}]}]
    msgs += [{"role": "user" if c["from"] == "human" else "assistant", "content": c["value"]} for c in conv[1:]]
    other = Row({"messages": msgs}, row.source, 1)
    assert vlm_example(processor, other, image_root=None, max_length=160) == \
        vlm_example(processor, row, image_root=None, max_length=160)


def test_missing_and_corrupt_images_name_file_and_row(micro_llava: Path, tmp_path: Path, shapes: Path) -> None:
    rows = json.loads(shapes.read_text())[:3]
    (tmp_path / "images").mkdir()
    for r in rows:
        (tmp_path / r["image"]).write_bytes((shapes.parent / r["image"]).read_bytes())
    (tmp_path / rows[1]["image"]).write_bytes(b"\x89PNG\r\n\x1a\n not really")  # corrupt
    rows[2]["image"] = "images/nowhere.png"  # missing
    data = tmp_path / "rows.json"
    data.write_text(json.dumps(rows))
    from alignkit.algorithms.vlm import load_processor

    cfg = _cfg(micro_llava, data)
    pipeline = VLMData(load_processor(cfg), cfg.data)
    with pytest.raises(DataError, match=rf"rows.json:2 field 'image': cannot read image .*{rows[1]['image']}"):
        pipeline.build_dataset([str(data)], "train")
    cfg = _cfg(micro_llava, data, "data.skip_invalid=true")
    pipeline = VLMData(load_processor(cfg), cfg.data)
    assert len(pipeline.build_dataset([str(data)], "train")) == 1
    counts = pipeline.row_counts["train"]
    assert counts.dropped == {"unreadable image": 1, "missing image": 1}
    assert "nowhere.png does not exist" in counts.summary() or counts.first["missing image"].endswith("rows.json:3")


def test_packed_equals_padded_for_image_rows(micro_llava: Path, processor: Any, shapes: Path) -> None:
    model = build_model(ModelSpec("policy", str(micro_llava), "vlm", trainable=True,
                                  train_parts=("projector", "language_model")),
                        ModelConfig(name_or_path=str(micro_llava)), torch.float32, None)
    grads = []
    for packed in (False, True):
        model.zero_grad()
        batch = _batch(processor, shapes, n=4, packed=packed)
        assert batch["pixel_values"].shape[0] == 4 and (batch["input_ids"].shape[0] == 1) == packed
        logps = forward_logps(model, batch)
        logps.sum().backward()
        grads.append((logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = grads
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert ga.keys() == gb.keys() and ga
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-4, atol=1e-6, msg=n)


def test_packed_rows_attend_per_example_in_the_language_model(micro_llava: Path, processor: Any, shapes: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A VLM loads with ``sdpa_packed`` for its language model only: a packed row's attention runs per
    example (no (T, T) block mask over the whole row), the vision tower keeps plain SDPA."""
    import torch.nn.functional as F

    model = build_model(ModelSpec("policy", str(micro_llava), "vlm", trainable=True,
                                  train_parts=("projector", "language_model")),
                        ModelConfig(name_or_path=str(micro_llava)), torch.float32, None)
    cfg = model.hf_model.config
    assert (cfg.text_config._attn_implementation, cfg.vision_config._attn_implementation) == ("sdpa_packed", "sdpa")
    batch = _batch(processor, shapes, n=4, packed=True)
    row = batch["input_ids"].shape[1]
    longest = max(torch.diff(torch.tensor([*(batch["position_ids"][0] == 0).nonzero().flatten().tolist(), row])))
    lengths: list[int] = []
    sdpa = F.scaled_dot_product_attention

    def recording(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        lengths.append(q.shape[-2])
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    forward_logps(model, batch)
    text_calls = [n for n in lengths if n != 1 + (IMAGE_SIZE // PATCH_SIZE) ** 2]  # not the tower: CLS + patches
    assert len(text_calls) == 4 * cfg.text_config.num_hidden_layers and max(text_calls) == longest < row


def test_pretrain_run_saves_for_transformers_and_its_projector_loads_into_sft(micro_llava: Path, shapes: Path,
                                                                           processor: Any, tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from alignkit.train.runner import run_train

    out = tmp_path / "pre"
    run_train(_cfg(micro_llava, shapes, "vlm.stage=pretrain", f"output_dir={out}", "training.max_steps=2",
                   "training.per_device_batch_size=4", "training.learning_rate=1e-2", "logging.report_to=[jsonl]",
                   "logging.plot=false"))
    before, after = load_file(str(micro_llava / "model.safetensors")), load_file(str(out / "final" / "model.safetensors"))
    assert before.keys() == after.keys()
    changed = {part_of(k) for k in before if not torch.equal(before[k], after[k])}
    assert changed == {"projector"}  # frozen parts saved untouched
    # transformers loads the final model and processor; its logits are what our log-prob forward computed
    saved = LlavaForConditionalGeneration.from_pretrained(out / "final").eval()
    AutoProcessor.from_pretrained(out / "final")
    ours = build_model(ModelSpec("policy", str(out / "final"), "vlm"), ModelConfig(name_or_path=str(out / "final")),
                       torch.float32, None).eval()
    batch = _batch(processor, shapes, n=2)
    with torch.no_grad():
        logits = saved(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       pixel_values=batch["pixel_values"]).logits
        got = forward_logps(ours, batch)
    keep = batch["targets"] != IGNORE_INDEX
    want = torch.log_softmax(logits[keep].double(), -1).gather(1, batch["targets"][keep][:, None]).squeeze(1)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    # the sft stage starts from the base model with the pretrain run's projector
    sft = build_model(ModelSpec("policy", str(micro_llava), "vlm", trainable=True, projector_from=str(out / "final"),
                                train_parts=("projector", "language_model")),
                      ModelConfig(name_or_path=str(micro_llava)), torch.float32, None)
    state = hf_model(sft).state_dict()
    base_state = LlavaForConditionalGeneration.from_pretrained(micro_llava).state_dict()
    for k, v in state.items():
        want_v = saved.state_dict()[k] if part_of(k) == "projector" else base_state[k]
        assert torch.equal(v, want_v), k
    assert not all(torch.equal(state[k], base_state[k]) for k in state if part_of(k) == "projector")


def test_lora_sft_run_merges_into_a_plain_llava(micro_llava: Path, shapes: Path, processor: Any, tmp_path: Path) -> None:
    """A LoRA sft stage saves the adapter with its trained projector; ``alignkit merge-lora`` makes a plain
    LLaVA + processor whose log-probs equal the adapter model's."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from alignkit.cli import main
    from alignkit.train.runner import run_train

    out = tmp_path / "lora"
    run_train(_cfg(micro_llava, shapes, "vlm.stage=sft", "model.lora.r=4", f"output_dir={out}", "training.max_steps=2",
                   "training.learning_rate=1e-2", "logging.report_to=[jsonl]", "logging.plot=false"))
    assert (out / "final" / "adapter_config.json").is_file()
    assert main(["merge-lora", str(out / "final"), str(tmp_path / "merged")]) == 0
    merged = LlavaForConditionalGeneration.from_pretrained(tmp_path / "merged").eval()
    AutoProcessor.from_pretrained(tmp_path / "merged")
    adapter = build_model(ModelSpec("policy", str(out / "final"), "vlm"), ModelConfig(name_or_path=str(out / "final")),
                          torch.float32, None).eval()
    base = LlavaForConditionalGeneration.from_pretrained(micro_llava)
    proj = {k: v for k, v in merged.state_dict().items() if part_of(k) == "projector"}
    assert proj and not all(torch.equal(v, base.state_dict()[k]) for k, v in proj.items())  # the trained projector
    batch = _batch(processor, shapes, n=2)
    with torch.no_grad():
        logits = merged(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        pixel_values=batch["pixel_values"]).logits
        got = forward_logps(adapter, batch)
    keep = batch["targets"] != IGNORE_INDEX
    want = torch.log_softmax(logits[keep].double(), -1).gather(1, batch["targets"][keep][:, None]).squeeze(1)
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("algorithm, over", [
    ("vlm_sft", ["vlm.stage=pretrain"]), ("vlm_sft", ["vlm.stage=sft"]),
    ("vlm_sft", ["vlm.stage=sft", "vlm.train_vision_tower=true"]), ("reward_model", []), ("dpo", []),
])
def test_estimator_counts_the_parts_that_train(micro_llava: Path, shapes: Path, algorithm: str, over: list[str]) -> None:
    """The memory estimator holds the whole VLM (vision tower + projector + LM) and trains exactly the
    parameters the built model trains (gradients and optimizer states are sized from those)."""
    from alignkit.algorithms import workload_of
    from alignkit.planner.auto import memory_inputs
    from alignkit.planner.plan import trainable_params

    cfg = _cfg(micro_llava, shapes, f"algorithm={algorithm}", *over)
    workload = workload_of(cfg)
    inputs = memory_inputs(cfg, workload, n_gpus=1, device="cpu")
    model = build_model(workload.trainable[0], cfg.model, torch.float32, None)
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert inputs.policy.n_params == total
    # the vision tower's unused pooling norm is frozen by the model but counted as trained by the estimate
    unused = sum(p.numel() for n, p in model.named_parameters() if "post_layernorm" in n and part_of(n) == "vision_tower")
    assert trainable_params(inputs) - trained in (0, unused)
