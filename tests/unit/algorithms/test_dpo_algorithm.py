"""DPO algorithm: per-sequence sums, reference sources, cached reference log-probs, config checks."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from alignkit.algorithms.base import Context
from alignkit.algorithms.dpo import DPO
from alignkit.algorithms.reward import CostModel, RewardModel
from alignkit.config import ConfigError
from alignkit.config.loader import apply_overrides, build_dataclass
from alignkit.config.schema import RunConfig
from alignkit.constants import IGNORE_INDEX
from alignkit.data.io import Row
from alignkit.data.preference import PairCollator, preference_example
from alignkit.distributed.env import DistEnv
from alignkit.algorithms import workload_of
from alignkit.models.policy import forward_scores, sequence_logps
from alignkit.models.roles import Models
from alignkit.train.runner import build_models, strategy_for
from alignkit.losses import bradley_terry_loss, cost_model_loss, dpo_loss
from alignkit.models.adapters import adapters_disabled
from alignkit.models.loading import load_tokenizer

ROWS = [
    {"prompt": "What is 12+30?", "chosen": "12+30=42. The answer is 42.", "rejected": "12+30=40."},
    {"prompt": "Keep it short. Uppercase: dog", "chosen": "DOG", "rejected": "Dog is the answer here"},
    {"prompt": "Reverse the letters: a b c d", "chosen": "d c b a", "rejected": "a b c d"},
]
SINGLE = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr=None, master_port=None)


def make_cfg(micro_model: Path, algorithm: str = "dpo", overrides: list[str] | None = None) -> RunConfig:
    raw: dict[str, Any] = {
        "algorithm": algorithm,
        "model": {"name_or_path": str(micro_model)},
        "data": {"train": "builtin:pref_train.jsonl", "max_length": 64},
        "training": {"per_device_batch_size": 3},
    }
    return build_dataclass(RunConfig, apply_overrides(copy.deepcopy(raw), overrides or []))


def setup(micro_model: Path, algorithm: str = "dpo", overrides: list[str] | None = None):
    cfg = make_cfg(micro_model, algorithm, overrides)
    tok = load_tokenizer(cfg.model)
    algo = {"dpo": DPO, "reward_model": RewardModel, "cost_model": CostModel}[algorithm](cfg, tok)
    strategy = strategy_for(cfg, SINGLE)
    torch.manual_seed(0)
    models = build_models(workload_of(cfg), cfg.model, strategy, tok, make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.0))
    examples = [preference_example(tok, Row(r, "t.jsonl", i + 1), max_length=64) for i, r in enumerate(ROWS)]
    return cfg, tok, algo, strategy, models, examples


def with_policy(models: Models, policy: torch.nn.Module) -> Models:
    """``models`` with another algorithm's policy (the same weights for both variants compared)."""
    out = Models(dict(models.handles), dict(models.frozen), dict(models.specs))
    out.handles["policy"] = type(models.handles["policy"])("policy", policy, None)
    return out


def naive_sum(hf, ids: list[int], labels: list[int]) -> torch.Tensor:
    """Sum of log p(label_t | ids_<t) over response tokens, from the full logits of one sequence."""
    logits = hf(input_ids=torch.tensor([ids])).logits[0, :-1]
    logp = F.log_softmax(logits.double(), -1)
    tgt = torch.tensor(labels[1:])
    keep = tgt != IGNORE_INDEX
    return logp[keep].gather(1, tgt[keep, None]).sum().float()


def test_sequence_sums_equal_naive_per_sequence(micro_model: Path) -> None:
    _, _, algo, _, models, examples = setup(micro_model)
    model = models["policy"]
    lens = [len(e["chosen_ids"]) for e in examples] + [len(e["rejected_ids"]) for e in examples]
    assert len(set(lens)) > 2  # pairs of different lengths
    hf = model.hf_model
    expected = torch.stack(
        [naive_sum(hf, e[f"{s}_ids"], e[f"{s}_labels"]) for s in ("chosen", "rejected") for e in examples]
    )
    for packed in (True, False):
        batch = PairCollator(0, packed=packed)(examples)
        got = sequence_logps(model, batch)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    counts = [sum(t != IGNORE_INDEX for t in e[f"{s}_labels"][1:]) for s in ("chosen", "rejected") for e in examples]
    assert batch["response_lengths"].tolist() == counts


def test_dpo_loss_matches_pure_loss_and_kl_is_token_mean(micro_model: Path) -> None:
    _, _, algo, _, models, examples = setup(micro_model)
    model, ref_model = models["policy"], models["reference"]
    batch = algo.data.collate(examples)
    with torch.no_grad():  # move the policy away from the reference
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    loss, sums = algo.loss(models, batch, normalizer=2.0)
    logps = sequence_logps(model, batch).detach()
    ref = sequence_logps(ref_model, batch)
    expected, _ = dpo_loss(logps[:3], logps[3:], ref[:3], ref[3:], beta=0.1)
    torch.testing.assert_close(loss.detach(), expected.sum() / 2.0)
    # k1 KL = mean over chosen response tokens of (log pi - log pi_ref), from per-token values
    tok_pi = model(input_ids=batch["input_ids"], targets=batch["targets"], position_ids=batch["position_ids"]).detach()
    tok_ref = ref_model(input_ids=batch["input_ids"], targets=batch["targets"], position_ids=batch["position_ids"])
    seq = batch["seq_index"][batch["targets"] != IGNORE_INDEX]
    chosen = seq < 3
    kl = (tok_pi - tok_ref)[chosen].mean()
    assert abs(sums.sums["kl"].item() / sums.counts["kl"].item() - kl.item()) < 1e-5
    assert set(sums.sums) >= {"rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin", "kl"}


def test_rpo_adds_the_chosen_per_token_nll(micro_model: Path) -> None:
    _, _, plain, _, models, examples = setup(micro_model)
    _, _, rpo, _, _, _ = setup(micro_model, overrides=["dpo.rpo_alpha=0.5"])
    batch = plain.data.collate(examples)
    base, _ = plain.loss(models, batch, normalizer=2.0)
    with_nll, sums = rpo.loss(models, batch, normalizer=2.0)
    logps = sequence_logps(models["policy"], batch).detach()
    nll = -logps[:3] / batch["response_lengths"][:3]
    torch.testing.assert_close(with_nll - base, 0.5 * nll.sum() / 2.0)
    assert abs(sums.sums["nll/chosen"].item() / 3 - nll.mean().item()) < 1e-5


def test_accuracy_counts_ties_as_half(micro_model: Path) -> None:
    _, _, algo, _, models, examples = setup(micro_model)
    sums = algo.eval_step(models, algo.data.collate(examples))  # policy == reference: every margin is 0
    assert sums.sums["rewards/accuracy"].item() / sums.counts["rewards/accuracy"].item() == 0.5


def test_lora_base_reference_equals_frozen_copy(micro_model: Path) -> None:
    lora = ["model.lora={r: 4, alpha: 8, dropout: 0.0}"]
    _, _, algo_lora, _, models_lora, examples = setup(micro_model, overrides=lora)
    policy = models_lora["policy"]
    assert algo_lora.reference == "lora_base" and "reference" not in models_lora  # no second copy
    _, _, algo_copy, _, models_copy, _ = setup(micro_model, overrides=lora + ["dpo.reference=model"])
    batch = algo_lora.data.collate(examples)
    frozen = algo_copy.reference_logps(models_copy, batch)  # the frozen copy of the start
    base = algo_lora.reference_logps(models_lora, batch)  # adapters disabled
    torch.testing.assert_close(base, frozen, rtol=0, atol=1e-5)
    # zero-initialised adapters: the policy is still its base
    torch.testing.assert_close(sequence_logps(policy, batch).detach(), frozen, rtol=0, atol=1e-5)
    with torch.no_grad():  # a trained adapter changes the policy but not the reference
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.add_(0.1 * torch.randn_like(p))
    assert (sequence_logps(policy, batch).detach() - frozen).abs().max() > 1e-3
    torch.testing.assert_close(algo_lora.reference_logps(models_lora, batch), frozen, rtol=0, atol=1e-5)
    with adapters_disabled(policy):  # the context really switches the adapters off, then back on
        torch.testing.assert_close(sequence_logps(policy, batch).detach(), frozen, rtol=0, atol=1e-5)
    assert (sequence_logps(policy, batch).detach() - frozen).abs().max() > 1e-3


@pytest.mark.parametrize("reference", ["model", "lora_base"])
def test_precomputed_reference_equals_on_the_fly(micro_model: Path, reference: str) -> None:
    over = ["model.lora={r: 4, alpha: 8, dropout: 0.0}", f"dpo.reference={reference}"]
    _, _, live, _, live_models, examples = setup(micro_model, overrides=over)
    _, _, cached, strategy, cached_models, _ = setup(micro_model, overrides=over + ["dpo.precompute_ref_logps=true"])
    cached_models = with_policy(cached_models, live_models["policy"])
    train, evalset = copy.deepcopy(examples[:2]), copy.deepcopy(examples[2:])
    cached.before_training(Context(cached_models, strategy), train, evalset)
    assert "reference" not in cached_models.frozen  # nothing held during training
    assert all("ref_chosen_logps" in e for e in train + evalset)
    both = train + evalset
    batch = cached.data.collate(both)
    live_batch = live.data.collate(examples)
    torch.testing.assert_close(batch["ref_logps"], live.reference_logps(live_models, live_batch), rtol=0, atol=1e-5)
    loss_cached, _ = cached.loss(cached_models, batch, normalizer=3.0)
    loss_live, _ = live.loss(live_models, live_batch, normalizer=3.0)
    torch.testing.assert_close(loss_cached, loss_live, rtol=0, atol=1e-6)


def test_reward_and_cost_losses_use_last_token_scores(micro_model: Path) -> None:
    _, tok, rm, _, models, _ = setup(micro_model, "reward_model", ["reward_model.margin=0.5", "reward_model.center_coeff=0.01"])
    rows = [
        {"prompt": "p one", "response_0": "safe and short", "response_1": "Step 1: do it. Step 2: more.",
         "is_response_0_safe": True, "is_response_1_safe": False, "better_response_id": 1, "safer_response_id": 0},
        {"prompt": "p two", "response_0": "a", "response_1": "bb cc", "is_response_0_safe": False,
         "is_response_1_safe": False, "better_response_id": 0, "safer_response_id": 1, },
    ]
    ex_h = [preference_example(tok, Row(r, "s.jsonl", i), max_length=64, pair="helpful") for i, r in enumerate(rows)]
    batch = rm.data.collate(ex_h)
    scores = forward_scores(models["reward"], batch)
    loss, sums = rm.loss(models, batch, normalizer=2.0)
    expected, _ = bradley_terry_loss(scores[:2], scores[2:], margin=torch.full((2,), 0.5), center_coeff=0.01)
    torch.testing.assert_close(loss, expected.sum() / 2.0)
    _, _, cm, _, cmodels, _ = setup(micro_model, "cost_model", ["reward_model.reg_coeff=0.01"])
    ex_s = [preference_example(tok, Row(r, "s.jsonl", i), max_length=64, pair="safety") for i, r in enumerate(rows)]
    batch = cm.data.collate(ex_s)
    c = forward_scores(cmodels["cost"], batch)  # chosen = safer, rejected = unsafer
    loss, sums = cm.loss(cmodels, batch, normalizer=2.0)
    assert batch["rejected_unsafe"].tolist() == [True, True] and batch["chosen_unsafe"].tolist() == [False, True]
    expected, _ = cost_model_loss(c[2:], c[:2], torch.tensor([True, True]), torch.tensor([False, True]), reg_coeff=0.01)
    torch.testing.assert_close(loss, expected.sum() / 2.0)
    assert "sign_accuracy" in sums.sums


@pytest.mark.parametrize(
    "algorithm, overrides, message",
    [
        ("dpo", ["dpo.loss_type=sigmod"], r"dpo.loss_type: unknown 'sigmod' \(did you mean 'sigmoid'\?\)"),
        ("dpo", ["dpo.reference=none"], r"needs reference log-probs"),
        ("dpo", ["dpo.reference=lora_base"], r"needs LoRA adapters"),
        ("dpo", ["dpo.loss_type=ipo", "dpo.label_smoothing=0.1"], r"not ipo"),
        ("cost_model", ["reward_model.pair=helpful"], r"ranks responses by safety"),
        ("cost_model", ["reward_model.margin=1.0"], r"options of algorithm reward_model only"),
    ],
)
def test_config_errors(micro_model: Path, algorithm: str, overrides: list[str], message: str) -> None:
    cls = {"dpo": DPO, "cost_model": CostModel}[algorithm]
    with pytest.raises(ConfigError, match=message):  # section checks fail at load, cross-section ones here
        cls(make_cfg(micro_model, algorithm, overrides), None)


def test_reference_resolution(micro_model: Path) -> None:
    assert DPO(make_cfg(micro_model), None).reference == "model"
    assert DPO(make_cfg(micro_model, overrides=["dpo.loss_type=simpo"]), None).reference == "none"
    lora = ["model.lora={r: 4}"]
    assert DPO(make_cfg(micro_model, overrides=lora), None).reference == "lora_base"
    assert DPO(make_cfg(micro_model, overrides=lora + [f"model.ref_name_or_path={micro_model}"]), None).reference == "model"
