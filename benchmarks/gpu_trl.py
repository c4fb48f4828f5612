"""One TRL run of ``bench_gpu.py`` (``../shared/gpu/trl_child.py``'s run, plus LoRA, gradient checkpointing,
gradient accumulation and GRPO): stamped at the end of every optimizer step by a callback that synchronises
CUDA first, with the step's tokens counted from its inputs (SFT: the attention mask's sum, or every input
id of a padding-free row; DPO: prompt tokens twice, chosen and rejected once; GRPO: completions). The
counts stay on the device until the run ends, so counting adds no host sync of its own.

usage: python3 gpu_trl.py SPEC_JSON   (SPEC: algo sft|dpo|grpo, variant padded|padding_free|base, model, data,
out, steps, batch, accum, max_length, lora, gc; GRPO: prompts, num_generations, max_new_tokens; optional
``attn``: sdpa (default) | varlen (``trl_varlen.py``: the only correct padding-free rows without flash-attn),
``liger``: ``use_liger_kernel=True``, ``bf16_frozen``: the DPO reference / the LoRA base held in bf16 as
alignkit holds them, instead of TRL's fp32)
Writes ``spec["out"]``: step_end (perf_counter s), step_tokens, peak_mem_mib, setup_s, trl, optim, attention,
frozen_dtype, liger.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import bench_data  # the script's folder is on sys.path (stdlib only)
import torch
import trl
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def attention(spec: dict[str, Any], cuda: bool) -> tuple[str, str]:
    """(attn_implementation to load with, the kernel a packed row runs: recorded in every row)."""
    if spec.get("attn", "sdpa") == "sdpa":
        wrong = spec["variant"] == "padding_free"
        return "sdpa", "SDPA" + (" (packed rows attend across examples: not a correct training)" if wrong else "")
    import trl_varlen

    kernel = "torch varlen_attn" if cuda and trl_varlen.torch_varlen() is not None else "SDPA per example"
    return trl_varlen.register(), f"{trl_varlen.NAME}: {kernel}"


def frozen_dtype(spec: dict[str, Any]) -> torch.dtype:
    """The DPO reference's / LoRA base's dtype: bf16 as alignkit holds them (``bf16_frozen``), else TRL's fp32."""
    return torch.bfloat16 if spec.get("bf16_frozen") else torch.float32


def common_args(spec: dict[str, Any], cuda: bool) -> dict[str, Any]:
    """The Trainer arguments every variant shares (trl_child.py's)."""
    base_dtype = frozen_dtype(spec) if spec.get("lora") else torch.float32  # peft keeps the adapters in fp32
    return dict(output_dir=str(Path(spec["out"]).with_suffix("")) + "_run", per_device_train_batch_size=spec["batch"],
                gradient_accumulation_steps=spec.get("accum", 1), learning_rate=spec.get("lr", 1e-5),
                lr_scheduler_type="constant", warmup_steps=0, max_steps=spec["steps"], seed=0, max_grad_norm=1.0,
                weight_decay=0.0, bf16=cuda, gradient_checkpointing=bool(spec.get("gc")), use_cpu=not cuda,
                report_to="none", logging_steps=10**6, save_strategy="no", eval_strategy="no",
                dataloader_num_workers=0, disable_tqdm=True, use_liger_kernel=bool(spec.get("liger")),
                model_init_kwargs={"dtype": base_dtype, "attn_implementation": attention(spec, cuda)[0]})


def build(spec: dict[str, Any], cuda: bool, callbacks: list[Any], count: Any) -> Any:
    """The trainer of ``spec`` whose ``training_step`` passes each micro-batch's inputs to ``count``."""
    algo, common = spec["algo"], common_args(spec, cuda)
    peft_config = None
    if spec.get("lora"):
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    tok = AutoTokenizer.from_pretrained(spec["model"])
    if algo == "grpo":
        from gpu_setup import letter_fraction

        rows = [json.loads(x) for x in Path(spec["prompts"]).read_text().splitlines() if x.strip()]
        ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows])
        args = trl.GRPOConfig(num_generations=spec["num_generations"], max_completion_length=spec["max_new_tokens"],
                              temperature=1.0, beta=0.0, num_iterations=1, **common)
        base, extra = trl.GRPOTrainer, {"reward_funcs": letter_fraction}
    else:
        rows = [json.loads(x) for x in (Path(spec["data"]) / f"{algo}.jsonl").read_text().splitlines() if x.strip()]
        ds = Dataset.from_list(rows)
        if algo == "sft":
            padding_free = spec["variant"] == "padding_free"
            # TRL refuses padding-free without packing while max_length is set: its own advice is None
            args = trl.SFTConfig(padding_free=padding_free, max_length=None if padding_free else spec["max_length"],
                                 **common)
            base = trl.SFTTrainer
        else:
            args = trl.DPOConfig(beta=0.1, loss_type=["sigmoid"], max_length=spec["max_length"], **common)
            base = trl.DPOTrainer
        extra = {"peft_config": peft_config} if peft_config else {}
        if algo == "dpo" and not peft_config and spec.get("bf16_frozen"):
            from transformers import AutoModelForCausalLM

            attn = common["model_init_kwargs"]["attn_implementation"]
            extra["ref_model"] = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16,
                                                                      attn_implementation=attn)

    class Counted(base):  # type: ignore[misc, valid-type]
        def training_step(self, model: Any, inputs: Any, *a: Any, **kw: Any) -> Any:
            count(inputs)
            return super().training_step(model, inputs, *a, **kw)

    return Counted(model=spec["model"], args=args, train_dataset=ds, processing_class=tok, callbacks=callbacks, **extra)


def token_counter(algo: str, pending: list[Any]) -> Any:
    """Appends each micro-batch's token count (a device tensor, or an int) to ``pending``."""

    def count(inputs: Any) -> None:
        if algo == "grpo":  # the raw rows (each prompt once per generation), or generated completions
            ids = inputs.get("completion_ids") if isinstance(inputs, dict) else None
            pending.append(len(inputs) if ids is None else int(ids.shape[0]))
        elif algo == "dpo":
            for k in ("prompt_attention_mask", "chosen_attention_mask", "rejected_attention_mask", "attention_mask"):
                if k in inputs:
                    pending.append(inputs[k].sum() * (2 if k == "prompt_attention_mask" else 1))
            if "input_ids" in inputs and "attention_mask" not in inputs and "chosen_attention_mask" not in inputs:
                pending.append(inputs["input_ids"].numel())
        elif "attention_mask" in inputs:
            pending.append(inputs["attention_mask"].sum())
        else:  # a padding-free row: every id is a token
            pending.append(inputs["input_ids"].numel())

    return count


def main() -> None:
    spec = json.loads(sys.argv[1])
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(int(spec.get("threads", 2)))
    rec: dict[str, Any] = {"side": "trl", "trl": trl.__version__, "spec": spec, "step_end": [], "step_tokens": []}
    pending: list[Any] = []
    per_step: list[list[Any]] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:  # after optimizer + scheduler
            if cuda:
                torch.cuda.synchronize()
            rec["step_end"].append(time.perf_counter())
            per_step.append(list(pending))
            pending.clear()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer = build(spec, cuda, [Stamp()], token_counter(spec["algo"], pending))
    if spec.get("attn") == "varlen":
        import trl_varlen

        trl_varlen.forget_each_forward(trainer.model)
    rec["setup_s"] = time.perf_counter() - t0
    rec["attention"] = attention(spec, cuda)[1]
    frozen = spec.get("lora") or spec["algo"] == "dpo"
    rec["frozen_dtype"] = str(frozen_dtype(spec)).replace("torch.", "") if frozen else None
    rec["liger"] = bool(spec.get("liger"))
    rec["optim"] = str(trainer.args.optim)
    trainer.train()
    rec["step_tokens"] = [sum(int(x) for x in step) for step in per_step]  # device counts read once, at the end
    rec["peak_mem_mib"] = (torch.cuda.max_memory_allocated() / 2**20 if cuda
                           else bench_data.peak_rss_mib())
    rec["peak_mem_kind"] = "cuda max_memory_allocated" if cuda else "CPU peak RSS"
    Path(spec["out"]).write_text(json.dumps(rec), encoding="utf-8")
    print(json.dumps({k: rec[k] for k in ("side", "trl", "peak_mem_mib", "setup_s", "optim", "attention")}))


if __name__ == "__main__":
    main()
