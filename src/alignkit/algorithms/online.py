"""What an online algorithm supplies to the online loop (``train/online_loop.py``).

The loop owns the iteration's frame: the prompts of this rank -> the algorithm's ``rollout`` (by
default: completions from the policy through the rollout engine -> scores of every signal, reward /
cost functions and models, gathered from every rank in global order -> ``make_experience``: old /
reference log-probs, values, advantages on this rank's samples, with statistics computed from the
gathered scores so every rank uses the same numbers) -> ``rollout.update_epochs`` passes over the
samples, each ``rollout.mini_batches`` optimizer steps over disjoint slices, through the shared step
code (``train/step.py``: accumulation with the global normaliser ``units`` counts, one reduction of
the step's metrics). The loop names no role: an
algorithm that routes the policy's outputs through a frozen ``target`` before scoring overrides
``rollout`` alone.

Batch semantics as in TRL: ``training.per_device_batch_size`` / ``global_batch_size`` count
completions; one iteration generates ``global_batch / num_generations`` prompts x ``num_generations``
completions (the completions of a prompt contiguous in global order, rank r taking the r-th slice,
so a prompt's group may span ranks), and each update epoch is ``rollout.mini_batches`` optimizer steps
(one by default).
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from pathlib import Path
from typing import Any, Literal, Sequence

import torch

from alignkit.algorithms.base import Algorithm, Batch, Context, Example
from alignkit.algorithms.reward import RewardConfig
from alignkit.algorithms.token_rollout import TokenRollout, run_engine
from alignkit.config.schema import RunConfig
from alignkit.config.sections import section_name
from alignkit.data.prompts import PromptData
from alignkit.metrics import MetricSums
from alignkit.rewards.signals import Signal
from alignkit.rollout.config import RolloutConfig
from alignkit.rollout.context import Experience, RolloutContext, rollout_stats
from alignkit.rollout.engine import ENGINES, Generations
from alignkit.rollout.experience import ROLLOUT_TOKEN_FIELDS, Sample, collate_samples, tokens_in


class OnlineAlgorithm(Algorithm):
    """An algorithm of the online loop (GRPO / RLOO / Dr.GRPO, PPO, Lagrangian PPO, ...): it owns its
    :meth:`rollout` (default: generate -> score -> :meth:`make_experience`) and its :meth:`evaluate`."""

    name: str = "online"
    config_sections = ("rollout", "reward", "off_policy")
    #: :meth:`evaluate` runs on every rank, also one with no eval prompt (fewer prompts than ranks): the gathers and
    #: forwards of a sharded policy (FSDP2 / ZeRO-3) are collectives every rank must join
    evaluate_on_every_rank: bool = False
    #: :meth:`evaluate` samples at the rollout's settings when its context carries seeds (``rollout.eval_samples``)
    sampled_eval: bool = True
    #: names of the further sums :meth:`evaluate` returns after its first three, turned into metrics by
    #: :meth:`eval_metrics` once summed over ranks (an agent's turns and tool calls)
    eval_sums: tuple[str, ...] = ()
    #: the per-token fields its samples carry into the update (one float per completion token): what
    #: :meth:`collate` puts into a micro-batch; a subclass or plugin adds its own (PPO: values, returns)
    token_fields: tuple[str, ...] = ROLLOUT_TOKEN_FIELDS
    #: the per-sequence float fields its samples carry into the update (``(B,)`` in a micro-batch)
    sequence_fields: tuple[str, ...] = ()

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        super().__init__(cfg, tokenizer)
        self.data = PromptData(tokenizer, cfg.data, max_new_tokens=cfg.section(RolloutConfig).max_new_tokens)
        self.reference = "none"
        #: the token policy's pieces (algorithms/token_rollout.py): temperature, masking, sampler weights, log-probs
        self.tokens = TokenRollout(cfg)

    @classmethod
    def own_sections(cls) -> list[str]:
        """Its sections and the engines' (``vllm:``): ``rollout.engine`` picks which one is read."""
        engines = [section_name(t) for t in (ENGINES.get(n).settings_type for n in ENGINES) if t is not None]
        return [*super().own_sections(), *engines]

    @classmethod
    def reserved_memory_fraction(cls, cfg: RunConfig) -> float:
        """What the run's rollout engine holds through the update (``vllm.gpu_memory_utilization`` unless it sleeps);
        nothing under ``rollout.placement: separate`` (the engine lives on the generator processes, not the trainers)."""
        if cfg.section(RolloutConfig).placement == "separate":
            return 0.0
        engine, settings = run_engine(cfg)
        return engine.reserved_memory_fraction(settings)

    def before_training(self, ctx: Context, train_set: list[Example], eval_set: list[Example]) -> None:
        """Once before the first rollout (``train_set``: the prompt rows): with ``rollout.disable_dropout``
        (default) every dropout of the trainable models is zeroed (``Models.disable_dropout``). The loop
        keeps the trained models in train mode, so the old log-probs (``TokenRollout.logps``) and the first
        update's new ones are the same deterministic forward (ratio exactly 1, as PPO assumes) and the
        critics' values are not dropout noise either. Overrides must call it."""
        if self.cfg.section(RolloutConfig).disable_dropout:
            ctx.models.disable_dropout()

    def on_optimizer_step(self, ctx: Context) -> None:
        """After each optimizer step of the update (``ctx.step``: the steps done), e.g. an EMA of the weights."""

    def on_iteration_end(self, ctx: Context, experience: Experience) -> dict[str, float]:
        """After an iteration's updates, with the iteration's :class:`Experience` (what its rollout drew and
        scored: an algorithm keeps nothing of a rollout on ``self`` for this hook); returns metrics to log.
        Default: :meth:`on_step_end` (``ctx.metrics``: the last step's and the iteration's statistics)."""
        return self.on_step_end(ctx)

    def output_weights(self, ctx: Context) -> contextlib.AbstractContextManager[Any]:
        """The weights evaluation and the final save see, for the duration (e.g. the EMA's); the trained ones after."""
        return contextlib.nullcontext()

    def save_files(self, folder: Path, ctx: Context) -> None:
        """Every rank writes its own state files into checkpoint ``folder`` (beside the JSON ``state_dict``)."""

    def load_files(self, folder: Path, ctx: Context) -> None:
        """Every rank reads back what :meth:`save_files` wrote into checkpoint ``folder`` (a resume)."""

    def sampling_summary(self) -> str:
        """How rollouts sample, for the start-up line."""
        r = self.cfg.section(RolloutConfig)
        return f"max_new_tokens={r.max_new_tokens}, temperature={r.temperature}, engine={r.engine}"

    def signals(self) -> dict[str, Signal]:
        """The signals a rollout scores and gathers: ``reward`` always (``reward.*``), more (``cost``) if any."""
        r, ro = self.cfg.section(RewardConfig), self.cfg.section(RolloutConfig)
        return {"reward": Signal("reward", r.functions, model_role="reward" if r.model else None,
                                 model_weight=r.model_weight, length_penalty=r.length_penalty,
                                 max_new_tokens=ro.max_new_tokens, placement=r.placement, **self.encoding())}

    def encoding(self) -> dict[str, Any]:
        """How a scorer with its own vocabulary re-encodes text: the run's chat template and length limit."""
        return {"chat_template": self.cfg.data.chat_template, "max_length": self.cfg.data.max_length}

    # ------------------------------------------------------------------ rollout
    @classmethod
    def default_rollout(cls, cfg: RunConfig) -> bool:
        """Whether ``cfg``'s run samples by the default :meth:`rollout` (the policy's completions of the
        iteration's rows, then scoring), which may then be drawn anywhere; an override says when it does too."""
        return cls.rollout is OnlineAlgorithm.rollout

    @classmethod
    def split_rollout(cls, cfg: RunConfig) -> str | None:
        """How ``rollout.placement: separate`` splits ``cfg``'s rollout between generator and trainer processes:
        ``completions`` (the default rollout: the generators sample and run the reward functions, the trainers
        the rest), ``items`` (the generators run :meth:`generator_items`, the trainers' :meth:`rollout` takes
        them through ``RolloutContext.delivered``), or None: not split (the run is refused)."""
        return "completions" if cls.default_rollout(cfg) else None

    def generator_items(self, rows: list[dict[str, Any]], seeds: list[int], generate: Any,
                        seconds: dict[str, float]) -> list[Any]:
        """A generator process's part of a split rollout of kind ``items`` (:meth:`split_rollout`): one item per
        prompt row (with ``prompt_ids``, ``completion_ids`` and ``sampler_logps``: the behaviour log-probs are
        filled in by a forward where None), ``generate(prompts, max_new_tokens)`` sampling from the policy."""
        raise NotImplementedError(f"{self.name} does not split its rollout into items")

    def rollout(self, ctx: RolloutContext) -> Experience:
        """This rank's samples of one iteration: the policy's completions of ``ctx.rows``, scored by every
        signal of :meth:`signals` (gathered from every rank), then :meth:`make_experience`. Override to put
        something between generation and scoring (e.g. a frozen ``target`` role answering the completions)."""
        gens = ctx.generate("policy", [row["prompt_ids"] for row in ctx.rows])
        samples = ctx.samples(gens.completion_ids)
        self.tokens.mask_truncated(samples, gens.truncated)
        self.tokens.keep_sampler_logps(samples, gens)
        inputs = ctx.score_inputs(samples, gens.texts)
        return self.experience_of(ctx, samples, gens, inputs.batches, ctx.score(self.signals(), inputs))

    def experience_of(self, ctx: RolloutContext, samples: list[Sample], gens: Generations, batches: Sequence[Batch],
                      scores: dict[str, torch.Tensor]) -> Experience:
        """The :class:`Experience` of scored samples: :meth:`make_experience`, the prompt and completion texts on
        each sample (for the log) and the rollout's statistics."""
        with ctx.timed("experience"):
            stats = self.make_experience(ctx, samples, batches, scores)  # type: ignore[arg-type]  # lazy: collated on use
        for s, row, text in zip(samples, ctx.rows, gens.texts):
            s["prompt"], s["completion"] = row["prompt"], text
        rollout_stats(stats, scores, gens, ctx.generate_s)
        return Experience(samples, scores, stats)

    @abstractmethod
    def make_experience(self, ctx: RolloutContext, samples: list[Sample], batches: list[Batch],
                        scores: dict[str, torch.Tensor]) -> MetricSums:
        """Fill this rank's ``samples`` (per-token fields for the loss) from the gathered ``scores``
        (signal -> ``(global,)``, this rank's at ``ctx.mine``); ``batches`` are the samples collated per
        micro-batch (on the device). Returns the iteration's statistics (identical on every rank)."""

    @torch.no_grad()
    def evaluate(self, ctx: RolloutContext) -> tuple[float, ...]:
        """Completions of ``ctx.rows`` (greedy, or sampled with ``ctx.params`` from ``ctx.seeds``: the online loop's
        ``_evaluate``) scored by the ``reward`` signal, each rank its own rows (ranks may hold different counts, so
        the functions run locally): this rank's (sum of the scored rewards, how many were scored, completion
        tokens, then the :attr:`eval_sums`)."""
        gens = ctx.generate("policy", [row["prompt_ids"] for row in ctx.rows])
        samples = ctx.samples(gens.completion_ids)
        inputs = ctx.score_inputs(samples, gens.texts)
        total = torch.tensor(self.signals()["reward"].score(ctx.models, inputs, ctx.strategy, placement="local")["total"],
                             dtype=torch.float64)
        ok = ~torch.isnan(total)
        return float(total[ok].sum()), float(ok.sum()), float(sum(len(c) for c in gens.completion_ids))

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Metrics of an evaluation's further sums (:attr:`eval_sums`, over every rank); none by default."""
        return {}

    def collate(self, samples: list[Sample]) -> Batch:
        """Samples -> one micro-batch of the log-prob forward (``rollout.experience.collate_samples``) with the
        declared :attr:`token_fields` / :attr:`sequence_fields`."""
        return collate_samples(samples, self.tokenizer.pad_token_id, self.token_fields, self.sequence_fields)

    @abstractmethod
    def units(self, batch: Batch) -> int:
        """Loss units of a micro-batch (tokens or sequences) for the global normaliser."""

    def tokens_in(self, batch: Batch) -> int:
        """Tokens a micro-batch puts through the policy (``train_tokens_per_s``): its attention mask's."""
        return tokens_in(batch)


Aggregation = Literal["auto", "token_mean", "sequence_mean", "constant"]
