"""The typed run configuration: one dataclass per YAML section.

Every field has a docstring-like ``help`` in its metadata and, where it matters, a range (``ge`` / ``gt`` / ``le``).
Choices are ``Literal`` types. Cross-field rules (batch arithmetic, algorithm needs) live in
:mod:`alignkit.config.loader` and run once at load time. The sections of single algorithms (``dpo``, ``reward``,
``sft``, ...) live next to their algorithm files, registered in :mod:`alignkit.config.sections`, read with
``cfg.section(DPOConfig)``.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, TypeVar, Union

from alignkit.config.sections import ALGORITHMS, NOT_REGISTERED, SECTIONS, section_name
from alignkit.errors import ConfigError

T = TypeVar("T")


def f(default: Any = None, help: str = "", **rules: Any) -> Any:  # noqa: A002 - mirrors argparse
    """A dataclass field carrying its help text and range rules (``ge``, ``gt``, ``le``)."""
    if isinstance(default, (list, dict)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata={"help": help, **rules})
    return field(default=default, metadata={"help": help, **rules})


def subsection(cls: type, help: str = "") -> Any:  # noqa: A002
    """A nested section field (``model:``, ``distributed.ddp:``) holding its defaults when absent."""
    return field(default_factory=cls, metadata={"help": help})


@dataclass
class LoraConfig:
    r: int = f(16, "LoRA rank.", gt=0)
    alpha: float = f(32.0, "LoRA alpha (scaling = alpha / r).", gt=0)
    dropout: float = f(0.05, "Dropout on the LoRA branch.", ge=0, le=1)
    target_modules: list[str] = f(["q_proj", "k_proj", "v_proj", "o_proj"], "Module names (suffixes) that get adapters.")


@dataclass
class ModelConfig:
    name_or_path: str = f("", "Hub id or local directory of the model (from_pretrained).")
    tokenizer: Optional[str] = f(None, "Tokenizer path; defaults to model.name_or_path.")
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = f(
        "auto", "Compute dtype: auto = bf16 if the GPU supports it, else fp16; fp32 on CPU."
    )
    gradient_checkpointing: bool = f(False, "Recompute activations in backward to save memory.")
    compute_weights: Literal["cast", "autocast"] = f(
        "cast", "How a bf16 run computes with the trained model (full fine-tuning, single / ddp / fsdp): cast = the "
        "optimizer steps fp32 master weights and the forward and backward run a bf16 copy of them, refreshed once per "
        "optimizer step (FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32); gradients accumulated "
        "and all-reduced in fp32; losses in fp32 under autocast); autocast = the forward runs the fp32 weights under "
        "autocast, which casts every weight again in every micro-batch (a bf16 SFT step of the 24-layer op-count "
        "model dispatches 1,743 cast and copy ops under autocast, 258 under cast: benchmarks/README.md). fsdp: autocast turns distributed.fsdp.mixed_precision off. "
        "LoRA, fp16 and fp32 runs, and DeepSpeed (its own bf16 engine), are unaffected."
    )
    attn_implementation: Optional[str] = f(
        "auto", "Attention kernel. auto (or sdpa): PyTorch SDPA for padded batches; a packed row (data.packing, "
        "DPO/reward pairs) attends within each example through flash-attention's varlen kernel when flash_attn is "
        "installed (CUDA, bf16/fp16), else torch's varlen_attn where torch has it, else one SDPA call per example "
        "(the CPU's fastest); the start-up log names the kernel. Any other value (eager, flash_attention_2, ...) is "
        "passed to from_pretrained as is; flash_attention_2 without flash_attn or on a CPU is an error before any "
        "model loads."
    )
    trust_remote_code: bool = f(False, "Allow model code from the hub/local dir to run. Off by default.")
    lora: Optional[LoraConfig] = f(None, "LoRA adapters through peft; null = full fine-tuning.")
    freeze: list[str] = f([], "Parameters kept frozen (full fine-tuning): regular expressions searched in each "
                          "parameter's name, e.g. ['embed_tokens', 'layers\\.0\\.']; no gradient, no optimizer state, "
                          "saved unchanged (LLaMA-Factory's finetuning_type: freeze). One matching nothing, or beside "
                          "model.lora, is an error.")
    ref_name_or_path: Optional[str] = f(None, "Reference model for DPO/PPO; defaults to the policy start.")
    kind: str = f("auto", "The policy's model kind (models/kinds.py): lm, vlm, diffusion, or one a plugin registers; "
                  "auto = the algorithm's (diffusion for flow_sft; vlm for a vision-language model, else lm).")


@dataclass
class DataConfig:
    train: list[str] = f([], "Training data: files (.jsonl / .json / .parquet), load_from_disk folders, Hub names "
                         "(org/name) or builtin:NAME; a list of {path, weight} mixes them by weight.")
    train_weights: list[float] = f([], "Mixture weights of data.train's entries (what {path, weight} sets); "
                                   "empty = every example once.")
    train_split: str = f("train", "Split of a Hub name or a load_from_disk folder in data.train.")
    train_config: Optional[str] = f(None, "Config (subset) of a Hub name in data.train.")
    eval: list[str] = f([], "Evaluation data (as data.train); empty = no evaluation.")
    eval_split: str = f("test", "Split of a Hub name or a load_from_disk folder in data.eval.")
    eval_config: Optional[str] = f(None, "Config (subset) of a Hub name in data.eval.")
    num_proc: int = f(1, "Processes that tokenise a data set the first time (the result is cached).", gt=0)
    cache_dir: Optional[str] = f(None, "Where tokenised data sets are cached; default $ALIGNKIT_DATA_CACHE or "
                                 "~/.cache/alignkit/data. Must be shared by the nodes of a run or it is "
                                 "prepared once per node.")
    streaming: bool = f(False, "Read data.train as a stream sharded across ranks (no preparation, in file "
                        "order); needs training.max_steps. Evaluation data is prepared as usual.")
    max_length: int = f(512, "Longest tokenized example; longer ones are truncated.", gt=0)
    packing: bool = f(False, "SFT: pack short examples into rows of max_length (padding-free).")
    pack_multiple_of: int = f(
        1, "SFT packing: pad each packed row up to a multiple of this many tokens (one padding segment that attends "
        "to itself and that no loss reads), so the row lengths fall into few buckets. With training.torch_compile "
        "and a value > 1 the decoder blocks compile with static shapes, once per bucket (at most max_length / N "
        "compiles, e.g. 256); 1 = exact lengths, compiled with dynamic shapes (one compile for every length).", ge=1
    )
    skip_invalid: bool = f(False, "Skip malformed rows (counted in the log) instead of failing.")
    chat_template: bool = f(
        False, "Preference data: render string prompt/response rows through the tokenizer's chat template "
        "(one user and one assistant turn), as message-list rows always are."
    )
    prompt_column: str = f("prompt", "Online algorithms: the column of the prompt in data.train / data.eval "
                           "(GSM8K: question); the other columns reach the reward functions by name.")
    system_prompt: Optional[str] = f(None, "Online algorithms: a system turn before each string prompt (the chat "
                                     "template renders it; without one it is the prompt's first paragraph).")
    num_workers: int = f(0, "DataLoader worker processes.", ge=0)
    max_train_examples: Optional[int] = f(None, "Use only the first N training rows.", gt=0)
    max_eval_examples: Optional[int] = f(None, "Use only the first N evaluation rows.", gt=0)
    image_root: Optional[str] = f(None, "Image-text rows (vlm_sft): folder their relative image paths start from; "
                                  "null = the data file's folder.")

    @classmethod
    def read_raw(cls, raw: dict[str, Any], prefix: str) -> dict[str, Any]:
        """``train: [{path, weight}, ...]`` (or one mapping) -> ``train`` paths and ``train_weights``."""
        train = raw.get("train")
        if isinstance(train, dict):
            train = [train]
        if not isinstance(train, list) or not any(isinstance(x, dict) for x in train):
            return raw
        if raw.get("train_weights"):
            raise ConfigError(f"{prefix}.train_weights: give weights in {prefix}.train's entries or here, not both")
        paths, weights = [], []
        for i, item in enumerate(train):
            key = f"{prefix}.train[{i}]"
            item = {"path": item} if isinstance(item, str) else item
            if not isinstance(item, dict):
                raise ConfigError(f"{key}: expected a path or a mapping {{path, weight}}, got {item!r}")
            unknown = sorted(set(item) - {"path", "weight"})
            if unknown:
                close = difflib.get_close_matches(str(unknown[0]), ["path", "weight"], n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"{key}: unknown key {unknown[0]!r}{hint}; an entry has path and weight")
            if not isinstance(item.get("path"), str) or not item["path"]:
                raise ConfigError(f"{key}.path: required (a file, folder, Hub name or builtin:NAME)")
            weight = item.get("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0 \
                    or not math.isfinite(weight):
                raise ConfigError(f"{key}.weight: expected a number > 0, got {weight!r}")
            paths.append(item["path"])
            weights.append(float(weight))
        return {**raw, "train": paths, "train_weights": weights}

    def __post_init__(self) -> None:
        if self.train_weights and len(self.train_weights) != len(self.train):
            raise ConfigError(f"data.train_weights: {len(self.train_weights)} weights for {len(self.train)} "
                              "data.train entries; give one weight per entry")
        if any(not (w > 0 and math.isfinite(w)) for w in self.train_weights):
            raise ConfigError(f"data.train_weights: every weight must be a number > 0, got {self.train_weights}")


@dataclass
class TrainingConfig:
    per_device_batch_size: Optional[int] = f(None, "Examples per process per micro-batch.", gt=0)
    global_batch_size: Optional[int] = f(
        None, "Examples per optimizer step over all processes (= per_device x accumulation x world).", gt=0
    )
    gradient_accumulation_steps: int = f(1, "Micro-batches per optimizer step.", gt=0)
    learning_rate: float = f(
        1e-5, "Peak learning rate (before lr_scaling); at most 1.0: fine-tuning uses ~1e-7 .. 1e-3, and a far "
        "larger value overflows AdamW's update (1e38 does in fp32).", gt=0, le=1.0
    )
    lr_scaling: Literal["none", "linear", "sqrt"] = f("none", "Scale learning_rate by (global batch / "
                                                      "reference_batch_size) or its square root.")
    reference_batch_size: Optional[int] = f(None, "Global batch the learning_rate was tuned for.", gt=0)
    lr_scheduler: Literal["constant", "linear", "cosine"] = f("cosine", "Decay after warmup.")
    warmup_steps: int = f(0, "Linear warmup in optimizer steps.", ge=0)
    warmup_ratio: float = f(0.0, "Warmup as a fraction of total optimizer steps (if warmup_steps=0).", ge=0, le=1)
    min_lr_ratio: float = f(0.0, "Floor of the decay as a fraction of the peak lr.", ge=0, le=1)
    max_steps: Optional[int] = f(None, "Optimizer steps to run; overrides epochs.", gt=0)
    epochs: float = f(1.0, "Passes over the training data (if max_steps is not set).", gt=0)
    max_grad_norm: float = f(1.0, "Clip the global gradient norm; 0 disables clipping.", ge=0)
    weight_decay: float = f(0.0, "AdamW weight decay (not applied to biases and norms).", ge=0)
    adam_beta1: float = f(0.9, "AdamW beta1.", ge=0, le=1)
    adam_beta2: float = f(0.999, "AdamW beta2.", ge=0, le=1)
    adam_epsilon: float = f(1e-8, "AdamW epsilon.", gt=0)
    torch_compile: bool = f(
        False, "Compile each trainable model's decoder blocks with torch.compile (regional compilation: one compile "
        "serves every block; dynamic shapes serve every sequence length, or with data.pack_multiple_of > 1 static "
        "shapes, one compile per bucket of packed lengths; a packed row's boundaries never recompile a block). The "
        "first step pays the compile (~1 min on 2 CPU cores; CPU needs a C++ compiler); single, ddp and fsdp "
        "strategies. Same losses to round-off. Off by default: whether it wins on a GPU has not been measured yet."
    )
    fused_layers: bool = f(
        False, "Train Llama-family models (Llama, Mistral, Qwen2/3, and the LLaVA language model) with memory-lean "
        "SwiGLU MLP and RMSNorm forwards: the same math and GEMMs, but the MLP keeps 2 of its 4 intermediate "
        "tensors for backward (the other two are recomputed) and RMSNorm no fp32 copy; ~25% fewer activation bytes. "
        "single, ddp and fsdp strategies (DeepSpeed's per-module parameter hooks keep the plain forward); "
        "LoRA-wrapped projections keep theirs. Same losses and gradients to round-off (like any kernel change, "
        "round-off that a long run can amplify: opt-in)."
    )
    liger_kernel: bool = f(
        False, "SFT: compute the LM head and cross-entropy with Liger-Kernel's fused linear cross-entropy (Triton, "
        "CUDA only; pip install 'alignkit[liger]'): gradients in the forward, no logits recompute. Off: the built-in "
        "chunked head (the same loss to round-off). Asking for it on a CPU, without the package or for another "
        "algorithm is an error before any model loads."
    )
    liger_layers: bool = f(
        False, "Train Llama and Qwen2 models with Liger-Kernel's RMSNorm, SwiGLU MLP and RoPE (Triton, CUDA only; "
        "pip install 'alignkit[liger]'), applied by Liger's own apply_liger_kernel_to_llama / _qwen2 on each trained "
        "model; any algorithm, beside training.liger_kernel's fused head or alignkit's chunked one. Not with "
        "training.fused_layers (the same forwards). Asking for it on a CPU or without the package is an error before "
        "any model loads."
    )
    optimizer_impl: Literal["auto", "fused", "foreach", "for_loop"] = f(
        "auto", "torch AdamW's implementation: fused = one kernel per parameter (no temporaries, fastest on CPU "
        "and GPU), foreach = grouped ops (a state-sized temporary), for_loop = one op at a time. auto = fused "
        "under the single and ddp strategies, foreach under fsdp and deepspeed (sharded or flattened "
        "parameters). Same update to round-off."
    )
    seed: int = f(42, "Seed for data order, init of new heads and dropout.")
    eval_steps: Optional[int] = f(None, "Evaluate every N optimizer steps (and at the end).", gt=0)
    eval_before_train: Optional[bool] = f(
        None, "Evaluate the untrained model before the first step, logged as step 0 (eval/*), so every eval curve "
        "starts at the starting value. null (default) = whenever the run has eval data; true without eval data "
        "(data.eval) is one warning line. Not repeated by a resumed run; the step-0 eval leaves the random state "
        "alone, so training is the same with it off.")
    eval_batch_size: Optional[int] = f(None, "Per-device eval batch; defaults to per_device_batch_size.", gt=0)
    nonfinite: Literal["skip", "stop"] = f(
        "skip", "A loss or gradient norm that is not finite on any rank: skip = that optimizer step is dropped "
        "(weights and optimizer state untouched, the step still counts), stopping with an error after "
        "max_nonfinite_steps in a row; stop = stop at the first one. fp16's loss-scaler skips are separate."
    )
    max_nonfinite_steps: int = f(5, "Consecutive skipped non-finite steps after which training stops.", gt=0)


@dataclass
class DDPConfig:
    find_unused_parameters: bool = f(False, "Let DDP tolerate parameters without gradients.")
    bucket_cap_mb: float = f(25.0, "Gradient bucket size in MB.", gt=0)
    gradient_as_bucket_view: bool = f(True, "Gradients alias the comm buckets (saves memory).")
    broadcast_buffers: bool = f(False, "Broadcast module buffers from rank 0 every forward.")
    static_graph: bool = f(False, "Tell DDP the graph never changes between iterations.")


@dataclass
class FSDPConfig:
    reshard_after_forward: bool = f(
        True,
        "Free each layer's gathered parameters after its forward (ZeRO-3-like, least memory); "
        "false keeps them until backward (ZeRO-2-like: more memory, one all-gather less per layer).",
    )
    mixed_precision: bool = f(
        True,
        "When model.dtype resolves to bf16/fp16, FSDP casts the fp32 parameter shards to it for compute "
        "(MixedPrecisionPolicy) instead of autocast; false = fp32 parameters under autocast (as "
        "model.compute_weights=autocast makes it).",
    )
    reduce_dtype: Literal["fp32", "compute"] = f(
        "fp32", "Dtype of the gradient reduce-scatter under mixed_precision: fp32 (exact) or the compute dtype."
    )
    cpu_offload: bool = f(False, "Keep parameter shards, gradients and optimizer state in host memory (CPUOffloadPolicy).")


@dataclass
class DeepSpeedConfig:
    zero_stage: Optional[int] = f(
        None, "ZeRO stage 0-3; null = the stage in config_path, else 2.", ge=0, le=3
    )
    offload_optimizer: bool = f(False, "Keep optimizer states (and their step) on the CPU (ZeRO 1-3).")
    offload_param: bool = f(False, "Keep parameters on the CPU between uses (ZeRO-3 only).")
    config_path: Optional[str] = f(
        None,
        "A DeepSpeed JSON (e.g. configs/deepspeed/zero3.json). Its \"auto\" values are filled from training.* "
        "and model.dtype; a value that disagrees with them is an error. Its optimizer (AdamW) and scheduler (Warmup*LR) "
        "sections and concrete batch/clipping/precision values are read into training.* / model.dtype where unset.",
    )


@dataclass
class DistributedConfig:
    strategy: Literal["auto", "single", "ddp", "fsdp", "deepspeed"] = f(
        "auto",
        "auto = single in one process; under a launcher the memory estimate against the device memory picks "
        "ddp, else ZeRO-2-like, else ZeRO-3-like (deepspeed stage 2/3 where importable on GPUs, else fsdp "
        "without/with resharding; see `alignkit estimate`); fsdp = PyTorch FSDP2; deepspeed = ZeRO (optional extra).",
    )
    backend: Literal["auto", "nccl", "gloo"] = f("auto", "auto = nccl on CUDA, gloo on CPU.")
    timeout_minutes: float = f(30.0, "Collective timeout.", gt=0)
    shard_frozen: Union[bool, Literal["auto"]] = f(
        "auto",
        "Frozen models (DPO reference, reward/cost models): auto = replicated on every rank unless the memory "
        "estimate says they would not fit the device and sharding them helps (fsdp, deepspeed zero_stage 3 only); "
        "true = always shard them under those engines; false = always replicate. ddp, single and deepspeed "
        "stages 0-2 always replicate.",
    )
    preflight_timeout_s: float = f(
        60.0, "Before training, every rank must reach a first collective within this many seconds "
        "(a stuck or unreachable rank is named), and torch/transformers/alignkit versions and backend must match.",
        gt=0,
    )
    ddp: DDPConfig = subsection(DDPConfig, "DistributedDataParallel options.")
    fsdp: FSDPConfig = subsection(FSDPConfig, "FSDP2 (fully_shard) options, used when strategy=fsdp.")
    deepspeed: DeepSpeedConfig = subsection(DeepSpeedConfig, "DeepSpeed ZeRO options, used when strategy=deepspeed.")


@dataclass
class CheckpointConfig:
    save_steps: Optional[int] = f(None, "Save every N optimizer steps (and at the end).", gt=0)
    save_total_limit: Optional[int] = f(None, "Keep only the newest N checkpoints.", gt=0)
    resume_from: Optional[str] = f(None, "null | latest | PATH to a checkpoint-STEP directory.")
    resume_weights_only: bool = f(
        False, "Start a NEW run (step 0, a fresh optimizer and schedule) from the trained weights of resume_from, "
        "e.g. a DPO run from an SFT checkpoint; without it resuming a checkpoint of another algorithm, model or "
        "data is an error."
    )
    overwrite_output_dir: bool = f(
        False, "A new run (no resume_from, or resume_weights_only) into an output_dir that holds another run "
        "(logged steps, checkpoints, a final model): false = refuse in one line; true = first rename that folder "
        "to OUTPUT_DIR.old-N beside it (moved aside, nothing deleted: remove it yourself when not needed)."
    )
    save_final: bool = f(True, "Write the final model to output_dir/final.")
    save_each_epoch: bool = f(False, "Also write the model at the end of every epoch to output_dir/epoch_N/ (Hugging "
                              "Face format; the adapter alone with LoRA), besides the step checkpoints.")
    save_on_interrupt: bool = f(
        True, "Ctrl-C or SIGTERM (a scheduler's preemption) during training: save a checkpoint at the end of the "
        "current step (online: iteration) and exit 130 / 143 with one line naming it and the resume command "
        "(checkpoint.resume_from=latest); a second signal stops at once. false = the signal's usual effect.")


@dataclass
class LoggingConfig:
    logging_steps: int = f(10, "Log metrics every N optimizer steps.", gt=0)
    logging_first_step: bool = f(
        False, "Also log the first optimizer step (an online run: its first iteration), whose loss is the untrained "
        "model's on the first batch, so the training curves start where training starts (the demo sets it).")
    report_to: list[str] = f(["console", "jsonl"], "Any of console, jsonl, tensorboard, wandb.")
    run_name: Optional[str] = f(None, "Name for W&B / TensorBoard; defaults to output_dir's name.")
    wandb_project: str = f("alignkit", "W&B project (W&B runs offline when WANDB_MODE=offline).")
    progress_bar: Literal["auto", "on", "off"] = f("auto", "auto = only when stdout is a terminal.")
    plot: bool = f(True, "At the end of a run draw its metrics.jsonl to output_dir/plots/summary.png (needs jsonl).")


@dataclass
class HubConfig:
    push_to_hub: bool = f(
        False, "At the end of the run (rank 0, after output_dir/final is saved) upload final/ with its model card "
        "to the Hugging Face Hub repo hub.repo_id (created if missing). The token comes from huggingface_hub's "
        "usual places (HF_TOKEN, or `hf auth login`); a failed push is one line and the run still exits 0, "
        "its files complete.")
    repo_id: Optional[str] = f(None, "The Hub model repo, org/name (or name: under your account); "
                               "required by push_to_hub.")
    private: bool = f(False, "Create the repo private (an existing repo keeps its visibility).")
    revision: Optional[str] = f(None, "Branch to push to; null = the repo's default branch (main).")

    def __post_init__(self) -> None:
        if self.push_to_hub and not self.repo_id:
            raise ConfigError("hub.repo_id: required when hub.push_to_hub is true (org/name, or name for your "
                              "own account)")
        if self.repo_id is not None:
            from huggingface_hub.utils import HFValidationError, validate_repo_id

            try:
                validate_repo_id(self.repo_id)
            except HFValidationError as e:
                raise ConfigError(f"hub.repo_id: {e}") from None


@dataclass
class RunConfig:
    algorithm: str = f("sft", "Which algorithm to run (sft, ...).")
    plugins: list[str] = f([], "Python modules imported before the config is read, e.g. [my_pkg.my_algo]: they "
                           "register algorithms, model kinds, reward functions or config sections of their own.")
    output_dir: str = f("runs/alignkit", "Where checkpoints, logs and the final model go.")
    model: ModelConfig = subsection(ModelConfig, "The trained (policy) model.")
    data: DataConfig = subsection(DataConfig, "Data files and tokenization.")
    training: TrainingConfig = subsection(TrainingConfig, "Optimisation and batch arithmetic.")
    distributed: DistributedConfig = subsection(DistributedConfig, "Strategy and process group.")
    checkpoint: CheckpointConfig = subsection(CheckpointConfig, "Saving and resuming.")
    logging: LoggingConfig = subsection(LoggingConfig, "Metrics sinks.")
    hub: HubConfig = subsection(HubConfig, "Publishing the final model to the Hugging Face Hub.")
    #: per-algorithm sections (``dpo``, ``reward``, ``sft``, ...) by YAML key; see config/sections.py
    sections: dict[str, Any] = field(default_factory=dict, repr=False, metadata={"internal": True})

    def section(self, cls: type[T]) -> T:
        """The algorithm section ``cls`` (a registered dataclass, e.g. ``cfg.section(DPOConfig)``): what the
        YAML's ``dpo:`` gave, or its defaults when the YAML has none."""
        name = section_name(cls)
        sections = self.__dict__.setdefault("sections", {})
        if name not in sections:
            sections[name] = cls()
        return sections[name]

    def __getattr__(self, name: str) -> Any:
        """``cfg.dpo`` etc. for scripts, tests and the REPL (it reads like the YAML); library code calls
        :meth:`section`, which is typed."""
        if name.startswith("__") or name == "sections":
            raise AttributeError(name)
        if not ALGORITHMS.names():  # else ``cfg.dpo`` would read as "no section 'dpo'"
            raise AttributeError(f"RunConfig.{name}: {NOT_REGISTERED}")
        if name not in SECTIONS:
            raise AttributeError(f"RunConfig has no section {name!r}")
        return self.section(SECTIONS.get(name))
