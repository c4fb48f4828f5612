"""The rollout engine: prompts in (token ids, plus a VLM's image inputs), completions out.

Every generation goes through this interface (ARCHITECTURE 7b): online rollouts, evaluation and
``alignkit generate`` (:func:`alignkit.rollout.generate.generate`,
:func:`alignkit.rollout.vlm_generate.generate_with_images`), Safe-MM-DPO's on-policy cost estimate. The engine owns the padding policy (left-padded batches of
``SamplingParams.batch_size`` prompts), pad / EOS, sampling and decoding, so a generator is a registry
entry: Hugging Face ``generate`` with the KV cache (``hf``) and vLLM (``vllm``, rollout/vllm_engine.py) receive
the same :class:`Prompt` s and return the same :class:`Generations`. Log-probs of the completions are computed
afterwards by the training forward (``forward_logps``), so with ``hf`` the old log-probs match the training
numerics exactly and the first PPO ratio is 1 (another sampler's are corrected for: ``importance_sampling``).

The engine gets the plain module to generate with: the caller enters ``Strategy.full_params`` once per
rollout (FSDP2 / ZeRO-3 gather the parameters once, never per token), or, with
``rollout.gather_full_params: false`` for models too big to gather, calls on the sharded module with
``synced`` set, so every rank keeps running forwards until all are done (HF ``synced_gpus``).

Engines have a lifecycle (ARCHITECTURE 9b; verl's ``BaseRollout``), the methods of :class:`RolloutEngine`:
built from its settings (:meth:`~RolloutEngine.from_settings`: its own config section and the run's
:class:`EngineRun`), then per generation phase (:func:`generation_phase`) ``sync_weights(model)`` (push the
weights the caller generates with, where they changed), ``wake()`` (retake its memory), ``generate`` and
``sleep()`` (hand the memory back to the update). It says what memory it holds beside the training state
(``reserved_memory_fraction``, read by the memory planner), whether the loss corrects for its sampler
(``importance_sampling``), and gives a copy bound to another tokenizer (``with_tokenizer``: a role of another
family). A new engine is one file with a :func:`register_engine` class, plus its line in
:data:`ENGINE_MODULES` (inside the package) or the config's ``plugins:`` (outside).
"""

from __future__ import annotations

import abc
import contextlib
import importlib
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, Sequence, TypeVar

import torch
from torch import nn

from alignkit.distributed.env import read_env
from alignkit.models.generation import (  # the kinds' floor; the three types re-exported here
    Generations,
    Prompt,
    SamplingParams,
    completion_texts,
)
from alignkit.progress import track
from alignkit.registry import Registry
from alignkit.rollout.hf_generate import (  # re-exported here
    HFGenerateConfig,
    InverseCDFSampler,  # noqa: F401  (re-exported: the tests and callers import it from here)
    cache_kwargs,
    sampling_kwargs,
)


@dataclass(frozen=True)
class EngineRun:
    """What an engine is built from besides its own settings: ``max_model_len``, the longest prompt + completion it
    serves (0: the model's own limit); ``dtype``: the run's ``model.dtype``; ``world_size``: training processes."""

    max_model_len: int = 0
    dtype: str = "auto"
    world_size: int = 1

    @classmethod
    def of(cls, cfg: Any, max_new_tokens: int) -> EngineRun:
        """The facts of run config ``cfg`` generating up to ``max_new_tokens`` after a prompt."""
        return cls(cfg.data.max_length + max_new_tokens, cfg.model.dtype, read_env().world_size)


@dataclass(frozen=True)
class ImportanceSampling:
    """The loss's correction for an engine whose sampler's numerics differ from the trainer's (losses/rl.py
    ``sampler_is_weights``): per token or sequence, truncated or masked (``mode``) at ``cap``; ``low``: the lower
    edge of the ``icepop`` / ``sequence_geo_mask`` band."""

    mode: str
    cap: float
    low: float = 0.0


class RolloutEngine(abc.ABC):
    """The engine lifecycle (module docstring). Subclasses implement :meth:`from_settings`, :meth:`with_tokenizer`
    and :meth:`generate`; the rest default to an engine that generates with the caller's module itself (nothing
    to push, no memory of its own, exact sampler). Its :meth:`generate` makes every engine the
    :class:`~alignkit.models.generation.TokenGenerator` a token kind's ``generate`` calls."""

    #: the registry name (set by :func:`register_engine`)
    name: ClassVar[str] = "engine"
    #: its config section's dataclass (registered with ``register_section``), or None: no settings
    settings_type: ClassVar[type | None] = None
    #: computes in the caller's thread: ``RolloutContext.generate`` wraps it in the Strategy's autocast
    runs_in_caller: ClassVar[bool] = False
    #: generates on a sharded module with every rank stepping together (``synced``; HF's ``synced_gpus``), so
    #: ``rollout.gather_full_params: false`` works; else it needs the gathered full weights
    generates_sharded: ClassVar[bool] = False
    #: takes the trained module as it is (sharded or not) and gathers its weights itself, bucket by bucket (the
    #: remote engine of a separate placement): the rollout gathers nothing for it
    gathers_weights: ClassVar[bool] = False

    @classmethod
    @abc.abstractmethod
    def from_settings(cls, tokenizer: Any, settings: Any, run: EngineRun) -> RolloutEngine:
        """The engine decoding and padding with ``tokenizer``, configured by ``settings`` (an instance of
        :attr:`settings_type`, None without one) and the run's facts ``run``."""

    @classmethod
    def reserved_memory_fraction(cls, settings: Any) -> float:
        """Share of each accelerator's memory the engine holds through the update (the memory planner leaves it
        out of the training state's)."""
        return 0.0

    @classmethod
    def importance_sampling(cls, settings: Any) -> ImportanceSampling | None:
        """How the loss weights the tokens this engine sampled (it reports ``Generations.logps``); None: it
        samples exactly the trainer's distribution."""
        return None

    @abc.abstractmethod
    def with_tokenizer(self, tokenizer: Any) -> RolloutEngine:
        """This engine with the same settings, padding, stopping and decoding with ``tokenizer``."""

    def sync_weights(self, model: nn.Module) -> bool:
        """Make the next :meth:`generate` sample from ``model``'s current weights (pushed into the engine's
        copy where they changed since the last push); whether it pushed."""
        return False

    def wake(self) -> None:
        """Retake the memory :meth:`sleep` released, before generating."""

    def sleep(self) -> None:
        """Release the engine's memory until the next :meth:`wake` (the update gets it)."""

    def scored(self, signal: str) -> dict[str, list[float]] | None:
        """``signal``'s function scores of the last :meth:`generate`'s completions, computed where they were
        sampled (a separate placement's generators: ``rollout/remote.py``), taken once; None: the caller scores."""
        return None

    @abc.abstractmethod
    def generate(self, model: nn.Module, prompts: Sequence[Prompt] | Sequence[list[int]], params: SamplingParams,
                 *, synced: bool = False, progress: str | None = None) -> Generations:
        """Sample one completion per prompt (repeat a prompt for several); ``prompts``: :class:`Prompt` s or
        plain token-id lists; ``progress``: show a progress bar over the batches with this description."""


ENGINES: Registry[type[RolloutEngine]] = Registry("rollout engine")
#: engines shipped in modules of their own, imported when first asked for by name (their backend, e.g. vllm, only
#: when one is built); an engine of another package registers itself from a module in the config's ``plugins:``
ENGINE_MODULES = {"vllm": "alignkit.rollout.vllm_engine"}

E = TypeVar("E", bound=type[RolloutEngine])


def register_engine(name: str) -> Callable[[E], E]:
    """Class decorator: ``@register_engine("mine")`` makes ``rollout.engine: mine`` build that class."""

    def wrap(cls: E) -> E:
        cls.name = name
        return ENGINES.register(name)(cls)

    return wrap


def load_engines() -> None:
    """Import every shipped engine's module: registers the engines and their config sections."""
    for module in ENGINE_MODULES.values():
        importlib.import_module(module)


def engine_class(name: str) -> type[RolloutEngine]:
    """The engine registered as ``name`` (an error naming the closest one otherwise)."""
    if name not in ENGINES:
        load_engines()
    return ENGINES.get(name)


def engine_settings(cls: type[RolloutEngine], cfg: Any = None) -> Any:
    """``cls``'s own settings: its section of the run config ``cfg`` (defaults without a config); None for an
    engine without settings."""
    if cls.settings_type is None:
        return None
    return cfg.section(cls.settings_type) if cfg is not None else cls.settings_type()


@contextlib.contextmanager
def generation_phase(engine: RolloutEngine, model: nn.Module) -> Iterator[RolloutEngine]:
    """One generation phase of ``engine``'s lifecycle around the block: ``model``'s weights pushed where they
    changed, the engine's memory retaken for the block and released after it."""
    engine.sync_weights(model)
    engine.wake()
    try:
        yield engine
    finally:
        engine.sleep()


def generate_once(engine: RolloutEngine, model: nn.Module, prompts: Sequence[Prompt] | Sequence[list[int]],
                  params: SamplingParams, *, progress: str | None = None) -> Generations:
    """``engine.generate`` outside a rollout (``alignkit generate``, the J_C estimate) in a phase of its own."""
    with generation_phase(engine, model):
        return engine.generate(model, prompts, params, progress=progress)


@contextlib.contextmanager
def generation_mode(model: nn.Module) -> Iterator[None]:
    """eval mode (no dropout; gradient checkpointing is off outside training mode) and the KV cache on
    for the duration; both restored after."""
    was_training = model.training
    configs = [m.config for m in model.modules() if hasattr(getattr(m, "config", None), "use_cache")]
    old = [c.use_cache for c in configs]
    model.eval()
    for c in configs:
        c.use_cache = True
    try:
        with torch.no_grad():
            yield
    finally:
        for c, v in zip(configs, old):
            c.use_cache = v
        model.train(was_training)


def row_seeds(chunk: Sequence[Prompt]) -> list[int] | None:
    """The batch's per-row seeds when every request has one; None when none has; a mix is refused (one
    batch cannot draw partly from the global generator and stay independent of its composition)."""
    seeds = [p.seed for p in chunk]
    if all(s is None for s in seeds):
        return None
    if any(s is None for s in seeds):
        raise ValueError("either every prompt of a generation carries a seed or none does")
    return [int(s) for s in seeds]  # type: ignore[arg-type]


def as_prompts(prompts: Sequence[Prompt] | Sequence[list[int]]) -> list[Prompt]:
    """Requests of ``prompts`` (plain token-id lists are wrapped as text prompts)."""
    return [p if isinstance(p, Prompt) else Prompt(list(p)) for p in prompts]


def left_pad(rows: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, T)`` ids and attention mask of ``rows``, padded on the left to the longest (T): a decoder-only
    model continues each row from its last column, so the real tokens must end there."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(list(r), dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids, mask


def stitch_inputs(chunk: Sequence[Prompt]) -> dict[str, torch.Tensor]:
    """The batch's extra model inputs: each prompt's tensors concatenated along dim 0 in row order (a LLaVA
    model fills its image tokens with image features in reading order, row by row); {} for text."""
    keys = sorted({k for p in chunk for k in (p.inputs or {})})
    return {k: torch.cat([p.inputs[k] for p in chunk if p.inputs and k in p.inputs]) for k in keys}


@register_engine("hf")
class HFEngine(RolloutEngine):
    """Hugging Face ``generate`` with the KV cache on left-padded batches (:func:`left_pad`, image inputs
    by :func:`stitch_inputs`); sampling by :class:`InverseCDFSampler`, greedy at temperature 0. It generates with
    the caller's module itself: no weights to push, no memory of its own to release. Its settings
    (:class:`HFGenerateConfig`) pick the static KV cache and a compiled decode step; either way the one host
    read per token is transformers' stop check (whether every row has finished)."""

    runs_in_caller = True
    generates_sharded = True
    settings_type = HFGenerateConfig

    def __init__(self, tokenizer: Any, settings: HFGenerateConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.settings = settings or HFGenerateConfig()
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos = set(eos if isinstance(eos, list) else [eos]) - {None}
        # any id pads (the attention mask hides it); a tokenizer without a pad token pads with EOS
        pad = tokenizer.pad_token_id
        self.pad = pad if pad is not None else min(self.eos, default=0)

    @classmethod
    def from_settings(cls, tokenizer: Any, settings: Any = None, run: EngineRun | None = None) -> HFEngine:
        return cls(tokenizer, settings)

    def with_tokenizer(self, tokenizer: Any) -> HFEngine:
        return HFEngine(tokenizer, self.settings)

    def generate(self, model: nn.Module, prompts: Sequence[Prompt] | Sequence[list[int]], params: SamplingParams,
                 *, synced: bool = False, progress: str | None = None) -> Generations:
        requests = as_prompts(prompts)
        device = next(model.parameters()).device
        out, reasons, logps = [], [], []
        record = params.logprobs and params.temperature > 0  # greedy draws have no sampler log-probs to report
        starts = range(0, len(requests), params.batch_size)
        with generation_mode(model):
            for start in track(starts, len(starts), progress, "batches") if progress else starts:
                new, lps = self._call(model, requests[start : start + params.batch_size], params, device, synced)
                for i, row in enumerate(new.tolist()):
                    ids, stopped = self._cut(row)
                    out.append(ids)
                    reasons.append("stop" if stopped else "length")
                    if record:
                        logps.append(lps[i, : len(ids)].tolist())
        texts = completion_texts(self.tokenizer, out)
        return Generations(out, reasons, texts, logps if record else None)

    def _call(self, model: nn.Module, chunk: list[Prompt], params: SamplingParams, device: torch.device,
              synced: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(B, new)`` generated ids of one batch (EOS-finished rows padded after their EOS) and, where the sampler
        recorded them (``params.logprobs``), ``(B, new)`` their log-probs on the CPU (None otherwise)."""
        ids, mask = left_pad([p.ids for p in chunk], self.pad)
        sampling = sampling_kwargs(params, row_seeds(chunk))
        kwargs: dict[str, Any] = dict(max_new_tokens=params.max_new_tokens, pad_token_id=self.pad,
                                      eos_token_id=sorted(self.eos) or None, use_cache=True,
                                      **sampling, **cache_kwargs(self.settings, device))
        if synced:
            kwargs["synced_gpus"] = True
        extra = {k: v.to(device) for k, v in stitch_inputs(chunk).items()}
        gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **extra, **kwargs)
        new = gen[:, ids.shape[1]:].cpu()
        sampler = sampling["logits_processor"][0] if "logits_processor" in sampling else None
        if sampler is None or sampler.steps is None:
            return new, None
        logps = sampler.logps()
        if logps.shape != new.shape:  # one recorded step per generated column, or the log-probs are not the tokens'
            raise RuntimeError(f"the sampler recorded {tuple(logps.shape)} log-probs for {tuple(new.shape)} tokens")
        return new, logps.cpu()

    def _cut(self, row: list[int]) -> tuple[list[int], bool]:
        """The completion up to and including the first EOS; (ids, whether it stopped)."""
        for i, t in enumerate(row):
            if t in self.eos:
                return row[: i + 1], True
        return row, False  # unfinished rows hold max_new_tokens real tokens (HF pads only finished rows)


def build_engine(name: str, tokenizer: Any, cfg: Any = None, *, max_new_tokens: int = 0) -> RolloutEngine:
    """The engine registered as ``name`` (``hf``, ``vllm``, a plugin's), decoding and padding with ``tokenizer`` (a
    VLM's: its processor's tokenizer), built from its settings in the run config ``cfg`` (defaults without one) and
    the run's :class:`EngineRun` (prompt + up to ``max_new_tokens``). Built once per run; generation phases follow
    (:func:`generation_phase`)."""
    cls = engine_class(name)
    run = EngineRun.of(cfg, max_new_tokens) if cfg is not None else EngineRun()
    return cls.from_settings(tokenizer, engine_settings(cls, cfg), run)
