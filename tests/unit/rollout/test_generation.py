"""The one generation path (rollout/engine.py): left padding, batching by ``batch_size``, image inputs
stitched per batch, finish reasons and decoded texts; and the callers built on it (``generate``,
``generate_with_images``, the Safe-MM-DPO cost estimate) give the greedy answers the former per-caller
paths gave (reproduced here as ``_old_*``: the tokenizer / processor padding a batch on the left)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch
from torch import nn

from alignkit.rollout.engine import Generations, Prompt, SamplingParams, build_engine, left_pad

GREEDY = SamplingParams(8, 0.0, batch_size=64)
TEXTS = ["a", "the quick brown fox jumps", "1 2 3 4 5 6 7 8 9 10 11 12 13", "hello world"]


@pytest.fixture(scope="module")
def lm(micro_model: Path) -> tuple[nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(micro_model)).eval()
    return model, AutoTokenizer.from_pretrained(str(micro_model))


@pytest.fixture(scope="module")
def llava(micro_llava: Path) -> tuple[nn.Module, Any]:
    from alignkit.rollout.vlm_generate import load_vlm_for_generation

    return load_vlm_for_generation(str(micro_llava))


def _ids(tok: Any, texts: list[str]) -> list[list[int]]:
    return tok(texts, add_special_tokens=False)["input_ids"]


def _greedy(**kw: Any) -> dict[str, Any]:
    return dict(do_sample=False, temperature=None, top_p=None, top_k=None, use_cache=True, **kw)


def _former(model: nn.Module, tok: Any, encode: Callable[[], Any], max_new: int) -> list[str]:
    """The former ``batched_generate`` on one batch: ``encode()`` runs with the tokenizer padding left. Its texts
    less the U+FFFD of a character cut at the end, which the engine leaves out since (issue 50: completion_texts)."""
    side, tok.padding_side = tok.padding_side, "left"
    try:
        enc = encode()
    finally:
        tok.padding_side = side
    with torch.no_grad():
        gen = model.generate(**enc, **_greedy(max_new_tokens=max_new, pad_token_id=tok.pad_token_id,
                                              eos_token_id=tok.eos_token_id))
    return [t.rstrip("\ufffd") for t in tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)]


def _old_generate(model: nn.Module, tok: Any, texts: list[str], max_new: int) -> list[str]:
    """The former ``generate``: the tokenizer pads the texts."""
    return _former(model, tok, lambda: tok(texts, return_tensors="pt", padding=True, add_special_tokens=False),
                   max_new)


def test_left_pad() -> None:
    ids, mask = left_pad([[5, 6, 7], [8]], pad=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_a_prompt_gets_the_same_greedy_completion_alone_and_in_a_mixed_batch(lm: tuple[nn.Module, Any]) -> None:
    model, tok = lm
    engine = build_engine("hf", tok)
    ids = _ids(tok, TEXTS)
    assert len({len(i) for i in ids}) == len(ids)  # every length differs: the batch pads all but one
    model.train()
    batch = engine.generate(model, ids, GREEDY)
    assert model.training  # generation_mode restores the mode
    alone = [engine.generate(model, [i], GREEDY).completion_ids[0] for i in ids]
    assert batch.completion_ids == alone
    wrapped = engine.generate(model, [Prompt(i) for i in ids], SamplingParams(8, 0.0, batch_size=3))
    assert wrapped.completion_ids == alone  # Prompt requests == plain id lists; chunks of 3 + 1


def test_texts_decode_the_completions(lm: tuple[nn.Module, Any]) -> None:
    model, tok = lm
    gens = build_engine("hf", tok).generate(model, _ids(tok, TEXTS), GREEDY)
    assert gens.texts == [tok.decode(c, skip_special_tokens=True) for c in gens.completion_ids]
    assert len(gens.texts) == len(TEXTS)


def test_finish_reasons_stop_on_eos_or_length(lm: tuple[nn.Module, Any]) -> None:
    """EOS made a token the random model emits for one prompt (third new token) but never for another."""
    model, tok = lm
    ids = _ids(tok, TEXTS)
    free = build_engine("hf", tok).generate(model, ids, GREEDY).completion_ids
    stop = free[0][2]
    other = next(i for i, c in enumerate(free) if stop not in c)
    eos_tok = SimpleNamespace(pad_token_id=tok.pad_token_id, eos_token_id=stop, batch_decode=tok.batch_decode)
    gens = build_engine("hf", eos_tok).generate(model, [ids[0], ids[other]], GREEDY)
    assert gens.finish_reasons == ["stop", "length"] and gens.truncated == [False, True]
    assert gens.completion_ids == [free[0][: free[0].index(stop) + 1], free[other]]
    assert Generations([[1]], ["length"], ["x"]).truncated == [True]


class Scripted(nn.Module):
    """A stand-in for an HF model: records each ``generate`` call's arguments and answers each row with
    ``script[last prompt token]`` (cut at max_new_tokens), padding finished rows as HF does."""

    def __init__(self, script: dict[int, list[int]]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.script, self.calls = script, []

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 pad_token_id: int, **kw: Any) -> torch.Tensor:
        self.calls.append({"input_ids": input_ids, "attention_mask": attention_mask, **kw})
        rows = [self.script[int(r[-1])][:max_new_tokens] for r in input_ids]
        width = max(len(r) for r in rows)
        return torch.cat([input_ids, torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])], 1)


def test_batches_of_batch_size_with_each_rows_images_stitched_in_order() -> None:
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=2,
                          batch_decode=lambda ids, skip_special_tokens: [" ".join(map(str, i)) for i in ids])
    model = Scripted({11: [7, 2], 12: [8, 8, 8], 13: [9, 2], 14: [2], 15: [6, 6]})
    pix = {i: torch.full((n, 3, 2, 2), float(i)) for i, n in ((11, 1), (12, 2), (14, 1))}
    prompts = [Prompt([5, 11], {"pixel_values": pix[11]}), Prompt([12], {"pixel_values": pix[12]}),
               Prompt([4, 4, 13]), Prompt([14], {"pixel_values": pix[14]}), [15]]
    gens = build_engine("hf", tok).generate(model, prompts, SamplingParams(3, 0.0, batch_size=2))
    assert [c["input_ids"].tolist() for c in model.calls] == [[[5, 11], [0, 12]], [[4, 4, 13], [0, 0, 14]], [[15]]]
    assert [c["attention_mask"].tolist() for c in model.calls][1] == [[1, 1, 1], [0, 0, 1]]
    assert torch.equal(model.calls[0]["pixel_values"], torch.cat([pix[11], pix[12]]))  # row order, 1 + 2 images
    assert torch.equal(model.calls[1]["pixel_values"], pix[14])  # a text row adds no images
    assert "pixel_values" not in model.calls[2]
    assert gens.completion_ids == [[7, 2], [8, 8, 8], [9, 2], [2], [6, 6]]
    assert gens.finish_reasons == ["stop", "length", "stop", "stop", "length"]
    assert gens.texts[1] == "8 8 8"


def test_generate_equals_the_former_path_and_the_engine(lm: tuple[nn.Module, Any]) -> None:
    from alignkit.data.prompts import prompt_text
    from alignkit.rollout.generate import generate

    model, tok = lm
    prompts: list[Any] = [*TEXTS, [{"role": "user", "content": "a chat prompt"}]]
    texts = [prompt_text(tok, p) for p in prompts]
    got = generate(model, tok, prompts, max_new_tokens=8, batch_size=2)
    assert got == _old_generate(model, tok, texts, 8)
    assert got == build_engine("hf", tok).generate(model, _ids(tok, texts), GREEDY).texts
    assert tok.padding_side == "right"  # the caller's tokenizer is left as it was


def _images(n: int, seed: int) -> list[Any]:
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return [Image.fromarray((torch.rand(32, 32, 3, generator=g) * 255).to(torch.uint8).numpy()) for _ in range(n)]


def _old_generate_with_images(model: nn.Module, processor: Any, texts: list[str], images: list[list[Any]],
                              max_new: int) -> list[str]:
    """The former ``generate_with_images``: the processor pads the texts, every image of the batch in one
    ``pixel_values``."""
    flat = [i for imgs in images for i in imgs]
    return _former(model, processor.tokenizer, lambda: processor(
        text=texts, images=flat or None, padding=True, add_special_tokens=False, return_tensors="pt"), max_new)


def test_generate_with_images_equals_the_former_path_and_the_engine(llava: tuple[nn.Module, Any]) -> None:
    from alignkit.rollout.vlm_generate import generate_with_images, image_prompt

    model, processor = llava
    chats = [[{"role": "user", "content": "<image>\nWhat colour is the shape?"}],
             [{"role": "user", "content": "<image><image>\nSame?"}],
             [{"role": "user", "content": "no image here, a longer question than the others"}],
             [{"role": "user", "content": "<image>\nShape?"}]]
    images = [_images(1, 0), _images(2, 1), [], _images(1, 2)]
    texts = [processor.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    requests = [image_prompt(processor, t, i) for t, i in zip(texts, images)]
    assert [0 if r.inputs is None else r.inputs["pixel_values"].shape[0] for r in requests] == [1, 2, 0, 1]
    got = generate_with_images(model, processor, chats, images, max_new_tokens=6, batch_size=3)
    assert got == _old_generate_with_images(model, processor, texts, images, 6)
    gens = build_engine("hf", processor.tokenizer).generate(model, requests, SamplingParams(6, 0.0))
    assert got == gens.texts
    alone = [build_engine("hf", processor.tokenizer).generate(model, [r], SamplingParams(6, 0.0)).texts[0]
             for r in requests]
    assert got == alone  # each prompt's images reach its own row


def test_cost_estimate_samples_through_the_engine(llava: tuple[nn.Module, Any], tmp_path: Path) -> None:
    """Per-prompt requests (ids + that prompt's ``pixel_values``) give the greedy responses the former
    one-batch call gave with every image in one ``pixel_values``."""
    from alignkit.algorithms.cost_estimate import prompt_inputs, sample_responses
    from alignkit.data.vlm import pixel_inputs
    from alignkit.rewards.scalar import EstimatePrompt

    model, processor = llava
    files = []
    for i, img in enumerate(_images(3, 5)):
        img.save(tmp_path / f"{i}.png")
        files.append(str(tmp_path / f"{i}.png"))
    prompts = [EstimatePrompt("Describe it.", [files[0]]), EstimatePrompt("Compare the two pictures.", files[1:])]
    requests = prompt_inputs(processor.tokenizer, prompts, chat_template=True, processor=processor)
    for r, p in zip(requests, prompts):
        assert r.inputs is not None
        assert torch.equal(r.inputs["pixel_values"], pixel_inputs(processor, p.images)["pixel_values"])
    got = sample_responses(model, build_engine("hf", processor.tokenizer), requests, max_new_tokens=6, do_sample=False,
                           temperature=1.0)
    tok = processor.tokenizer
    ids, mask = left_pad([r.ids for r in requests], tok.pad_token_id)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, **pixel_inputs(processor, files),
                             **_greedy(max_new_tokens=6, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    assert got == tok.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
