#!/usr/bin/env python
"""alignkit vs TRL, SFT and DPO, side by side in one run (the setup of /work/shared/BASELINES.md).

    python benchmarks/bench_sft_dpo.py                      # everything: tiny+small, sft+dpo, alignkit+TRL
    python benchmarks/bench_sft_dpo.py --quick --models tiny   # smoke test (few steps)
    python benchmarks/bench_sft_dpo.py --skip-trl            # alignkit only

The parent process prepares the models, the data and TRL's virtualenv, measures the machine's fp32
GEMM peak, then runs every variant in its OWN subprocess (so peak RSS is per variant) and collects
one ``BENCH_RESULT {json}`` line from each, then measures the GEMM peak again: MFU uses the higher
of the two (a busy moment only lowers a measurement), with a warning when they differ by > 10%.
alignkit children run with this interpreter (alignkit installed); TRL children run with
``benchmarks/results/.venv-trl`` (a clean venv: TRL is never a dependency of alignkit). Results:
``OUT/<timestamp>.json`` and ``OUT/<timestamp>.md``.

Measurement (identical on both sides): each child records, at the end of every optimizer step
(after the optimizer and LR-scheduler step), a ``time.perf_counter()`` stamp and the non-pad input
tokens that step processed (DPO: chosen and rejected sequences, prompt included). The timed window
runs from the end of the last warm-up step to the end of the last timed step, so it holds
everything the loop does for those steps (data loading, collation, forward, backward, optimizer).

This file's top level imports only the standard library: the TRL venv runs it too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import bench_data  # noqa: E402  (stdlib only)

RESULT_TAG = "BENCH_RESULT "
THREADS = 2
BATCH = 8
MAX_LENGTH = 256
LR = 1e-4
SEED = 0
#: (warm-up steps, timed steps) as in BASELINES.md; --quick uses QUICK_STEPS.
STEPS = {"tiny": (3, 20), "small": (1, 5)}
QUICK_STEPS = {"tiny": (1, 3), "small": (1, 1)}
LORA = {"r": 16, "alpha": 32, "dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
#: start and end GEMM peaks further apart than this (relative to the higher) get a warning
PEAK_SPREAD_WARN = 0.10
TRL_VERSION = "1.16.0"
TRL_PINS = ["transformers==5.23.0", "peft==0.21.2", "datasets", "accelerate"]
#: extra warm-up steps of the torch.compile variants
COMPILE_WARMUP = 2
#: large libraries a training process should import only when a run uses them (recorded per alignkit child)
HEAVY_MODULES = ("datasets", "pyarrow", "pandas", "matplotlib", "tensorboard", "torch.utils.tensorboard", "deepspeed",
                 "diffusers", "accelerate", "peft", "scipy", "sklearn", "wandb", "PIL", "torchvision")


# ====================================================================== variants
def variants(model: str, algo: str) -> list[dict[str, Any]]:
    """Every variant of one (model, algo). ``match`` pairs an alignkit variant with its TRL twin.

    ``policy_flops`` is the FLOPs per token per parameter of the policy update (6: full
    fine-tuning; 4: LoRA, the frozen base gets no weight gradients); ``ref_flops`` is 2 when a
    reference forward runs inside the timed window.
    """
    v: list[dict[str, Any]] = []
    if algo == "sft":
        v += [
            {"side": "alignkit", "name": "packed (padding-free)", "match": "padding_free", "packing": True},
            {"side": "alignkit", "name": "padded", "match": "baseline", "packing": False},
            {"side": "trl", "name": "baseline", "match": "baseline", "padding_free": False},
            # TRL's padding-free row attends across examples under SDPA (no flash-attn on CPU): it runs
            # trl_varlen.py's attention (SDPA per example, boundaries from position_ids), a correct training
            {"side": "trl", "name": "padding_free (varlen attention)", "match": "padding_free", "padding_free": True,
             "attn": "varlen"},
            # torch.compile, each side's opt-in: alignkit's training.torch_compile (decoder blocks, dynamic
            # shapes) on the packed variant, TRL's TrainingArguments.torch_compile on its padding-free one
            {"side": "alignkit", "name": "packed + torch_compile", "match": "compile", "packing": True,
             "compile": True, "cfg_extra": {"training": {"torch_compile": True}}},
            {"side": "trl", "name": "padding_free (varlen attention) + torch_compile", "match": "compile",
             "padding_free": True, "compile": True, "attn": "varlen"},
            # alignkit's opt-in training.fused_layers (memory-lean SwiGLU MLP / RMSNorm) on the packed variant
            {"side": "alignkit", "name": "packed + fused_layers", "match": "fused", "packing": True,
             "cfg_extra": {"training": {"fused_layers": True}}},
        ]
        for x in v:
            x.update(policy_flops=6, ref_flops=0, lora=False, precompute=False)
    else:
        v += [
            {"side": "alignkit", "name": "frozen reference model", "match": "baseline", "precompute": False, "lora": False},
            {"side": "alignkit", "name": "precompute_ref_logps", "match": "precompute", "precompute": True, "lora": False},
            {"side": "trl", "name": "baseline", "match": "baseline", "precompute": False, "lora": False},
            {"side": "trl", "name": "precompute_ref_log_probs", "match": "precompute", "precompute": True, "lora": False},
        ]
        if model == "tiny":
            v += [
                {"side": "alignkit", "name": "LoRA r16 (reference = adapters off)", "match": "lora", "precompute": False, "lora": True},
                {"side": "trl", "name": "LoRA r16", "match": "lora", "precompute": False, "lora": True},
            ]
        for x in v:
            x.update(policy_flops=4 if x["lora"] else 6, ref_flops=0 if x["precompute"] else 2)
    for x in v:
        x.update(model=model, algo=algo)
        x["id"] = f"{x['side']}-{algo}-{model}-{x['match']}"
    return v


# ====================================================================== children
def _child_env_setup() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(THREADS)



def _non_embedding_params(model: Any) -> int:
    """N of the MFU formula: every base-model parameter except the input embedding (LM head included);
    LoRA adapter weights are left out (they add well under 1% of the FLOPs)."""
    n = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name or "lora_" in name:
            continue
        n += p.numel()
    return n


def child_gemm(spec: dict[str, Any]) -> dict[str, Any]:
    """Best fp32 GEMM rate (2048^3, THREADS threads) and N for each model."""
    _child_env_setup()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(spec.get("repeats", 15)):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    params = {}
    for size, path in spec["models"].items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        params[size] = {"non_embedding": _non_embedding_params(model),
                        "total": sum(p.numel() for p in model.parameters())}
    return {"gemm_gflops": 2 * n**3 / best / 1e9, "gemm_best_s": best, "params": params,
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def child_alignkit(spec: dict[str, Any]) -> dict[str, Any]:
    """One alignkit run through ``load_config`` + ``run_train`` (the ``alignkit train`` path), with
    the trainer's algorithm instrumented to stamp every optimizer step.

    ``spec`` may override ``batch``, ``max_length`` and ``lr`` and add config sections (``cfg_extra``:
    ``{section: {key: value}}``, merged last), which is how ``bench_vlm.py`` runs ``vlm_sft`` here. The
    alignkit of this checkout (``REPO/src``) is imported, not whichever is installed."""
    if (REPO / "src" / "alignkit").is_dir():
        sys.path.insert(0, str(REPO / "src"))
    _child_env_setup()
    import torch  # noqa: F401
    import yaml

    import alignkit
    import alignkit.train.runner as runner
    from alignkit.config import load_config

    warm, timed = spec["warmup"], spec["timed"]
    out = Path(spec["run_dir"])
    cfg_raw: dict[str, Any] = {
        "algorithm": spec["algo"],
        "output_dir": str(out),
        "model": {"name_or_path": spec["model_path"], "dtype": "fp32", "attn_implementation": "sdpa",
                  "gradient_checkpointing": False},
        "data": {"train": [spec["data_path"]], "max_length": spec.get("max_length", MAX_LENGTH), "num_workers": 0},
        "training": {"per_device_batch_size": spec.get("batch", BATCH), "gradient_accumulation_steps": 1,
                     "learning_rate": spec.get("lr", LR),
                     "lr_scheduler": "constant", "warmup_steps": 0, "max_steps": warm + timed, "seed": SEED,
                     "max_grad_norm": 1.0, "weight_decay": 0.0},
        "distributed": {"strategy": "single"},
        "checkpoint": {"save_final": False},
        "logging": {"logging_steps": 1, "report_to": ["jsonl"], "progress_bar": "off"},
    }
    if spec["algo"] == "sft":
        cfg_raw["data"]["packing"] = spec["packing"]
        cfg_raw["sft"] = {"loss_on": spec["sft_loss_on"]}
    elif spec["algo"] == "dpo":
        cfg_raw["dpo"] = {"loss_type": "sigmoid", "beta": 0.1, "precompute_ref_logps": spec["precompute"],
                          "reference": "lora_base" if spec["lora"] else "model"}
    if spec.get("lora"):
        cfg_raw["model"]["lora"] = dict(LORA)
    for section, values in spec.get("cfg_extra", {}).items():
        cfg_raw.setdefault(section, {}).update(values)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    cfg_path = out / "bench.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg_raw, sort_keys=False), encoding="utf-8")
    cfg = load_config(cfg_path)

    rec: dict[str, Any] = {"step_end": [], "step_tokens": [], "step_loss_tokens": [], "precompute_s": 0.0,
                           "precompute_pairs": 0}
    pending = [0, 0]  # input tokens, loss units of the step so far

    class TimedTrainer(runner.OfflineTrainer):  # type: ignore[misc, valid-type]
        """Wraps the algorithm's hooks; the loop itself runs unchanged."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            algo = self.algo
            tokens_in, loss_units = algo.data.tokens_in, algo.data.loss_units
            on_step_end, before_training = algo.on_step_end, algo.before_training

            def counted_tokens_in(batch: Any) -> int:
                n = tokens_in(batch)
                pending[0] += n
                return n

            def counted_loss_units(batch: Any) -> int:
                n = loss_units(batch)
                pending[1] += n
                return n

            def stamped_on_step_end(ctx: Any) -> Any:  # after optimizer + scheduler step
                rec["step_end"].append(time.perf_counter())
                rec["step_tokens"].append(pending[0])
                rec["step_loss_tokens"].append(pending[1])
                pending[0] = pending[1] = 0
                return on_step_end(ctx)

            def timed_before_training(ctx: Any, train_set: Any, eval_set: Any) -> None:
                t0 = time.perf_counter()
                before_training(ctx, train_set, eval_set)
                model = ctx.models[ctx.models.primary]
                if spec.get("precompute"):
                    rec["precompute_s"] = time.perf_counter() - t0
                    rec["precompute_pairs"] = len(train_set) + len(eval_set)
                rec["n_params"] = _non_embedding_params(model)
                rec["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)

            algo.data.tokens_in, algo.data.loss_units = counted_tokens_in, counted_loss_units
            algo.on_step_end, algo.before_training = stamped_on_step_end, timed_before_training

    runner.OfflineTrainer = TimedTrainer
    runner.run_train(cfg)
    rec["peak_rss_mib"] = bench_data.peak_rss_mib()
    rec["heavy_modules"] = sorted(m for m in HEAVY_MODULES if m in sys.modules)
    # alignkit's own view (tokens_per_s of each logged step), as a cross-check of the stamps above
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    logged = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r.get("step", 0) > warm]
    rec["logged_tokens_per_s_mean"] = sum(logged) / len(logged) if logged else None
    rec["versions"] = {"alignkit": getattr(alignkit, "__version__", "?")}
    return rec


def child_trl(spec: dict[str, Any]) -> dict[str, Any]:
    """One TRL run (SFTTrainer / DPOTrainer from model and tokenizer paths), stamped by a callback."""
    _child_env_setup()
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    warm, timed = spec["warmup"], spec["timed"]
    rows = [json.loads(x) for x in Path(spec["data_path"]).read_text().splitlines() if x.strip()]
    dataset = Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    rec: dict[str, Any] = {"step_end": [], "step_tokens": [], "precompute_s": 0.0, "precompute_pairs": 0}
    pending = [0]

    class Stamp(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:  # after optimizer + scheduler
            rec["step_end"].append(time.perf_counter())
            rec["step_tokens"].append(pending[0])
            pending[0] = 0

    common = dict(
        output_dir=spec["run_dir"], per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, max_steps=warm + timed, seed=SEED,
        max_grad_norm=1.0, weight_decay=0.0, bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True,
        report_to="none", logging_steps=10**6, save_strategy="no", eval_strategy="no", dataloader_num_workers=0,
        disable_tqdm=True, max_length=MAX_LENGTH,
    )
    peft_config = None
    if spec["lora"]:
        from peft import LoraConfig

        peft_config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                                 target_modules=LORA["target_modules"], task_type="CAUSAL_LM")

    def count(inputs: Any) -> None:
        if "attention_mask" in inputs:
            pending[0] += int(inputs["attention_mask"].sum())
        else:  # padding-free: one row, no pad tokens
            pending[0] += int(inputs["input_ids"].numel())

    if spec["algo"] == "sft":
        base = trl.SFTTrainer
        if spec["padding_free"]:
            # TRL 1.16 refuses padding_free without packing while max_length is set ("not enforced"):
            # its advice is max_length=None, so the ~2% of rows longer than 256 tokens stay whole here.
            common["max_length"] = None
        if spec.get("attn") == "varlen":
            import trl_varlen

            common["model_init_kwargs"] = {"attn_implementation": trl_varlen.register()}
        args = trl.SFTConfig(padding_free=spec["padding_free"], torch_compile=bool(spec.get("compile")), **common)
        train = dataset.select_columns(["messages"])
    else:
        base = trl.DPOTrainer
        args = trl.DPOConfig(beta=0.1, loss_type=["sigmoid"], precompute_ref_log_probs=spec["precompute"], **common)
        train = dataset.select_columns(["prompt", "chosen", "rejected"])

    class Timed(base):  # type: ignore[misc, valid-type]
        def training_step(self, model: Any, inputs: Any, *a: Any, **kw: Any) -> Any:
            count(inputs)
            return super().training_step(model, inputs, *a, **kw)

        def _precompute_ref_logps(self, ds: Any, name: str, batch_size: int) -> Any:  # DPO only
            t0 = time.perf_counter()
            out = super()._precompute_ref_logps(ds, name, batch_size)
            rec["precompute_s"] += time.perf_counter() - t0
            rec["precompute_pairs"] += len(ds)
            return out

    trainer = Timed(model=spec["model_path"], args=args, train_dataset=train, processing_class=tokenizer,
                    peft_config=peft_config, callbacks=[Stamp()])
    if spec.get("attn") == "varlen":
        trl_varlen.forget_each_forward(trainer.model)
    rec["n_params"] = _non_embedding_params(trainer.model)
    rec["trainable_params"] = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    trainer.train()
    rec["peak_rss_mib"] = bench_data.peak_rss_mib()
    rec["versions"] = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}
    rec["trl_optim"] = str(args.optim)
    return rec


def correct(variant: dict[str, Any]) -> bool:
    """Whether a variant trains what it claims: TRL's padding-free rows only with a varlen attention."""
    return not (variant["side"] == "trl" and variant.get("padding_free") and variant.get("attn") != "varlen")


CHILDREN = {"gemm": child_gemm, "alignkit": child_alignkit, "trl": child_trl}


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm")


def op_breakdown(events: Any) -> dict[str, Any]:
    """Seconds of CPU time by kind from a torch.profiler ``key_averages()``: GEMMs (self time of the matmul
    ops), attention (SDPA kernels), the optimizer step (``Optimizer.step#...`` totals), the rest; plus the
    ten ops with the most self time."""
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS) / 1e6
    attention = sum(e.self_cpu_time_total for e in events
                    if "scaled_dot_product" in e.key or "flash_attention" in e.key) / 1e6
    optimizer = sum(e.cpu_time_total for e in events if e.key.startswith("Optimizer.step#")) / 1e6
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]
    return {"total_s": total, "gemm_s": gemm, "attention_s": attention, "optimizer_s": optimizer,
            "other_s": total - gemm - attention - optimizer,
            "top": [[e.key, e.self_cpu_time_total / 1e6, e.count] for e in top]}


def child_main(kind: str, spec_json: str) -> None:
    spec = json.loads(spec_json)
    if spec.get("profile"):  # --profile: where the child's CPU time goes (the profiler slows small ops a bit)
        import torch.profiler

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            result = CHILDREN[kind](spec)
        result["op_profile"] = op_breakdown(prof.key_averages())
    else:
        result = CHILDREN[kind](spec)
    sys.stdout.flush()
    print("\n" + RESULT_TAG + json.dumps(result), flush=True)


# ====================================================================== parent: setup
def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ensure_models(models_dir: Path, sizes: list[str]) -> dict[str, str]:
    """The BASELINES models (``build_tiny_model``), built once and reused (deterministic)."""
    paths = {}
    for size in sizes:
        path = models_dir / size
        if not (path / "config.json").exists() or not (path / "tokenizer.json").exists():
            log(f"building the {size} model in {path}")
            subprocess.run([sys.executable, "-c", "import sys; from alignkit.models.tiny import build_tiny_model; "
                            "build_tiny_model(sys.argv[1], size=sys.argv[2])", str(path), size], check=True)
        paths[size] = str(path)
    return paths


def ensure_trl_venv(venv: Path, extra: dict[str, str] | None = None) -> Path:
    """A clean venv with torch (the local CPU wheel) and TRL; returns its python. ``extra``: more packages a
    benchmark needs there, ``{import name: pip requirement}`` (installed into an existing venv too)."""
    py = venv / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "-q"]
    extra = extra or {}
    if py.exists():
        probe = subprocess.run([str(py), "-c", "import trl, peft, datasets, transformers, torch; print(trl.__version__)"],
                               capture_output=True, text=True)
        if probe.returncode == 0:
            missing = [req for mod, req in extra.items()
                       if subprocess.run([str(py), "-c", f"import {mod}"], capture_output=True).returncode != 0]
            if missing:
                log(f"installing {', '.join(missing)} into {venv}")
                subprocess.run(pip + missing, check=True)
            return py
    log(f"creating the TRL virtualenv {venv} (a few minutes, once)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    import importlib.metadata as md

    torch_version = md.version("torch").split("+")[0]
    subprocess.run(pip + [f"torch=={torch_version}"], check=True)
    if subprocess.run(pip + [f"trl=={TRL_VERSION}"] + TRL_PINS).returncode != 0:
        log(f"trl=={TRL_VERSION} is not installable here; taking the newest trl")
        subprocess.run(pip + ["trl"] + TRL_PINS, check=True)
    if extra:
        subprocess.run(pip + list(extra.values()), check=True)
    return py


def run_child(python: str, kind: str, spec: dict[str, Any], log_path: Path, timeout: float,
              script: Path | None = None) -> dict[str, Any]:
    """Run ``script --child KIND SPEC`` (default: this file) with ``python``; its ``BENCH_RESULT`` line."""
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory(prefix="bench-hf-") as hf_cache:
        env["HF_DATASETS_CACHE"] = hf_cache  # TRL caches precomputed ref log-probs there: never reuse them
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([python, str(script or Path(__file__).resolve()), "--child", kind, json.dumps(spec)],
                                  capture_output=True, text=True, env=env, cwd=str(REPO), timeout=timeout)
            stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            stderr = (e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")) + f"\nTIMEOUT after {timeout}s"
            rc = -1
        wall = time.perf_counter() - t0
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text(f"$ {kind} {json.dumps(spec)}\n--- stdout\n{stdout}\n--- stderr\n{stderr}\n", encoding="utf-8")
    lines = [x for x in stdout.splitlines() if x.startswith(RESULT_TAG)]
    if rc != 0 or not lines:
        tail = "\n".join((stderr or stdout).strip().splitlines()[-6:])
        return {"ok": False, "error": f"exit {rc}: {tail}", "log": str(log_path), "wall_s": wall}
    res = json.loads(lines[-1][len(RESULT_TAG):])
    res.update(ok=True, log=str(log_path), wall_s=wall, loadavg_before=load0, loadavg_after=os.getloadavg()[0])
    return res


# ====================================================================== parent: numbers
def settle_peak(start: dict[str, Any], measure_end: Callable[[], dict[str, Any]], given: float = 0.0) -> dict[str, Any]:
    """The GEMM peak for MFU, from the probe at the start (``start``, a gemm child's result) and one at
    the end (``measure_end()``, the same kind of result): the higher of the two, since contention only
    ever lowers a measurement (a busy moment once gave 127 GFLOP/s on a 195 GFLOP/s machine, and MFU
    figures of 91%). Logs a warning when they differ by more than ``PEAK_SPREAD_WARN`` of the higher,
    or when the end probe failed. ``given`` (``--peak-gflops``) overrides the choice; both
    measurements are recorded either way."""
    end = measure_end()
    s = start["gemm_gflops"]
    e = end["gemm_gflops"] if end.get("ok") else None
    best = s if e is None else max(s, e)
    spread = 0.0 if e is None else abs(s - e) / best
    warning = None
    if e is None:
        warning = f"WARNING: the end GEMM probe failed ({end.get('error', '?')}); MFU uses the start peak alone"
    elif spread > PEAK_SPREAD_WARN:
        warning = (f"WARNING: fp32 GEMM peak {s:.1f} GFLOP/s at the start, {e:.1f} at the end ({100 * spread:.0f}% "
                   f"apart): the machine was busy, timings are noisy; MFU uses the higher, {best:.1f}")
    if warning:
        log(warning)
    log(f"fp32 GEMM peak: start {s:.1f}, end {'-' if e is None else f'{e:.1f}'} GFLOP/s; MFU uses "
        + (f"--peak-gflops {given:.1f}" if given else f"{best:.1f}"))
    return {"gemm_gflops": given or best, "gemm_measured_gflops": best, "gemm_start_gflops": s,
            "gemm_end_gflops": e, "gemm_spread": spread, "gemm_warning": warning, "gemm": start, "gemm_end": end}


def summarize(v: dict[str, Any], res: dict[str, Any], peak_gflops: float) -> dict[str, Any]:
    """tok/s, s/step, MFU over the timed window (see the module docstring)."""
    warm, timed = v["warmup"], v["timed"]
    ends, toks = res["step_end"], res["step_tokens"]
    if len(ends) < warm + timed:
        raise RuntimeError(f"{v['id']}: only {len(ends)} step stamps, expected {warm + timed}")
    start = ends[warm - 1] if warm > 0 else None
    if start is None:
        raise RuntimeError("at least one warm-up step is needed (the window starts at its end)")
    window = ends[warm + timed - 1] - start
    tokens = sum(toks[warm:warm + timed])
    out = {"window_s": window, "tokens": tokens, "tok_s": tokens / window, "s_step": window / timed,
           "peak_rss_mib": res["peak_rss_mib"], "n_params": res["n_params"]}
    flops = (v["policy_flops"] + v["ref_flops"]) * res["n_params"] * tokens
    out["mfu"] = flops / window / (peak_gflops * 1e9)
    if v.get("precompute") and res.get("precompute_pairs"):
        # amortised: the precompute's cost per pair, for the pairs the timed window trained on
        pairs = BATCH * timed
        share = res["precompute_s"] * pairs / res["precompute_pairs"]
        out.update(precompute_s=res["precompute_s"], precompute_pairs=res["precompute_pairs"],
                   tok_s_with_precompute=tokens / (window + share))
    return out


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def render(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    used, measured = meta["gemm_gflops"], meta["gemm_measured_gflops"]
    peak_note = "" if used == measured else f" ({used:.1f} given for MFU)"
    end = meta["gemm_end_gflops"]
    lines = [f"# alignkit vs TRL {meta.get('trl_version', '(skipped)')}: SFT and DPO", "",
             f"{meta['when']} | {meta['cpu']} | torch {meta['torch']} | {THREADS} threads | fp32 GEMM peak "
             f"{measured:.1f} GFLOP/s (best of start {meta['gemm_start_gflops']:.1f}, end "
             f"{'-' if end is None else f'{end:.1f}'}){peak_note} | alignkit {meta['alignkit_commit']} | "
             f"{'QUICK (smoke) run' if meta['quick'] else 'full run'} | load avg at start {meta['loadavg_start']:.2f}", "",
             *([f"**{meta['gemm_warning']}**", ""] if meta.get("gemm_warning") else []),
             "tok/s = non-pad tokens (DPO: chosen + rejected, prompt included) of the timed steps / window seconds. "
             "Precompute rows: `a (b)` = a without, b with the amortised precompute time. "
             "Ratios are alignkit / TRL-best, where TRL-best is the correct TRL full-fine-tuning variant with the "
             "highest tok/s (precompute time excluded) of that model and algorithm (a padding-free row under plain "
             "SDPA attends across examples: never TRL-best); `same` compares with the matching TRL variant. "
             "Targets: tok/s ratio >= 1.5, RSS ratio <= 0.7, MFU on small >= 70%.", ""]
    summary = ["## Summary", "", "| model | algo | best alignkit | tok/s | TRL best | tok/s | tok/s ratio | RSS ratio "
               "| alignkit MFU | targets |", "|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["variant"]["model"], r["variant"]["algo"]), []).append(r)
    body = []
    for (model, algo), rs in groups.items():
        ok = [r for r in rs if r.get("ok")]
        trl_full = [r for r in ok if r["variant"]["side"] == "trl" and not r["variant"]["lora"]
                    and correct(r["variant"])]
        best = max(trl_full, key=lambda r: r["tok_s"]) if trl_full else None
        body += [f"## {algo.upper()} {model} ({rs[0]['variant']['warmup']} warm-up + {rs[0]['variant']['timed']} "
                 f"timed steps, batch {BATCH}{' pairs' if algo == 'dpo' else ''}, max_length {MAX_LENGTH})", "",
                 "| variant | tok/s | s/step | peak RSS MiB | MFU | tok/s ÷ TRL-best | RSS ÷ TRL-best | tok/s ÷ TRL same |",
                 "|---|---|---|---|---|---|---|---|"]
        for r in rs:
            v = r["variant"]
            label = f"{v['side']} {algo.upper()} {model}, {v['name']}"
            if not r.get("ok"):
                body.append(f"| {label} | FAILED: {r['error'].splitlines()[-1][:120] if r['error'] else ''} | | | | | | |")
                continue
            tok = f"{r['tok_s']:.0f}"
            if "tok_s_with_precompute" in r:
                tok += f" ({r['tok_s_with_precompute']:.0f})"
            ratio = rss = same = "-"
            if v["side"] == "alignkit":
                if best is not None:
                    ratio = f"{r['tok_s'] / best['tok_s']:.2f}x"
                    if "tok_s_with_precompute" in r:
                        ratio += f" ({r['tok_s_with_precompute'] / best['tok_s']:.2f}x)"
                    rss = f"{r['peak_rss_mib'] / best['peak_rss_mib']:.2f}x"
                twin = [t for t in ok if t["variant"]["side"] == "trl" and t["variant"]["match"] == v["match"]]
                if twin:
                    same = f"{r['tok_s'] / twin[0]['tok_s']:.2f}x"
            elif best is r:
                label += " **(TRL-best)**"
            body.append(f"| {label} | {tok} | {r['s_step']:.2f} | {r['peak_rss_mib']:.0f} | {100 * r['mfu']:.1f}% "
                        f"| {ratio} | {rss} | {same} |")
        # every variant with the same steps trains on the same rows, each once: their totals must agree
        # (the compile variants run COMPILE_WARMUP more warm-up steps, so they form their own group)
        for steps in sorted({r["variant"]["warmup"] for r in ok}):
            totals = {r["variant"]["id"]: sum(r["raw"]["step_tokens"]) for r in ok if r["variant"]["warmup"] == steps}
            if len(set(totals.values())) > 1:
                body.append("")
                body.append(f"**Token totals over all steps differ between variants with {steps} warm-up steps** "
                            "(counting or data mismatch): " + ", ".join(f"{k} {t}" for k, t in totals.items()))
            elif totals:
                body.append("")
                body.append(f"Token totals over all steps agree across the variants with {steps} warm-up steps "
                            f"({next(iter(totals.values()))}).")
        profiled = [r for r in ok if r["raw"].get("op_profile")]
        if profiled:
            body += ["", "Where each child's CPU time went (torch.profiler, whole child: model load, warm-up and timed "
                     "steps; self time of the GEMM and attention kernels, the optimizer step's total):", "",
                     "| variant | CPU s | GEMM | attention | optimizer | other | top non-GEMM ops (s) |", "|---|---|---|---|---|---|---|"]
            for r in profiled:
                op = r["raw"]["op_profile"]
                pct = {k: f"{100 * op[k + '_s'] / op['total_s']:.1f}%" for k in ("gemm", "attention", "optimizer", "other")}
                top = ", ".join([f"{k} {t:.2f}" for k, t, _ in op["top"] if k not in GEMM_OPS][:4])
                body.append(f"| {r['variant']['side']} {r['variant']['name']} | {op['total_s']:.1f} | {pct['gemm']} | "
                            f"{pct['attention']} | {pct['optimizer']} | {pct['other']} | {top} |")
        body.append("")
        ak_full = [r for r in ok if r["variant"]["side"] == "alignkit" and not r["variant"]["lora"]]
        if ak_full:
            a = max(ak_full, key=lambda r: r["tok_s"])
            tr, rr = (a["tok_s"] / best["tok_s"], a["peak_rss_mib"] / best["peak_rss_mib"]) if best else (None, None)
            checks = []
            if tr is not None:
                checks.append("tok/s " + ("ok" if tr >= 1.5 else "MISS"))
                checks.append("RSS " + ("ok" if rr <= 0.7 else "MISS"))
            if model == "small":
                checks.append("MFU " + ("ok" if a["mfu"] >= 0.70 else "MISS"))
            summary.append(
                f"| {model} | {algo} | {a['variant']['name']} | {a['tok_s']:.0f} | "
                f"{best['variant']['name'] if best else '-'} | {_f(best and best['tok_s'], '.0f')} | "
                f"{_f(tr, '.2f')}x | {_f(rr, '.2f')}x | {100 * a['mfu']:.1f}% | {', '.join(checks)} |")
    return "\n".join(lines + summary + [""] + body) + "\n"


# ====================================================================== parent: main
def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except OSError:
        return "?"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,small", help="comma list of tiny,small")
    p.add_argument("--algos", default="sft,dpo", help="comma list of sft,dpo")
    p.add_argument("--quick", action="store_true", help="few steps (smoke/CI): tiny 1+3, small 1+1")
    p.add_argument("--skip-trl", action="store_true", help="alignkit variants only")
    p.add_argument("--out", default=str(HERE / "results"), help="results folder (default benchmarks/results)")
    p.add_argument("--only", default="", help="comma list of substrings; run only variants whose id contains one "
                   "(ids look like alignkit-dpo-tiny-precompute, trl-sft-small-padding_free)")
    p.add_argument("--trl-venv", default=str(HERE / "results" / ".venv-trl"), help="TRL's virtualenv (created if missing)")
    p.add_argument("--sft-loss-on", choices=["all", "assistant"], default="all",
                   help="alignkit SFT loss tokens; 'all' = the same objective as TRL's default on messages rows")
    p.add_argument("--rows", type=int, default=0, help="data rows (0 = exactly the rows the run trains on: "
                   "(warm-up + timed) x batch; also what a precompute variant precomputes)")
    p.add_argument("--peak-gflops", type=float, default=0.0, help="use this fp32 GEMM peak for MFU instead of the "
                   "one measured now (e.g. 195.6, BASELINES' machine), for a machine that is not idle")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per variant")
    p.add_argument("--profile", action="store_true", help="run each child under torch.profiler and print where its "
                   "CPU time went (GEMM, attention, optimizer, other); slows the children: not for the speed table")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child_main(*a.child)
        return 0

    models = [m for m in a.models.split(",") if m]
    algos = [x for x in a.algos.split(",") if x]
    for m in models:
        if m not in STEPS:
            p.error(f"unknown model {m!r}; choose from {', '.join(STEPS)}")
    for x in algos:
        if x not in ("sft", "dpo"):
            p.error(f"unknown algo {x!r}; choose from sft, dpo")
    out = Path(a.out).resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = out / "work" / stamp
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    load_start = os.getloadavg()[0]
    if load_start > 0.5:
        log(f"WARNING: load average {load_start:.2f} on {os.cpu_count()} cores: timings will be noisy")

    model_paths = ensure_models(out / "models", models)
    trl_py = None if a.skip_trl else ensure_trl_venv(Path(a.trl_venv))
    log("measuring the fp32 GEMM peak (again at the end; MFU uses the higher)")
    gemm = run_child(sys.executable, "gemm", {"models": model_paths}, work / "logs" / "gemm.log", 600)
    if not gemm.get("ok"):
        log(f"GEMM probe failed: {gemm['error']}")
        return 1
    peak = a.peak_gflops or gemm["gemm_gflops"]
    log(f"fp32 GEMM peak measured {gemm['gemm_gflops']:.1f} GFLOP/s ({THREADS} threads, 2048^3, best of 15)"
        + (f"; MFU uses --peak-gflops {peak:.1f}" if a.peak_gflops else "; MFU below is provisional"))

    plan: list[dict[str, Any]] = []
    for model in models:
        warm, timed = (QUICK_STEPS if a.quick else STEPS)[model]
        n_rows = a.rows or (warm + timed) * BATCH
        # the compile variants warm up COMPILE_WARMUP more steps (the compile, and the recompile for dynamic
        # shapes that the second sequence length triggers, stay out of the timed window): SFT gets their rows;
        # make_rows draws rows in sequence, so DPO's rows are the first n_rows of the same draw
        sft_rows = bench_data.make_rows(n_rows + (0 if a.rows else COMPILE_WARMUP * BATCH), SEED)
        rows = sft_rows[:n_rows]
        data = {"sft": bench_data.write_jsonl(sft_rows, work / f"data-{model}-sft.jsonl", ("messages",)),
                "dpo": bench_data.write_jsonl(rows, work / f"data-{model}-dpo.jsonl", ("prompt", "chosen", "rejected"))}
        for algo in algos:
            vs = [v for v in variants(model, algo) if not (a.skip_trl and v["side"] == "trl")]
            if a.only:
                vs = [v for v in vs if any(s in v["id"] for s in a.only.split(","))]
            # interleave alignkit and TRL so slow drift of the machine hits both sides alike
            ak = [v for v in vs if v["side"] == "alignkit"]
            tr = [v for v in vs if v["side"] == "trl"]
            order = [x for pair in zip(ak, tr) for x in pair] + ak[len(tr):] + tr[len(ak):]
            for v in order:
                v.update(warmup=warm + (COMPILE_WARMUP if v.get("compile") else 0), timed=timed,
                         model_path=model_paths[model], data_path=str(data[algo]),
                         run_dir=str(work / "runs" / v["id"]), sft_loss_on=a.sft_loss_on, profile=a.profile)
                plan.append(v)

    results = []
    for i, v in enumerate(plan, 1):
        log(f"[{i}/{len(plan)}] {v['id']} ...")
        python = sys.executable if v["side"] == "alignkit" else str(trl_py)
        res = run_child(python, v["side"], v, work / "logs" / f"{v['id']}.log", a.timeout)
        row: dict[str, Any] = {"variant": v, "ok": res.get("ok", False), "raw": res}
        if res.get("ok"):
            try:
                row.update(summarize(v, res, peak))
            except Exception as e:  # a child that ran but stamped too few steps
                row.update(ok=False, error=str(e))
        else:
            row["error"] = res.get("error", "")
        results.append(row)
        if row["ok"]:
            extra = f" ({row['tok_s_with_precompute']:.0f} with precompute)" if "tok_s_with_precompute" in row else ""
            log(f"    {row['tok_s']:.0f} tok/s{extra}, {row['s_step']:.2f} s/step, peak RSS {row['peak_rss_mib']:.0f} MiB, "
                f"MFU {100 * row['mfu']:.1f}%{'' if a.peak_gflops else ' of the start peak'}  "
                f"(child {res['wall_s']:.0f}s, load {res['loadavg_before']:.1f})")
            if res.get("heavy_modules") is not None:
                log(f"    large modules imported: {', '.join(res['heavy_modules']) or 'none'}")
        else:
            log(f"    FAILED: {row['error'].strip().splitlines()[-1] if row['error'].strip() else '?'} (log: {res.get('log')})")

    log("measuring the fp32 GEMM peak again")
    peaks = settle_peak(gemm, lambda: run_child(sys.executable, "gemm", {"models": {}}, work / "logs" / "gemm-end.log",
                                                600), a.peak_gflops)
    for row in results:  # MFU against the settled peak (the log lines above used the start one)
        if row["ok"]:
            row.update(summarize(row["variant"], row["raw"], peaks["gemm_gflops"]))
    trl_versions = next((r["raw"].get("versions") for r in results if r["ok"] and r["variant"]["side"] == "trl"), None)
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu_name(), "cores": os.cpu_count(),
        "torch": gemm["torch"], **peaks, "alignkit_commit": git_commit(), "quick": a.quick,
        "trl_version": trl_versions["trl"] if trl_versions else None, "trl_versions": trl_versions,
        "loadavg_start": load_start, "loadavg_end": os.getloadavg()[0], "total_wall_s": time.perf_counter() - t_start,
        "argv": sys.argv[1:], "batch": BATCH, "max_length": MAX_LENGTH, "lr": LR, "seed": SEED, "threads": THREADS,
        "sft_loss_on": a.sft_loss_on, "work_dir": str(work),
    }
    table = render(results, meta)
    (out / f"{stamp}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1), encoding="utf-8")
    (out / f"{stamp}.md").write_text(table, encoding="utf-8")
    print()
    print(table)
    log(f"wrote {out / (stamp + '.json')} and {out / (stamp + '.md')} in {meta['total_wall_s'] / 60:.1f} min")
    return 0 if all(r["ok"] for r in results) else 2


if __name__ == "__main__":
    sys.exit(main())
