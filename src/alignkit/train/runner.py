"""From a validated config to a finished run: environment, plan, strategy, models, loop.

:class:`Session` is one process's view of a run, built once: the launcher environment, the
algorithm and the models it declares (:class:`~alignkit.models.roles.Workload`), the
:class:`~alignkit.train.run_plan.RunPlan` (strategy and why, batch arithmetic, learning rate), the
Strategy (set up, pre-flight checked, frozen-model sharding decided) and the tokenizer. ``run_train``
and ``alignkit eval`` start one; the loop gets everything from it as arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from alignkit import progress
from alignkit.algorithms import ALGORITHMS, workload_of
from alignkit.algorithms.base import OfflineAlgorithm
from alignkit.algorithms.online import OnlineAlgorithm
from alignkit.config import RunConfig, dump_yaml, to_dict
from alignkit.config.schema import ModelConfig
from alignkit.data.streaming import RowStream
from alignkit.distributed.env import DistEnv, read_env, read_launch_env
from alignkit.distributed.placement import Placement
from alignkit.distributed.strategy import build_strategy
from alignkit.distributed.strategy.base import Handle, OptimizerFactory, Strategy
from alignkit.distributed.strategy.sharded import decoder_blocks
from alignkit.errors import ConfigError
from alignkit.logging import RunLogger, scrub, setup_console
from alignkit.models import attention, fused
from alignkit.models.kinds import KINDS
from alignkit.models.liger import apply_liger_layers, check_liger, check_liger_layers
from alignkit.models.loading import count_parameters
from alignkit.models.roles import Models, ModelSpec, Workload, build_model, role_tokenizer
from alignkit.planner.auto import frozen_roles, frozen_sharding, memory_inputs
from alignkit.planner.plan import estimate
from alignkit.planner.plan_report import format_table
from alignkit.planner.preflight import preflight
from alignkit.plot import plot_after_run
from alignkit.train.checkpoint import resolve_resume, role_dir
from alignkit.train.generator_loop import check_separate, run_generator, separate_workload, split_placement
from alignkit.train.hub_push import check_at_start, publish
from alignkit.train.offline_loop import OfflineTrainer, TrainResult
from alignkit.train.online_loop import OnlineTrainer, check_groups, online_steps
from alignkit.train.optim import build_optimizer, optimizer_impl
from alignkit.train.output_dir import check_reuse, hold, release
from alignkit.train.resume import check_same_run
from alignkit.train.run_plan import RunPlan, plan_run

if TYPE_CHECKING:
    from alignkit.planner.auto import DeviceMemory


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Session:
    cfg: RunConfig
    env: DistEnv
    algo: OfflineAlgorithm | OnlineAlgorithm
    workload: Workload
    plan: RunPlan
    strategy: Strategy
    preflight: dict[str, str]

    @classmethod
    def start(cls, cfg: RunConfig) -> Session:
        """Plan once, build and set up the strategy, check the ranks, seed, load the tokenizer."""
        env = read_env()
        setup_console(env.is_main)
        progress.configure(is_main=env.is_main, mode=cfg.logging.progress_bar)
        algo_cls = ALGORITHMS.get(cfg.algorithm)
        workload = workload_of(cfg)
        for spec in workload.specs:  # a folder that holds no model of its kind: one line before any work
            if spec.loaded:
                KINDS.get(spec.kind).check_source(spec.source)
        if not cfg.checkpoint.resume_weights_only and (
                resumed := resolve_resume(Path(cfg.output_dir), cfg.checkpoint.resume_from)):
            check_same_run(resumed, dump_yaml(cfg))  # another run's checkpoint: one line before any model loads
        plan = plan_run(cfg, env, workload)
        strategy = configured_strategy(cfg, env, plan)
        strategy.setup()
        if cfg.training.liger_kernel:  # one line where it cannot run, before any model loads
            check_liger(cfg.algorithm, strategy.device)
        if cfg.training.liger_layers:
            check_liger_layers(strategy.device, cfg.training.fused_layers)
        if strategy.device.type == "cpu":
            # Adam's second moments and tiny gradients drift into subnormal floats, which x86 CPUs
            # process ~100x slower: measured 2 s -> 6 s per step on the tiny model. Flush them to 0.
            torch.set_flush_denormal(True)
        # flash_attention_2 without flash_attn or off CUDA: one line, before any model loads
        attention.check_installed(cfg.model.attn_implementation, strategy.device)
        checked = {}
        separate = read_launch_env().world_size != env.world_size  # rollout.placement: separate split the world
        if separate:
            check_separate(cfg, algo_cls, workload, plan.strategy, read_launch_env().world_size - env.world_size,
                           plan.batch.global_batch)
        elif env.is_distributed:  # every rank reachable, same versions and decision, before any model is built
            checked = preflight(strategy.backend, plan.strategy, cfg.distributed.preflight_timeout_s)
        set_seed(cfg.training.seed)
        first = workload.trainable[0] if workload.trainable else workload.specs[0]  # the policy's kind reads the data
        algo = algo_cls(cfg, KINDS.get(first.kind).tokenizer(cfg.model))
        if separate:  # the generators' reward models are not loaded here (the plan counted them: it stays)
            workload = separate_workload(algo, workload, env.is_main)
        strategy.decide_frozen_sharding(frozen_roles(workload), functools.partial(frozen_sharding, cfg, workload))
        return cls(cfg, env, algo, workload, plan, strategy, checked)

    def announce(self, logger: RunLogger) -> None:
        env, plan, checked = self.env, self.plan, self.preflight
        if env.is_distributed:
            logger.info(f"Distributed training initialized: world_size={env.world_size} backend={self.strategy.backend}")
        if checked:
            logger.info(f"Pre-flight OK: {env.world_size} ranks reachable; torch {checked['torch']}, transformers "
                        f"{checked['transformers']}, alignkit {checked['alignkit']} and strategy match")
        logger.info(f"Strategy: {plan.strategy} ({plan.reason}); device={self.strategy.device.type}; "
                    f"algorithm={self.cfg.algorithm}")
        if any(spec.kind != "diffusion" for spec in self.workload.specs):  # a diffusion model has its own attention
            logger.info(attention.describe(self.cfg.model.attn_implementation, self.strategy.device))

    def build_models(self, *, train: bool = True, logger: RunLogger | None = None) -> Models:
        t = self.cfg.training
        impl = optimizer_impl(t, self.plan.strategy)
        make_optimizer = (lambda m: build_optimizer(m, t, self.plan.lr, impl=impl)) if train else None
        workload = self.workload
        if train and self.cfg.checkpoint.resume_weights_only:
            workload = weights_from_checkpoint(self.cfg, workload)
        compile_blocks = None
        if train and t.torch_compile:  # packed lengths in buckets (data.pack_multiple_of): static shapes
            compile_blocks = "static" if self.cfg.data.packing and self.cfg.data.pack_multiple_of > 1 else "dynamic"
        if compile_blocks and self.plan.strategy not in COMPILE_STRATEGIES:
            raise ConfigError(f"training.torch_compile: supported under the {', '.join(COMPILE_STRATEGIES)} "
                              f"strategies, not {self.plan.strategy} (set it to false)")
        return build_models(workload, self.cfg.model, self.strategy, self.algo.tokenizer,
                            make_optimizer=make_optimizer, logger=logger, compile_blocks=compile_blocks,
                            fused_layers=train and fused.fused_layers_on(t.fused_layers, self.plan.strategy),
                            liger_layers=train and t.liger_layers)


def weights_from_checkpoint(cfg: RunConfig, workload: Workload) -> Workload:
    """``checkpoint.resume_weights_only``: the trainable roles start from the checkpoint's weights (each
    role's Hugging Face export in ``checkpoint-N/ROLE/``); nothing else of that run is kept."""
    path = resolve_resume(Path(cfg.output_dir), cfg.checkpoint.resume_from)
    if path is None:
        raise ConfigError("checkpoint.resume_weights_only: checkpoint.resume_from names no checkpoint "
                          f"(latest in {cfg.output_dir} has none yet)")
    first = next(s.role for s in workload.specs if s.trainable)
    specs = tuple(dataclasses.replace(s, source=str(role_dir(path, s.role, first=s.role == first)))
                  if s.trainable else s for s in workload.specs)
    return dataclasses.replace(workload, specs=specs)


def build_models(workload: Workload, model_cfg: ModelConfig, strategy: Strategy, tokenizer: Any, *,
                 make_optimizer: OptimizerFactory | None = None, logger: RunLogger | None = None,
                 compile_blocks: str | None = None, fused_layers: bool = False,
                 liger_layers: bool = False) -> Models:
    """Every loaded role of ``workload``: trainable ones prepared by the strategy with an optimizer
    from ``make_optimizer`` (None: evaluation only, placed like a frozen model in fp32), frozen ones
    in the compute dtype through ``strategy.prepare_frozen``. ``compile_blocks`` (``training.torch_compile``:
    ``dynamic`` or ``static`` shapes, None: off) compiles each trainable model's decoder blocks in place
    (:func:`compile_decoder_blocks`); ``fused_layers``
    (``training.fused_layers``) gives them the memory-lean MLP / RMSNorm forwards first (models/fused.py),
    ``liger_layers`` (``training.liger_layers``) Liger-Kernel's RMSNorm / SwiGLU / RoPE (models/liger.py)."""
    models = Models(specs={spec.role: spec for spec in workload.specs}, tokenizers={"policy": tokenizer})
    for spec in workload.specs:
        if not spec.loaded:
            continue
        models.tokenizers[spec.role] = role_tokenizer(spec, tokenizer, model_cfg)
        if not spec.trainable:
            module = build_model(spec, model_cfg, strategy.compute_dtype, tokenizer)
            models.frozen[spec.role] = strategy.prepare_frozen(module)
            continue
        dtype = strategy.policy_dtype(lora=spec.lora) if make_optimizer else torch.float32
        module = build_model(spec, model_cfg, dtype, tokenizer)
        if logger is not None:
            _log_parameters(logger, spec, module)
        if fused_layers and make_optimizer is not None:
            counts = fused.apply_fused_layers(module)
            if logger is not None and any(counts.values()):
                logger.info(f"fused layers: {counts['mlp']} SwiGLU MLPs and {counts['rmsnorm']} RMSNorms of the "
                            f"{spec.role} model (training.fused_layers)")
        if liger_layers and make_optimizer is not None:
            kind = apply_liger_layers(module)
            if logger is not None:
                logger.info(f"Liger-Kernel RMSNorm, SwiGLU and RoPE in the {spec.role} model ({kind}; training.liger_layers)")
        if compile_blocks and make_optimizer is not None:
            n = compile_decoder_blocks(module, dynamic=compile_blocks == "dynamic")
            if logger is not None:
                logger.info(f"torch.compile: {n} decoder blocks of the {spec.role} model (compiled at the first step)")
        if make_optimizer is None:
            models.handles[spec.role] = Handle(spec.role, strategy.prepare_frozen(module), optimizer=None)  # type: ignore[arg-type]
        else:
            models.handles[spec.role] = strategy.prepare(module, scaled_lr(make_optimizer, spec.lr_scale), role=spec.role)
    return models


#: engines under which ``training.torch_compile`` is supported (DeepSpeed's parameter hooks are not)
COMPILE_STRATEGIES = fused.STRATEGIES


def compile_decoder_blocks(module: torch.nn.Module, *, dynamic: bool = True, backend: str = "inductor") -> int:
    """``Module.compile`` each repeated transformer block of ``module`` (regional compilation: the blocks
    share one compiled graph, and parameter names, state dicts and engine wrapping are unchanged);
    ``dynamic=True`` so a new sequence length does not recompile, ``False`` (``data.pack_multiple_of`` > 1: packed
    lengths in buckets) for static shapes, one compile per bucket. A packed row's boundaries reach the attention
    as one opaque input the blocks never read (``models.attention.PackedRow``). Returns how many blocks."""
    blocks = decoder_blocks(module)
    if not blocks:
        raise ConfigError(f"training.torch_compile: found no decoder blocks in {type(module).__name__} "
                          "(no _no_split_modules and no layers list); set it to false")
    for block in blocks:
        block.compile(dynamic=dynamic, backend=backend)
        block.compile_dynamic = dynamic  # what a deep copy (compute_weights.split) compiles its own with
    return len(blocks)


def scaled_lr(make_optimizer: OptimizerFactory, scale: float) -> OptimizerFactory:
    """``make_optimizer`` with every parameter group's learning rate times ``scale`` (a role's ``lr_scale``); the LR
    schedule built on the optimizer then runs from that peak."""
    if scale == 1.0:
        return make_optimizer

    def make(module: torch.nn.Module) -> torch.optim.Optimizer:
        optimizer = make_optimizer(module)
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * scale
        return optimizer

    return make


def _log_parameters(logger: RunLogger, spec: ModelSpec, module: torch.nn.Module) -> None:
    trainable, total = count_parameters(module)
    if spec.lora:
        logger.info(f"LoRA enabled for {spec.role} model: {trainable:,} trainable / {total:,} total "
                    f"parameters ({100 * trainable / total:.2f}%)")
    else:
        logger.info(f"{spec.role.capitalize()} model: {total:,} parameters ({trainable:,} trainable)")


def strategy_for(cfg: RunConfig, env: DistEnv, memory: DeviceMemory | None = None) -> Strategy:
    """The configured (not yet set up) Strategy ``cfg`` gets under ``env``: for tools and tests."""
    return configured_strategy(cfg, env, plan_run(cfg, env, workload_of(cfg), memory))


def configured_strategy(cfg: RunConfig, env: DistEnv, plan: RunPlan) -> Strategy:
    """The planned engine with its resolved settings, configured with the batch plan and clipping."""
    strategy = build_strategy(plan.strategy, plan.distributed, env, cfg.model.dtype, auto_picked=plan.auto_picked,
                              compute_weights=cfg.model.compute_weights)
    strategy.configure(plan.batch, cfg.training.max_grad_norm)
    return strategy


def memory_line(device: torch.device) -> str:
    """This process's memory after the models are placed: the CUDA allocator's allocated and reserved
    bytes on a GPU (the seed guides' line), resident memory on CPU."""
    if device.type == "cuda":
        return (f"GPU memory allocated: {torch.cuda.memory_allocated(device) / 2**30:.2f} GB, "
                f"reserved: {torch.cuda.memory_reserved(device) / 2**30:.2f} GB (rank 0)")
    import psutil

    return f"Process memory (RSS): {psutil.Process().memory_info().rss / 2**30:.2f} GB (rank 0)"


def memory_table(cfg: RunConfig, workload: Workload, strategy: Strategy) -> str:
    """The memory estimator's per-component table (policy, optimizer, gradients, reference, frozen
    models, activations) for this run's engine, as the seed guides print one at start-up."""
    stage = getattr(strategy, "zero_stage", None)
    name = strategy.frozen_plan() or (f"zero{stage}" if stage in (1, 2) else "ddp")
    try:
        inputs = memory_inputs(cfg, workload, n_gpus=strategy.dp_size, device=strategy.device.type)
    except ValueError as e:  # a hub id or an unknown architecture: the run goes on without a table
        return f"Memory estimate by component: not available ({e})"
    return "Memory estimate by component (the estimator's, per device):\n" + format_table(
        inputs, {name: estimate(inputs, name)})


def check_output_dir(path: Path) -> None:
    """Create ``output_dir`` and write a probe file in it, so a place rank 0 cannot write to is one line
    naming it and why, before any model is loaded (not a traceback from the first write)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".alignkit-write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        file = next((p for p in (path, *path.parents) if p.is_file()), None)
        why = f"{file} is a file, not a directory" if file else (e.strerror or str(e))
        raise ConfigError(f"output_dir {str(path)!r}: cannot write there ({why})") from None


def open_stream(cfg: RunConfig, algo: OfflineAlgorithm | OnlineAlgorithm, strategy: Strategy) -> RowStream:
    """``data.streaming``: this rank's share of data.train's rows, converted as they are read."""
    convert = getattr(algo.data, "convert_row", None)
    if convert is None or isinstance(algo, OnlineAlgorithm):
        raise ConfigError(f"data.streaming: the {cfg.algorithm} data pipeline cannot convert single rows; "
                          "prepare the data set instead (data.streaming: false)")
    d = cfg.data
    return RowStream(d.train, convert, rank=strategy.dp_rank, world=strategy.dp_size, skip_invalid=d.skip_invalid,
                     split=d.train_split, config=d.train_config)


def claim_output_dir(cfg: RunConfig) -> str | None:
    """Rank 0, before anything else: create ``output_dir`` (one line where it cannot be written), hold its run
    lock (a second run at once is refused, naming the first's pid and host), then refuse or move aside another
    run's folder (:func:`check_reuse`); returns the line saying it was moved, if it was."""
    out = Path(cfg.output_dir)
    check_output_dir(out)
    hold(out)
    moved = check_reuse(cfg)
    if moved:  # the lock moved aside with the old run's folder: hold the new one
        release(out)
        check_output_dir(out)
        hold(out)
    return moved


def run_train(cfg: RunConfig) -> TrainResult:
    """A whole run; rank 0 holds ``output_dir``'s run lock from the start to the end (:func:`claim_output_dir`).
    Under ``rollout.placement: separate`` the world is split first and a generator process runs its own loop."""
    placement = split_placement(cfg)
    if placement is not None and placement.role == "generator":
        return run_generator(cfg, placement)
    main = read_env().is_main
    moved = claim_output_dir(cfg) if main else None
    try:
        return _run(cfg, moved, placement)
    finally:
        if main:
            release(Path(cfg.output_dir))


def _run(cfg: RunConfig, moved: str | None, placement: Placement | None) -> TrainResult:
    session = Session.start(cfg)
    strategy, algo = session.strategy, session.algo
    out = Path(cfg.output_dir)
    logger = RunLogger(is_main=strategy.is_main, output_dir=out, report_to=cfg.logging.report_to,
                       run_name=cfg.logging.run_name, wandb_project=cfg.logging.wandb_project,
                       progress_bar=cfg.logging.progress_bar, config=to_dict(cfg))
    if moved:
        logger.info(moved)
    session.announce(logger)
    if strategy.is_main:  # hub.push_to_hub: what would make the push at the end fail, said now
        check_at_start(cfg.hub, logger)
    if strategy.is_main:
        import yaml

        (out / "config.yaml").write_text(yaml.safe_dump(scrub(to_dict(cfg)), sort_keys=False), encoding="utf-8")
    if isinstance(algo, OnlineAlgorithm):
        check_groups(session.plan, cfg)  # before the data are read: a config error is cheap to report
    train_set = open_stream(cfg, algo, strategy) if cfg.data.streaming else algo.data.build_dataset(cfg.data.train, "train")
    eval_set = algo.data.build_dataset(cfg.data.eval, "eval") if cfg.data.eval else []
    if cfg.training.eval_before_train and not eval_set:
        logger.info("training.eval_before_train=true: no evaluation before training, the run has no eval data "
                    "(data.eval)")
    for split, name in (("train", "training"), ("eval", "evaluation")):  # rows dropped or changed, by cause
        for line in algo.data.row_counts[split].lines(name) if split in algo.data.row_counts else []:
            logger.info(line)
    if isinstance(algo, OnlineAlgorithm):
        plan = online_steps(len(train_set), session.plan, cfg)
        models = session.build_models(logger=logger)
        logger.info(memory_line(strategy.device))
        result = OnlineTrainer(cfg, algo, strategy, models, plan, train_set, eval_set, logger, placement).fit()
    else:
        # a stream's length is unknown: its plan is training.max_steps steps (load_config requires it)
        n_train = session.plan.batch.global_batch * (cfg.training.max_steps or 0) if cfg.data.streaming else len(train_set)
        plan = session.plan.with_steps(n_train, cfg.training)
        models = session.build_models(logger=logger)
        logger.info(memory_line(strategy.device))
        if algo.memory_table:
            logger.info(memory_table(cfg, session.workload, strategy))
        result = OfflineTrainer(cfg, algo, strategy, models, plan, train_set, eval_set, logger).fit()
    plot = None
    if cfg.logging.plot and strategy.is_main:  # a failure here is a warning line: the run has finished
        plot = plot_after_run(out, cfg.logging.report_to)
    if strategy.is_main and result.final_dir is not None:  # the card shows the plot; then hub.push_to_hub
        publish(cfg, result.final_dir, plot, logger, source=models.specs[models.primary].source)
    logger.info(f"Run finished: outputs in {out}")
    return result
