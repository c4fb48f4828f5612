"""The batch contract (data/batch.py): only a collator's declared model inputs reach a forward. PPO-Lag's
own fields (old / reference log-probs, values, returns, advantages of both signals) ride in the same
micro-batch as its inputs; a backbone whose forward REJECTS unknown keyword arguments must never see
them, in the experience forwards (log-probs, values) or in the loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from alignkit.algorithms import ALGORITHMS, workload_of
from alignkit.config.loader import apply_overrides, build_dataclass
from alignkit.config.schema import RunConfig
from alignkit.data.batch import Batch, model_inputs
from alignkit.distributed.env import DistEnv
from alignkit.models.loading import load_tokenizer
from alignkit.train.runner import build_models, strategy_for

SINGLE = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr=None, master_port=None)


def strict(module: torch.nn.Module, seen: list[set[str]]) -> None:
    """Make ``module.forward`` refuse any keyword but a text decoder's inputs (HF backbones would swallow
    unknown ones in ``**kwargs``)."""
    allowed = {"input_ids", "attention_mask", "position_ids", "use_cache"}

    def hook(_: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        seen.append(set(kwargs))
        unknown = set(kwargs) - allowed
        if unknown:
            raise TypeError(f"forward() got unexpected keyword arguments {sorted(unknown)}")

    module.register_forward_pre_hook(hook, with_kwargs=True)


def test_ppo_lag_fields_never_reach_a_forward(micro_model: Path) -> None:
    raw = {"algorithm": "ppo_lag", "model": {"name_or_path": str(micro_model)}, "data": {"train": "x.jsonl"},
           "training": {"per_device_batch_size": 4}}
    cfg = build_dataclass(RunConfig, apply_overrides(raw, ["ppo_lag.cost_functions=[{name: length}]"]))
    tok = load_tokenizer(cfg.model)
    algo = ALGORITHMS.get("ppo_lag")(cfg, tok)
    models = build_models(workload_of(cfg), cfg.model, strategy_for(cfg, SINGLE), tok,
                          make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.0))
    assert {"policy", "value", "cost_value", "reference"} <= set(models)
    seen: list[set[str]] = []
    for role in models:
        for m in models[role].modules():
            if type(m).__name__ == "LlamaModel":  # the decoder every role's forward goes through
                strict(m, seen)
    g = torch.Generator().manual_seed(0)
    samples = []
    for n in (3, 5, 2, 4):
        ids = torch.randint(5, 200, (n,), generator=g).tolist()
        samples.append({"prompt_ids": [1, 7, 9], "completion_ids": ids, **{f: [0.1] * n for f in algo.token_fields}})
    batch = algo.collate(samples)
    assert isinstance(batch, Batch) and set(model_inputs(batch)) == {"input_ids", "attention_mask"}
    assert {"cost_values", "cost_returns", "cost_advantages", "old_logps"} <= set(batch.fields())
    with torch.no_grad():  # the experience forwards
        models.logps("policy", batch), models.logps("reference", batch)
        models.values("value", batch), models.values("cost_value", batch)
    losses, _ = algo.loss(models, batch, normalizer=1.0)
    assert set(losses) == {"policy", "value", "cost_value"} and all(torch.isfinite(v) for v in losses.values())
    assert len(seen) >= 7 and all(s <= {"input_ids", "attention_mask", "use_cache"} for s in seen), seen


def test_a_new_field_is_never_a_model_input() -> None:
    batch = Batch({"input_ids": torch.ones(1, 2)}, {"targets": torch.zeros(1, 2)})
    batch["advantages"] = torch.zeros(1, 2)  # an algorithm's own field: not an input unless declared
    batch.add_inputs({"pixel_values": torch.zeros(1, 3, 4, 4)})
    moved = batch.to(torch.device("cpu"))
    assert set(model_inputs(moved)) == {"input_ids", "pixel_values"} == set(model_inputs(batch))
    # the targets' flat positions, computed on the host as the batch leaves it: a field too
    assert set(moved.fields()) == {"targets", "advantages", "target_index"}
    with pytest.raises(TypeError, match="needs an alignkit Batch"):
        model_inputs({"input_ids": torch.ones(1, 2)})  # a plain dict cannot say which keys are inputs


def test_a_batch_leaving_the_host_carries_its_target_positions() -> None:
    """Batch.to adds the flat positions of the targets (computed on the host, where it costs no sync), and
    at_targets picks with them what the boolean mask picks."""
    from alignkit.constants import IGNORE_INDEX
    from alignkit.data.batch import at_targets

    targets = torch.tensor([[IGNORE_INDEX, 5, 6, IGNORE_INDEX], [7, IGNORE_INDEX, IGNORE_INDEX, 8]])
    batch = Batch({"input_ids": torch.ones(2, 4, dtype=torch.long)}, {"targets": targets})
    values = torch.arange(16.0).reshape(2, 4, 2)
    by_mask = at_targets(batch, values)
    moved = batch.to(torch.device("cpu"))
    assert moved["target_index"].tolist() == [1, 2, 4, 7]
    assert torch.equal(at_targets(moved, values), by_mask)
    assert torch.equal(at_targets(moved, targets), torch.tensor([5, 6, 7, 8]))
