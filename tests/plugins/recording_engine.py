"""A rollout engine registered from OUTSIDE the package (the worked example of docs/architecture.md "add a
generation engine"): Hugging Face generate (alignkit's ``hf`` engine, wrapped) with a settings section of its own,
which writes each lifecycle call to a JSONL file, so a test sees the online loop build it from its settings and
run every generation phase as sync_weights -> wake -> generate -> sleep, pushing only weights that changed. It
says it holds ``reserved`` of each accelerator's memory, which the memory planner leaves to it.

Use: ``plugins: [tests.plugins.recording_engine]``, ``rollout.engine: recording`` and
``recording_engine: {log: calls.jsonl, reserved: 0.25}``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from alignkit.config.schema import f
from alignkit.config.sections import register_section
from alignkit.rollout.engine import (
    EngineRun,
    Generations,
    HFEngine,
    Prompt,
    RolloutEngine,
    SamplingParams,
    register_engine,
)


@register_section("recording_engine")
@dataclass
class RecordingConfig:
    log: str = f("", "JSONL file each lifecycle call is appended to (empty: none).")
    reserved: float = f(0.0, "Share of each accelerator's memory the engine holds (the memory planner reads it).",
                        ge=0, lt=1)


@register_engine("recording")
class RecordingEngine(RolloutEngine):
    settings_type = RecordingConfig
    runs_in_caller = True  # HF generate, in this thread: under the Strategy's autocast
    generates_sharded = True

    def __init__(self, inner: HFEngine, settings: RecordingConfig) -> None:
        self.inner, self.settings = inner, settings
        self.held: tuple[tuple[int, int], ...] | None = None  # the weights of the last push (storage, version)

    @classmethod
    def from_settings(cls, tokenizer: Any, settings: RecordingConfig, run: EngineRun) -> RecordingEngine:
        engine = cls(HFEngine(tokenizer), settings)
        engine.record("from_settings", max_model_len=run.max_model_len, dtype=run.dtype)
        return engine

    @classmethod
    def reserved_memory_fraction(cls, settings: RecordingConfig) -> float:
        return settings.reserved

    def with_tokenizer(self, tokenizer: Any) -> RecordingEngine:
        return RecordingEngine(self.inner.with_tokenizer(tokenizer), self.settings)

    def sync_weights(self, model: nn.Module) -> bool:
        mark = tuple((p.data_ptr(), p._version) for p in model.parameters())
        changed, self.held = mark != self.held, mark
        self.record("sync_weights", changed=changed)
        return changed

    def wake(self) -> None:
        self.record("wake")

    def sleep(self) -> None:
        self.record("sleep")

    def generate(self, model: nn.Module, prompts: Sequence[Prompt] | Sequence[list[int]], params: SamplingParams,
                 *, synced: bool = False, progress: str | None = None) -> Generations:
        self.record("generate", prompts=len(prompts), temperature=params.temperature)
        return self.inner.generate(model, prompts, params, synced=synced, progress=progress)

    def record(self, call: str, **info: Any) -> None:
        if self.settings.log:
            with open(self.settings.log, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"call": call, "rank": int(os.environ.get("RANK", "0")), **info}) + "\n")
