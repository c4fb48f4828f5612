"""The ``rollout:`` section: how an online run samples (group size, sampling, the engine by name) and how
many optimizer steps each iteration's samples make (``rollout.update_epochs`` x ``rollout.mini_batches``).
Every online algorithm reads it (``config_sections`` of ``algorithms/online.py``), and so do the online loop
and ``alignkit generate``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from alignkit.config.schema import f
from alignkit.config.sections import register_section
from alignkit.errors import ConfigError
from alignkit.rollout.engine import engine_class


@register_section("rollout")
@dataclass
class RolloutConfig:
    num_generations: int = f(8, "Completions per prompt (the group size of GRPO / RLOO).", gt=0)
    max_new_tokens: int = f(16, "Longest completion in tokens; a longer one is cut and counted as truncated.", gt=0)
    temperature: float = f(1.0, "Sampling temperature; 0 = greedy (no exploration: only for evaluation).", ge=0)
    top_p: float = f(1.0, "Nucleus sampling.", gt=0, le=1)
    top_k: int = f(0, "Top-k sampling; 0 = off.", ge=0)
    update_epochs: int = f(1, "Passes over each iteration's samples (PPO epochs; TRL num_iterations).", gt=0)
    mini_batches: int = f(
        1, "Optimizer steps per pass, each over a disjoint slice of the iteration's samples (PPO mini-batches; "
        "flow_grpo: 2): a rank's sample i goes to slice i mod mini_batches, the same split over any number of "
        "ranks; the later slices are scored by a policy that has moved (ratio != 1, clipped). Each rank's samples "
        "per iteration (per_device x accumulation) must be a multiple of it.", gt=0)
    engine: str = f("hf", "Rollout engine by name: hf = Hugging Face generate with the KV cache; vllm = a colocated "
                    "vLLM engine (the vllm: section; needs the vllm extra); or one a plugin registers. The engine "
                    "reads its own section.")
    gather_full_params: bool = f(
        True, "FSDP2 / ZeRO-3: gather the full policy ONCE per rollout for generation; false = generate on the "
        "sharded model (parameters gathered per forward: slow, for models too big to gather).")
    generation_batch_size: int = f(64, "Sequences per generate call.", gt=0)
    eval_samples: int = f(
        0, "Held-out evaluation at the rollout's sampling settings (temperature, top_p, top_k): this many sampled "
        "completions (an agent: trajectories) per eval prompt, logged as eval/sampled_* beside the greedy eval/*; "
        "their own seeds (the run's seed, the prompt, the sample), so the training's samples do not change; "
        "0 = greedy only.", ge=0)
    log_samples: int = f(2, "Prompt / completion samples written to the JSONL log per logged iteration.", ge=0)
    mask_truncated_completions: bool = f(
        False, "A completion cut by max_new_tokens carries no loss (TRL's option of the same name): it still counts "
        "in its group's reward statistics, its tokens get loss_mask 0.")
    disable_dropout: bool = f(
        True, "Zero every dropout of the trained models (policy, critics) once at the start, as TRL's "
        "disable_dropout: the old log-probs are taken in train mode, and with dropout (LoRA's 0.05) the first "
        "update's ratio would be noise instead of exactly 1.")

    placement: Literal["colocated", "separate"] = f(
        "colocated", "Who generates: colocated = the trainer processes themselves, between updates; separate = the "
        "last rollout.generator_processes processes of the launched world generate (and only they), the others train; "
        "the weights go from trainer rank 0 to the generators after every update (bucketed broadcasts), the "
        "completions come back by torch.distributed point-to-point (docs/workflows/async-rl.md).")
    generator_processes: int = f(
        1, "placement: separate: how many of the launched processes generate (the last ones); the launched world "
        "must be larger. An iteration's completions split evenly over them.", gt=0)
    max_staleness: int = f(
        0, "placement: separate: how many policy versions the generators may run ahead of the update (k): iteration "
        "i's completions are sampled with the weights after update max(i - k, first) and trained on at version i "
        "(their staleness); 0 = synchronous, the same numbers as colocated. A sample older than k versions is dropped "
        "and counted.", ge=0)

    @property
    def steps_per_iteration(self) -> int:
        """Optimizer steps per iteration: ``update_epochs`` passes x ``mini_batches`` slices."""
        return self.update_epochs * self.mini_batches

    def __post_init__(self) -> None:
        engine_class(self.engine)  # an unknown name: one line with the closest name
        if self.placement == "colocated" and self.max_staleness:
            raise ConfigError(f"rollout.max_staleness={self.max_staleness} needs rollout.placement: separate (colocated "
                              "generation is synchronous: every iteration samples from the weights it trains)")
