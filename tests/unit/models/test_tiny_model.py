"""Tiny models and the shipped tokenizer: they load like hub checkpoints and are deterministic."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from alignkit.models.tiny import build_tiny_model
from alignkit.models.tiny_base import CHAT_TEMPLATE, IM_END, IM_START, SIZES, train_tokenizer


@pytest.fixture(scope="module")
def micro_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """Two micro builds with seed 0 and one with seed 1."""
    root = tmp_path_factory.mktemp("tiny")
    a = build_tiny_model(root / "a", size="micro", seed=0)
    b = build_tiny_model(root / "b", size="micro", seed=0)
    c = build_tiny_model(root / "c", size="micro", seed=1)
    return a, b, c


def test_loads_with_auto_classes(micro_dirs: tuple[Path, Path, Path]) -> None:
    model = AutoModelForCausalLM.from_pretrained(micro_dirs[0])
    tok = AutoTokenizer.from_pretrained(micro_dirs[0])
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == len(tok) == SIZES["micro"]["vocab_size"]
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
    assert model.config.tie_word_embeddings is False
    assert model.config.hidden_size == 64 and model.config.num_key_value_heads == 2


def test_special_ids_agree(micro_dirs: tuple[Path, Path, Path]) -> None:
    model = AutoModelForCausalLM.from_pretrained(micro_dirs[0])
    tok = AutoTokenizer.from_pretrained(micro_dirs[0])
    assert tok.pad_token == "<|pad|>" and tok.bos_token == "<|bos|>" and tok.eos_token == IM_END
    assert tok.padding_side == "right" and tok.model_max_length == 2048
    assert tok.pad_token_id != tok.eos_token_id
    for cfg in (model.config, model.generation_config):
        assert cfg.pad_token_id == tok.pad_token_id
        assert cfg.eos_token_id == tok.eos_token_id
    assert model.config.bos_token_id == tok.bos_token_id


def test_chat_template_renders_and_tokenizes(micro_dirs: tuple[Path, Path, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(micro_dirs[0])
    assert tok.chat_template == CHAT_TEMPLATE
    msgs = [{"role": "user", "content": "Uppercase: dog"}, {"role": "assistant", "content": "DOG"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<|im_start|>user\nUppercase: dog<|im_end|>\n<|im_start|>assistant\nDOG<|im_end|>\n"
    prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tok(text)["input_ids"]
    start, end = tok.convert_tokens_to_ids(IM_START), tok.convert_tokens_to_ids(IM_END)
    assert ids[0] == start  # no bos added automatically
    assert ids.count(start) == 2 and ids.count(end) == 2
    assert tok.decode(ids) == text  # byte-level: lossless round trip
    assert tok.decode(ids, skip_special_tokens=True) == "user\nUppercase: dog\nassistant\nDOG\n"


def test_digits_are_single_tokens(micro_dirs: tuple[Path, Path, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(micro_dirs[0])
    assert tok.tokenize("12345") == list("12345")
    pieces = tok.tokenize("23+45=68.")
    assert [p for p in pieces if p.isdigit()] == list("234568")
    assert all(len(p) == 1 for p in pieces if any(ch.isdigit() for ch in p))


def test_same_seed_same_files(micro_dirs: tuple[Path, Path, Path]) -> None:
    a, b, c = micro_dirs
    wa, wb, wc = (load_file(str(d / "model.safetensors")) for d in (a, b, c))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_forward_pass(micro_dirs: tuple[Path, Path, Path]) -> None:
    model = AutoModelForCausalLM.from_pretrained(micro_dirs[0])
    tok = AutoTokenizer.from_pretrained(micro_dirs[0])
    batch = tok(["What is 12+34?", "Reverse the letters: a b c d e"], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], len(tok))
    assert torch.isfinite(logits).all()


def test_unknown_size_or_arch_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="micro"):
        build_tiny_model(tmp_path, size="huge")
    with pytest.raises(ValueError, match="llama"):
        build_tiny_model(tmp_path, arch="gpt9")


def test_shipped_corpus_reaches_8192() -> None:
    tok = train_tokenizer(8192)
    assert len(tok) == 8192
    assert tok.backend_tokenizer.to_str() == train_tokenizer(8192).backend_tokenizer.to_str()


def test_custom_corpus(tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n" * 50, encoding="utf-8")
    tok = train_tokenizer(300, corpus=corpus)
    assert len(tok) <= 300  # a tiny corpus runs out of merges early
    assert tok.decode(tok("hello world 42")["input_ids"]) == "hello world 42"
    with pytest.raises(FileNotFoundError):
        train_tokenizer(300, corpus=tmp_path / "missing.txt")
