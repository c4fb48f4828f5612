"""Image + text preference rows (PKU-SafeRLHF fields with an image, BeaverTails-V) for a vision-language model:
tokens and labels of both sides, BeaverTails-V read as PKU, the collator's images in sequence order, a
vision-language scorer (save -> load -> same scores; each packed sequence sees its own image), bad rows named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from alignkit.constants import IGNORE_INDEX
from alignkit.data.io import TRUNCATED, Row
from alignkit.data.preference import PairCollator, pair_converter, pair_from_row
from alignkit.data.safety import safety_example
from alignkit.data.synth_vlm import generate_vlm
from alignkit.errors import DataError


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 image preference rows (PKU fields + image) and their images."""
    return generate_vlm(16, 0, tmp_path_factory.mktemp("vpairs") / "pairs.jsonl", stage="preference", split="train")


def _rows(path: Path) -> list[Row]:
    return [Row(json.loads(line), str(path), i) for i, line in enumerate(path.read_text().splitlines(), start=1)]


def _convert(processor: Any, pair: str = "helpful", max_length: int = 160, **kw: Any) -> pair_converter:
    return pair_converter(processor.tokenizer, max_length, pair, False, processor=processor, **kw)


def _image_tokens(processor: Any, pairs: Path) -> int:
    from PIL import Image

    with Image.open(next((pairs.parent / "images").iterdir())) as img:
        ids = processor(text=["<image>"], images=[img.convert("RGB")])["input_ids"][0]
    return list(ids).count(processor.image_token_id)


def test_image_pair_tokens_labels_and_order(processor: Any, pairs: Path) -> None:
    image_id, n_patches = processor.image_token_id, _image_tokens(processor, pairs)
    tok = processor.tokenizer
    for row in _rows(pairs)[:6]:
        ex = _convert(processor)(row)
        d = row.data
        chosen, rejected = d[f"response_{d['better_response_id']}"], d[f"response_{1 - d['better_response_id']}"]
        assert ex["images"] == [str(pairs.parent / d["image"])]
        for side, text in (("chosen", chosen), ("rejected", rejected)):
            ids, labels = ex[f"{side}_ids"], ex[f"{side}_labels"]
            assert ids.count(image_id) == n_patches  # the image's features, once
            assert all(lab == IGNORE_INDEX for i, lab in zip(ids, labels) if i == image_id)
            trained = tok.decode([t for t in labels if t != IGNORE_INDEX], skip_special_tokens=True)
            assert trained.strip() == text  # only the response carries loss; the question and image do not
            assert d["prompt"] in tok.decode(ids)
        # the safety pair of the same row is ordered by safer_response_id
        s = _convert(processor, "safety")(row)
        safer = d[f"response_{d['safer_response_id']}"]
        assert tok.decode([t for t in s["chosen_labels"] if t != IGNORE_INDEX], skip_special_tokens=True).strip() == safer
        assert s["chosen_unsafe"] == (not d[f"is_response_{d['safer_response_id']}_safe"])


def test_beavertails_v_reads_as_pku(tmp_path: Path) -> None:
    pku = generate_vlm(12, 5, tmp_path / "pku.jsonl", stage="preference")
    btv = generate_vlm(12, 5, tmp_path / "btv.jsonl", stage="beavertails_v")
    for a, b in zip(_rows(pku), _rows(btv)):
        for pair in ("helpful", "safety"):
            assert pair_from_row(a, pair) == pair_from_row(b, pair)
    row = _rows(btv)[0]
    row.data["more_helpful_response_id"] = 0  # BeaverTails-V counts from 1
    with pytest.raises(DataError, match=r"btv.jsonl:1.*more_helpful_response_id.*expected 1 or 2"):
        pair_from_row(row)
    row = _rows(btv)[0]
    row.data["response_2_harmless_rate"] = "high"
    with pytest.raises(DataError, match=r"response_2_harmless_rate.*expected a number"):
        pair_from_row(row, "safety")


def test_collator_images_follow_the_sequences(processor: Any, pairs: Path) -> None:
    examples = [_convert(processor)(r) for r in _rows(pairs)[:3]]
    text_only = {k: v for k, v in examples[0].items() if k != "images"}
    batch = PairCollator(processor.tokenizer.pad_token_id, packed=True, processor=processor)(examples)
    assert batch["pixel_values"].shape[0] == 6  # 3 chosen, then the same 3 images for the rejected sides
    single = PairCollator(processor.tokenizer.pad_token_id, packed=True, processor=processor)([examples[1]])
    assert torch.equal(batch["pixel_values"][1], single["pixel_values"][0])
    assert torch.equal(batch["pixel_values"][4], single["pixel_values"][1])
    mixed = PairCollator(processor.tokenizer.pad_token_id, packed=True, processor=processor)([text_only, examples[2]])
    assert mixed["pixel_values"].shape[0] == 2
    with pytest.raises(ValueError, match="need the processor"):
        PairCollator(processor.tokenizer.pad_token_id, packed=True)(examples)


def test_truncation_keeps_the_image_and_drops_what_cannot_fit(processor: Any, pairs: Path) -> None:
    row = _rows(pairs)[0]
    for k in (0, 1):
        row.data[f"response_{k}"] += " and more" * 40
    labels = _convert(processor)(row)["chosen_labels"]
    n_prompt = next(i for i, t in enumerate(labels) if t != IGNORE_INDEX)
    ex = _convert(processor, max_length=n_prompt + 3)(row)
    assert len(ex["chosen_ids"]) == n_prompt + 3  # the whole prompt, image included, and 3 response tokens
    assert ex["chosen_ids"].count(processor.image_token_id) == _image_tokens(processor, pairs)
    assert TRUNCATED in [c for c, _ in row.notes]
    row = _rows(pairs)[0]
    assert _convert(processor, max_length=_image_tokens(processor, pairs) // 2)(row) is None
    assert row.dropped == "image tokens beyond data.max_length"


def test_bad_image_rows_are_named(processor: Any, pairs: Path, micro_model: Path) -> None:
    from alignkit.config.schema import ModelConfig
    from alignkit.models.loading import load_tokenizer

    row = _rows(pairs)[2]
    row.data["image"] = "images/nope.png"
    with pytest.raises(DataError, match=r"pairs.jsonl:3.*image.*nope.png does not exist"):
        _convert(processor)(row)
    text_tok = load_tokenizer(ModelConfig(name_or_path=str(micro_model)))
    with pytest.raises(DataError, match=r"pairs.jsonl:1.*has images but model.name_or_path is a text-only model"):
        pair_converter(text_tok, 160, "helpful", False)(_rows(pairs)[0])


def test_safety_example_keeps_both_responses_and_the_image(processor: Any, pairs: Path) -> None:
    row = _rows(pairs)[0]
    ex = safety_example(processor.tokenizer, row, max_length=160, chat_template=False, processor=processor)
    assert ex["images"] == [str(pairs.parent / row.data["image"])]
    assert (ex["better_id"], ex["safer_id"]) == (row.data["better_response_id"], row.data["safer_response_id"])
    assert ex["prompt"] == row.data["prompt"]


def test_vision_language_scorer_round_trip_and_packing(micro_llava: Path, processor: Any, pairs: Path,
                                                       tmp_path: Path) -> None:
    """A score head on LLaVA: the vision tower frozen, the rest trains; each sequence of a packed batch scores
    as it does alone (its own image); saved, it loads back through AutoModelForSequenceClassification."""
    from transformers import AutoModelForSequenceClassification

    from alignkit.config.schema import ModelConfig
    from alignkit.models.policy import forward_scores
    from alignkit.models.scalar import ScalarHeadModel, load_scalar_model
    from alignkit.models.vlm import part_of

    hf = load_scalar_model(ModelConfig(name_or_path=str(micro_llava)), trainable=True)
    trained = {part_of(n) for n, p in hf.named_parameters() if p.requires_grad}
    assert trained == {"projector", "language_model"}
    assert hf.score.weight.requires_grad
    torch.nn.init.normal_(hf.score.weight)  # a fresh head is random anyway; make the scores differ clearly
    model = ScalarHeadModel(hf).eval()
    collate = PairCollator(processor.tokenizer.pad_token_id, packed=True, processor=processor)
    examples = [_convert(processor)(r) for r in _rows(pairs)[:3]]
    with torch.no_grad():
        together = forward_scores(model, collate(examples))
        alone = torch.cat([forward_scores(model, collate([e])) for e in examples])
    order = torch.tensor([0, 3, 1, 4, 2, 5])  # alone: (c0, r0), (c1, r1), ...; together: c0 c1 c2 r0 r1 r2
    torch.testing.assert_close(together[order], alone, atol=1e-5, rtol=1e-4)
    # a different image changes the score (the head sees the picture)
    swapped = dict(examples[0], images=examples[1]["images"])
    with torch.no_grad():
        assert not torch.allclose(forward_scores(model, collate([swapped])), alone[:2])
    hf.save_pretrained(tmp_path / "rm")
    back = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    with torch.no_grad():
        again = forward_scores(ScalarHeadModel(back).eval(), collate(examples))
    torch.testing.assert_close(again, together)
