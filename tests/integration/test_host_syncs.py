"""A training step never waits on the host (issue 38, ARCHITECTURE 9b): at most ONE device-to-host read per
optimizer step in steady state (the losses and gradient norms that decide whether to step), for SFT (packed
and padded), reward models, DPO (with and without cached reference log-probs), ORPO, KTO (its z0 pass
included), Safe-MM-DPO and the GRPO /
PPO update steps. Counted on CPU with a dispatch mode (tests/host_syncs.py) around the loops' ``_step``;
the collation and the loss-unit counts work on host data by design and are not counted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from alignkit.config import load_config
from alignkit.data.batch import Batch
from alignkit.train.offline_loop import OfflineTrainer
from alignkit.train.online_loop import OnlineTrainer
from alignkit.train.runner import run_train
from tests.conftest import REPO, write_config
from tests.host_syncs import SyncCounter, count_syncs, host_side
from tests.safe_dpo_models import make_scorers

WARM = 2  # steps before counting: optimizer state and caches are built on the first ones
PER_STEP = 1  # the step's one read-back (train/step.py optimizer_step)


def counted_run(monkeypatch: pytest.MonkeyPatch, cfg_path: Path | str, overrides: list[str]) -> list[SyncCounter]:
    """Run a config in this process; a SyncCounter for every optimizer step after the warm ones."""
    counters: list[SyncCounter] = []
    seen = [0]
    offline, online = OfflineTrainer._step, OnlineTrainer._step

    def offline_step(self: OfflineTrainer, group: list[Any]) -> Any:
        data = self.algo.data
        data.loss_units, data.tokens_in = host_side(type(data).loss_units.__get__(data)), \
            host_side(type(data).tokens_in.__get__(data))
        return counted(lambda: offline(self, group))

    def online_step(self: OnlineTrainer, samples: list[Any]) -> Any:
        algo = self.algo
        for name in ("collate", "units", "tokens_in"):
            setattr(algo, name, host_side(getattr(type(algo), name).__get__(algo)))
        return counted(lambda: online(self, samples))

    def counted(run: Any) -> Any:
        seen[0] += 1
        if seen[0] <= WARM:
            return run()
        with count_syncs() as counter:
            out = run()
        counters.append(counter)
        return out

    # a batch leaving the host adds its target positions there (data.batch.Batch.to): host data by design
    monkeypatch.setattr(Batch, "to", host_side(Batch.to))
    monkeypatch.setattr(OfflineTrainer, "_step", offline_step)
    monkeypatch.setattr(OnlineTrainer, "_step", online_step)
    run_train(load_config(str(cfg_path), overrides))
    assert counters, "no step was counted"
    return counters


def assert_few_syncs(counters: list[SyncCounter]) -> None:
    for i, c in enumerate(counters):
        assert c.total() <= PER_STEP, f"step {WARM + 1 + i}: {c.total()} host syncs: {c.report()}"


COMMON = ["data.max_train_examples=32", "data.max_length=64", "training.per_device_batch_size=4",
          "training.max_steps=4", "training.eval_steps=null", "logging.logging_steps=100", "logging.report_to=[]",
          "logging.plot=false", "checkpoint.save_final=false", "checkpoint.save_steps=null"]


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_sft_step(monkeypatch, micro_model: Path, tmp_path: Path, sft_config: dict, packing: bool) -> None:
    sft_config["data"]["packing"] = packing
    sft_config["training"]["gradient_accumulation_steps"] = 2
    counters = counted_run(monkeypatch, write_config(tmp_path / "c.yaml", sft_config),
                           ["logging.logging_steps=100", "logging.report_to=[]"])
    assert_few_syncs(counters)


def _varlen_stand_in(query: Any, key: Any, value: Any, cu_seq_q: Any, cu_seq_k: Any, max_q: int, max_k: int, *,
                     scale: Any = None, window_size: Any = (-1, -1), enable_gqa: bool = False) -> Any:
    """torch 2.13's varlen_attn computed on CPU (SDPA per span); run host_side: only its caller is counted."""
    import itertools

    import torch
    import torch.nn.functional as F

    bounds = cu_seq_q.tolist()
    assert window_size == (-1, 0) and max_q == max_k == max(b - a for a, b in itertools.pairwise(bounds))
    return torch.cat([F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (query, key, value)),
                                                     is_causal=True, scale=scale, enable_gqa=enable_gqa).transpose(0, 1)
                      for a, b in itertools.pairwise(bounds)])


def test_sft_step_through_the_varlen_path(monkeypatch, micro_model: Path, tmp_path: Path, sft_config: dict) -> None:
    """The packed SFT step with packed rows sent down the CUDA path (``models.attention._varlen``: layouts,
    cu_seq_lens, max_length, the kernel call) instead of per-example SDPA asks the device nothing more: what
    alignkit adds around torch's varlen_attn on a GPU holds no host sync (issue 49: the CUDA failures)."""
    from alignkit.models import attention

    calls = [0]

    def kernel(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return host_side(_varlen_stand_in)(*args, **kwargs)

    monkeypatch.setattr(attention, "packed_kernel", lambda *a, **k: attention.TORCH_VARLEN)
    monkeypatch.setattr(attention, "torch_varlen", lambda: attention.VarlenApi(kernel, "window_size", True, True))
    sft_config["data"]["packing"] = True
    counters = counted_run(monkeypatch, write_config(tmp_path / "c.yaml", sft_config),
                           ["logging.logging_steps=100", "logging.report_to=[]"])
    assert calls[0] > 0
    assert_few_syncs(counters)


@pytest.mark.parametrize("config,extra", [
    ("rm_helpful.yaml", []),
    ("dpo.yaml", []),
    ("dpo.yaml", ["dpo.precompute_ref_logps=true"]),
    ("orpo.yaml", []),
    ("kto.yaml", ["training.gradient_accumulation_steps=2"]),  # z0 of the step: before_step, one all-reduce
], ids=["reward", "dpo", "dpo-precompute", "orpo", "kto"])
def test_preference_steps(monkeypatch, micro_model: Path, tmp_path: Path, config: str, extra: list[str]) -> None:
    counters = counted_run(monkeypatch, REPO / "configs" / config,
                           [f"model.name_or_path={micro_model}", f"output_dir={tmp_path / 'run'}", *COMMON, *extra])
    assert_few_syncs(counters)


def test_safe_dpo_step(monkeypatch, micro_model: Path, tmp_path: Path) -> None:
    helpful, cost = make_scorers(micro_model, tmp_path / "scorers")
    counters = counted_run(monkeypatch, REPO / "configs" / "safe_dpo.yaml", [
        f"model.name_or_path={micro_model}", f"safe_dpo.helpful_model={helpful}", f"safe_dpo.cost_model={cost}",
        f"output_dir={tmp_path / 'run'}", *COMMON, "safe_dpo.cost_eval_every=2", "safe_dpo.cost_eval_prompts=2",
        "safe_dpo.cost_max_new_tokens=4"])
    assert_few_syncs(counters)


@pytest.mark.parametrize("config", ["grpo.yaml", "ppo.yaml"])
def test_online_update_steps(monkeypatch, micro_model: Path, tmp_path: Path, config: str) -> None:
    counters = counted_run(monkeypatch, REPO / "configs" / config, [
        f"model.name_or_path={micro_model}", f"output_dir={tmp_path / 'run'}", "rollout.num_generations=4",
        "rollout.max_new_tokens=4", "rollout.update_epochs=2", "training.per_device_batch_size=8",
        "training.gradient_accumulation_steps=2", "training.max_steps=4", "training.eval_steps=null",
        "logging.logging_steps=100", "logging.report_to=[]", "logging.plot=false",
        "checkpoint.save_final=false", "checkpoint.save_steps=null"])
    assert_few_syncs(counters)


def test_the_counter_sees_what_it_must() -> None:
    """The counter is not blind: .item(), bool(), .tolist() and nonzero are counted, host_side code is not."""
    import torch

    x = torch.arange(6.0)
    with count_syncs() as c:
        float(x.sum()), bool((x > 2).any()), x.tolist(), (x > 2).nonzero()
        host_side(lambda: x.sum().item())()
        x[x > 2]
    assert c.total() >= 5 and {"nonzero", ".tolist()", "boolean-mask indexing"} <= set(c.syncs), c.report()
    assert all("<lambda>" not in site for sites in c.syncs.values() for site in sites)
