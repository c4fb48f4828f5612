"""The ``hf`` rollout engine's own section (``hf_generate:``): the KV cache's kind and a compiled decode step,
and the ``generate`` arguments they make (``rollout/engine.py``'s ``HFEngine`` reads them); its sampler
(:class:`InverseCDFSampler`) and the sampling arguments of a :class:`SamplingParams` (:func:`sampling_kwargs`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from alignkit.config.schema import f
from alignkit.config.sections import register_section
from alignkit.errors import ConfigError
from alignkit.models.generation import SamplingParams


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


class InverseCDFSampler:
    """A logits processor that draws the next token itself: temperature, top-k and top-p as Hugging Face's
    warpers define them, then ONE uniform number per row looked up in the cumulative distribution
    (inverse-CDF sampling, an exact draw from the same categorical). It returns 0 at the drawn token and
    -inf elsewhere, so ``generate``'s greedy step takes it. ``torch.multinomial`` draws an exponential
    variate for every vocabulary entry of every row instead: on CPU that was a quarter of a rollout
    (6 ms a step at 32 x 8192, measured)."""

    def __init__(self, temperature: float, top_k: int = 0, top_p: float = 1.0,
                 seeds: Sequence[int] | None = None, record: bool = False) -> None:
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        #: with ``record``: per decoding step, the ``(B, 1)`` log-prob of each row's drawn token under the tempered
        #: softmax of the step's logits (top-k / top-p not applied: the training forward's log-probs), kept on the
        #: device until :meth:`logps`
        self.temperature, self.steps = temperature, [] if record else None

        #: one generator per row, seeded with its request's seed (``rollout/seeds.py``): row i's t-th token
        #: uses the t-th number of its own stream whatever rows share its batch; None: the global generator
        self.generators = None if seeds is None else [torch.Generator().manual_seed(s) for s in seeds]

        self.warpers: list[Any] = [TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
        if top_k:
            self.warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        raw = scores
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        probs = torch.softmax(scores.float(), dim=-1)
        cdf = probs.cumsum(dim=-1)
        # u in (0, 1] times the total: the first index whose cumulative mass reaches it has mass > 0
        u = (1.0 - self._uniform(cdf)) * cdf[:, -1:]
        token = torch.searchsorted(cdf, u).clamp_(max=cdf.shape[1] - 1)
        if self.steps is not None:
            self.steps.append(self._drawn_logps(raw, probs, token))
        return torch.full_like(scores, float("-inf")).scatter_(1, token, 0.0)

    def _drawn_logps(self, raw: torch.Tensor, probs: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """``(B, 1)`` log softmax(z / T) at the drawn tokens: the sampling softmax's own where only the temperature
        warped it (a drawn token has mass > 0: no log 0), else z_t / T - logsumexp(z / T) of the raw logits."""
        if len(self.warpers) <= int(self.temperature != 1.0):
            return probs.gather(1, token).log()
        z = raw.float() / self.temperature
        return z.gather(1, token) - torch.logsumexp(z, dim=-1, keepdim=True)

    def logps(self) -> torch.Tensor:
        """``(B, steps)`` the recorded log-probs (``record``), one column per decoding step."""
        if self.steps is None:
            raise ValueError("the sampler was built without record=True")
        return torch.cat(self.steps, dim=1)

    def _uniform(self, cdf: torch.Tensor) -> torch.Tensor:
        """``(B, 1)`` uniforms in [0, 1) for the rows of ``cdf``: from each row's generator (drawn on the CPU,
        where a seeded stream is the same on every machine, then copied to ``cdf``'s device), else from the
        global one."""
        rows = cdf.shape[0]
        if self.generators is None:
            return torch.rand(rows, 1, device=cdf.device, dtype=cdf.dtype)
        if len(self.generators) != rows:
            raise ValueError(f"{len(self.generators)} seeds for {rows} rows")
        u = torch.cat([torch.rand(1, 1, generator=g, dtype=cdf.dtype) for g in self.generators])
        return u.to(cdf.device, non_blocking=True)


#: ``generate`` arguments that switch off the logits processors a generation config can ask for (transformers'
#: ``_get_logits_processor``); min_length 0 and forced EOS off: a rollout's length is ``max_new_tokens`` alone
PROCESSORS_OFF: dict[str, Any] = {
    "repetition_penalty": None, "encoder_repetition_penalty": None, "no_repeat_ngram_size": None,
    "encoder_no_repeat_ngram_size": None, "bad_words_ids": None, "sequence_bias": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None, "guidance_scale": None, "min_length": 0, "min_new_tokens": None,
    "renormalize_logits": False, "remove_invalid_values": False}


def sampling_kwargs(params: SamplingParams, seeds: Sequence[int] | None = None) -> dict[str, Any]:
    """``generate`` arguments of ``params``: greedy decoding, or sampling through :class:`InverseCDFSampler`
    (greedy over its one-hot scores; ``seeds``: one per row, its own stream; recording the drawn tokens' log-probs
    where ``params.logprobs``), with the generation config's own sampling settings switched off, and so every logits
    processor a model's ``generation_config.json`` may turn on (Qwen2.5's sets ``repetition_penalty: 1.05``): the
    sampled distribution is the policy's (what the trainer's forward scores), greedy is its argmax."""
    from transformers import LogitsProcessorList

    off: dict[str, Any] = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None, **PROCESSORS_OFF}
    if params.temperature <= 0:
        return off
    return {**off, "logits_processor": LogitsProcessorList(
        [InverseCDFSampler(params.temperature, params.top_k, params.top_p, seeds, record=params.logprobs)])}
