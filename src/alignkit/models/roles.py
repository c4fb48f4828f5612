"""Models as declared roles.

An algorithm lists the models it needs as :class:`ModelSpec` s, each under a role it names (the shipped
algorithms' ``policy`` / ``reference`` / ``reward`` / ``cost`` / ``value`` / ``cost_value`` / ``target`` /
``image_policy`` / ``image_reference``; a plugin algorithm declares its own the same way: no list to edit);
``kind``: an entry of :data:`~alignkit.models.kinds.KINDS`,
lm | scalar | vlm or one registered from outside; trainable or frozen). The
runner builds each through its kind's adapter, hands trainable ones to the
Strategy (one handle each) and frozen ones to ``Strategy.prepare_frozen``, and gives the algorithm
the resulting :class:`Models` bundle. The memory planner sizes the same specs, so nothing under
``distributed/`` names an algorithm.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from alignkit.config.schema import ModelConfig
from alignkit.data.batch import Batch
from alignkit.models.adapters import adapters_disabled
from alignkit.models.handle import Handle
from alignkit.models.kinds import KINDS, ModelKind
from alignkit.models.loading import load_tokenizer
from alignkit.models.policy import sequence_sums
from alignkit.models.sources import model_errors


@dataclass(frozen=True)
class ModelSpec:
    """One model a run needs.

    ``source``: hub id, local directory or LoRA adapter directory. ``lora``: trained through new or
    loaded LoRA adapters (the planner counts only the adapters as trained). ``transient``: loaded only
    before training (e.g. to precompute reference log-probs) and freed before the first step.
    ``shares``: the role is served by another role's weights (``"policy"``: the policy's LoRA base
    with adapters off), so nothing is loaded for it. ``chunk_size``: rows of hidden states per
    LM-head chunk (``lm``/``vlm``; 0 = by memory, ``ops.logprobs.chunk_rows``). ``train_parts`` (``vlm``): the
    parts that train (``vision_tower``, ``projector``, ``language_model``; None = all, or for a vision-language
    ``scalar`` model the projector and language model), the rest frozen before the Strategy sees the model.
    ``projector_from`` (``vlm``): a directory or file whose projector weights replace the loaded ones
    (a pretrain stage's output). ``tokenizer``: where this role's tokenizer is; None = the run's for the
    roles that read the policy's token ids (policy, reference, critics), and for a frozen scorer or target
    its own directory's when it has one (:func:`role_tokenizer`). ``lora_config``: LoRA settings of this role
    (rank, alpha, targets) where they are not ``model.lora`` (a second trained model of another kind); ``lr_scale``:
    its optimizer's learning rate as a multiple of the run's.
    """

    role: str
    source: str
    kind: str = "lm"
    trainable: bool = False
    lora: bool = False
    transient: bool = False
    shares: str | None = None
    chunk_size: int = 0
    train_parts: tuple[str, ...] | None = None
    projector_from: str | None = None
    tokenizer: str | None = None
    #: the role's own LoRA settings (a ``LoraConfig``) instead of ``model.lora`` (flow_rtpo's image policy)
    lora_config: Any = dataclasses.field(default=None, compare=False, hash=False)
    #: this trained role's learning rate relative to the run's (``training.learning_rate`` after its batch scaling)
    lr_scale: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.role, str) and self.role.isidentifier()):
            raise ValueError(f"ModelSpec.role must be a name of letters, digits and underscores (the algorithm's "
                             f"role, e.g. 'policy'), got {self.role!r}")
        if self.kind not in KINDS:
            raise ValueError(f"ModelSpec.kind must be one of {KINDS.names()}, got {self.kind!r}")
        if self.trainable and (self.transient or self.shares):
            raise ValueError("a trainable model cannot be transient or share another role's weights")
        if self.kind == "lm" and (self.train_parts is not None or self.projector_from):
            raise ValueError("train_parts / projector_from apply to a vlm (or a vision-language scalar) model only")
        if self.kind == "scalar" and self.projector_from:
            raise ValueError("projector_from applies to a vlm model only")

    @property
    def loaded(self) -> bool:
        """Whether the runner loads weights for this role (not when it shares another's)."""
        return self.shares is None


@dataclass(frozen=True)
class ImageShape:
    """What one trained forward of a diffusion policy sees: square images of ``resolution`` pixels with
    ``text_tokens`` T5 prompt positions (the pipeline adds its CLIP ones), ``copies`` 2 where classifier-free
    guidance puts the unconditional half through the same forward."""

    resolution: int
    text_tokens: int
    copies: int = 1


@dataclass(frozen=True)
class Workload:
    """What a run puts on the devices, as the memory planner needs it: the model specs and how many
    sequences one example puts through the trainable model (2 for a chosen/rejected pair)."""

    specs: tuple[ModelSpec, ...]
    sequences_per_example: int = 1
    #: share of each accelerator's memory held outside the models (a colocated vLLM engine's)
    reserved_fraction: float = 0.0
    #: a diffusion policy's forward (None: no diffusion model trains)
    image: ImageShape | None = None

    @property
    def trainable(self) -> list[ModelSpec]:
        return [s for s in self.specs if s.trainable]

    @property
    def frozen(self) -> list[ModelSpec]:
        """Frozen models that are loaded (held all run, or transient)."""
        return [s for s in self.specs if not s.trainable and s.loaded]


def build_model(spec: ModelSpec, cfg: ModelConfig, dtype: torch.dtype, tokenizer: Any) -> nn.Module:
    """The model of ``spec`` built by its kind's adapter; a missing / unreachable model or a corrupt weights
    file is one ModelError line."""
    with model_errors(spec.source):
        return KINDS.get(spec.kind).build(spec, cfg, dtype, tokenizer)


@dataclass
class Models:
    """A run's models by role: trainable ones as Strategy handles (``handles[role].module`` is what
    forward calls: the DDP / FSDP module or DeepSpeed engine), frozen ones as placed modules, and each
    role's spec (its kind's adapter answers :meth:`logps`, :meth:`scores`, :meth:`values`,
    :meth:`generate`). A role that ``shares`` the policy (the LoRA base as reference) is served by the
    policy with its adapters off, in eval mode: the one place that resolves it."""

    handles: dict[str, Handle] = field(default_factory=dict)
    frozen: dict[str, nn.Module] = field(default_factory=dict)
    specs: dict[str, ModelSpec] = field(default_factory=dict)
    #: each role's tokenizer (or processor); a role without one reads the policy's
    tokenizers: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, role: str) -> nn.Module:
        if role in self.handles:
            return self.handles[role].module
        if role in self.frozen:
            return self.frozen[role]
        raise KeyError(f"no model with role {role!r} in this run (have {sorted([*self.handles, *self.frozen])})")

    def __contains__(self, role: object) -> bool:
        return role in self.handles or role in self.frozen

    @property
    def primary(self) -> str:
        """The first trainable role (its weights are the run's ``final/``)."""
        return next(iter(self.handles))

    def tokenizer(self, role: str) -> Any:
        """``role``'s tokenizer (processor), else the policy's; None when the bundle has none (tests)."""
        return self.tokenizers.get(role, self.tokenizers.get("policy"))

    def kind(self, role: str) -> ModelKind:
        """The adapter of ``role``'s kind (``lm`` when the bundle was built without specs, as in tests)."""
        spec = self.specs.get(role)
        return KINDS.get(spec.kind if spec is not None else "lm")

    @contextlib.contextmanager
    def running(self, role: str) -> Iterator[nn.Module]:
        """The module that computes ``role``: its own, or for a role sharing the policy's weights the policy
        with its LoRA adapters disabled and in eval mode (no dropout, like a frozen copy), restored after."""
        spec = self.specs.get(role)
        if spec is None or spec.shares is None:
            yield self[role]
            return
        owner = self[spec.shares]
        was_training = owner.training
        owner.eval()
        try:
            with adapters_disabled(owner):
                yield owner
        finally:
            owner.train(was_training)

    def logps(self, role: str, batch: Batch, *, temperature: float = 1.0, with_entropy: bool = False,
              **options: Any) -> Any:
        """``(N,)`` log-probs of the batch's targets under ``role`` (row-major over target positions), of
        ``softmax(logits / temperature)`` (online algorithms: the sampler's temperature; offline: 1.0); with
        ``with_entropy`` the pair (log-probs, ``(N,)`` exact entropies of that distribution, no gradient).
        ``options``: the kind's own (the diffusion kind's ``params``, its sampler's settings, and ``with_step``)."""
        with self.running(role) as module:
            return self.kind(role).logps(module, batch, temperature=temperature, with_entropy=with_entropy, **options)

    def sequence_logps(self, role: str, batch: Batch) -> torch.Tensor:
        """``(S,)`` per-sequence sums of :meth:`logps` (``seq_index``; S = ``len(response_lengths)``)."""
        return sequence_sums(self.logps(role, batch), batch)

    def scores(self, role: str, batch: Batch) -> torch.Tensor:
        """``(S,)`` one score per sequence of a reward / cost model."""
        return self.kind(role).scores(self[role], batch)

    def values(self, role: str, batch: Batch) -> torch.Tensor:
        """``(N,)`` a critic's value at every target position, aligned with :meth:`logps`."""
        return self.kind(role).values(self[role], batch)

    def free(self, role: str) -> None:
        """Drop a frozen model (e.g. a reference whose log-probs are cached)."""
        self.frozen.pop(role, None)

    def train(self, mode: bool = True) -> None:
        for h in self.handles.values():
            h.module.train(mode)

    def disable_dropout(self) -> None:
        """Zero the dropout of every trainable model (:func:`disable_dropout`), so a forward in train mode
        is deterministic: the online algorithms' old log-probs equal the first update's new ones. Frozen
        roles already run in eval mode (``Strategy.prepare_frozen``; ``running`` for a shared LoRA base)."""
        for h in self.handles.values():
            disable_dropout(h.module)

    def __iter__(self) -> Iterator[str]:
        return iter([*self.handles, *self.frozen])


def disable_dropout(module: nn.Module) -> None:
    """Set every ``nn.Dropout``'s ``p`` to 0 in ``module`` (LoRA's ``lora_dropout`` included), as TRL's
    ``disable_dropout_in_model`` (trl/trainer/utils.py) does for its GRPO (``disable_dropout``) and PPO
    trainers. Also zeroes the float ``attention_dropout`` attribute that HF attention modules (Llama, Qwen2,
    Mistral, ...) copy from their config and apply functionally in train mode (TRL leaves it, which keeps
    old != new log-probs for a checkpoint whose config sets it > 0); the config itself is left as it is, so
    a saved checkpoint keeps the user's value."""
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0


#: frozen roles that read text of their own (scorers, a red-team target): they keep their own tokenizer
OWN_TOKENIZER_ROLES = ("reward", "cost", "target")


def role_tokenizer(spec: ModelSpec, run_tokenizer: Any, cfg: ModelConfig) -> Any:
    """The tokenizer ``spec``'s role reads with: ``spec.tokenizer`` if set; for a frozen scorer or target of a
    text policy, the one saved in its local directory (a reward_model run's final/ has it), else the run's."""
    source = spec.tokenizer
    if source is None and spec.role in OWN_TOKENIZER_ROLES and not spec.trainable and hasattr(run_tokenizer, "get_vocab"):
        local = Path(spec.source)
        if any((local / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            source = spec.source
    if source is None:
        return run_tokenizer
    return load_tokenizer(dataclasses.replace(cfg, name_or_path=source, tokenizer=source))


def same_vocabulary(a: Any, b: Any) -> bool:
    """Whether token ids mean the same tokens under tokenizers ``a`` and ``b``."""
    return a is b or a.get_vocab() == b.get_vocab()

