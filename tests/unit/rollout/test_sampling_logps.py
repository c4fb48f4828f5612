"""Issue 24: the log-probs an online update trains on are those of the distribution the rollout sampled.

* the chunked LM-head op and ``CausalLMLogps`` at a temperature equal ``log_softmax(logits / T)`` computed
  naively from full logits, with the exact entropy of that softmax, chunk by chunk (never (N, V) at once);
* GRPO's old, new and reference log-probs are all at ``rollout.temperature`` (first ratio exactly 1), and
  its ``entropy`` metric is the exact entropy, not the sampled estimate ``mean(-log p(y))``;
* ``rollout.disable_dropout`` (default): a LoRA policy with dropout 0.05 gives old == new log-probs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from alignkit.algorithms import ALGORITHMS, workload_of
from alignkit.algorithms.base import Context
from alignkit.config.loader import build_dataclass
from alignkit.config.schema import ModelConfig, RunConfig
from alignkit.constants import IGNORE_INDEX
from alignkit.distributed.env import DistEnv
from alignkit.models.loading import load_tokenizer
from alignkit.ops.logprobs import chunked_token_logps
from alignkit.rollout.context import RolloutContext
from alignkit.rollout.engine import SamplingParams, build_engine
from alignkit.rollout.experience import flat
from alignkit.train.runner import build_models, strategy_for

SINGLE = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr=None, master_port=None)
T = 0.7


def naive(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N,)`` log p(target) and entropies of ``softmax(logits / T)`` from full ``(N, V)`` logits."""
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


def test_chunked_op_at_a_temperature_with_entropy_matches_full_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, 8, generator=g, dtype=torch.float64)
    weight = torch.randn(21, 8, generator=g, dtype=torch.float64)
    bias = torch.randn(21, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 21, (13,), generator=g)
    targets[4] = IGNORE_INDEX
    ok = targets != IGNORE_INDEX
    want_lp, want_h = naive(F.linear(hidden, weight, bias)[ok], targets[ok], T)
    rows: list[int] = []
    linear = F.linear

    def spy(*args: Any) -> torch.Tensor:  # every logits chunk the op builds, forward and backward
        out = linear(*args)
        rows.append(out.shape[0])
        return out

    monkeypatch.setattr(F, "linear", spy)
    for chunk in (1, 4, 13):
        rows.clear()
        lp, h = chunked_token_logps(hidden, weight, targets, bias=bias, chunk_size=chunk, temperature=T, with_entropy=True)
        torch.testing.assert_close(lp[ok], want_lp, rtol=0, atol=1e-12)
        torch.testing.assert_close(h[ok], want_h, rtol=0, atol=1e-12)
        assert lp[4] == 0 and h[4] == 0 and not h.requires_grad
        assert max(rows) <= chunk  # never the (N, V) logits at once
    monkeypatch.undo()
    # the gradient of the tempered log-probs (the 1/T of the chain rule), hidden, weight and bias
    args = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    assert torch.autograd.gradcheck(
        lambda h_, w_, b_: chunked_token_logps(h_, w_, targets, bias=b_, chunk_size=4, temperature=T), args)
    # temperature 1.0 is the untempered head (offline numbers unchanged)
    torch.testing.assert_close(chunked_token_logps(hidden, weight, targets, bias=bias, temperature=1.0)[ok],
                               naive(F.linear(hidden, weight, bias)[ok], targets[ok], 1.0)[0], rtol=0, atol=1e-12)


def test_causal_lm_logps_at_a_temperature_equal_the_hf_models_logits(micro_model: Path) -> None:
    from alignkit.models.loading import load_causal_lm
    from alignkit.models.policy import CausalLMLogps

    hf = load_causal_lm(ModelConfig(name_or_path=str(micro_model), dtype="fp32")).eval()
    ids = torch.randint(5, 200, (2, 9), generator=torch.Generator().manual_seed(1))
    targets = torch.full_like(ids, IGNORE_INDEX)
    targets[:, 3:8] = ids[:, 4:9]  # position t predicts token t + 1
    with torch.no_grad():
        lp, h = CausalLMLogps(hf, chunk_size=3)(ids, targets, temperature=T, with_entropy=True)
        keep = targets != IGNORE_INDEX
        want_lp, want_h = naive(hf(input_ids=ids).logits[keep].double(), targets[keep], T)
    torch.testing.assert_close(lp.double(), want_lp, rtol=0, atol=2e-5)
    torch.testing.assert_close(h.double(), want_h, rtol=0, atol=2e-5)


def online_setup(micro_model: Path, *, lora: bool = False, algorithm: str = "grpo",
                 **rollout: Any) -> tuple[Any, Any, RolloutContext]:
    """GRPO (or PPO) at temperature 0.7, two update epochs, on the micro model: beta 0.1 (a frozen
    reference), or a LoRA policy with dropout 0.05 (no reference)."""
    raw = {"algorithm": algorithm, "model": {"name_or_path": str(micro_model), "dtype": "fp32"},
           "data": {"train": "x.jsonl"}, "training": {"per_device_batch_size": 4},
           "rollout": {"num_generations": 4, "max_new_tokens": 6, "temperature": T, "update_epochs": 2, **rollout},
           **({"grpo": {"beta": 0.1}} if algorithm == "grpo" else {})}
    if lora:
        raw["model"]["lora"] = {"r": 4, "alpha": 8, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}
        raw["grpo"] = {"beta": 0.0}
    cfg = build_dataclass(RunConfig, raw)
    tok = load_tokenizer(cfg.model)
    algo = ALGORITHMS.get(algorithm)(cfg, tok)
    strategy = strategy_for(cfg, SINGLE)
    models = build_models(workload_of(cfg), cfg.model, strategy, tok,
                          make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.0))
    rows = [{"prompt_ids": tok("Add 2 and 3.")["input_ids"], "prompt": "", "fields": {}}] * 4
    ctx = RolloutContext(models, strategy, build_engine("hf", tok), rows, slice(0, 4),
                         SamplingParams(6, T), 4, algo.collate)
    return algo, models, ctx


def first_update(algo: Any, models: Any, ctx: RolloutContext, monkeypatch: pytest.MonkeyPatch):
    """Rollout at T, the experience (old / reference log-probs), then the first update's loss in train
    mode; returns (the batch, new log-probs and old ones as the surrogate saw them, the loss metrics)."""
    import importlib

    module = importlib.import_module(type(algo).__module__)  # grpo.py or ppo.py: its clipped_surrogate

    torch.manual_seed(0)
    gens = ctx.generate("policy", [r["prompt_ids"] for r in ctx.rows])
    samples = ctx.samples(gens.completion_ids)
    algo.make_experience(ctx, samples, ctx.batches(samples), {"reward": torch.tensor([1.0, 0.0, 0.5, 0.2])})
    seen: dict[str, torch.Tensor] = {}
    surrogate = module.clipped_surrogate

    def spy(logps: torch.Tensor, old: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen["new"], seen["old"] = logps.detach(), old
        return surrogate(logps, old, *args, **kwargs)

    monkeypatch.setattr(module, "clipped_surrogate", spy)
    models.train()
    batch = algo.collate(samples)
    _, metrics = algo.loss(models, batch, normalizer=1.0)
    return batch, seen["new"], seen["old"], metrics.means()


def test_grpo_old_new_and_reference_logps_are_at_the_sampling_temperature(micro_model: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    algo, models, ctx = online_setup(micro_model)
    algo.before_training(Context(models, ctx.strategy), [], [])
    batch, new, old, metrics = first_update(algo, models, ctx, monkeypatch)
    assert torch.equal(new, old)  # the first ratio is exactly 1
    keep = batch["targets"] != IGNORE_INDEX
    with torch.no_grad():
        logits = models["policy"].hf_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        ref_logits = models["reference"].hf_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    want, entropy = naive(logits[keep].double(), batch["targets"][keep], T)
    torch.testing.assert_close(new.double(), want, rtol=0, atol=2e-5)
    torch.testing.assert_close(flat(batch, "ref_logps").double(), naive(ref_logits[keep].double(), batch["targets"][keep], T)[0],
                               rtol=0, atol=2e-5)
    untempered = naive(logits[keep].double(), batch["targets"][keep], 1.0)[0]
    assert (new.double() - untempered).abs().max() > 1e-2  # the test can tell the two apart
    # the logged entropy: the exact one of softmax(logits / T), not the sampled estimate mean(-log p(y))
    assert metrics["entropy"] == pytest.approx(float(entropy.mean()), abs=1e-5)
    assert abs(metrics["entropy"] - float(-want.mean())) > 1e-3, (metrics["entropy"], float(-want.mean()))


def test_ppo_old_and_new_logps_and_entropy_at_the_sampling_temperature(micro_model: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    algo, models, ctx = online_setup(micro_model, algorithm="ppo")
    algo.before_training(Context(models, ctx.strategy), [], [])
    batch, new, old, metrics = first_update(algo, models, ctx, monkeypatch)
    assert torch.equal(new, old)
    keep = batch["targets"] != IGNORE_INDEX
    with torch.no_grad():
        logits = models["policy"].hf_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    want, entropy = naive(logits[keep].double(), batch["targets"][keep], T)
    torch.testing.assert_close(new.double(), want, rtol=0, atol=2e-5)
    torch.testing.assert_close(flat(batch, "ref_logps").double(), want, rtol=0, atol=2e-5)  # reference = the start
    assert metrics["entropy"] == pytest.approx(float(entropy.mean()), abs=1e-5)


def perturbed_lora(models: Any) -> None:
    """LoRA B starts at zero (its dropout then changes nothing): give it the values a few updates would."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in models["policy"].named_parameters():
            if "lora_B" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("disable", [True, False])
def test_disable_dropout_makes_the_first_ratio_exactly_one(micro_model: Path, monkeypatch: pytest.MonkeyPatch,
                                                            disable: bool) -> None:
    extra = {} if disable else {"disable_dropout": False}  # true is the default
    algo, models, ctx = online_setup(micro_model, lora=True, **extra)
    policy = models["policy"]
    assert any(isinstance(m, torch.nn.Dropout) and m.p == 0.05 for m in policy.modules())
    for m in policy.modules():  # a checkpoint whose config sets attention dropout: zeroed too
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.1
    perturbed_lora(models)
    algo.before_training(Context(models, ctx.strategy), [], [])  # what OnlineTrainer.fit calls first
    _, new, old, _ = first_update(algo, models, ctx, monkeypatch)
    if disable:
        assert all(m.p == 0 for m in policy.modules() if isinstance(m, torch.nn.Dropout))
        assert all(m.attention_dropout == 0 for m in policy.modules() if hasattr(m, "attention_dropout"))
        assert torch.equal(new, old)
    else:  # the old behaviour: dropout in both forwards, the first ratio is noise
        assert (new - old).abs().max() > 1e-4
