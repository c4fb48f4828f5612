"""The diffusion kind behind the seams the text kinds use (issue 40.2): Flow-GRPO draws its images through
``RolloutContext.generate`` (the kind's SDE / ODE sampler, not the token engine), and ``models.logps`` gives the
log-probs of the stored transitions (the sampler's again while the policy has not moved), their Gaussians'
entropies and the whole step (the mean the KL term reads, the LoRA-off reference's through the same call)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from alignkit.algorithms import ALGORITHMS, workload_of
from alignkit.config.loader import build_dataclass
from alignkit.config.schema import RunConfig
from alignkit.distributed.env import DistEnv
from alignkit.models.diffusion_sample import TRANSITION_INPUTS, FlowSampling, ImagePrompt, generate
from alignkit.models.kinds import KINDS
from alignkit.rollout.context import RolloutContext
from alignkit.rollout.engine import SamplingParams, build_engine
from alignkit.train.runner import build_models, strategy_for
from tests.unit.models.test_diffusion_kind import perturb

pytest.importorskip("diffusers")

PROMPTS = ["A red circle in the top left.", "A blue square in the bottom right."]


def flow_setup(micro_sd3: Path) -> tuple[object, object, RolloutContext]:
    raw = {"algorithm": "flow_grpo", "model": {"name_or_path": str(micro_sd3), "dtype": "fp32",
                                               "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
           "data": {"train": "x.json"}, "training": {"per_device_batch_size": 2},
           "rollout": {"num_generations": 2},
           "flow_grpo": {"resolution": 32, "guidance_scale": 2.0, "num_inference_steps": 3, "max_sequence_length": 8,
                         "scorers": [{"name": "shapes_colour"}]}}
    cfg = build_dataclass(RunConfig, raw)
    tok = KINDS.get("diffusion").tokenizer(cfg.model)
    algo = ALGORITHMS.get("flow_grpo")(cfg, tok)
    strategy = strategy_for(cfg, DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr=None, master_port=None))
    models = build_models(workload_of(cfg), cfg.model, strategy, tok,
                          make_optimizer=lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.0))
    rows = [{"prompt": p, "prompt_ids": [], "fields": {}} for p in PROMPTS]
    ctx = RolloutContext(models, strategy, build_engine("hf", tok), rows, slice(0, 2), SamplingParams(1), 2,
                         algo.collate)
    return algo, models, ctx


def test_flow_grpo_draws_through_ctx_generate_and_scores_through_models_logps(micro_sd3: Path) -> None:
    algo, models, ctx = flow_setup(micro_sd3)
    drawn = algo.flow.render(ctx, PROMPTS, ["sample:0", "sample:1"], steps=3, noise_level=0.7, step=0)
    assert "sample" in ctx.seconds and "generate" not in ctx.seconds  # the token phase's seconds stay the tokens'
    assert len(drawn.images) == 2 and drawn.trajectory.logps.shape == (2, 3)
    # the kind's sampler called directly on the module draws the same images (seeded noise per image)
    params = algo.flow.sampling(3, 0.7)
    from alignkit.algorithms.flow_sft import seeded

    direct = generate(models["policy"], [ImagePrompt(p, seeded(algo.cfg.training.seed, 0, f"sample:{i}"))
                                         for i, p in enumerate(PROMPTS)], params)
    assert torch.equal(direct.trajectory.latents, drawn.trajectory.latents)

    units = algo.flow.units_of(drawn, PROMPTS)
    for u in units:
        u["advantage"] = torch.tensor(1.0)
    batch = algo.collate(units)
    assert set(batch.model_inputs()) == set(TRANSITION_INPUTS)  # the batch contract: the rest are fields
    with torch.no_grad():
        logp = models.logps("policy", batch, params=params)
        logp2, entropy = models.logps("policy", batch, params=params, with_entropy=True)
        step = models.logps("policy", batch, params=params, with_step=True)
        ref = models.logps("reference", batch, params=params, with_step=True)  # the LoRA base: B = 0, the same
    torch.testing.assert_close(logp, batch["old_logp"], rtol=0, atol=1e-5)  # ratio 1 before any update
    assert torch.equal(logp, logp2) and torch.equal(logp, step.logp)
    want = torch.distributions.Normal(step.mean, step.std.reshape(-1, 1, 1, 1)).entropy().flatten(1).mean(1)
    torch.testing.assert_close(entropy, want)
    torch.testing.assert_close(ref.mean, step.mean, rtol=0, atol=1e-6)
    perturb(models["policy"])
    with torch.no_grad():
        moved = models.logps("policy", batch, params=params, with_step=True)
        base = models.logps("reference", batch, params=params, with_step=True)
    assert not torch.allclose(moved.logp, logp, atol=1e-4) and not torch.allclose(moved.mean, base.mean, atol=1e-4)
    torch.testing.assert_close(base.mean, ref.mean, rtol=0, atol=1e-6)  # the reference did not move
    with pytest.raises(TypeError, match="sampler's settings"):
        models.logps("policy", batch)


def test_the_ode_draws_without_log_probs_and_alignkit_generate_is_the_same_path(micro_sd3: Path) -> None:
    algo, models, ctx = flow_setup(micro_sd3)
    drawn = algo.flow.render(ctx, PROMPTS, ["eval:0", "eval:1"], steps=2, noise_level=0.0, step=-1)
    assert torch.equal(drawn.trajectory.logps, torch.zeros(2, 2))
    params = FlowSampling(2, 0.0, 2.0, 32, 8)
    with pytest.raises(TypeError, match="cannot generate"):
        KINDS.get("scalar").generate(models["policy"], None, [], params)
    from alignkit.algorithms.flow_sft import seeded

    again = KINDS.get("diffusion").generate(models["policy"], None, [
        ImagePrompt(p, seeded(algo.cfg.training.seed, -1, f"eval:{i}")) for i, p in enumerate(PROMPTS)], params)
    assert torch.equal(again.trajectory.latents, drawn.trajectory.latents)
    assert [a.tobytes() for a in again.images] == [b.tobytes() for b in drawn.images]


def test_a_stored_sigma_cap_per_sample_is_the_float_one() -> None:
    from alignkit.ops.flow_sde import sde_step

    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 4, 2, 2, generator=g), torch.randn(2, 4, 2, 2, generator=g)
    sigma, nxt = torch.tensor([1.0, 1.0]), torch.tensor([0.8, 0.8])
    a = sde_step(v, x, sigma, nxt, noise_level=0.7, sigma_cap=0.9, noise=x)
    b = sde_step(v, x, sigma, nxt, noise_level=0.7, sigma_cap=torch.tensor([0.9, 0.9]), noise=x)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
