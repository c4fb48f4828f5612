"""The ``hf`` rollout engine's own section (``hf_generate:``): the KV cache's kind and a compiled decode step,
and the ``generate`` arguments they make (``rollout/engine.py``'s ``HFEngine`` reads them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from alignkit.config.schema import f
from alignkit.config.sections import register_section
from alignkit.errors import ConfigError


@register_section("hf_generate")
@dataclass
class HFGenerateConfig:
    """The ``hf`` engine's settings (``hf_generate:``): the KV cache's kind and a compiled decode step."""

    static_cache: bool = f(
        False, "Generate with transformers' static KV cache (cache_implementation=static): the cache is allocated "
        "once at prompt + max_new_tokens and reused, so every decode step has the same shapes (the condition for "
        "compile_decode). Greedy decoding gives the dynamic cache's tokens; sampling with the same seed gives the same "
        "draws except where float round-off of attention over the longer cache flips a draw at a probability "
        "boundary (1 of 64 tiny-model rows at 48 tokens); log-probs are the training forward's either way. "
        "benchmarks/bench_generate.py measures it.")
    compile_decode: bool = f(
        False, "With static_cache: torch.compile the decode step (transformers' CompileConfig; CUDA graphs on "
        "CUDA, inductor's default mode elsewhere). Compiles once per batch shape (seconds to minutes), so it pays "
        "only over many rollouts; off on CPU, where it loses (benchmarks/README.md).")

    def __post_init__(self) -> None:
        if self.compile_decode and not self.static_cache:
            raise ConfigError("hf_generate.compile_decode=true needs hf_generate.static_cache=true: a dynamic cache "
                              "grows every step, so the compiled decode step would recompile every token")


def cache_kwargs(settings: HFGenerateConfig, device: torch.device) -> dict[str, Any]:
    """``generate`` arguments of ``settings``: the static cache, and either a compiled decode step or none
    (transformers compiles a static-cache decode on CUDA by itself unless told not to)."""
    if not settings.static_cache:
        return {}
    if not settings.compile_decode:
        return {"cache_implementation": "static", "disable_compile": True}
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=False, dynamic=False,
                           mode="reduce-overhead" if device.type == "cuda" else "default")
    config._compile_all_devices = True  # transformers compiles only on accelerators unless asked
    return {"cache_implementation": "static", "compile_config": config}
