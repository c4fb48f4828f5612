"""A generator process of ``rollout.placement: separate`` (distributed/placement.py splits the world).

It holds the policy's architecture (weights from trainer rank 0, never trained here) and the run's engine, and per
iteration j of the run: takes the weights of version ``max(start, j - k)`` (``rollout.max_staleness`` k; it takes
every version trainer rank 0 pushes, in order, so it runs at most k versions ahead of the update), samples its
share of iteration j's completions (the same prompt order and per-completion seeds as the trainers compute,
``online_loop.iteration_requests``), and sends each trainer its part (``rollout/remote.py`` ``Delivery``), without
waiting for the trainer to be ready. A resumed run starts where trainer rank 0's checkpoint says (the start
position is broadcast), with the checkpoint's weights: the first k iterations after a resume are sampled by the
checkpoint's version (their staleness is lower than in the uninterrupted run; with k = 0 nothing differs).

What a generator makes of its rows is the algorithm's split (``OnlineAlgorithm.split_rollout``): ``completions``
(the default rollout): it samples them and scores them by every signal (``Signal.score``, the code the trainers'
scoring runs colocated): the reward / cost functions and the signals' reward / cost MODELS (``reward.model``: the
generator loads those roles, :func:`generator_scored_roles`; the trainers then do not, unless they evaluate), and
sends the scores with them; the trainers run the algorithm's rollout on the received completions, taking the
scores as received (``RolloutContext.score``), then old / reference log-probs and advantages, so an algorithm sees
the same experience as colocated. ``items`` (``grpo_agent``, ``ppo_agent``): it runs the algorithm's
``generator_items`` (the environments and the multi-turn loop, every running trajectory's turn in one engine call)
and sends the finished trajectories; the trainers' rollout takes them (``RolloutContext.delivered``). Either way
the behaviour log-probs go with them (the engine's, or a forward of the sampling weights). The generators never
compute old / reference log-probs or update.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any

import torch

from alignkit.algorithms import ALGORITHMS, workload_of
from alignkit.algorithms.online import OnlineAlgorithm
from alignkit.config import RunConfig, resolve_batch
from alignkit.data.sampler import GlobalOrder
from alignkit.distributed.env import DistEnv, read_launch_env
from alignkit.distributed.placement import (
    Placement,
    broadcast_start,
    check_base,
    check_world,
    frozen_tensors,
    pull_weights,
    send_object,
    split_world,
    sync_tensors,
)
from alignkit.distributed.strategy import build_strategy
from alignkit.distributed.strategy.base import pick_backend, pick_compute_dtype, pick_device
from alignkit.errors import ConfigError
from alignkit.logging import log, setup_console
from alignkit.models.kinds import KINDS
from alignkit.models.roles import Models, Workload, build_model, role_tokenizer
from alignkit.rewards.signals import ScoreInputs
from alignkit.rollout.config import RolloutConfig
from alignkit.rollout.context import LazyBatches
from alignkit.rollout.engine import Prompt, SamplingParams, build_engine, generation_phase
from alignkit.rollout.experience import collate_samples, micro_batches, per_sequence
from alignkit.rollout.remote import Delivery, generator_parts
from alignkit.train.offline_loop import TrainResult
from alignkit.train.online_loop import iteration_requests, online_steps
from alignkit.train.run_plan import RunPlan, plan_run
from alignkit.train.step import TrainState

#: strategies whose trainers can send the policy: whole on every rank (single, ddp, ZeRO 0-2) or gathered bucket by
#: bucket over the trainers' group (fsdp, ZeRO-3)
SEPARATE_STRATEGIES = ("single", "ddp", "fsdp", "deepspeed")


def unsplit_rollout(cfg: RunConfig, algo_cls: type) -> str | None:
    """Why ``algo_cls`` as configured cannot run under ``placement: separate`` (its rollout is not split), or None."""
    if issubclass(algo_cls, OnlineAlgorithm) and algo_cls.split_rollout(cfg) is not None:
        return None
    return (f"the {cfg.algorithm} algorithm, as configured, has a rollout of its own, not split yet (split so far: "
            "the default rollout, grpo_agent's and ppo_agent's; not red teaming, flow, dynamic sampling: "
            "grpo.dynamic_sampling)")


def check_separate_config(cfg: RunConfig, processes: int | None = None) -> None:
    """What ``alignkit validate`` and ``alignkit launch`` (its dry run too) can refuse of ``placement: separate``
    from the config alone, before any process starts: an algorithm whose rollout is not split, and (``processes``:
    the launched world, when known) a world with no trainer left. The runner checks the rest (:func:`check_separate`)."""
    r = cfg.section(RolloutConfig)
    if r.placement != "separate":
        return
    if why := unsplit_rollout(cfg, ALGORITHMS.get(cfg.algorithm)):
        raise ConfigError(f"rollout.placement: separate: {why}; use placement: colocated")
    if processes is not None:
        check_world(r.generator_processes, processes)
        trainers = processes - r.generator_processes
        if why := uneven_split(resolve_batch(cfg, trainers).global_batch, r.generator_processes):
            raise ConfigError(f"rollout.placement: separate: {why} (with {trainers} trainer processes of the "
                              f"{processes} launched); change the batch or the generator count")


def uneven_split(global_batch: int, generators: int) -> str | None:
    """Why an iteration's ``global_batch`` completions cannot be shared by ``generators`` processes, or None."""
    if global_batch % generators:
        return (f"an iteration's {global_batch} completions must split evenly over rollout.generator_processes "
                f"({generators})")
    return None


def check_separate(cfg: RunConfig, algo_cls: type, workload: Workload, strategy: str, generators: int,
                   global_batch: int) -> None:
    """What ``placement: separate`` supports so far, each refusal one line: an algorithm whose rollout splits
    (``OnlineAlgorithm.split_rollout``: the default one, grpo_agent's and ppo_agent's), a token policy (kind lm; full weights or
    LoRA, whose adapters alone travel) under single / ddp / fsdp / deepspeed, and an iteration's completions that
    split evenly over the generators."""
    policy = next(s for s in workload.specs if s.trainable)
    why = unsplit_rollout(cfg, algo_cls)
    if why is None:
        if policy.kind != "lm":
            why = f"the policy must be a language model (kind lm) for now, not kind {policy.kind}"
        elif strategy not in SEPARATE_STRATEGIES:
            why = f"the trainers' strategy must be one of {', '.join(SEPARATE_STRATEGIES)} for now, not {strategy}"
        else:
            why = uneven_split(global_batch, generators)
    if why:
        raise ConfigError(f"rollout.placement: separate: {why}; use placement: colocated")


def generator_scored_roles(algo: Any) -> list[str]:
    """The model roles of ``algo``'s signals (``reward.model``'s ``reward``, a cost model's ``cost``) that score on
    the generators under ``placement: separate``: those of a split ``completions`` rollout (none otherwise). The
    generators load them whole, with no sharding strategy: ``distributed.shard_frozen: true`` is refused."""
    if not isinstance(algo, OnlineAlgorithm) or type(algo).split_rollout(algo.cfg) != "completions":
        return []
    roles = sorted({s.model_role for s in algo.signals().values() if s.model_role})
    if roles and algo.cfg.distributed.shard_frozen is True:
        raise ConfigError(f"rollout.placement: separate: the generators load the reward model roles ({', '.join(roles)})"
                          " whole, without a sharding strategy, so distributed.shard_frozen: true cannot hold for "
                          "them; set it to auto or false")
    return roles


def separate_workload(algo: Any, workload: Workload, is_main: bool) -> Workload:
    """The trainers' workload under ``placement: separate``: without the roles the generators score with
    (:func:`generator_scored_roles`), unless the run evaluates (the trainers' greedy evaluation scores with them);
    rank 0 says which in one line."""
    roles = generator_scored_roles(algo)
    if not roles:
        return workload
    if is_main:
        log.info(f"rollout.placement: separate: the reward model roles {', '.join(roles)} score on the generators"
                 + ("; the trainers load them too, for evaluation (data.eval)" if algo.cfg.data.eval
                    else ", not loaded on the trainers"))
    if algo.cfg.data.eval:
        return workload
    return dataclasses.replace(workload, specs=tuple(s for s in workload.specs if s.role not in roles))


def trainer_processes(cfg: RunConfig, processes: int) -> int:
    """How many of the launched ``processes`` train (``alignkit validate`` / ``launch`` count the batch over them):
    all of them, or with ``rollout.placement: separate`` all but ``rollout.generator_processes`` (at least 1)."""
    if not issubclass(ALGORITHMS.get(cfg.algorithm), OnlineAlgorithm):
        return processes
    r = cfg.section(RolloutConfig)
    return max(1, processes - r.generator_processes) if r.placement == "separate" else processes


def trainer_view(placement: Placement) -> DistEnv:
    """The trainers' world as a trainer sees it (the batch plan counts trainers)."""
    env = placement.env
    return DistEnv(0, placement.trainers, env.local_rank, env.local_world_size, env.master_addr, env.master_port)


class Generator:
    """One generator process's loop (module docstring)."""

    def __init__(self, cfg: RunConfig, placement: Placement, algo: OnlineAlgorithm, workload: Workload,
                 plan: RunPlan, prompts: list[dict[str, Any]]) -> None:
        self.cfg, self.placement, self.prompts, self.plan = cfg, placement, prompts, plan
        r = cfg.section(RolloutConfig)
        self.r, self.device = r, pick_device(placement.env)
        self.compute_dtype = pick_compute_dtype(cfg.model.dtype, self.device)
        spec = next(s for s in workload.specs if s.trainable)
        # in the trainers' dtype (fp32 master weights; a LoRA base in theirs): the broadcast copies them as they are
        trainers = build_strategy(plan.strategy, plan.distributed, trainer_view(placement), cfg.model.dtype,
                                  compute_weights=cfg.model.compute_weights)
        self.policy = build_model(spec, cfg.model, trainers.policy_dtype(lora=spec.lora), algo.tokenizer)
        self.policy = self.policy.to(self.device).eval()
        self.sync = sync_tensors(self.policy, lora=spec.lora)  # what a version brings (a LoRA's adapters only)
        self.base = frozen_tensors(self.policy) if spec.lora else None  # checked against the trainers' once
        self.policy.requires_grad_(False)
        self.kind = KINDS.get(spec.kind)  # generates as the trainers' rollout does: through the policy's kind
        self.pad = algo.tokenizer.pad_token_id
        self.engine = build_engine(r.engine, algo.tokenizer, cfg, max_new_tokens=r.max_new_tokens)
        self.algo, self.split = algo, type(algo).split_rollout(cfg)
        self.signals = algo.signals() if self.split == "completions" else {}
        self.trainers = trainers  # not set up: its device and autocast score the reward models as the trainers' did
        self.models = self._scoring_models(workload, algo.tokenizer)
        self.params = SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k, r.generation_batch_size)
        self.autocast = (torch.autocast(self.device.type, dtype=self.compute_dtype)
                         if self.compute_dtype != torch.float32 and self.engine.runs_in_caller
                         else contextlib.nullcontext())
        self.order = GlobalOrder(len(prompts), 1, 0, 1, seed=cfg.training.seed)
        self.per_iteration = plan.batch.global_batch // r.num_generations
        self.parts = generator_parts(plan.batch.global_batch, len(placement.generators), placement.trainers)
        self.version = -1  # the last version received
        self.send_s = 0.0  # seconds pickling and starting the last delivery's sends

    def _scoring_models(self, workload: Workload, tokenizer: Any) -> Models:
        """The roles the signals score with (:func:`generator_scored_roles`), frozen and whole as a trainer holds
        them colocated (``build_models``: the compute dtype, ``prepare_frozen``), beside the policy's tokenizer."""
        roles = generator_scored_roles(self.algo)
        specs = {s.role: s for s in workload.specs if s.role in roles or s.trainable}
        models = Models(specs=specs, tokenizers={"policy": tokenizer})
        for role in roles:
            spec = specs[role]
            models.tokenizers[role] = role_tokenizer(spec, tokenizer, self.cfg.model)
            models.frozen[role] = self.trainers.prepare_frozen(
                build_model(spec, self.cfg.model, self.trainers.compute_dtype, tokenizer))
        return models

    def run(self) -> None:
        start = broadcast_start(None, self.placement)
        if self.base is not None:  # the trainers check it before their first push
            check_base(self.base, self.placement)
        state = TrainState(start["step"], start["epoch"], start["consumed"])
        spi = self.r.steps_per_iteration
        first, last = state.step // spi, math.ceil(self.plan.steps.total / spi)
        self.version = first - 1
        pending: list[Any] = []
        for j in range(first, last):
            idle = self._take_weights(max(first, j - self.r.max_staleness))
            completions, seeds = iteration_requests(self.order, state, self.per_iteration, self.cfg)
            pending += self._generate_and_send(j, completions, seeds, idle)
            state.step += spi
        self._take_weights(last - 1)  # every version the trainers push is taken (their broadcasts complete)
        for work in pending:
            work.wait()

    @torch.no_grad()
    def _behaviour_logps(self, prompt_ids: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        """The sampling policy's log-prob of each completion token (the behaviour policy of the off-policy
        correction, ``sampler_logps``), by the training forward's numerics in ``per_device`` micro-batches, where
        the engine does not report its own (hf)."""
        samples = [{"prompt_ids": p, "completion_ids": c} for p, c in zip(prompt_ids, completions)]
        out: list[list[float]] = []
        for part in micro_batches(samples, self.plan.batch.per_device):
            batch = collate_samples(part, self.pad, (), ()).to(self.device)
            with self.autocast:
                out += per_sequence(self.kind.logps(self.policy, batch, temperature=behaviour_temperature(self.r)), batch)
        return out

    def _take_weights(self, version: int) -> float:
        """Receive the pushed versions up to ``version``; the seconds it waited."""
        start = time.perf_counter()
        while self.version < version:
            pull_weights(self.sync, self.placement)
            self.version += 1
        return time.perf_counter() - start

    def _generate_and_send(self, iteration: int, completions: list[int], seeds: list[int], idle: float) -> list[Any]:
        """Make this generator's share of the iteration and start sending each trainer its part."""
        g = self.placement.generator_index
        per_gen = len(completions) // len(self.placement.generators)
        lo = g * per_gen
        rows, mine = [self.prompts[c] for c in completions[lo : lo + per_gen]], seeds[lo : lo + per_gen]
        # the trainers update iteration j at version j: only samples of an older version need behaviour log-probs
        # (at staleness 0 the behaviour policy is the trainers' own, weight 1: sent without, as colocated)
        stale = iteration > self.version
        start = time.perf_counter()
        made = self._items(rows, mine, stale) if self.split == "items" else self._completions(rows, mine, stale)
        made.iteration, made.version, made.idle_s = iteration, self.version, idle
        made.generate_s = time.perf_counter() - start
        made.phases["send"] = self.send_s  # the previous delivery's (pickled, its sends started)
        began = time.perf_counter()
        sends = [send_object(made.part(slice(a - lo, b - lo)), t, self.placement)
                 for t, (a, b) in enumerate(self.parts[g]) if a != b]
        self.send_s = time.perf_counter() - began
        return sends

    def _generate(self, prompts: list[Any], params: SamplingParams) -> Any:
        """The policy's outputs of ``prompts``: one phase of the engine, as a trainer's ``RolloutContext.generate``."""
        with self.autocast, generation_phase(self.engine, self.policy):
            return self.kind.generate(self.policy, self.engine, prompts, params)

    def _completions(self, rows: list[dict[str, Any]], seeds: list[int], stale: bool) -> Delivery:
        """The rows' completions, their behaviour log-probs where ``stale`` (the engine's own: vLLM's always, hf's
        off the decoding steps' logits, ``SamplingParams.logprobs``; a forward of the sampling weights where it
        reports none: greedy) and every signal's function scores."""
        requests = [Prompt(list(row["prompt_ids"]), seed=s) for row, s in zip(rows, seeds)]
        began = time.perf_counter()
        gens = self._generate(requests, dataclasses.replace(self.params, logprobs=stale))
        phases = {"sample": time.perf_counter() - began}
        logps, began = gens.logps, time.perf_counter()
        if logps is None and stale:
            logps = self._behaviour_logps([p.ids for p in requests], gens.completion_ids)
        phases["behaviour_logps"] = time.perf_counter() - began
        began = time.perf_counter()
        samples = [{"prompt_ids": p.ids, "completion_ids": list(c)} for p, c in zip(requests, gens.completion_ids)]
        inputs = ScoreInputs([row["prompt"] for row in rows], gens.texts, [len(c) for c in gens.completion_ids],
                             [row["fields"] for row in rows], LazyBatches(lambda: self._batches(samples)))
        # the trainers apply the weights and penalties to the parts: only the parts travel
        scores = {name: {k: v for k, v in signal.score(self.models, inputs, self.trainers).items() if k != "total"}
                  for name, signal in self.signals.items()}
        scored_by = self.placement.env.rank if any(s.model_role for s in self.signals.values()) else -1
        phases["score"] = time.perf_counter() - began
        return Delivery(-1, -1, seeds, gens.completion_ids, gens.finish_reasons, gens.texts, logps, scores=scores,
                        seconds={"score": phases["score"]}, scored_by=scored_by, phases=phases)

    def _batches(self, samples: list[dict[str, Any]]) -> list[Any]:
        """``samples`` collated in ``per_device`` micro-batches on the device, as a trainer's
        ``RolloutContext.batches`` (a reward model's inputs)."""
        return [self.algo.collate(mb).to(self.device) for mb in micro_batches(samples, self.plan.batch.per_device)]

    def _items(self, rows: list[dict[str, Any]], seeds: list[int], stale: bool) -> Delivery:
        """The algorithm's items of the rows (``grpo_agent``: finished trajectories) and, where ``stale``, their
        behaviour log-probs (as :meth:`_completions`)."""
        seconds: dict[str, float] = {}

        def generate(prompts: list[Any], max_new: int) -> Any:
            began = time.perf_counter()
            try:
                return self._generate(prompts, dataclasses.replace(self.params, max_new_tokens=max_new,
                                                                   logprobs=stale))
            finally:
                seconds["generate"] = seconds.get("generate", 0.0) + time.perf_counter() - began

        items = self.algo.generator_items(rows, seeds, generate, seconds)
        logps, began = [x.sampler_logps for x in items], time.perf_counter()
        if any(lp is None for lp in logps):
            logps = self._behaviour_logps([x.prompt_ids for x in items], [x.completion_ids for x in items]) \
                if stale else None
        phases = {("sample" if k == "generate" else k): v for k, v in seconds.items()}
        phases["behaviour_logps"] = time.perf_counter() - began
        return Delivery(-1, -1, seeds, [], [], [], logps, items=items, seconds=seconds, phases=phases)


def behaviour_temperature(r: RolloutConfig) -> float:
    """The temperature the behaviour log-probs are taken at: the sampler's (greedy: 1), as the trainer's
    (``TokenRollout.temperature``)."""
    return r.temperature if r.temperature > 0 else 1.0


def split_placement(cfg: RunConfig) -> Placement | None:
    """The split world of an online run with ``rollout.placement: separate`` (every process calls it first), else
    None: nothing changes."""
    algo_cls = ALGORITHMS.get(cfg.algorithm)
    if not issubclass(algo_cls, OnlineAlgorithm) or cfg.section(RolloutConfig).placement != "separate":
        return None
    env = read_launch_env()
    device = pick_device(env)
    return split_world(cfg.section(RolloutConfig).generator_processes,
                       pick_backend(cfg.distributed.backend, device), device, cfg.distributed.timeout_minutes)


def run_generator(cfg: RunConfig, placement: Placement) -> TrainResult:
    """A generator process's whole run: the trainers' plan and prompt set, then :class:`Generator`'s loop."""
    setup_console(False)
    algo_cls = ALGORITHMS.get(cfg.algorithm)
    workload = workload_of(cfg)
    plan = plan_run(cfg, trainer_view(placement), workload)
    check_separate(cfg, algo_cls, workload, plan.strategy, len(placement.generators), plan.batch.global_batch)
    torch.manual_seed(cfg.training.seed)
    first = workload.trainable[0]
    algo = algo_cls(cfg, KINDS.get(first.kind).tokenizer(cfg.model))
    prompts = algo.data.build_dataset(cfg.data.train, "train")
    plan = online_steps(len(prompts), plan, cfg)
    Generator(cfg, placement, algo, workload, plan, prompts).run()
    return TrainResult(None, {}, {}, [])


def separate_split(cfg: RunConfig, processes: int) -> tuple[int, int] | None:
    """(trainer, generator) process counts of ``processes`` launched under ``rollout.placement: separate`` (None:
    not separate); fewer than one trainer is refused in one line."""
    if not issubclass(ALGORITHMS.get(cfg.algorithm), OnlineAlgorithm) or \
            cfg.section(RolloutConfig).placement != "separate":
        return None
    generators = cfg.section(RolloutConfig).generator_processes
    if processes <= generators:
        raise ConfigError(f"rollout.placement: separate: {processes} processes leave no trainer beside "
                          f"rollout.generator_processes={generators}")
    return processes - generators, generators
