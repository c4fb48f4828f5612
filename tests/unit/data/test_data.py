"""SFT tokenization and masking, collators (padded / packed), samplers, malformed rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from alignkit.algorithms.sft import sft_example
from alignkit.constants import IGNORE_INDEX
from alignkit.data.collate import TokenCollator, count_loss_tokens, shift_labels
from alignkit.data.io import DataError, Row, convert_rows, read_rows
from alignkit.data.sampler import EvalSampler, GlobalOrder


@pytest.fixture(scope="module")
def tok(micro_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(micro_model)


def row(data: dict, line: int = 7) -> Row:
    return Row(data, "data.jsonl", line)


def test_chat_loss_only_on_assistant_tokens(tok) -> None:
    msgs = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}]
    ex = sft_example(tok, row({"messages": msgs}), max_length=512)
    ids, labels = ex["input_ids"], ex["labels"]
    text = tok.decode(ids)
    assert text == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"
    trained = tok.decode([t for t in labels if t != IGNORE_INDEX])
    # exactly the assistant content, its end-of-turn token and the newline the template puts after it
    assert trained == "5<|im_end|>\n"
    prompt_len = len(tok(tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True))["input_ids"])
    assert all(t == IGNORE_INDEX for t in labels[:prompt_len])


def test_multi_turn_masks_every_assistant_turn(tok) -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Uppercase: dog"},
        {"role": "assistant", "content": "DOG"},
        {"role": "user", "content": "Uppercase: cat"},
        {"role": "assistant", "content": "CAT"},
    ]
    ex = sft_example(tok, row({"messages": msgs}), max_length=512)
    trained = tok.decode([t for t in ex["labels"] if t != IGNORE_INDEX])
    assert trained == "DOG<|im_end|>\nCAT<|im_end|>\n"


def test_prompt_completion_plain_text(tok) -> None:
    ex = sft_example(tok, row({"prompt": "Reverse the letters: a b c\n", "completion": "c b a"}), max_length=512)
    trained = [t for t in ex["labels"] if t != IGNORE_INDEX]
    assert tok.decode(trained) == "c b a<|im_end|>"  # completion + eos
    assert ex["labels"][0] == IGNORE_INDEX


def test_truncation_and_empty_after_truncation(tok) -> None:
    msgs = [{"role": "user", "content": "x " * 200}, {"role": "assistant", "content": "ok"}]
    assert sft_example(tok, row({"messages": msgs}), max_length=16) is None  # no answer token survives
    ex = sft_example(tok, row({"messages": msgs}), max_length=16, loss_on="all")
    assert len(ex["input_ids"]) == 16


@pytest.mark.parametrize(
    "data, pattern",
    [
        ({"foo": 1}, r"data.jsonl:7: an SFT row needs 'messages'"),
        ({"messages": "hi"}, r"data.jsonl:7 field 'messages': expected a non-empty list"),
        ({"messages": [{"role": "bot", "content": "x"}]}, r"data.jsonl:7 field 'messages'\[0\]: unknown role 'bot'"),
        ({"prompt": "q", "completion": 3}, r"data.jsonl:7 field 'completion': expected a string, got int"),
        ({"prompt": "q", "completion": "  "}, r"data.jsonl:7 field 'completion': is empty"),
    ],
)
def test_malformed_rows_name_file_line_field(tok, data: dict, pattern: str) -> None:
    with pytest.raises(DataError, match=pattern):
        sft_example(tok, row(data), max_length=64)


def test_skip_invalid_counts_and_bad_json(tmp_path: Path, tok) -> None:
    f = tmp_path / "d.jsonl"
    good = {"prompt": "a", "completion": "b"}
    f.write_text("\n".join([json.dumps(good), json.dumps({"prompt": "a"}), json.dumps(good)]) + "\n")
    conv = lambda r: sft_example(tok, r, max_length=64)  # noqa: E731
    with pytest.raises(DataError, match=r"d.jsonl:2: missing field 'completion'"):
        convert_rows([str(f)], conv, skip_invalid=False)
    out, counts = convert_rows([str(f)], conv, skip_invalid=True)
    assert len(out) == 2 and counts.total_dropped == 1
    f.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(DataError, match=r"d.jsonl:2: not valid JSON"):
        read_rows(str(f))
    with pytest.raises(DataError, match="does not exist"):
        read_rows(str(tmp_path / "nope.jsonl"))


def test_parquet_and_jsonl_agree() -> None:
    a = [r.data["messages"] for r in read_rows("builtin:sft_train.jsonl")]
    b = [r.data["messages"] for r in read_rows("builtin:sft_train.parquet")]
    assert a == b


def test_collators_shift_and_pack() -> None:
    exs = [
        {"input_ids": [5, 6, 7], "labels": [IGNORE_INDEX, 6, 7]},
        {"input_ids": [8, 9], "labels": [IGNORE_INDEX, 9]},
    ]
    assert shift_labels([1, 2, 3]) == [2, 3, IGNORE_INDEX]
    padded = TokenCollator(pad_token_id=0)(exs)
    assert padded["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert padded["targets"].tolist() == [[6, 7, IGNORE_INDEX], [9, IGNORE_INDEX, IGNORE_INDEX]]
    packed = TokenCollator(pad_token_id=0, packed=True)(exs)
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    # the last token of example 1 does not predict the first token of example 2
    assert packed["targets"].tolist() == [[6, 7, IGNORE_INDEX, 9, IGNORE_INDEX]]
    assert packed["seq_index"].tolist() == [[0, 0, 0, 1, 1]]
    assert count_loss_tokens(padded) == count_loss_tokens(packed) == 3


def test_packed_forward_equals_padded(micro_model: Path, tok) -> None:
    """Padding-free packing gives the same per-token log-probs and gradients as right padding,
    through the per-example packed attention (``sdpa_packed``) and the plain SDPA block mask."""
    from alignkit.config.schema import ModelConfig
    from alignkit.models.loading import load_causal_lm
    from alignkit.models.policy import CausalLMLogps

    rows = [r for r in read_rows("builtin:sft_train.jsonl")[:4]]
    exs = [sft_example(tok, r, max_length=96) for r in rows]
    padded = {k: v for k, v in TokenCollator(0)(exs).items() if k != "seq_index"}
    packed = {k: v for k, v in TokenCollator(0, packed=True)(exs).items() if k != "seq_index"}
    results = []
    for attn in ("sdpa", "eager"):  # sdpa -> alignkit's sdpa_packed; eager -> transformers' block mask
        model = CausalLMLogps(load_causal_lm(ModelConfig(name_or_path=str(micro_model), attn_implementation=attn)))
        a = model(**padded)
        a.sum().backward()
        ga = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        b = model(**packed)
        b.sum().backward()
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        for n, p in model.named_parameters():
            torch.testing.assert_close(ga[n], p.grad, atol=1e-5, rtol=1e-4)
        results.append(b.detach())
    assert model.hf_model.config._attn_implementation == "eager"
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)


def test_packed_attention_is_not_saved_in_config(micro_model: Path, tmp_path: Path) -> None:
    """The saved model loads anywhere: config.json never names alignkit's attention."""
    from alignkit.config.schema import ModelConfig
    from alignkit.models.loading import load_causal_lm

    model = load_causal_lm(ModelConfig(name_or_path=str(micro_model)))
    assert model.config._attn_implementation == "sdpa_packed"
    model.save_pretrained(tmp_path)
    assert "sdpa_packed" not in (tmp_path / "config.json").read_text()


def _epoch(n: int, w: int, pd: int, epoch: int, consumed: int = 0) -> list[list[list[int]]]:
    """Every round of the epoch from ``consumed``: [rank 0's indices, rank 1's, ...]."""
    per_rank = [list(GlobalOrder(n, w, r, pd, seed=1).rounds(epoch, consumed)) for r in range(w)]
    assert len({len(p) for p in per_rank}) == 1  # the same number of rounds on every rank
    return [[per_rank[r][k][0] for r in range(w)] for k in range(len(per_rank[0]))]


def test_global_order_partitions_and_resumes_at_any_world_size() -> None:
    n, w, pd = 23, 3, 2
    rounds = _epoch(n, w, pd, epoch=2)
    flat = [i for rnd in rounds for part in rnd for i in part]
    assert len(flat) == len(set(flat)) == (n // w) * w  # no example twice, tail dropped evenly
    assert all(len({len(p) for p in rnd}) == 1 for rnd in rounds)  # equal shares in every round
    order = GlobalOrder(n, 1, 0, w * pd, seed=1).order(2)
    assert sorted(rounds[0][0] + rounds[0][1] + rounds[0][2]) == sorted(order[: w * pd])  # 1 rank == 3 ranks
    # resume after 2 rounds (12 examples) with 2 ranks of 4, or 1 rank of 5: exactly the unseen examples
    seen = {i for rnd in rounds[:2] for part in rnd for i in part}
    for w2, pd2 in ((2, 4), (1, 5)):
        rest = [i for rnd in _epoch(n, w2, pd2, epoch=2, consumed=12) for part in rnd for i in part]
        assert seen.isdisjoint(rest) and len(rest) == len(set(rest))
        assert seen | set(rest) == set(GlobalOrder(n, w2, 0, pd2, seed=1).order(2)[: (n // w2) * w2]) | seen
    assert list(GlobalOrder(n, w, 0, pd, seed=1).order(3)) != list(GlobalOrder(n, w, 0, pd, seed=1).order(2))  # reshuffled


def test_eval_sampler_exactly_once() -> None:
    n, w = 10, 4
    parts = [list(EvalSampler(n, w, r)) for r in range(w)]
    assert sorted(i for p in parts for i in p) == list(range(n))
