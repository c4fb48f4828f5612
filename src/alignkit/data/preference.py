"""Preference rows -> tokenized (chosen, rejected) pairs, and their collator.

Two row formats (ALGORITHMS 1.7):

* ``{"prompt", "chosen", "rejected"}``: each a string, or a list of ``{role, content}`` messages
  (then the chat template is applied). Optional: ``margin`` (a number, the Bradley-Terry margin
  of that pair) and ``is_chosen_safe`` / ``is_rejected_safe`` (bools, for the cost model).
* PKU-SafeRLHF: ``{"prompt", "response_0", "response_1", "better_response_id",
  "safer_response_id", "is_response_0_safe", "is_response_1_safe"}``. ``pair="helpful"`` orders
  the pair by ``better_response_id``, ``pair="safety"`` by ``safer_response_id``; the per-response
  safety labels travel with the pair either way.
* BeaverTails-V (image + text): ``{"question", "image", "response_1", "response_2",
  "more_helpful_response_id", "safer_response_id"`` (1 or 2), ``"response_1_harmless_rate",
  "response_2_harmless_rate"}``: read as PKU-SafeRLHF with response_1/2 as responses 0/1, a response
  unsafe when its harmless rate is below 0 (the cost sign is minus the harmless rate).

Any row may carry images (``image``: a file name or a list, ``images``: a list; paths relative to
``data.image_root``) when the model is a vision-language model (``images=`` a processor): the prompt
becomes a chat whose first user turn holds the ``<image>`` placeholders (put before its text when it
has none), image tokens carry no loss, and the example keeps the image files for the collator, which
adds ``pixel_values`` (each pair's images for its chosen and again for its rejected sequence).

An example is ``{chosen_ids, chosen_labels, rejected_ids, rejected_labels, margin,
chosen_unsafe, rejected_unsafe}``; labels are the ids on response tokens and IGNORE_INDEX on the
prompt, so log-prob sums cover the response only. Too-long sequences keep the end of the prompt
and the start of the response (``max_length`` tokens in all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from alignkit.constants import IGNORE_INDEX
from alignkit.data.collate import TokenCollator
from alignkit.data.io import (
    NOTHING_TO_LEARN,
    TRUNCATED,
    DataError,
    Row,
    RowCounts,
    convert_rows,
    require_field,
    require_messages,
)
from alignkit.data.tokenize import encode_prompt_response
from alignkit.data.vlm import IMAGE_BEYOND_MAX_LENGTH, PixelCache, RowImages, image_refs, pixel_inputs

PAIRS = ("helpful", "safety")


def text_or_messages(row: Row, field: str) -> str | list[dict[str, str]]:
    """A non-empty string or a non-empty message list whose contents are not all blank."""
    value = require_field(row, field)
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{row.where(field)}: is empty")
        return value
    if isinstance(value, list):
        msgs = require_messages(row, field)
        if not any(m["content"].strip() for m in msgs):
            raise DataError(f"{row.where(field)}: is empty (every message has blank content)")
        return msgs
    raise DataError(f"{row.where(field)}: expected a string or a list of messages, got {type(value).__name__}")


def _bool(row: Row, field: str) -> bool:
    value = require_field(row, field)
    if not isinstance(value, bool):
        raise DataError(f"{row.where(field)}: expected true/false, got {value!r}")
    return value


def _response_id(row: Row, field: str, first: int = 0) -> int:
    """``field``'s value (``first`` or ``first + 1``) as 0 or 1."""
    value = require_field(row, field)
    if isinstance(value, bool) or value not in (first, first + 1):
        raise DataError(f"{row.where(field)}: expected {first} or {first + 1}, got {value!r}")
    return int(value) - first


@dataclass
class PairText:
    """One preference pair before tokenization. ``*_unsafe`` is None when the row has no labels."""

    prompt: str | list[dict[str, str]]
    chosen: str | list[dict[str, str]]
    rejected: str | list[dict[str, str]]
    margin: float | None = None
    chosen_unsafe: bool | None = None
    rejected_unsafe: bool | None = None


@dataclass(frozen=True)
class TwoResponseFields:
    """Where a two-response row keeps its fields (PKU-SafeRLHF, or BeaverTails-V with ids 1 / 2)."""

    prompt: str = "prompt"
    responses: tuple[str, str] = ("response_0", "response_1")
    better: str = "better_response_id"
    safer: str = "safer_response_id"
    first_id: int = 0
    safe: tuple[str, str] | None = ("is_response_0_safe", "is_response_1_safe")
    harmless: tuple[str, str] | None = None


PKU = TwoResponseFields()
BEAVERTAILS_V = TwoResponseFields("question", ("response_1", "response_2"), "more_helpful_response_id",
                                  "safer_response_id", 1, None, ("response_1_harmless_rate", "response_2_harmless_rate"))


def two_response_fields(row: Row) -> TwoResponseFields | None:
    """The layout of a PKU-SafeRLHF / BeaverTails-V row, or None for a chosen/rejected row."""
    d = row.data
    if "more_helpful_response_id" in d or "response_2" in d:
        return BEAVERTAILS_V
    if "response_0" in d or "response_1" in d:
        return PKU
    return None


@dataclass
class TwoResponseRow:
    """A PKU-SafeRLHF / BeaverTails-V row, read and checked: ``better`` / ``safer`` are 0 or 1 (None when
    not read), ``unsafe[k]`` whether response k is unsafe (None without labels)."""

    prompt: str | list[dict[str, str]]
    responses: tuple[Any, Any]
    better: int | None
    safer: int | None
    unsafe: tuple[bool, bool] | tuple[None, None]

    def pair(self, which: str) -> PairText:
        """The ``helpful`` (by better id) or ``safety`` (by safer id) pair of the row."""
        first = {"helpful": self.better, "safety": self.safer}[which]
        assert first is not None, f"the {which} id was not read"
        return PairText(self.prompt, self.responses[first], self.responses[1 - first], None,
                        self.unsafe[first], self.unsafe[1 - first])


def _unsafe(row: Row, f: TwoResponseFields, k: int) -> bool:
    if f.harmless is not None:  # BeaverTails-V: cost = -harmless rate, C > 0 = unsafe
        value = require_field(row, f.harmless[k])
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DataError(f"{row.where(f.harmless[k])}: expected a number, got {value!r}")
        return value < 0
    assert f.safe is not None
    return not _bool(row, f.safe[k])


def two_response_row(row: Row, f: TwoResponseFields, *, better: bool, safer: bool, labels: bool | None) -> TwoResponseRow:
    """Read the fields asked for (``labels=None``: the safety labels if the row has any)."""
    d = row.data
    label_keys = f.harmless or f.safe or ()
    if labels is None:
        labels = any(k in d for k in label_keys)
    return TwoResponseRow(
        prompt=text_or_messages(row, f.prompt),
        responses=(text_or_messages(row, f.responses[0]), text_or_messages(row, f.responses[1])),
        better=_response_id(row, f.better, f.first_id) if better else None,
        safer=_response_id(row, f.safer, f.first_id) if safer else None,
        unsafe=(_unsafe(row, f, 0), _unsafe(row, f, 1)) if labels else (None, None),
    )


def pair_from_row(row: Row, pair: str = "helpful") -> PairText:
    """Read one row of any format (see the module docstring); raises DataError naming file:line field."""
    if pair not in PAIRS:
        raise ValueError(f"pair must be one of {PAIRS}, got {pair!r}")
    d = row.data
    fields = two_response_fields(row)
    if fields is not None:
        helpful = pair == "helpful"
        return two_response_row(row, fields, better=helpful, safer=not helpful,
                                labels=None if helpful else True).pair(pair)
    if "chosen" not in d and "rejected" not in d:
        raise DataError(
            f"{row.where()}: a preference row needs 'prompt'+'chosen'+'rejected' or the PKU-SafeRLHF fields "
            f"'response_0'/'response_1' (row has {sorted(d)})"
        )
    prompt = text_or_messages(row, "prompt")
    chosen, rejected = text_or_messages(row, "chosen"), text_or_messages(row, "rejected")
    margin = d.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))):
        raise DataError(f"{row.where('margin')}: expected a number, got {margin!r}")
    cu = ru = None
    if "is_chosen_safe" in d or "is_rejected_safe" in d:
        cu, ru = not _bool(row, "is_chosen_safe"), not _bool(row, "is_rejected_safe")
    return PairText(prompt, chosen, rejected, None if margin is None else float(margin), cu, ru)


def as_chat(x: str | list[dict[str, str]], role: str) -> list[dict[str, str]]:
    return x if isinstance(x, list) else [{"role": role, "content": x}]


def truncate_prompt_response(ids: list[int], mask: list[int], max_length: int) -> tuple[list[int], list[int]]:
    """Keep the end of the prompt and the start of the response, ``max_length`` tokens in all.

    The response keeps ``max(max_length - prompt, max_length // 2)`` tokens at most, so a long
    prompt cannot squeeze the response out entirely.
    """
    if len(ids) <= max_length:
        return ids, mask
    start = mask.index(1) if 1 in mask else len(mask)
    n_resp = len(ids) - start
    keep_resp = min(n_resp, max(max_length - start, max_length // 2))
    keep_prompt = max_length - keep_resp
    lo, hi = start - keep_prompt, start + keep_resp
    return ids[lo:hi], mask[lo:hi]


#: a pair whose two sides are the same text (or the same tokens once truncated): kept, with a warning
SAME_PAIR = "with chosen identical to rejected (no preference to learn)"
SAME_AFTER_TRUNCATION = "with chosen identical to rejected once truncated to data.max_length (no preference to learn)"


def encode_pair(tokenizer: Any, p: PairText, row: Row, *, max_length: int, chat_template: bool = False,
                images: RowImages | None = None) -> dict[str, Any] | None:
    """Tokenize a pair; None when a side has no response tokens (``row.drop``, counted by the caller).

    ``chat_template=True`` renders string rows as one user turn and one assistant turn, as
    message-list rows always are. A truncated pair, and one whose sides are identical, are noted on the
    row. Identical sides are kept, not dropped: pairwise losses (Bradley-Terry, the DPO family) get no
    gradient from them, but the cost model's per-response safety terms still learn from their labels.

    ``images`` (a row of a vision-language model): the prompt is a chat holding the ``<image>``
    placeholders, each expanded to the processor's image tokens (no loss on them); a too-long sequence
    keeps its whole prompt and the start of the response (dropped when the prompt alone does not fit).
    The example keeps ``images``: the image files, for the collator.
    """
    prompt, chosen, rejected = p.prompt, p.chosen, p.rejected
    if chat_template or images is not None:
        prompt, chosen, rejected = as_chat(prompt, "user"), as_chat(chosen, "assistant"), as_chat(rejected, "assistant")
    if images is not None:
        prompt = images.place(prompt, row)
    out: dict[str, Any] = {}
    memo: dict[str, list[int]] = {}  # the prompt's tokens serve both sides
    for side, response in (("chosen", chosen), ("rejected", rejected)):
        ids, mask = encode_prompt_response(tokenizer, prompt, response, row, memo)
        if images is not None:
            ids, mask = images.expand(ids, mask, [*prompt, *response], row)
            if len(ids) > max_length and not images.fits(ids, max_length):
                row.drop(IMAGE_BEYOND_MAX_LENGTH)
                return None
        if len(ids) > max_length:
            ids, mask = (ids[:max_length], mask[:max_length]) if images is not None else \
                truncate_prompt_response(ids, mask, max_length)
            row.note(TRUNCATED)
        if sum(mask[1:]) == 0:  # position 0 is never predicted
            row.drop(NOTHING_TO_LEARN)
            return None
        out[f"{side}_ids"] = ids
        out[f"{side}_labels"] = [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
    if out["chosen_ids"] == out["rejected_ids"]:
        row.note(SAME_PAIR if chosen == rejected else SAME_AFTER_TRUNCATION, warn=True)
    out["margin"] = p.margin
    out["chosen_unsafe"] = p.chosen_unsafe
    out["rejected_unsafe"] = p.rejected_unsafe
    if images is not None:
        out["images"] = images.sources
    return out


def encode_scored(tokenizer: Any, prompt: Any, response: Any, row: Row, *, max_length: int, chat_template: bool,
                  images: RowImages | None = None) -> list[int]:
    """The tokens a reward / cost model scores for (prompt, response), encoded as training pairs are: the
    chat template when asked or for message lists; a vision-language model's image tokens in the prompt
    (a response beyond ``max_length`` is cut, the prompt and its image kept)."""
    if chat_template or isinstance(prompt, list) or isinstance(response, list) or images is not None:
        prompt, response = as_chat(prompt, "user"), as_chat(response, "assistant")
    if images is None:
        return truncate_prompt_response(*encode_prompt_response(tokenizer, prompt, response, row), max_length)[0]
    prompt = images.place(prompt, row)
    ids, _ = images.expand(*encode_prompt_response(tokenizer, prompt, response, row), [*prompt, *response], row)
    return ids[:max_length] if images.fits(ids, max_length) else ids


def row_images(processor: Any, row: Row, image_root: str | None) -> RowImages | None:
    """The row's images when the model takes them (``processor`` not None); None for a text model. A row
    with images for a text-only model is an error naming it (its images would be silently ignored)."""
    refs = image_refs(row)
    if processor is None:
        if refs:
            raise DataError(f"{row.where('image')}: the row has images but model.name_or_path is a text-only model "
                            "(image rows need a vision-language model, e.g. `alignkit tiny-model OUT --arch llava`)")
        return None
    return RowImages.read(processor, row, refs, image_root)


def preference_example(
    tokenizer: Any, row: Row, *, max_length: int, pair: str = "helpful", chat_template: bool = False
) -> dict[str, Any] | None:
    """A row -> a tokenized pair example (module docstring), or None if nothing is left to score."""
    return pair_converter(tokenizer, max_length, pair, chat_template)(row)


@dataclass
class PairCollator:
    """Collates B pairs into 2B sequences: chosen 0..B-1, then rejected 0..B-1.

    ``packed=True`` (DPO) puts all 2B sequences in one padding-free row, ``seq_index`` naming
    each token's sequence. Extra per-sequence/per-pair tensors:

    * ``response_lengths`` ``(2B,)`` loss tokens of each sequence;
    * ``margin`` ``(B,)`` (NaN where a row has none); ``chosen_unsafe`` / ``rejected_unsafe`` ``(B,)``
      bool when every pair of the batch has safety labels;
    * ``ref_logps`` ``(2B,)`` when every example carries precomputed reference log-probs;
    * ``pixel_values`` (and the image processor's other tensors) when examples carry ``images``: the
      images of chosen sequences in order, then those of rejected ones (``processor`` required).
    """

    pad_token_id: int
    packed: bool = False
    processor: Any = None  # a vision-language model's processor: images -> pixel_values
    cache: PixelCache | None = None  # preprocessed images kept across calls by the pipeline that owns it

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        seqs = [{"input_ids": e[f"{s}_ids"], "labels": e[f"{s}_labels"]} for s in ("chosen", "rejected") for e in examples]
        batch = TokenCollator(self.pad_token_id, packed=self.packed)(seqs)
        # one token fewer than labels: position 0 is never a target (targets are shifted)
        batch["response_lengths"] = torch.tensor([sum(t != IGNORE_INDEX for t in s["labels"][1:]) for s in seqs])
        # NaN where the row gives no margin: the algorithm fills in its configured default
        batch["margin"] = torch.tensor(
            [float("nan") if e.get("margin") is None else e["margin"] for e in examples], dtype=torch.float32
        )
        if all(e.get("chosen_unsafe") is not None and e.get("rejected_unsafe") is not None for e in examples):
            batch["chosen_unsafe"] = torch.tensor([bool(e["chosen_unsafe"]) for e in examples])
            batch["rejected_unsafe"] = torch.tensor([bool(e["rejected_unsafe"]) for e in examples])
        if all("ref_chosen_logps" in e for e in examples):
            batch["ref_logps"] = torch.tensor(
                [e["ref_chosen_logps"] for e in examples] + [e["ref_rejected_logps"] for e in examples], dtype=torch.float32
            )
        images = [s for e in examples for s in e.get("images") or []]
        if images:  # the sequences are chosen 0..B-1 then rejected 0..B-1: every pair's images twice
            if self.processor is None:
                raise ValueError("PairCollator: examples with images need the processor")
            batch.add_inputs(pixel_inputs(self.processor, images + images, self.cache or PixelCache()))
        return batch


def count_pairs(batch: dict[str, torch.Tensor]) -> int:
    return int(batch["margin"].shape[0])


def load_pairs(
    tokenizer: Any,
    specs: list[str],
    *,
    max_length: int,
    pair: str,
    chat_template: bool,
    skip_invalid: bool,
    limit: int | None = None,
    need_safety_labels: bool = False,
) -> tuple[list[dict[str, Any]], RowCounts]:
    """Every row of ``specs`` as a pair example; returns (examples, the rows dropped or changed by cause).

    ``need_safety_labels`` (the cost model) makes a row without per-response safety labels a
    DataError naming its file and line.
    """

    convert = pair_converter(tokenizer, max_length=max_length, pair=pair, chat_template=chat_template,
                             need_safety_labels=need_safety_labels)
    return convert_rows(specs, convert, skip_invalid=skip_invalid, limit=limit)


@dataclass
class pair_converter:  # noqa: N801 - used as a function; a class so that datasets.map workers can pickle it
    """``row -> pair example or None`` (see :func:`load_pairs`); ``processor``: a vision-language model's
    (rows may carry images, relative to ``image_root``)."""

    tokenizer: Any
    max_length: int
    pair: str
    chat_template: bool
    need_safety_labels: bool = False
    processor: Any = None
    image_root: str | None = None

    def __call__(self, row: Row) -> dict[str, Any] | None:
        p = pair_from_row(row, self.pair)
        if self.need_safety_labels and (p.chosen_unsafe is None or p.rejected_unsafe is None):
            raise DataError(
                f"{row.where()}: the cost model needs per-response safety labels "
                "(is_response_0_safe/is_response_1_safe, or is_chosen_safe/is_rejected_safe)"
            )
        return encode_pair(self.tokenizer, p, row, max_length=self.max_length, chat_template=self.chat_template,
                           images=row_images(self.processor, row, self.image_root))
