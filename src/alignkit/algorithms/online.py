"""What an online algorithm supplies to the online loop (``train/online_loop.py``).

The loop owns the iteration: prompts -> completions (the rollout engine) -> scores (reward / cost
functions and models, gathered from every rank in global order) -> ``make_experience`` (the
algorithm: old / reference log-probs, values, advantages on this rank's samples, with statistics
computed from the gathered scores so every rank uses the same numbers) -> ``rollout.update_epochs``
optimizer steps over the samples through the shared step code (``train/step.py``: accumulation with
the global normaliser ``units`` counts, one reduction of the step's metrics).

Batch semantics as in TRL: ``training.per_device_batch_size`` / ``global_batch_size`` count
completions; one iteration generates ``global_batch / num_generations`` prompts x ``num_generations``
completions (the completions of a prompt contiguous in global order, rank r taking the r-th slice,
so a prompt's group may span ranks), and each update epoch is one optimizer step.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterator, Literal

import torch

from alignkit.algorithms.base import Batch, MetricSums
from alignkit.algorithms.reward import RewardConfig
from alignkit.config.schema import RunConfig, f
from alignkit.config.sections import register_section
from alignkit.data.prompts import PromptData
from alignkit.errors import ConfigError
from alignkit.models.adapters import adapters_disabled, is_adapter_dir
from alignkit.models.policy import forward_logps
from alignkit.models.roles import ModelSpec, Models
from alignkit.rollout.engine import ENGINES
from alignkit.rollout.experience import Sample, per_sequence
from alignkit.rollout.score import Scorer


@register_section("rollout")
@dataclass
class RolloutConfig:
    num_generations: int = f(8, "Completions per prompt (the group size of GRPO / RLOO).", gt=0)
    max_new_tokens: int = f(16, "Longest completion in tokens; a longer one is cut and counted as truncated.", gt=0)
    temperature: float = f(1.0, "Sampling temperature; 0 = greedy (no exploration: only for evaluation).", ge=0)
    top_p: float = f(1.0, "Nucleus sampling.", gt=0, le=1)
    top_k: int = f(0, "Top-k sampling; 0 = off.", ge=0)
    update_epochs: int = f(1, "Optimizer steps over each iteration's samples (PPO epochs; TRL num_iterations).", gt=0)
    engine: str = f("hf", "Rollout engine by name: hf = Hugging Face generate with the KV cache.")
    gather_full_params: bool = f(
        True, "FSDP2 / ZeRO-3: gather the full policy ONCE per rollout for generation; false = generate on the "
        "sharded model (parameters gathered per forward: slow, for models too big to gather).")
    generation_batch_size: int = f(64, "Sequences per generate call.", gt=0)
    log_samples: int = f(2, "Prompt / completion samples written to the JSONL log per logged iteration.", ge=0)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            ENGINES.get(self.engine)  # one line with the closest name


def policy_has_lora(cfg: RunConfig) -> bool:
    return cfg.model.lora is not None or is_adapter_dir(cfg.model.name_or_path)


def resolve_reference(cfg: RunConfig, choice: str, needed: bool) -> str:
    """``none`` when no reference is needed, else ``model`` or ``lora_base`` (``auto``: lora_base with LoRA)."""
    if not needed:
        return "none"
    if choice == "auto":
        return "lora_base" if policy_has_lora(cfg) and not cfg.model.ref_name_or_path else "model"
    if choice == "lora_base" and not policy_has_lora(cfg):
        raise ConfigError("reference=lora_base needs LoRA adapters (set model.lora)")
    return choice


def policy_specs(cfg: RunConfig, reference: str) -> list[ModelSpec]:
    m = cfg.model
    specs = [ModelSpec("policy", m.name_or_path, "lm", trainable=True, lora=policy_has_lora(cfg))]
    if reference == "model":
        specs.append(ModelSpec("reference", m.ref_name_or_path or m.name_or_path, "lm"))
    elif reference == "lora_base":
        specs.append(ModelSpec("reference", m.name_or_path, "lm", shares="policy"))
    return specs


class OnlineAlgorithm(ABC):
    """One algorithm of the online loop (GRPO / RLOO / Dr.GRPO, PPO, Lagrangian PPO, ...)."""

    name: str = "online"
    sequences_per_example = 1

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.data = PromptData(tokenizer, cfg.data, max_new_tokens=cfg.section(RolloutConfig).max_new_tokens)
        self.reference = "none"

    @classmethod
    @abstractmethod
    def model_specs(cls, cfg: RunConfig) -> list[ModelSpec]:
        """The models this run needs, the policy first."""

    def scorers(self) -> dict[str, Scorer]:
        """The signals the loop scores and gathers: ``reward`` always (``reward.*``), more (``cost``) if any."""
        r, ro = self.cfg.section(RewardConfig), self.cfg.section(RolloutConfig)
        return {"reward": Scorer("reward", r.functions, model_role="reward" if r.model else None,
                                 model_weight=r.model_weight, length_penalty=r.length_penalty,
                                 max_new_tokens=ro.max_new_tokens, placement=r.placement)}

    @abstractmethod
    def make_experience(self, models: Models, samples: list[Sample], batches: list[Batch],
                        scores: dict[str, torch.Tensor], mine: slice, strategy: Any) -> MetricSums:
        """Fill this rank's ``samples`` (per-token fields for the loss) from the gathered ``scores``
        (signal -> ``(global,)``, this rank's at ``mine``); ``batches`` are the samples collated per
        micro-batch (on the device). Returns the iteration's statistics (identical on every rank)."""

    @abstractmethod
    def loss(self, models: Models, batch: Batch, *, normalizer: float) -> tuple[torch.Tensor | dict[str, torch.Tensor], MetricSums]:
        """Loss of one micro-batch divided by ``normalizer`` (global ``units`` / dp_size)."""

    @abstractmethod
    def units(self, batch: Batch) -> int:
        """Loss units of a micro-batch (tokens or sequences) for the global normaliser."""

    def on_iteration_end(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """After each iteration's updates, with global metrics (e.g. a dual update); extra metrics to log."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    # ------------------------------------------------------------------ shared pieces
    @torch.no_grad()
    def token_logps(self, models: Models, batches: list[Batch], strategy: Any, *, role: str = "policy") -> list[list[float]]:
        """Per-sample completion-token log-probs of ``role`` (``reference`` served by the LoRA base when
        it shares the policy), in the training forward's numerics."""
        out: list[list[float]] = []
        for batch in batches:
            with self._as(models, role) as module, strategy.autocast():
                out += per_sequence(forward_logps(module, batch), batch)
        return out

    @contextlib.contextmanager
    def _as(self, models: Models, role: str) -> Iterator[torch.nn.Module]:
        if role == "reference" and self.reference == "lora_base":
            policy = models["policy"]
            was_training = policy.training
            policy.eval()
            try:
                with adapters_disabled(policy):
                    yield policy
            finally:
                policy.train(was_training)
        else:
            yield models[role]


Aggregation = Literal["auto", "token_mean", "sequence_mean", "constant"]
