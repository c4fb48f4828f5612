"""fp16 loss scaling with several trainable roles (PPO's actor and critic): each handle owns its
GradScaler, so one role's overflow neither skips nor rescales another role's step, and every
optimizer sees its role's true (unscaled) gradients."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from alignkit.config.schema import DistributedConfig
from alignkit.distributed.env import DistEnv
from alignkit.distributed.strategy.base import Handle
from alignkit.distributed.strategy.single import SingleStrategy
from alignkit.models.roles import Models
from alignkit.train.step import optimizer_step

ENV = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr=None, master_port=None)
INIT_SCALE = 2.0**16  # torch.amp.GradScaler's default init_scale


def fp16_strategy() -> SingleStrategy:
    strategy = SingleStrategy(DistributedConfig(), ENV, "fp16")
    assert strategy.compute_dtype == torch.float16  # on the CPU too: torch.amp.GradScaler("cpu")
    return strategy


def two_roles(strategy: SingleStrategy) -> Models:
    torch.manual_seed(0)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731 - plain SGD: update = -lr * grad
    return Models(handles={role: strategy.prepare(nn.Linear(3, 2), sgd, role=role) for role in ("policy", "value")})


def record_grads(handle: Handle) -> list[list[torch.Tensor]]:
    """The gradients ``handle``'s optimizer holds each time it really steps."""
    seen: list[list[torch.Tensor]] = []
    handle.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append([p.grad.clone() for g in opt.param_groups for p in g["params"]]))
    return seen


def test_each_role_steps_with_its_own_scaler() -> None:
    """The policy's gradients overflow, the value's are finite: the policy's update is skipped and its
    scale halves; the value steps with its true gradients and keeps its scale (a shared scaler would
    unscale the value's gradients by the already halved scale: twice the true gradients)."""
    strategy = fp16_strategy()
    models = two_roles(strategy)
    policy, value = models.handles["policy"], models.handles["value"]
    x = torch.tensor([[1.0, -2.0, 0.5], [0.25, 1.5, -1.0]], device=strategy.device)
    true_value = copy.deepcopy(value.module)
    (true_value(x) ** 2).sum().backward()
    before = {role: [p.detach().clone() for p in h.module.parameters()] for role, h in models.handles.items()}
    seen_value, seen_policy = record_grads(value), record_grads(policy)

    # as train/step.py does it: backward of every role's loss, then one step per handle. The policy's
    # loss is finite, but its gradients times the loss scale (2**16) overflow: an fp16 overflow.
    losses = {"policy": policy.module(x).sum() * 1e36, "value": (value.module(x) ** 2).sum()}
    for role, loss in losses.items():
        strategy.backward(loss, models.handles[role])
    sums = {role: float(loss.detach()) for role, loss in losses.items()}
    assert all(torch.isfinite(torch.tensor(v)) for v in sums.values())
    norms, dropped, _ = optimizer_step(strategy, models, 0.0, sums)

    assert seen_policy == [] and not torch.isfinite(torch.tensor(norms["policy"]))
    assert all(torch.equal(a, b) for a, b in zip(policy.module.parameters(), before["policy"]))
    assert len(seen_value) == 1
    for grad, p in zip(seen_value[0], true_value.parameters()):
        torch.testing.assert_close(grad, p.grad)
    for p, old, t in zip(value.module.parameters(), before["value"], true_value.parameters()):
        torch.testing.assert_close(p.detach(), old - 0.1 * t.grad)
    assert policy.scaler.get_scale() == INIT_SCALE / 2
    assert value.scaler.get_scale() == INIT_SCALE
    assert not dropped  # the policy's skip is its scaler's business, not a non-finite step of the run


def test_scaler_state_saved_and_loaded_per_role(tmp_path: Path) -> None:
    """Each role's checkpoint folder holds its own scaler state, and loading gives each handle its own."""
    strategy = fp16_strategy()
    models = two_roles(strategy)
    for role, scale in (("policy", 1024.0), ("value", 8.0)):
        scaler = models.handles[role].scaler
        scaler.scale(torch.ones(()))  # the scaler allocates its scale lazily, at the first scale()
        scaler.update(scale)
    for role, handle in models.handles.items():
        (tmp_path / role).mkdir()
        weights = {k: v.cpu() for k, v in handle.module.state_dict().items()}
        save_file(weights, str(tmp_path / role / "model.safetensors"))
        strategy.save_training_state(handle, tmp_path / role)

    fresh = fp16_strategy()
    loaded = two_roles(fresh)
    for role, handle in loaded.handles.items():
        fresh.load_training_state(handle, tmp_path / role)
    assert loaded.handles["policy"].scaler.get_scale() == 1024.0
    assert loaded.handles["value"].scaler.get_scale() == 8.0


def test_bf16_and_fp32_handles_have_no_scaler() -> None:
    for dtype in ("bf16", "fp32"):
        strategy = SingleStrategy(DistributedConfig(), ENV, dtype)
        handle = strategy.prepare(nn.Linear(2, 1), lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
        assert handle.scaler is None and not strategy.scales_loss(handle)
