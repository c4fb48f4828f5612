"""ORPO and KTO algorithms: losses from naive per-sequence sums, KTO rows and KL pairs, z0 shared by a step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from alignkit.algorithms import ALGORITHMS, workload_of
from alignkit.algorithms.base import Context
from alignkit.config import ConfigError
from alignkit.constants import IGNORE_INDEX
from alignkit.data.io import DataError, Row
from alignkit.data.unpaired import attach_kl_completions, kl_batch, unpaired_converter
from alignkit.losses import kto_loss, kto_reference_point, orpo_loss
from alignkit.models.loading import load_tokenizer
from alignkit.models.policy import sequence_logps
from alignkit.train.runner import build_models, strategy_for
from tests.unit.algorithms.test_dpo_algorithm import ROWS, SINGLE, make_cfg

UNPAIRED = [
    {"prompt": "What is 2+2?", "completion": "4", "label": True},
    {"prompt": "Uppercase: cat", "completion": "cat is a cat", "label": False},
    {"prompt": "Reverse: a b", "completion": "b a", "label": True},
    {"prompt": "Reverse: a b", "completion": "a b", "label": False},  # same prompt as the row before
]


def setup(micro_model: Path, algorithm: str, overrides: list[str] | None = None):
    cfg = make_cfg(micro_model, algorithm, overrides)
    tok = load_tokenizer(cfg.model)
    algo = ALGORITHMS.get(algorithm)(cfg, tok)
    strategy = strategy_for(cfg, SINGLE)
    torch.manual_seed(0)
    models = build_models(workload_of(cfg), cfg.model, strategy, tok,
                          make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.0))
    # move the policy and its reference apart: the reference (a random step lowers log-probs, so the policy is
    # above it: the KL estimate, z0, is > 0), else the policy
    moved = models.frozen.get("reference", models["policy"])
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return cfg, tok, algo, strategy, models


def kto_examples(tok, rows: list[dict]) -> list[dict]:
    convert = unpaired_converter(tok, max_length=64, pair="helpful", chat_template=False)
    out = [convert(Row(r, "u.jsonl", i + 1)) for i, r in enumerate(rows)]
    examples = [o[0] for o in out] + [o[1] for o in out if len(o) > 1]
    attach_kl_completions(examples, 64)
    return examples


def test_orpo_loss_is_the_pure_loss_of_response_sums(micro_model: Path) -> None:
    _, tok, algo, _, models = setup(micro_model, "orpo", ["orpo.beta=0.3"])
    from alignkit.data.preference import preference_example

    examples = [preference_example(tok, Row(r, "t.jsonl", i + 1), max_length=64) for i, r in enumerate(ROWS)]
    batch = algo.data.collate(examples)
    loss, sums = algo.loss(models, batch, normalizer=2.0)
    logps = sequence_logps(models["policy"], batch).detach()
    lengths = batch["response_lengths"].float()
    expected, met = orpo_loss(logps[:3], logps[3:], lengths[:3], lengths[3:], beta=0.3)
    torch.testing.assert_close(loss.detach(), expected.sum() / 2.0)
    assert "reference" not in models.frozen and len(models.handles) == 1  # no reference model
    for key in ("nll", "log_odds_ratio", "log_odds_chosen", "rewards/accuracy", "rewards/margin"):
        assert key in sums.sums
    assert abs(sums.sums["nll"].item() / 3 - met["nll"].mean().item()) < 1e-5


def test_kto_rows_pairs_and_kl_completions(micro_model: Path) -> None:
    tok = load_tokenizer(make_cfg(micro_model, "kto").model)
    examples = kto_examples(tok, UNPAIRED + [ROWS[0]])  # four unpaired rows and one pair
    assert [e["label"] for e in examples] == [True, False, True, False, True, False]  # the pair's halves last
    for e in examples:
        prompt = e["input_ids"][: e["prompt_len"]]
        assert e["kl_input_ids"][: e["prompt_len"]] == prompt  # its own prompt ...
        kl_completion = e["kl_input_ids"][e["prompt_len"]:]
        others = [o["input_ids"][o["prompt_len"]:] for o in examples if o["input_ids"][: o["prompt_len"]] != prompt]
        assert kl_completion in others  # ... with another prompt's completion
        assert all(t == IGNORE_INDEX for t in e["kl_labels"][: e["prompt_len"]])
    # row 4 shares row 3's prompt: its KL completion comes from row 2, not row 3
    assert examples[3]["kl_input_ids"][examples[3]["prompt_len"]:] == examples[1]["input_ids"][examples[1]["prompt_len"]:]


@pytest.mark.parametrize("row, message", [
    ({"prompt": "p", "completion": "c"}, r"^u.jsonl:7: a KTO row needs a desirability label 'label'"),
    ({"prompt": "p", "completion": "c", "label": "yes"}, r"^u.jsonl:7 field 'label': expected true/false"),
    ({"prompt": "p", "answer": "c"}, r"^u.jsonl:7: a KTO row needs 'prompt'\+'completion'\+'label'"),
])
def test_kto_bad_rows_are_one_line_errors(micro_model: Path, row: dict, message: str) -> None:
    tok = load_tokenizer(make_cfg(micro_model, "kto").model)
    with pytest.raises(DataError, match=message):
        unpaired_converter(tok, max_length=64, pair="helpful", chat_template=False)(Row(row, "u.jsonl", 7))


def test_kto_z0_is_shared_by_the_step_and_the_loss_is_the_pure_loss(micro_model: Path) -> None:
    _, tok, algo, strategy, models = setup(micro_model, "kto", ["kto.beta=0.5", "kto.desirable_weight=1.3"])
    examples = kto_examples(tok, UNPAIRED + ROWS)
    group = [algo.data.collate(examples[:3]), algo.data.collate(examples[3:])]
    with pytest.raises(RuntimeError, match="before_step"):
        algo.loss(models, group[0], normalizer=1.0)
    algo.before_step(Context(models, strategy), group)
    # z0 by hand: every KL pair of BOTH micro-batches, policy minus reference, mean, clamped at 0
    diffs = torch.cat([sequence_logps(models["policy"], kl_batch(b)).detach() - sequence_logps(models["reference"], kl_batch(b))
                       for b in group])
    z0 = kto_reference_point(diffs.double().sum(), torch.tensor(float(len(diffs))))
    assert z0.item() > 0  # the comparison below says something only if the clamp does not zero it
    for batch in group:
        loss, sums = algo.loss(models, batch, normalizer=4.0)
        pi = sequence_logps(models["policy"], batch).detach()
        ref = sequence_logps(models["reference"], batch)
        expected, _ = kto_loss(pi, ref, batch["desirable"], z0.float(), beta=0.5, desirable_weight=1.3)
        torch.testing.assert_close(loss.detach(), expected.sum() / 4.0)
        assert {"rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl"} <= set(sums.sums)


@pytest.mark.parametrize("overrides, message", [
    (["data.streaming=true", "training.max_steps=4"], r"data.streaming: kto pairs every completion"),
    (["kto.reference=lora_base"], r"kto.reference=lora_base needs LoRA adapters"),
])
def test_kto_config_errors(micro_model: Path, overrides: list[str], message: str) -> None:
    from alignkit.algorithms.kto import KTO

    from alignkit.config.loader import validate

    with pytest.raises(ConfigError, match=message):  # at load (alignkit validate says it too), or at start
        cfg = make_cfg(micro_model, "kto", overrides)
        validate(cfg)
        KTO(cfg, None)


def test_kto_precomputed_reference_equals_on_the_fly(micro_model: Path) -> None:
    _, tok, live, strategy, models = setup(micro_model, "kto")
    _, _, cached, _, cached_models = setup(micro_model, "kto", ["kto.precompute_ref_logps=true"])
    examples = kto_examples(tok, UNPAIRED + ROWS)
    train, evalset = [dict(e) for e in examples[:5]], [dict(e) for e in examples[5:]]
    cached.before_training(Context(cached_models, strategy), train, evalset)
    assert "reference" not in cached_models.frozen  # freed: nothing held during training
    both = train + evalset
    assert all("ref_logps" in e and "ref_kl_logps" in e for e in both)
    group_live = [live.data.collate(examples[:4]), live.data.collate(examples[4:])]
    group_cached = [cached.data.collate(both[:4]), cached.data.collate(both[4:])]
    torch.testing.assert_close(group_cached[0]["ref_logps"], sequence_logps(models["reference"], group_live[0]),
                               rtol=0, atol=1e-5)
    live.before_step(Context(models, strategy), group_live)
    cached.before_step(Context(cached_models, strategy), group_cached)
    torch.testing.assert_close(cached._z0, live._z0, rtol=0, atol=1e-6)
    assert live._z0.item() > 0
    for a, b in zip(group_live, group_cached):
        torch.testing.assert_close(cached.loss(cached_models, b, normalizer=3.0)[0],
                                   live.loss(models, a, normalizer=3.0)[0], rtol=0, atol=1e-6)
