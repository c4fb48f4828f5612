"""``alignkit score MODEL_DIR FILE``: reward/cost-model scores for every response of a data file.

Row kinds (each row keeps its fields; score fields are added):

* preference ``prompt/chosen/rejected``   -> ``chosen_score``, ``rejected_score``
* PKU-SafeRLHF ``prompt/response_0/1``     -> ``response_0_score``, ``response_1_score``
* ``prompt/response`` (or ``completion``)  -> ``score``
* ``messages`` (a whole chat)              -> ``score``
* BeaverTails-V ``question/response_1/2``  -> ``response_1_score``, ``response_2_score``

With a vision-language reward / cost model, rows' images (``image`` / ``images``, relative to the data
file's folder) go in with their prompt, as in training.

The score is the scalar head at each sequence's last token, exactly as in training.
The pairs are encoded by ``rewards/scalar.py``, which scores generated pairs the same way online.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from alignkit.constants import IGNORE_INDEX
from alignkit.data.collate import TokenCollator
from alignkit.data.io import DataError, Row, read_rows, require_messages
from alignkit.data.preference import encode_scored, row_images, text_or_messages
from alignkit.data.tokenize import encode_chat
from alignkit.data.vlm import pixel_inputs
from alignkit.models.policy import model_inputs
from alignkit.models.scalar import load_scorer
from alignkit.models.vlm import is_vlm_source
from alignkit.rewards.scalar import trained_format

#: row kind -> the fields scored (each together with the row's prompt)
_RESPONSE_FIELDS = (("chosen", "rejected"), ("response_0", "response_1"), ("response_1", "response_2"), ("response",),
                    ("completion",))


def _sequences(tok: Any, row: Row, *, max_length: int, chat_template: bool,
               processor: Any = None) -> list[tuple[str, list[int], list[str]]]:
    """(output field, token ids, image files) for every response of the row."""
    d = row.data
    images = row_images(processor, row, None)
    sources = images.sources if images is not None else []
    if "messages" in d and "prompt" not in d and images is None:
        ids, _ = encode_chat(tok, require_messages(row, "messages"), row)
        return [("score", ids[-max_length:], [])]
    fields = next((f for f in _RESPONSE_FIELDS if all(k in d for k in f)), None)
    fields = fields or next((f for f in _RESPONSE_FIELDS if any(k in d for k in f)), None)
    if fields is None:
        raise DataError(f"{row.where()}: nothing to score; expected chosen/rejected, response_0/response_1, "
                        f"response, completion or messages (row has {sorted(d)})")
    prompt = text_or_messages(row, "question" if "prompt" not in d and "question" in d else "prompt")
    out = []
    for field in fields:
        ids = encode_scored(tok, prompt, text_or_messages(row, field), row, max_length=max_length,
                            chat_template=chat_template, images=images)
        out.append(("score" if len(fields) == 1 else f"{field}_score", ids, sources))
    return out


@torch.no_grad()
def score_rows(model: Any, tok: Any, rows: list[Row], *, batch_size: int = 16, max_length: int = 512,
               chat_template: bool = False, processor: Any = None) -> list[dict[str, Any]]:
    """Every row's data plus its score field(s); ``processor``: a vision-language scorer's (rows' images)."""
    items = [(i, name, ids, src) for i, row in enumerate(rows)
             for name, ids, src in _sequences(tok, row, max_length=max_length, chat_template=chat_template,
                                              processor=processor)]
    results = [dict(r.data) for r in rows]
    collate = TokenCollator(tok.pad_token_id, packed=False)
    device = next(model.parameters()).device
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        batch = collate([{"input_ids": ids, "labels": [IGNORE_INDEX] * len(ids)} for _, _, ids, _ in chunk])
        if processor is not None:
            batch.add_inputs(pixel_inputs(processor, [s for *_, src in chunk for s in src]))
        batch = batch.to(device)
        scores = model(seq_index=batch["seq_index"], num_seqs=len(chunk), **model_inputs(batch))
        for (i, name, _, _), s in zip(chunk, scores.tolist()):
            results[i][name] = s
    return results


def summary(results: list[dict[str, Any]]) -> str:
    """One line: rows, mean score, and pairwise accuracy where rows are pairs."""
    scores = [v for r in results for k, v in r.items() if k == "score" or k.endswith("_score")]
    parts = [f"scored {len(results)} rows ({len(scores)} responses)"]
    if scores:
        parts.append(f"mean score {sum(scores) / len(scores):.4f}")
    pairs = [(r["chosen_score"], r["rejected_score"]) for r in results if "chosen_score" in r]
    if pairs:
        parts.append(f"pairwise accuracy {sum(c > r for c, r in pairs) / len(pairs):.4f}")
    return ", ".join(parts)


def score_command(model_dir: str, file: str, out: str | None, *, batch_size: int, max_length: int | None = None,
                  chat_template: bool | None = None) -> list[dict[str, Any]]:
    """Scores rows the way the model was trained: ``chat_template`` / ``max_length`` default to the
    training run's ``data.*`` (its config.yaml), else no template and 512 tokens."""
    trained = trained_format(model_dir)
    chat_template = trained.get("chat_template", False) if chat_template is None else chat_template
    max_length = trained.get("max_length", 512) if max_length is None else max_length
    model, tok = load_scorer(model_dir)
    processor = None
    if is_vlm_source(str(model_dir)):
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(model_dir)
    results = score_rows(model, tok, read_rows(file), batch_size=batch_size, max_length=max_length,
                         chat_template=chat_template, processor=processor)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text, encoding="utf-8")
        print(f"{summary(results)}; wrote {out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
        print(summary(results), file=sys.stderr)
    return results
