"""Image/caption rows for text-to-image training (``algorithm: flow_sft``).

A row is ``{"image": ref, "caption": text}`` (``text`` or ``prompt`` name the caption too), or a LLaVA
caption row (``image`` + ``conversations`` whose last ``gpt`` turn is the caption: the ``pretrain`` stage of
``alignkit data synth --kind vlm``). Image references resolve as the VLM rows' do (``data.image_root``, else
the data file's folder; ``data:`` URIs). An example keeps the resolved image, the caption and a ``key`` (file,
line) that seeds its noise. The collator reads the images as ``(B, 3, H, W)`` pixels in [-1, 1] at
``resolution`` (square, bicubic); images and captions are batch fields: the policy's own encoders turn them
into latents and text embeddings (the images of rows whose latents flow_sft's cache holds are not read).
"""

from __future__ import annotations

from collections.abc import Container
from pathlib import PurePath
from typing import Any

import torch

from alignkit.config.schema import DataConfig
from alignkit.data.batch import Batch
from alignkit.data.io import DataError, Row, RowCounts, convert_rows
from alignkit.data.vlm import open_image, resolve_image

CAPTION_KEYS = ("caption", "text", "prompt")


def caption_of(row: Row) -> str:
    d = row.data
    for key in CAPTION_KEYS:
        if isinstance(d.get(key), str) and d[key].strip():
            return d[key].strip()
    turns = [t.get("value") for t in d.get("conversations") or [] if isinstance(t, dict) and t.get("from") == "gpt"]
    if turns and isinstance(turns[-1], str) and turns[-1].strip():
        return turns[-1].strip()
    raise DataError(f"{row.where()}: an image/caption row needs 'caption' (or 'text' / 'prompt', or LLaVA "
                    f"'conversations' ending in a gpt turn) (has {sorted(d)})")


def caption_example(row: Row, *, image_root: str | None) -> dict[str, Any]:
    """A row -> ``{image, caption, key, noise_key}`` (the image file checked to exist, not read yet): ``key`` names
    the row where it lies (the encoding cache's key), ``noise_key`` by its file's name and line only, so the noise a
    run draws for it does not depend on the folder the data lies in."""
    ref = row.data.get("image")
    if not isinstance(ref, str) or not ref:
        raise DataError(f"{row.where('image')}: an image/caption row needs one image reference")
    return {"image": resolve_image(ref, row, image_root), "caption": caption_of(row), "key": row.where(),
            "noise_key": f"{PurePath(row.source).name}:{row.line}"}


def pil_pixels(images: list[Any], resolution: int) -> torch.Tensor:
    """``(B, 3, resolution, resolution)`` float pixels in [-1, 1] of RGB PIL images (resized, bicubic)."""
    import numpy as np
    from PIL import Image

    out = []
    for img in images:
        if img.size != (resolution, resolution):
            img = img.resize((resolution, resolution), Image.Resampling.BICUBIC)
        out.append(torch.from_numpy(np.asarray(img, dtype=np.float32)).permute(2, 0, 1))
    return torch.stack(out) / 127.5 - 1.0


def image_pixels(sources: list[str], resolution: int) -> torch.Tensor:
    """:func:`pil_pixels` of image files (or ``data:`` URIs)."""
    return pil_pixels([open_image(src) for src in sources], resolution)


class CaptionData:
    """The data pipeline of image/caption rows; the loss unit is an image."""

    def __init__(self, cfg: DataConfig, resolution: int, encoded: Container[str] | None = None) -> None:
        """``encoded``: the keys of rows whose images the consumer holds encoded (flow_sft's cache_encodings): the
        collator does not read their images; ``pixels`` holds those of the other rows, named by ``pixel_keys``."""
        self.cfg, self.resolution, self.encoded = cfg, resolution, encoded
        self.skipped: dict[str, int] = {}
        self.row_counts: dict[str, RowCounts] = {}

    def convert_row(self, row: Row) -> dict[str, Any]:
        return caption_example(row, image_root=self.cfg.image_root)

    def build_dataset(self, specs: list[str], split: str) -> list[dict[str, Any]]:
        limit = self.cfg.max_train_examples if split == "train" else self.cfg.max_eval_examples
        examples, counts = convert_rows(specs, self.convert_row, skip_invalid=self.cfg.skip_invalid, limit=limit)
        self.row_counts[split], self.skipped[split] = counts, counts.total_dropped
        return examples

    def collate(self, examples: list[dict[str, Any]]) -> Batch:
        read = [e for e in examples if self.encoded is None or e["key"] not in self.encoded]
        pixels = (image_pixels([e["image"] for e in read], self.resolution) if read
                  else torch.zeros(0, 3, self.resolution, self.resolution))
        return Batch({}, {"pixels": pixels, "pixel_keys": [e["key"] for e in read],
                          "captions": [e["caption"] for e in examples], "keys": [e["key"] for e in examples],
                          "noise_keys": [e["noise_key"] for e in examples]})

    def loss_units(self, batch: Batch) -> int:
        return len(batch["captions"])

    def tokens_in(self, batch: Batch) -> int:
        return 0


class ImagePromptData(CaptionData):
    """Prompt rows of a text-to-image policy (``algorithm: flow_grpo``): ``{"prompt": text, ...}``, or an
    image/caption row whose caption is the prompt (so the rows ``flow_sft`` trained on serve as prompts). An
    example is ``{"prompt": text, "prompt_ids": [], "fields": {the row's other fields}}``: the policy's own
    text encoders read the text; the fields travel to the reward scorers."""

    def __init__(self, cfg: DataConfig) -> None:
        super().__init__(cfg, resolution=0)

    def convert_row(self, row: Row) -> dict[str, Any]:
        return {"prompt": caption_of(row), "prompt_ids": [], "fields": {k: v for k, v in row.data.items() if k != "prompt"}}
