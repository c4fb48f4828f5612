"""The flow sampler on the micro SD3 pipeline: the ODE path is diffusers' own pipeline call (same schedule, timestep
scale and guidance), the SDE path's stored transitions score again to the sampled log-probs (ratio 1), noise is
per image, and the LoRA-off base is the reference (equal to the policy while LoRA B = 0)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from alignkit.models.adapters import adapters_disabled
from alignkit.models.diffusion_sample import Conditioning, latent_shape, sample, schedule, velocity
from alignkit.ops.flow_sde import sde_step
from tests.unit.models.test_diffusion_kind import build, perturb

pytest.importorskip("diffusers")

PROMPTS = ["A red circle in the top left.", "A blue square in the bottom right."]


def conditioning(flow: torch.nn.Module, guidance: bool) -> Conditioning:
    embeds, pooled = flow.encode_text(PROMPTS, max_sequence_length=8)
    if not guidance:
        return Conditioning(embeds, pooled)
    neg, neg_pooled = flow.encode_text(["", ""], max_sequence_length=8)
    return Conditioning(embeds, pooled, neg, neg_pooled)


def test_ode_sampler_is_the_diffusers_pipeline(micro_sd3: Path) -> None:
    flow = build(micro_sd3, lora=False)
    cond, shape = conditioning(flow, True), latent_shape(flow, 32)
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    traj = sample(flow, cond, gens, shape=shape, sigmas=schedule(flow.pipe.scheduler, 4), guidance=3.0,
                  noise_level=0.0, scale=1000.0)
    start = traj.latents[:, 0]
    assert torch.equal(start[0], torch.randn((5, *shape), generator=torch.Generator().manual_seed(0))[0])
    want = flow.pipe(prompt_embeds=cond.embeds, pooled_prompt_embeds=cond.pooled,
                     negative_prompt_embeds=cond.neg_embeds, negative_pooled_prompt_embeds=cond.neg_pooled, latents=start.clone(), num_inference_steps=4,
                     guidance_scale=3.0, height=32, width=32, output_type="latent").images
    assert torch.allclose(traj.latents[:, -1], want, atol=1e-5)


def test_sde_sampler_log_probs_score_again_and_the_lora_base_is_the_reference(micro_sd3: Path) -> None:
    flow = build(micro_sd3, lora=True)
    cond = conditioning(flow, False)
    sigmas = schedule(flow.pipe.scheduler, 3)
    gens = [torch.Generator().manual_seed(i) for i in (5, 6)]
    traj = sample(flow, cond, gens, shape=latent_shape(flow, 32), sigmas=sigmas, guidance=1.0, noise_level=0.7,
                  scale=1000.0)
    assert traj.latents.shape == (2, 4, 4, 16, 16) and traj.logps.shape == (2, 3)
    # one image alone draws the same trajectory (its own generator)
    alone = sample(flow, Conditioning(cond.embeds[:1], cond.pooled[:1]), [torch.Generator().manual_seed(5)],
                   shape=latent_shape(flow, 32), sigmas=sigmas, guidance=1.0, noise_level=0.7, scale=1000.0)
    assert torch.allclose(alone.latents[0], traj.latents[0], atol=1e-5)

    def step_at(module: torch.nn.Module, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = sigmas[j].expand(2)
        with torch.no_grad():
            v = velocity(module, traj.latents[:, j], s, cond, guidance=1.0, scale=1000.0)
        out = sde_step(v, traj.latents[:, j], s, sigmas[j + 1].expand(2), noise_level=0.7, sigma_cap=traj.sigma_cap,
                       next_sample=traj.latents[:, j + 1])
        return out.logp, out.mean

    for j in range(3):  # the unmoved policy re-scores its own transitions: ratio 1
        logp, mean = step_at(flow, j)
        assert torch.allclose(logp, traj.logps[:, j], atol=1e-5)
        with adapters_disabled(flow):  # LoRA B = 0: the base is the policy, the KL term's means agree
            assert torch.allclose(step_at(flow, j)[1], mean, atol=1e-6)
    perturb(flow)
    moved_logp, moved_mean = step_at(flow, 1)
    with adapters_disabled(flow):
        base_mean = step_at(flow, 1)[1]
    assert not torch.allclose(moved_logp, traj.logps[:, 1], atol=1e-4)
    assert not torch.allclose(moved_mean, base_mean, atol=1e-4)


def test_the_timestep_stays_float32_under_a_bf16_transformer() -> None:
    """Issue 39.1: latents go to the text embeddings' dtype (bf16), the timestep does not (diffusers' SD3
    pipeline and flow_grpo pass fp32 timesteps): bf16 would round 913.35 to 916."""
    seen = []

    def module(latents, t, embeds, pooled):
        seen.append(t)
        return latents

    cond = Conditioning(torch.zeros(2, 3, 4, dtype=torch.bfloat16), torch.zeros(2, 5, dtype=torch.bfloat16))
    sigma = torch.tensor([0.91335, 0.85769])
    velocity(module, torch.zeros(2, 4, 2, 2), sigma, cond, guidance=1.0, scale=1000.0)
    assert seen[0].dtype == torch.float32
    torch.testing.assert_close(seen[0], sigma * 1000.0)
