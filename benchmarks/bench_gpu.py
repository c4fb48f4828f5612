"""alignkit vs TRL side by side on one GPU, in one go (issue 38; the workload of ``../shared/gpu/probe.sh``, so
the numbers compare with the issue's table). Each variant runs in its own process, one after another:

* SFT: alignkit packed (the real CLI, ``alignkit train CFG``) vs TRL padded and TRL ``padding_free``;
* DPO (frozen reference): alignkit vs TRL; LoRA SFT (r16, all linear): alignkit vs TRL + peft;
* gradient checkpointing: alignkit vs TRL padding_free; a GPU-filling SFT workload (16 x 2 accumulation =
  32 conversations, ~36k tokens per optimizer step) where MFU means something;
* GRPO rollout (HF generate) + update: alignkit vs TRL's GRPOTrainer (last: only if the time budget allows);
* a ``torch.profiler`` trace of one alignkit SFT step and one TRL padding-free step (top CUDA kernels, GPU idle
  gaps between kernels, sync calls), from the same runs (the profiled step is a warm-up step).

Workload (``--size 0.5b``): a random Qwen2.5-0.5B-shaped model built here (``gpu_setup.py``), multi-turn chats
(``gpu_setup.py data``), batch 8, max_length 2048, lr 1e-5 constant, 15 steps, fp32 weights + bf16 autocast;
tok/s over steps 6-15 (alignkit: the mean ``tokens_per_s`` of its logged windows 6-10 and 11-15; TRL: tokens
over the time between CUDA-synchronised step stamps); MFU = k·N·tok/s / the measured bf16 GEMM peak (k: SFT 6,
DPO 8, LoRA 4; attention FLOPs not counted); peak memory: ``torch.cuda.max_memory_allocated``.

usage::

    python benchmarks/bench_gpu.py                                  # on a GPU machine, ~8 minutes
    python benchmarks/bench_gpu.py --wheels DIR                     # first install DIR/*.whl (prepare_gpu.sh)
    python benchmarks/bench_gpu.py --device cpu --size micro        # the same pipeline on CPU, a micro model
    python benchmarks/bench_gpu.py --skip-trl --only ak_sft,ak_dpo  # pieces

Variants are run in priority order and each gets at most the time left of ``--budget`` seconds: a variant
with no time left is reported as skipped, so the whole run fits one 8-minute machine run. Results (rewritten
after every variant): ``OUT/results.json``, ``OUT/summary.md``; logs, configs and traces under ``OUT/work``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import gpu_report  # noqa: E402  (standard library only)

LORA = {"r": 16, "alpha": 32, "dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
#: per model size: the main workload, the GPU-filling one and GRPO's (steps, warm = steps before the window)
WORKLOADS: dict[str, dict[str, Any]] = {
    "0.5b": {"batch": 8, "accum": 1, "steps": 15, "warm": 5, "log": 5, "rows": 512, "max_length": 2048,
             "fill": {"batch": 16, "accum": 2, "steps": 8, "warm": 4, "log": 4},
             "grpo": {"batch": 64, "G": 8, "max_new": 48, "steps": 6, "warm": 2}},
    "micro": {"batch": 2, "accum": 1, "steps": 6, "warm": 2, "log": 2, "rows": 48, "max_length": 512,
              "fill": {"batch": 2, "accum": 2, "steps": 3, "warm": 1, "log": 1},
              "grpo": {"batch": 16, "G": 8, "max_new": 8, "steps": 3, "warm": 1}},
}
WORKLOADS["deep"] = WORKLOADS["0.5b"]
#: in priority order; kind: how MFU counts FLOPs; TRL's LoRA / checkpointing / fill rows are padding-free (its best)
VARIANTS: list[dict[str, Any]] = [
    {"name": "ak_sft", "side": "alignkit", "algo": "sft", "kind": "sft", "profile": True},
    {"name": "trl_sft_pf", "side": "trl", "algo": "sft", "variant": "padding_free", "kind": "sft", "profile": True},
    {"name": "ak_dpo", "side": "alignkit", "algo": "dpo", "kind": "dpo", "profile": True},
    {"name": "trl_dpo", "side": "trl", "algo": "dpo", "variant": "base", "kind": "dpo"},
    {"name": "ak_fill", "side": "alignkit", "algo": "sft", "kind": "sft", "fill": True},
    {"name": "trl_fill", "side": "trl", "algo": "sft", "variant": "padding_free", "kind": "sft", "fill": True},
    {"name": "trl_sft_padded", "side": "trl", "algo": "sft", "variant": "padded", "kind": "sft"},
    {"name": "ak_lora", "side": "alignkit", "algo": "sft", "kind": "lora", "lora": True},
    {"name": "trl_lora", "side": "trl", "algo": "sft", "variant": "padding_free", "kind": "lora", "lora": True},
    {"name": "ak_gc", "side": "alignkit", "algo": "sft", "kind": "sft", "gc": True},
    {"name": "trl_gc", "side": "trl", "algo": "sft", "variant": "padding_free", "kind": "sft", "gc": True},
    {"name": "ak_grpo", "side": "alignkit", "algo": "grpo", "kind": None},
    {"name": "trl_grpo", "side": "trl", "algo": "grpo", "kind": None},
    # training.torch_compile (regional, the decoder blocks) on the GPU-filling workload: its wall time less
    # ak_fill's is about the compile
    {"name": "ak_fill_compile", "side": "alignkit", "algo": "sft", "kind": "sft", "fill": True, "compile": True},
]
#: (alignkit row, TRL row) compared in the summary
PAIRS = [("ak_sft", "trl_sft_pf"), ("ak_sft", "trl_sft_padded"), ("ak_dpo", "trl_dpo"), ("ak_lora", "trl_lora"),
         ("ak_gc", "trl_gc"), ("ak_fill", "trl_fill"), ("ak_grpo", "trl_grpo"), ("ak_fill_compile", "trl_fill")]
#: seconds one variant may take at most (GPU / CPU), and the least worth starting
CAP_S = {"cuda": 150, "cpu": 600}
MIN_S = {"cuda": 25, "cpu": 20}


def log(msg: str) -> None:
    print(f"[bench_gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def shape(v: dict[str, Any], wl: dict[str, Any]) -> dict[str, Any]:
    """Batch, accumulation, steps, warm-up and logging interval of variant ``v``."""
    base = {k: wl[k] for k in ("batch", "accum", "steps", "warm", "log")}
    if v.get("fill"):
        base.update(wl["fill"])
    if v["algo"] == "grpo":
        base.update({k: wl["grpo"][k] for k in ("batch", "steps", "warm")}, accum=1, log=1)
    return base


def alignkit_config(v: dict[str, Any], wl: dict[str, Any], paths: dict[str, Path], run_dir: Path,
                    log_steps: int | None = None, steps: int | None = None) -> dict[str, Any]:
    """probe.sh's config for variant ``v`` (the attention kernel is alignkit's default, unlike probe.sh's sdpa)."""
    s = shape(v, wl)
    model: dict[str, Any] = {"name_or_path": str(paths["model"]), "dtype": "auto", "gradient_checkpointing": bool(v.get("gc"))}
    if v.get("lora"):
        model["lora"] = LORA
    cfg: dict[str, Any] = {"algorithm": v["algo"], "output_dir": str(run_dir), "model": model,
                           "checkpoint": {"save_final": False},
                           "logging": {"logging_steps": log_steps or s["log"], "report_to": ["console", "jsonl"],
                                       "progress_bar": "off", "plot": False}}
    train = {"per_device_batch_size": s["batch"], "gradient_accumulation_steps": s["accum"], "learning_rate": 1.0e-5,
             "lr_scheduler": "constant", "warmup_steps": 0, "max_steps": steps or s["steps"], "max_grad_norm": 1.0,
             "weight_decay": 0.0, "seed": 0, "torch_compile": bool(v.get("compile"))}
    if v["algo"] == "sft":
        cfg["data"] = {"train": str(paths["data"] / "sft.jsonl"), "max_length": wl["max_length"], "packing": True}
        cfg["sft"] = {"loss_on": "all"}  # TRL's objective on messages rows
    elif v["algo"] == "dpo":
        cfg["data"] = {"train": str(paths["data"] / "dpo.jsonl"), "max_length": wl["max_length"]}
        cfg["dpo"] = {"loss_type": "sigmoid", "beta": 0.1, "reference": "model"}
    else:
        g = wl["grpo"]
        cfg["data"] = {"train": str(paths["prompts"]), "max_length": 64}
        cfg["rollout"] = {"num_generations": g["G"], "max_new_tokens": g["max_new"], "temperature": 1.0, "log_samples": 0}
        cfg["reward"] = {"functions": [{"name": "gpu_setup:letter_fraction", "weight": 1.0}]}
        cfg["grpo"] = {"beta": 0.0}
        train.update(learning_rate=1.0e-6)
    cfg["training"] = train
    return cfg


def trl_spec(v: dict[str, Any], wl: dict[str, Any], paths: dict[str, Path], out: Path, steps: int | None = None) -> dict[str, Any]:
    s = shape(v, wl)
    spec = {"algo": v["algo"], "variant": v.get("variant", "base"), "model": str(paths["model"]), "data": str(paths["data"]),
            "out": str(out), "steps": steps or s["steps"], "batch": s["batch"], "accum": s["accum"],
            "max_length": wl["max_length"], "lora": bool(v.get("lora")), "gc": bool(v.get("gc"))}
    if v["algo"] == "grpo":
        spec.update(prompts=str(paths["prompts"]), num_generations=wl["grpo"]["G"], max_new_tokens=wl["grpo"]["max_new"],
                    lr=1e-6)
    return spec


def child_env(device: str, site: Path | None, alignkit: bool) -> dict[str, str]:
    """Offline, quiet, this checkout's alignkit first (TRL children: the benchmark helpers only)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1")
    path = ([str(site)] if site else []) + ([str(REPO / "src")] if alignkit else []) + [str(HERE)]
    env["PYTHONPATH"] = os.pathsep.join(path)
    if device == "cpu":
        env.update(OMP_NUM_THREADS="2", CUDA_VISIBLE_DEVICES="")
    return env


def run_child(cmd: list[str], env: dict[str, str], timeout: float, log_path: Path, cwd: Path) -> dict[str, Any]:
    """Run ``cmd`` in its own process group (killed whole on timeout); its exit status, seconds, log tail."""
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(cwd), start_new_session=True)
        try:
            rc = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            rc = -9
        finally:  # a timeout, or this process stopped (SIGTERM / Ctrl-C): the child's whole group goes too
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = log_path.read_text(encoding="utf-8", errors="replace")
    tail = [x[:300] for x in text.splitlines() if x.strip()][-6:]
    return {"rc": rc, "wall_s": round(time.perf_counter() - t0, 1), "timed_out": rc == -9, "tail": tail if rc else [],
            "last_line": tail[-1] if tail else ""}


class Bench:
    """One run: the work folder, the children's environment, the time budget and the results so far."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a, self.device, self.wl = a, a.device, WORKLOADS[a.size]
        self.out = Path(a.out or HERE / "results" / f"gpu-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
        self.work = self.out / "work"
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.site = self.install_wheels(Path(a.wheels)) if a.wheels else None
        self.paths = {"model": self.work / "model", "data": self.work / "data", "prompts": self.work / "prompts.jsonl"}
        self.res: dict[str, Any] = {"args": vars(a), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": {},
                                    "setup": {}, "pairs": []}

    def left(self) -> float:
        return self.a.budget - (time.monotonic() - self.t0)

    def install_wheels(self, wheels: Path) -> Path:
        site = self.work / "site"
        whl = sorted(str(p) for p in wheels.glob("*.whl"))
        log(f"installing {len(whl)} wheels from {wheels} into {site}")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", str(site)] + whl, check=True)
        return site

    def child(self, name: str, cmd: list[str], alignkit: bool = True, cap: float | None = None) -> dict[str, Any] | None:
        """Run one child under the budget; None (recorded as skipped) when too little time is left."""
        left = self.left() - 5
        if left < MIN_S[self.device]:
            log(f"{name}: skipped ({left:.0f} s of the budget left)")
            return None
        env = child_env(self.device, self.site, alignkit)
        r = run_child(cmd, env, min(cap or CAP_S[self.device], left), self.work / "logs" / f"{name}.log", self.work)
        log(f"{name}: rc={r['rc']} {r['wall_s']} s  {r['last_line'][:150]}")
        return r

    # ------------------------------------------------------------------ setup
    def setup(self) -> bool:
        """Versions, the model, the data, GRPO's prompts and the GEMM peak; False when a needed piece failed."""
        py, setup = self.a.python, self.res["setup"]
        ver = ("import json, torch, transformers; import alignkit; d = {'torch': torch.__version__, 'cuda': torch.version.cuda,"
               " 'transformers': transformers.__version__, 'alignkit': alignkit.__file__, 'python': __import__('sys').version.split()[0]}\n"
               "for m in ('peft', 'accelerate', 'datasets', 'trl', 'flash_attn', 'liger_kernel'):\n"
               "    try: d[m] = __import__(m).__version__\n    except Exception: d[m] = None\n"
               "d['gpu'] = torch.cuda.get_device_name() if torch.cuda.is_available() else None; print(json.dumps(d))")
        r = self.child("versions", [py, "-c", ver], cap=120)
        setup["versions"] = self._json_line("versions") if r and r["rc"] == 0 else None
        git = ["git", "-C", str(REPO)]
        setup["commit"] = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        if subprocess.run(git + ["diff", "--quiet", "HEAD", "--", "src"]).returncode == 1:
            setup["commit"] += " + uncommitted src changes"
        from bench_grpo import write_prompts

        write_prompts(self.paths["prompts"])
        for name, cmd in (("make_model", ["model", str(self.paths["model"]), self.a.size]),
                          ("make_data", ["data", str(self.paths["data"]), str(self.wl["rows"])]),
                          ("gemm", ["gemm", self.device])):
            r = self.child(name, [py, str(HERE / "gpu_setup.py")] + cmd, cap=180)
            setup[name] = self._json_line(name) if r and r["rc"] == 0 else {"error": r and r["tail"]}
        ok = "n_params" in setup["make_model"] and "rows" in setup["make_data"]
        if self.device == "cuda" and not (setup["versions"] or {}).get("gpu"):
            log("--device cuda but torch sees no GPU: the numbers would be CPU numbers")
            ok = False
        return ok

    def _json_line(self, name: str) -> Any:
        lines = [x for x in (self.work / "logs" / f"{name}.log").read_text().splitlines() if x.startswith("{")]
        return json.loads(lines[-1]) if lines else None

    def trl_ready(self) -> str | None:
        """Why the TRL rows cannot run (no TRL importable by their python), or None."""
        r = self.child("trl_import", [self.a.trl_python, "-c", "import trl, datasets, peft; print(trl.__version__)"],
                       alignkit=False, cap=120)
        return None if r and r["rc"] == 0 else f"TRL is not importable by {self.a.trl_python}"

    # ------------------------------------------------------------------ variants
    def run_variant(self, v: dict[str, Any]) -> dict[str, Any]:
        name, s = v["name"], shape(v, self.wl)
        probe: list[str] = []
        if v.get("profile") and not self.a.no_profile:
            step = max(2, s["warm"] - 1)  # a warm-up step: its profiling stays out of the timed window
            probe = ["--profile", str(step), "--trace", str(self.work / f"{name}.trace.json.gz")]
        if v["side"] == "alignkit":
            cfg = self.work / f"{name}.yaml"
            cfg.write_text(json.dumps(alignkit_config(v, self.wl, self.paths, self.work / "runs" / name), indent=1))
            target = ["-m", "alignkit", "train", str(cfg)]
            py = self.a.python
        else:
            spec = trl_spec(v, self.wl, self.paths, self.work / f"{name}.json")
            target, py = [str(HERE / "gpu_trl.py"), json.dumps(spec)], self.a.trl_python
        cmd = [py, str(HERE / "gpu_probe.py")] + probe + ["--"] + target if probe else [py] + target
        r = self.child(name, cmd, alignkit=v["side"] == "alignkit")
        if r is not None and r["rc"] and probe:  # the speed row matters more than the profile: once more without
            log(f"{name}: failed under the profiler; again without it")
            probe, cmd = [], [py] + target
            shutil.rmtree(self.work / "runs" / name, ignore_errors=True)  # alignkit refuses a used output_dir
            r = self.child(name, cmd, alignkit=v["side"] == "alignkit")
        if r is None:
            return {"skipped": "time budget"}
        row: dict[str, Any] = {"rc": r["rc"], "wall_s": r["wall_s"], "timed_window": f"steps {s['warm'] + 1}-{s['steps']}"}
        if r["rc"]:
            row["error"] = r["tail"]
        speed = (gpu_report.alignkit_speed(self.work / "runs" / name, s["warm"]) if v["side"] == "alignkit"
                 else gpu_report.trl_speed(self.work / f"{name}.json", s["warm"]))
        row.update(speed or {})
        if v["algo"] == "grpo" and row.get("s_per_step") and "samples_per_s" not in row:
            row["samples_per_s"] = s["batch"] / row["s_per_step"]
        n = (self.res["setup"].get("make_model") or {}).get("n_params")
        row["mfu"] = gpu_report.mfu(v["kind"], n or 0, row.get("tok_s"), (self.res["setup"].get("gemm") or {}).get("gemm_tflops"))
        trace = self.work / f"{name}.trace.json.gz"
        if probe and trace.exists():
            try:
                row["profile"] = gpu_report.trace_summary(trace)
            except Exception as e:  # a trace torch wrote differently: keep the speed row
                row["profile"] = {"error": repr(e)}
        return row

    def save(self) -> None:
        self.res["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        self.res["pairs"] = gpu_report.pairs(self.res["rows"], PAIRS)
        (self.out / "results.json").write_text(json.dumps(self.res, indent=1))
        (self.out / "summary.md").write_text(gpu_report.render(self.res))

    def run(self) -> int:
        if not self.setup():
            self.save()
            log(f"setup failed: see {self.work / 'logs'}")
            return 1
        only = [x for x in self.a.only.split(",") if x]  # --only's order is the run order
        chosen = sorted((v for v in VARIANTS if not only or v["name"] in only),
                        key=lambda v: only.index(v["name"]) if only else 0)
        no_trl = "--skip-trl" if self.a.skip_trl else None
        if not no_trl and any(v["side"] == "trl" for v in chosen):
            no_trl = self.trl_ready()
        for v in chosen:
            if v["side"] == "trl" and no_trl:
                self.res["rows"][v["name"]] = {"skipped": no_trl}
                continue
            self.res["rows"][v["name"]] = self.run_variant(v)
            self.save()
        self.save()
        print(gpu_report.render(self.res), flush=True)
        log(f"results: {self.out / 'results.json'} and summary.md ({self.res['elapsed_s']} s)")
        failed = [k for k, r in self.res["rows"].items() if r.get("rc")]
        return 1 if failed and self.a.strict else 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--size", choices=("0.5b", "micro"), default=None, help="default: 0.5b on cuda, micro on cpu")
    p.add_argument("--only", default="", help="comma-separated variant names, run in this order: " + ",".join(v["name"] for v in VARIANTS))
    p.add_argument("--skip-trl", action="store_true", help="alignkit rows only")
    p.add_argument("--no-profile", action="store_true", help="no torch.profiler trace")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run (variants past it are skipped)")
    p.add_argument("--wheels", default="", help="install DIR/*.whl (prepare_gpu.sh) into the run's site folder first")
    p.add_argument("--python", default=sys.executable, help="python of the alignkit children")
    p.add_argument("--trl-python", default="", help="python of the TRL children (default: this python on cuda; "
                   "benchmarks/results/.venv-trl on cpu, built if missing)")
    p.add_argument("--out", default="", help="results folder (default benchmarks/results/gpu-<time>)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a variant failed")
    a = p.parse_args(argv)
    a.size = a.size or ("0.5b" if a.device == "cuda" else "micro")
    if a.size == "0.5b" and a.device == "cpu":
        p.error("--size 0.5b on CPU would take hours: use --size micro")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds run_child, which stops its child
    if not a.trl_python:
        a.trl_python = sys.executable
        if a.device == "cpu" and not a.skip_trl:
            from bench_sft_dpo import ensure_trl_venv

            a.trl_python = str(ensure_trl_venv(HERE / "results" / ".venv-trl"))
    if shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi", "-L"])
    return Bench(a).run()


if __name__ == "__main__":
    sys.exit(main())
