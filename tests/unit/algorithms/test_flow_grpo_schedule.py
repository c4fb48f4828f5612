"""Flow-GRPO's defaults and update schedule against flow_grpo's code (yifan123/flow_grpo ``config/grpo.py``,
``scripts/train_sd3.py``, ``flow_grpo/ema.py``): the advantage std over the whole batch, the EMA stepped as its loop
steps it, the optimizer steps per rollout over disjoint slices of the samples, and its T5 prompt length."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from alignkit.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig, flow_image_shape
from alignkit.algorithms.flow_update import FlowUpdate
from alignkit.config import load_config, resolve_batch
from alignkit.errors import ConfigError
from alignkit.models.ema import ParamEMA
from alignkit.rollout.config import RolloutConfig
from alignkit.train.online_loop import OnlineTrainer, online_steps
from alignkit.train.run_plan import RunPlan
from tests.conftest import REPO

RECIPE = REPO / "configs" / "flow_grpo.yaml"


class ReferenceEMA:
    """flow_grpo/ema.py's ``EMAModuleWrapper.step`` (the rule, copied)."""

    def __init__(self, params: list[torch.Tensor], decay: float, update_step_interval: int) -> None:
        self.ema = [p.clone() for p in params]
        self.decay, self.interval = decay, update_step_interval

    def step(self, params: list[torch.Tensor], optimization_step: int) -> None:
        one_minus_decay = 1 - min((1 + optimization_step) / (10 + optimization_step), self.decay)
        if (optimization_step + 1) % self.interval == 0:
            for e, p in zip(self.ema, params):
                e.add_(one_minus_decay * (p - e))


def _flow_algo(opts: FlowGRPOConfig, num_generations: int = 4) -> Any:
    """A FlowGRPO with only what its EMA and advantage code read (no pipeline, no scorers)."""
    algo = FlowGRPO.__new__(FlowGRPO)
    algo.opts, algo.ema = opts, None
    algo.flow = FlowUpdate(opts, 0, role="policy", reference_role="reference", reference="none")
    algo.cfg = SimpleNamespace(section=lambda cls: RolloutConfig(num_generations=num_generations))
    return algo


@pytest.mark.parametrize("accumulation", [1, 2])
def test_ema_steps_as_flow_grpos_loop_once_per_micro_batch_with_its_step_count(accumulation: int) -> None:
    """train_sd3.py calls ``ema.step(params, global_step)`` after every training micro-batch, global_step counting the
    optimizer steps done (from 1 after the first). Without accumulation that is one update per optimizer step at
    s = the steps done (the old code used s - 1: its updates came one optimizer step late, with another decay). With
    accumulation 2 each count is stepped twice with the same weights (once after its optimizer step, once during the
    next one's accumulation): flow_grpo.ema_updates_per_step 2 gives the same averages at every iteration end (2
    optimizer steps per iteration, so an iteration never ends between the two)."""
    torch.manual_seed(0)
    interval, steps = 2, 12
    weights = [torch.randn(5)]
    for _ in range(steps):
        weights.append(weights[-1] + torch.randn(5))  # weights[s]: after optimizer step s
    ref = ReferenceEMA([weights[0]], decay=0.9, update_step_interval=interval)
    global_step, reference = 0, {}
    for micro in range(steps * accumulation):  # the reference loop: micro-batches, a sync every `accumulation`
        if (micro + 1) % accumulation == 0:
            global_step += 1
        ref.step([weights[global_step]], global_step)
        if (micro + 1) % (2 * accumulation) == 0:
            reference[global_step] = ref.ema[0].clone()
    opts = FlowGRPOConfig(ema=True, ema_decay=0.9, ema_interval=interval)
    if accumulation > 1:
        opts.ema_updates_per_step = accumulation
    algo = _flow_algo(opts)
    params = {"w": weights[0].clone()}
    algo.ema = ParamEMA(params, decay=0.9, interval=interval)
    algo.ema_params = lambda ctx: params
    for s in range(1, steps + 1):
        params["w"].copy_(weights[s])
        algo.on_optimizer_step(SimpleNamespace(step=s))
        if s in reference:
            assert torch.allclose(algo.ema.shadow["w"], reference[s], atol=1e-6), s
    # the docs' numbers: 2 updates a step at decay 0.9 move the average as one at 0.81 would
    moved = ParamEMA({"w": torch.zeros(1)}, decay=0.9, interval=1)
    moved.after_step({"w": torch.ones(1)}, 100, times=2)
    assert moved.shadow["w"].item() == pytest.approx(1 - 0.81)


def test_global_std_is_the_default_and_keeps_a_near_flat_groups_advantages_small() -> None:
    """flow_grpo's base and SD3 configs set sample.global_std = True: a group whose rewards barely differ (+-0.02)
    gets advantages of that size against the batch's spread (0.05), not +-1.2 (over its own std, 0.016)."""
    assert FlowGRPOConfig().global_std is True
    reward = torch.tensor([0.50, 0.52, 0.48, 0.50, 0.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    ctx = SimpleNamespace(mine=slice(0, 8))

    def advantages(opts: FlowGRPOConfig) -> torch.Tensor:
        algo = _flow_algo(opts)
        samples = [{"image": i} for i in range(8)]
        algo.make_experience(ctx, samples, [], {"reward": reward})
        return torch.tensor([float(s["advantage"]) for s in samples])

    flat_global, flat_group = advantages(FlowGRPOConfig())[:4], advantages(FlowGRPOConfig(global_std=False))[:4]
    assert flat_group.abs().max() > 1.0 and flat_global.abs().max() < 0.1
    assert load_config(RECIPE).section(FlowGRPOConfig).global_std is True


def test_t5_prompt_length_default_is_flow_grpos() -> None:
    """train_sd3.py encodes prompts with max_sequence_length=128 (diffusers' SD3 pipeline: 256); the memory estimate's
    workload carries it."""
    assert FlowGRPOConfig().max_sequence_length == 128
    assert flow_image_shape(SimpleNamespace(section=lambda cls: FlowGRPOConfig())).text_tokens == 128  # type: ignore[arg-type]


def _plan(cfg: Any, world: int) -> RunPlan:
    return RunPlan("single", "", cfg.distributed, resolve_batch(cfg, world), cfg.training.learning_rate)


def test_mini_batches_are_disjoint_slices_the_same_over_any_number_of_ranks() -> None:
    """rollout.mini_batches 2: each iteration takes 2 optimizer steps per update epoch, over disjoint halves of the
    samples; one process with accumulation and 2 ranks put the same global samples in each step, and flow_grpo's
    (image, step) units (step-major) follow their image."""
    cfg = load_config(RECIPE, ["rollout.update_epochs=2", "training.global_batch_size=8",
                               "training.per_device_batch_size=4", "training.gradient_accumulation_steps=2",
                               "rollout.num_generations=4"])
    trainer = SimpleNamespace(cfg=cfg)
    one = OnlineTrainer._mini_batches(trainer, list(range(8)))  # type: ignore[arg-type]
    assert one == [[0, 2, 4, 6], [1, 3, 5, 7]] * 2  # epochs x mini-batches, in order
    ranks = [OnlineTrainer._mini_batches(trainer, list(range(r * 4, r * 4 + 4))) for r in (0, 1)]  # type: ignore[arg-type]
    assert [sorted(ranks[0][m] + ranks[1][m]) for m in range(4)] == one
    units = [(step, image) for step in range(3) for image in range(8)]  # FlowGRPO.units_of's order
    for m, part in enumerate(OnlineTrainer._mini_batches(trainer, units)[:2]):  # type: ignore[arg-type]
        assert {image for _, image in part} == set(one[m]) and len(part) == 12
    n_prompts = 40  # 20 iterations of 2 prompts x 4 images: 2 epochs x 2 mini-batches each
    assert online_steps(n_prompts, _plan(cfg, 1), cfg).steps.per_epoch == 20 * 4


def test_mini_batches_must_split_each_ranks_completions_evenly() -> None:
    cfg = load_config(RECIPE, ["rollout.mini_batches=3", "training.global_batch_size=8",
                               "training.per_device_batch_size=4", "rollout.num_generations=4"])
    with pytest.raises(ConfigError, match=r"^rollout.mini_batches: each process's 4 completions per iteration "
                                          r"\(per_device 4 x accumulation 1\) must split into 3 equal slices$"):
        online_steps(40, _plan(cfg, 2), cfg)


def test_shipped_recipe_follows_flow_grpos_schedule() -> None:
    """Two optimizer steps per iteration (flow_grpo: gradient_accumulation_steps = num_batches_per_epoch / 2), the
    advantages over the batch's std; with the EMA on, stepped twice per optimizer step as its loop does."""
    cfg = load_config(RECIPE)
    r, o = cfg.section(RolloutConfig), cfg.section(FlowGRPOConfig)
    assert (r.update_epochs, r.mini_batches) == (1, 2) and o.global_std and o.ema_updates_per_step == 2
