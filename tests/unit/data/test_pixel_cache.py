"""Images read once: PixelCache (a VLM's preprocessed images kept across epochs) gives the very tensors the uncached
path gives, each image read once; a processor whose tensors are not one per image, or a full cache, goes the
uncached way. flow_sft's caption batches read no image whose latents its encoding cache holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from alignkit.data import vlm
from alignkit.data.io import Row
from alignkit.data.preference import PairCollator
from alignkit.data.synth_vlm import generate_vlm
from alignkit.data.vlm import PixelCache, VLMCollator, pixel_inputs, vlm_example


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_vlm(6, 0, tmp_path_factory.mktemp("shapes") / "sft.json", stage="sft", split="train")


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every image file the data code opens, in order."""
    seen: list[str] = []
    real = vlm.open_image

    def counting(source: str, where: str = "") -> Any:
        seen.append(source)
        return real(source, where)

    monkeypatch.setattr(vlm, "open_image", counting)
    return seen


def _examples(processor: Any, shapes: Path) -> list[dict[str, Any]]:
    rows = [Row(r, str(shapes), i) for i, r in enumerate(json.loads(shapes.read_text()), start=1)]
    return [vlm_example(processor, r, image_root=None, max_length=160) for r in rows]


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_epochs_after_the_first_read_no_image_and_collate_the_same_tensors(processor: Any, shapes: Path,
                                                                           opened: list[str]) -> None:
    examples = _examples(processor, shapes)
    opened.clear()
    plain = VLMCollator(processor, processor.tokenizer.pad_token_id)
    cached = VLMCollator(processor, processor.tokenizer.pad_token_id, cache=PixelCache())
    for order in ([0, 1, 2], [3, 4, 5], [5, 0, 3], [2, 4, 1]):  # two "epochs", shuffled
        batch = [examples[i] for i in order]
        want = plain(batch)
        n = len(opened)
        got = cached(batch)
        assert _equal(dict(want), dict(got))  # every field: tokens and images
        assert torch.equal(got["pixel_values"], want["pixel_values"]) and got["pixel_values"].shape[0] == 3
        assert len(opened) - n == (3 if order[0] in (0, 3) else 0)  # the second epoch opens nothing
    # the batch's tensor is new: a consumer writing into it cannot change the cache
    batch = [examples[i] for i in (0, 1)]
    cached(batch)["pixel_values"].zero_()
    assert torch.equal(cached(batch)["pixel_values"], plain(batch)["pixel_values"])


def test_image_pairs_preprocess_each_image_once(processor: Any, shapes: Path, opened: list[str]) -> None:
    """PairCollator feeds every pair's images twice (chosen, then rejected sequences): the same tensors as before,
    each file read and preprocessed once."""
    ids = processor.tokenizer("a b", add_special_tokens=False)["input_ids"]
    images = [e["images"] for e in _examples(processor, shapes)[:3]]
    pairs = [{"chosen_ids": ids, "chosen_labels": ids, "rejected_ids": ids, "rejected_labels": ids, "images": im}
             for im in images]
    opened.clear()
    got = PairCollator(0, packed=True, processor=processor)(pairs)
    assert len(opened) == 3
    flat = [s for im in images for s in im]
    assert torch.equal(got["pixel_values"], pixel_inputs(processor, flat + flat)["pixel_values"])


class _FlatPatches:
    """An image processor like Qwen2-VL's: every image's patches flattened into one (patches, dim) tensor."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, images: list[Any], return_tensors: str) -> dict[str, torch.Tensor]:
        self.calls += 1
        rows = [torch.from_numpy(np.asarray(im, dtype=np.float32)).reshape(-1, 3)[: 4 + i] for i, im in enumerate(images)]
        return {"pixel_values": torch.cat(rows), "image_grid_thw": torch.tensor([[1, 1, r.shape[0]] for r in rows])}


def test_tensors_not_one_per_image_go_uncached(shapes: Path) -> None:
    proc = type("P", (), {"image_processor": _FlatPatches()})()
    sources = [str(shapes.parent / r["image"]) for r in json.loads(shapes.read_text())[:3]]
    cache = PixelCache()
    got = pixel_inputs(proc, sources, cache)
    assert cache.max_bytes == 0 and not cache.images  # switched off at the first image
    proc.image_processor.calls = 0
    assert _equal(got, pixel_inputs(proc, sources)) and _equal(pixel_inputs(proc, sources, cache), got)
    assert proc.image_processor.calls == 2  # one batched call each, no per-image tries any more


def test_a_full_cache_serves_what_it_holds_and_preprocesses_the_rest_as_before(processor: Any, shapes: Path) -> None:
    sources = [str(shapes.parent / r["image"]) for r in json.loads(shapes.read_text())]
    cache = PixelCache(max_bytes=1)  # full after one image
    assert _equal(pixel_inputs(processor, sources[:1], cache), pixel_inputs(processor, sources[:1]))
    assert list(cache.images) == sources[:1]
    assert _equal(pixel_inputs(processor, sources, cache), pixel_inputs(processor, sources))
    assert list(cache.images) == sources[:1]  # nothing more kept


def test_dataloader_workers_go_uncached(processor: Any, shapes: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's copy of the cache starts empty every epoch: it would only turn one call into one per image."""
    sources = [str(shapes.parent / r["image"]) for r in json.loads(shapes.read_text())]
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object())
    cache = PixelCache()
    assert _equal(pixel_inputs(processor, sources, cache), pixel_inputs(processor, sources)) and not cache.images


def test_caption_batches_read_no_image_whose_encoding_is_held(shapes: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """flow_sft with cache_encodings: the collator reads only the images of rows whose latents are not held; their
    pixels are those of the full batch's rows (pixel_keys names them)."""
    from alignkit.config.schema import DataConfig
    from alignkit.data import captions
    from alignkit.data.captions import CaptionData

    read: list[str] = []
    monkeypatch.setattr(captions, "open_image", lambda s: read.append(s) or vlm.open_image(s))
    cfg = DataConfig(train=str(shapes))
    examples = CaptionData(cfg, 32).build_dataset([str(shapes)], "train")[:4]
    full = CaptionData(cfg, 32).collate(examples)
    held = {examples[1]["key"]: None, examples[3]["key"]: None}
    assert len(read) == 4 and full["pixel_keys"] == [e["key"] for e in examples]
    part = CaptionData(cfg, 32, encoded=held).collate(examples)
    assert len(read) == 6 and part["pixel_keys"] == [examples[0]["key"], examples[2]["key"]]
    assert torch.equal(part["pixels"], full["pixels"][[0, 2]]) and part["keys"] == full["keys"]
    none = CaptionData(cfg, 32, encoded={e["key"]: None for e in examples}).collate(examples)
    assert len(read) == 6 and none["pixels"].shape == (0, 3, 32, 32)
