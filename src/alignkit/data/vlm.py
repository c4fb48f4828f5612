"""Image + text rows -> examples -> micro-batches with ``pixel_values`` (vision-language models).

Row formats:

* LLaVA JSON: ``{"id", "image": "a.png" (or a list), "conversations": [{"from": "human"|"gpt"|"system",
  "value": "<image>\\nWhat is ...?"}, ...]}``. Without an ``<image>`` in the text, the image goes before
  the first human turn (as LLaVA's own loader does).
* ``messages`` whose content is a string or a list of parts: ``{"type": "image", "image": "a.png"}``
  (also ``"path"`` / ``"url"``) and ``{"type": "text", "text": ...}``; or string contents with ``<image>``
  placeholders and the files in a top-level ``"images"`` list (the TRL / LLaMA-Factory layout).

Image paths are relative to ``data.image_root`` (default: the data file's folder); ``data:image/...;base64,``
URIs work too. Each ``<image>`` becomes the processor's image tokens (one per patch for LLaVA-1.5);
image and prompt tokens never carry loss (IGNORE_INDEX): only assistant turns do. A missing or unreadable
image is a :class:`DataError` naming the file and the row (``data.skip_invalid`` skips and counts it).

Examples keep token ids and the images' locations, not pixels: the collator reads and preprocesses
the images of each micro-batch, so memory does not grow with the data set (a bounded :class:`PixelCache`
keeps preprocessed images for the next epochs). Packing concatenates the
examples of a micro-batch into one row and their images in the same order; LLaVA fills the image
tokens of a row with the image features in order, so each example sees its own image.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from alignkit.constants import IGNORE_INDEX
from alignkit.data.collate import TokenCollator
from alignkit.data.io import NOTHING_TO_LEARN, TRUNCATED, Row, convert_rows
from alignkit.data.tokenize import encode_chat, render_chat
from alignkit.errors import DataError

IMAGE_PLACEHOLDER = "<image>"
IMAGE_BEYOND_MAX_LENGTH = "image tokens beyond data.max_length"
MISSING_IMAGE = "missing image"
UNREADABLE_IMAGE = "unreadable image"
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


# ------------------------------------------------------------------------------- rows -> chat + images
def _llava_messages(row: Row) -> tuple[list[dict[str, str]], list[str]]:
    d = row.data
    conv = d["conversations"]
    if not isinstance(conv, list) or not conv:
        raise DataError(f"{row.where('conversations')}: expected a non-empty list of turns")
    messages = []
    for i, turn in enumerate(conv):
        if not isinstance(turn, dict) or turn.get("from") not in _ROLES or not isinstance(turn.get("value"), str):
            raise DataError(f"{row.where('conversations')}[{i}]: expected {{from: human|gpt|system, value: string}}")
        messages.append({"role": _ROLES[turn["from"]], "content": turn["value"]})
    image = d.get("image")
    images = [] if image is None else [image] if isinstance(image, str) else image
    if not isinstance(images, list) or not all(isinstance(x, str) for x in images):
        raise DataError(f"{row.where('image')}: expected a file name or a list of them")
    if images and not any(IMAGE_PLACEHOLDER in m["content"] for m in messages):
        first = next((m for m in messages if m["role"] == "user"), messages[0])
        first["content"] = "".join(f"{IMAGE_PLACEHOLDER}\n" for _ in images) + first["content"]
    return messages, images


def _image_of_part(row: Row, part: dict[str, Any]) -> str:
    for key in ("image", "path", "url", "image_url"):
        value = part.get(key)
        if isinstance(value, dict):  # OpenAI style {"image_url": {"url": ...}}
            value = value.get("url")
        if isinstance(value, str):
            return value
    raise DataError(f"{row.where('messages')}: an image part needs 'image' (a file name), has {sorted(part)}")


def _parts_messages(row: Row) -> tuple[list[dict[str, str]], list[str]]:
    msgs = row.data["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{row.where('messages')}: expected a non-empty list of messages")
    messages, images = [], []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or _ROLES.get(m.get("role", "")) is None:
            raise DataError(f"{row.where('messages')}[{i}]: expected {{role: system|user|assistant, content}}")
        content = m.get("content")
        if isinstance(content, list):
            text = ""
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image":
                    images.append(_image_of_part(row, part))
                    text += f"{IMAGE_PLACEHOLDER}\n"
                elif kind == "text" and isinstance(part.get("text"), str):
                    text += part["text"]
                else:
                    raise DataError(f"{row.where('messages')}[{i}]: a content part must be "
                                    "{type: image, image: FILE} or {type: text, text: ...}")
            content = text
        elif not isinstance(content, str):
            raise DataError(f"{row.where('messages')}[{i}].content: expected a string or a list of parts")
        messages.append({"role": _ROLES[m["role"]], "content": content})
    extra = row.data.get("images", [])
    if not isinstance(extra, list) or not all(isinstance(x, str) for x in extra):
        raise DataError(f"{row.where('images')}: expected a list of file names")
    return messages, images + extra


def chat_and_images(row: Row) -> tuple[list[dict[str, str]], list[str]]:
    """A row's chat (string contents, one ``<image>`` per image) and its image references, in order."""
    if "conversations" in row.data:
        messages, images = _llava_messages(row)
    elif "messages" in row.data:
        messages, images = _parts_messages(row)
    else:
        raise DataError(f"{row.where()}: an image-text row needs 'conversations' (LLaVA) or 'messages' "
                        f"(has {sorted(row.data)})")
    n = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
    if n != len(images):
        raise DataError(f"{row.where()}: {n} {IMAGE_PLACEHOLDER} placeholder(s) in the text but {len(images)} image(s)")
    return messages, images


# ------------------------------------------------------------------------------- images
def resolve_image(ref: str, row: Row, image_root: str | None) -> str:
    """The file an image reference names (``image_root`` / the data file's folder + ref), or a data URI."""
    if ref.startswith("data:"):
        return ref
    path = Path(ref).expanduser()
    if not path.is_absolute():
        path = Path(image_root or Path(row.source).parent) / path
    if not path.is_file():
        raise DataError(f"{row.where('image')}: image file {path} does not exist", cause=MISSING_IMAGE)
    return str(path)


def open_image(source: str, where: str = "") -> Any:
    """An RGB PIL image from a file or ``data:`` URI; a DataError naming it (and ``where``) if unreadable."""
    from PIL import Image, UnidentifiedImageError

    try:
        if source.startswith("data:"):
            fh: Any = io.BytesIO(base64.b64decode(source.split(",", 1)[1]))
            name = "a data: URI"
        else:
            fh, name = source, source
        with Image.open(fh) as img:
            return img.convert("RGB")  # convert() reads the whole file: a truncated one fails here
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        prefix = f"{where}: " if where else ""
        raise DataError(f"{prefix}cannot read image {name if source.startswith('data:') else source}: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}", cause=UNREADABLE_IMAGE) from None


# ------------------------------------------------------------------------------- tokens
def expand_image_mask(ids: list[int], mask: list[int], expanded: list[int], image_id: int, row: Row) -> list[int]:
    """The loss mask of ``ids`` (one image token per ``<image>``) carried over to ``expanded`` (the processor's
    ids: each ``<image>`` repeated once per image patch); 0 on every image token."""
    out: list[int] = []
    i = j = 0
    while i < len(ids):
        if ids[i] == image_id:
            while i < len(ids) and ids[i] == image_id:
                i += 1
            start = j
            while j < len(expanded) and expanded[j] == image_id:
                j += 1
            if j == start:
                break
            out += [0] * (j - start)
            continue
        if j >= len(expanded) or expanded[j] != ids[i]:
            break
        out.append(mask[i])
        i, j = i + 1, j + 1
    if i != len(ids) or j != len(expanded):
        raise DataError(f"{row.where()}: the processor's tokens differ from the chat template's beyond the image "
                        "tokens, so assistant tokens cannot be located")
    return out


def image_refs(row: Row) -> list[str]:
    """The image references of a preference / prompt row: ``image`` (a name or a list) and ``images``."""
    refs: list[str] = []
    for key in ("image", "images"):
        value = row.data.get(key)
        if value is None:
            continue
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise DataError(f"{row.where(key)}: expected a file name or a list of them")
        refs += value
    return refs


@dataclass
class RowImages:
    """A row's images for a processor: where they are (``sources``, re-read by the collator) and the
    processor's image tokens for a chat that holds one ``<image>`` per image."""

    processor: Any
    sources: list[str]
    images: list[Any]

    @classmethod
    def read(cls, processor: Any, row: Row, refs: list[str], image_root: str | None) -> RowImages:
        """Resolve and open ``refs`` (a missing / unreadable file is a DataError naming the row)."""
        sources = [resolve_image(r, row, image_root) for r in refs]
        return cls(processor, sources, [open_image(s, row.where("image")) for s in sources])

    def place(self, messages: list[dict[str, str]], row: Row) -> list[dict[str, str]]:
        """``messages`` with one ``<image>`` per image: as written, or all before the first user turn's text
        when the text has none (as LLaVA's loader does)."""
        n = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
        if n == 0 and self.sources:
            messages = [dict(m) for m in messages]
            first = next((m for m in messages if m["role"] == "user"), messages[0])
            first["content"] = f"{IMAGE_PLACEHOLDER}\n" * len(self.sources) + first["content"]
        elif n != len(self.sources):
            raise DataError(f"{row.where()}: {n} {IMAGE_PLACEHOLDER} placeholder(s) in the text but "
                            f"{len(self.sources)} image(s)")
        return messages

    def expand(self, ids: list[int], mask: list[int], messages: list[dict[str, str]], row: Row
               ) -> tuple[list[int], list[int]]:
        """The chat's ids (one ``<image>`` token per image) as the processor tokenises it (each ``<image>``
        repeated once per image feature), and ``mask`` carried over (0 on image tokens)."""
        tokenizer = self.processor.tokenizer
        enc = self.processor(text=[render_chat(tokenizer, messages)], images=self.images or None,
                             add_special_tokens=False)
        expanded = list(enc["input_ids"][0])
        return expanded, expand_image_mask(ids, mask, expanded, self.processor.image_token_id, row)

    def fits(self, ids: list[int], max_length: int) -> bool:
        """Whether no image token lies beyond ``max_length`` (an image cut in half cannot be fed)."""
        return self.processor.image_token_id not in ids[max_length:]


def vlm_example(processor: Any, row: Row, *, image_root: str | None, max_length: int,
                loss_on: str = "assistant") -> dict[str, Any] | None:
    """A row -> ``{input_ids, labels, images}`` (``images``: files or data URIs, read again by the collator).

    ``loss_on="all"`` trains on every text token; image tokens never carry loss. None (``row.drop``) when
    nothing is left to learn or the image tokens do not fit in ``max_length``.
    """
    messages, refs = chat_and_images(row)
    images = RowImages.read(processor, row, refs, image_root)
    ids, mask = encode_chat(processor.tokenizer, messages, row)
    expanded, mask = images.expand(ids, mask if loss_on == "assistant" else [1] * len(ids), messages, row)
    if sum(mask[1:]) == 0:
        row.drop(NOTHING_TO_LEARN)
        return None
    if len(expanded) > max_length:
        if not images.fits(expanded, max_length):
            row.drop(IMAGE_BEYOND_MAX_LENGTH)
            return None
        expanded, mask = expanded[:max_length], mask[:max_length]
        if sum(mask[1:]) == 0:
            row.drop(NOTHING_TO_LEARN)
            return None
        row.note(TRUNCATED)
    return {"input_ids": expanded, "labels": [t if m else IGNORE_INDEX for t, m in zip(expanded, mask)],
            "images": images.sources}


def pixel_inputs(processor: Any, sources: list[str], cache: PixelCache | None = None) -> dict[str, torch.Tensor]:
    """``pixel_values`` (and e.g. ``image_sizes``) of the images at ``sources``, in order; {} for none.
    With ``cache``, images it holds are not read and preprocessed again (the same tensors, see PixelCache)."""
    if not sources:
        return {}
    if cache is not None:
        cached = cache.pixels(processor, sources)
        if cached is not None:
            return cached
    pixels = processor.image_processor([open_image(s) for s in sources], return_tensors="pt")
    return {k: v for k, v in pixels.items() if isinstance(v, torch.Tensor)}


class PixelCache:
    """Each image's preprocessed tensors by source, so that a later epoch (or the rejected half of an image
    pair) does not decode and preprocess it again: the image processors are deterministic, so the batch is
    the same tensors. A miss is preprocessed alone and kept (its tensors with a leading image dimension of 1);
    a micro-batch is served from the cache only when every one of its images' tensors has the same shape, in
    which case preprocessing them together pads nothing and gives the concatenation (an image processor that
    pads to the batch's largest image, or flattens patches of unequal counts, goes the uncached way). Bounded:
    once ``max_bytes`` are held, a micro-batch with an image not held is preprocessed the uncached way, so
    memory stays bounded however large the data set (32x32 images take 12 KiB each). Not in a DataLoader worker
    (``data.num_workers``): each epoch's workers start from an empty copy, which would only add per-image calls."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes, self.nbytes = max_bytes, 0
        self.images: dict[str, dict[str, torch.Tensor]] = {}

    def pixels(self, processor: Any, sources: list[str]) -> dict[str, torch.Tensor] | None:
        """The micro-batch's tensors (new ones, each image's concatenated in order) or None: go uncached."""
        if torch.utils.data.get_worker_info() is not None:
            return None
        for s in dict.fromkeys(sources):
            if s in self.images:
                continue
            if self.nbytes >= self.max_bytes or s.startswith("data:"):
                return None
            one = processor.image_processor([open_image(s)], return_tensors="pt")
            one = {k: v for k, v in one.items() if isinstance(v, torch.Tensor)}
            if any(v.dim() == 0 or v.shape[0] != 1 for v in one.values()):
                self.max_bytes = 0  # tensors not per image (flattened patches): this processor goes uncached
                return None
            self.images[s] = one
            self.nbytes += sum(v.numel() * v.element_size() for v in one.values())
        per_image = [self.images[s] for s in sources]
        first = per_image[0]
        if any(p.keys() != first.keys() or any(p[k].shape != v.shape for k, v in first.items()) for p in per_image):
            return None
        return {k: torch.cat([p[k] for p in per_image]) for k in first}


# ------------------------------------------------------------------------------- batches
@dataclass
class VLMCollator:
    """:class:`TokenCollator` (padded, or packed into one row) plus ``pixel_values``: every image of the
    micro-batch, in example order, preprocessed by the processor's image processor ``(N_images, C, H, W)``."""

    processor: Any
    pad_token_id: int
    packed: bool = False
    cache: PixelCache | None = None  # kept across calls (epochs) by the pipeline that owns it

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = TokenCollator(self.pad_token_id, packed=self.packed)(
            [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples])
        batch.add_inputs(pixel_inputs(self.processor, [s for e in examples for s in e.get("images", [])],
                                      self.cache))
        return batch


class VLMData:
    """The image-text pipeline (``vlm_sft``): one sequence per example, loss unit = loss token, padded or
    packed (``data.packing``); the processor turns rows into tokens and images into ``pixel_values``."""

    def __init__(self, processor: Any, cfg: Any, *, loss_on: str = "assistant") -> None:
        self.processor, self.cfg, self.loss_on = processor, cfg, loss_on
        self.pixels = PixelCache()  # every epoch after the first reads its images from here
        self.skipped: dict[str, int] = {}
        self.row_counts: dict[str, Any] = {}

    def convert(self, row: Row) -> dict[str, Any] | None:
        return vlm_example(self.processor, row, image_root=self.cfg.image_root, max_length=self.cfg.max_length,
                           loss_on=self.loss_on)

    def build_dataset(self, specs: list[str], split: str) -> list[dict[str, Any]]:
        limit = self.cfg.max_train_examples if split == "train" else self.cfg.max_eval_examples
        examples, counts = convert_rows(specs, self.convert, skip_invalid=self.cfg.skip_invalid, limit=limit)
        self.row_counts[split], self.skipped[split] = counts, counts.total_dropped
        return examples

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return VLMCollator(self.processor, self.processor.tokenizer.pad_token_id, packed=self.cfg.packing,
                           cache=self.pixels)(examples)

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["targets"] != IGNORE_INDEX).sum())

    def tokens_in(self, batch: dict[str, torch.Tensor]) -> int:
        if "attention_mask" in batch:
            return int(batch["attention_mask"].sum())
        return int(batch["input_ids"].numel())
