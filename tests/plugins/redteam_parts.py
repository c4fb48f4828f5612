"""Stand-ins for the red-team tests: a scorer that is a known function of the text it reads (so a test can
recompute every rank's rewards from attacks.jsonl) and a scripted target."""

from __future__ import annotations

from typing import Any


def vowel_share(prompts: list[Any], completions: list[str], **_: Any) -> list[float]:
    """The share of vowels among the letters of each target output (0 without letters)."""
    out = []
    for text in completions:
        letters = [c for c in text.lower() if c.isalpha()]
        out.append(sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0)
    return out


def attack_length(prompts: list[Any], completions: list[str], **_: Any) -> list[float]:
    """A quality stand-in: the attack's length in characters over 100."""
    return [len(p) / 100 for p in prompts]


def echo_target(attacks: list[str], **_: Any) -> list[str]:
    """A scripted target: answers each attack with the attack upper-cased."""
    return [a.upper() for a in attacks]


def build_classifier(out: str, tokenizer_dir: str, labels: list[str], *, multi_label: bool, seed: int = 0) -> str:
    """A tiny random Llama text classifier (``labels`` heads) with the tokenizer of ``tokenizer_dir``, saved at
    ``out`` in HF format: what ``name: toxicity`` loads by path."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = AutoConfig.from_pretrained(tokenizer_dir)
    config.num_labels = len(labels)
    config.id2label = dict(enumerate(labels))
    config.label2id = {name: i for i, name in enumerate(labels)}
    config.problem_type = "multi_label_classification" if multi_label else "single_label_classification"
    config.pad_token_id = tok.pad_token_id
    LlamaForSequenceClassification(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def bad_target(attacks: list[str], **_: Any) -> list[float]:
    """A broken target: numbers instead of answers."""
    return [1.0 for _ in attacks]


def vowel_share_logged(prompts: list[Any], completions: list[str], **fields: Any) -> list[float]:
    """:func:`vowel_share`, appending "RANK N" (the process that scored, how many) to $REDTEAM_SCORE_LOG."""
    import os

    path = os.environ.get("REDTEAM_SCORE_LOG")
    if path:
        with open(f"{path}.{os.environ.get('RANK', '0')}", "a", encoding="utf-8") as fh:
            fh.write(f"{os.environ.get('RANK', '0')} {len(completions)}\n")
    return vowel_share(prompts, completions, **fields)


def broken_judge(prompts: list[Any], completions: list[str], **_: Any) -> list[float]:
    """A judge that fails (on whichever rank runs it)."""
    raise RuntimeError("the judge's server is down")
