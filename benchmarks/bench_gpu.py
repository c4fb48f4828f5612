"""alignkit vs TRL side by side on one GPU, in one go (issue 38; the workload of ``../shared/gpu/probe.sh``, so
the numbers compare with the issue's table). Each variant runs in its own process, one after another:

* SFT: alignkit packed (the real CLI, ``alignkit train CFG``) vs TRL padded (SDPA) and TRL ``padding_free`` with
  a varlen attention (``trl_varlen.py``: under plain SDPA its packed rows attend across examples, not a correct
  training), and the same with ``use_liger_kernel=True``;
* DPO (frozen reference): alignkit vs TRL, both references in bf16; LoRA SFT (r16, all linear): alignkit vs TRL +
  peft, both bases in bf16 (adapters fp32);
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

    python3 benchmarks/bench_gpu.py --out $OUT                       # on a GPU machine (see README: the run calls)
    python3 benchmarks/bench_gpu.py --wheels DIR --out $OUT          # first install DIR/*.whl (prepare_gpu.sh)
    python3 benchmarks/bench_gpu.py --device cpu --size micro        # the same pipeline on CPU, a micro model
    python3 benchmarks/bench_gpu.py --dry-run --out DIR              # CPU, tiny sizes: checks OUT's layout
    python3 benchmarks/bench_gpu.py --skip-trl --only ak_sft,ak_dpo  # pieces

Variants run in priority order (each TRL row right after its alignkit pair) within ``--budget`` seconds: a TRL
row gets the time its pair's alignkit row took, times ``TRL_FACTOR``, plus ``TRL_SETUP_S`` (it is skipped, and
the summary says why, when less is left or its pair did not run). Work (wheels, model, data, runs, traces) goes
to ``--scratch``; ``OUT`` receives only ``results.json`` and ``summary.md`` (rewritten after every variant) and
``bench-logs.tgz`` (logs, configs, metrics; < 16 MiB) at the end: a GPU machine returns a few small files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import gpu_report  # noqa: E402  (standard library only)
from gpu_plan import PAIRS, VARIANTS, WORKLOADS, alignkit_config, shape, trl_spec  # noqa: E402

#: seconds one variant may take at most (GPU / CPU), and the least worth starting
CAP_S = {"cuda": 150, "cpu": 600}
MIN_S = {"cuda": 25, "cpu": 20}
#: a TRL row's time: its pair's alignkit wall seconds x TRL_FACTOR + TRL_SETUP_S (H100, 2026-11-27: a TRL row's wall
#: time was 1.4-2.1x its pair's, 33.6-39.5 s against 18.7-32.7 s)
TRL_FACTOR, TRL_SETUP_S = 2.0, 30.0
#: what a run leaves in OUT (a GPU machine returns a few small files from it)
OUT_FILES = ("bench-logs.tgz", "results.json", "summary.md")
ARCHIVE_MAX = 15 * 2**20


def log(msg: str) -> None:
    print(f"[bench_gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


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
        self.work = Path(a.scratch).resolve() / "work"
        shutil.rmtree(self.work, ignore_errors=True)  # a rerun on the same machine starts clean
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
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
    def trl_time(self, v: dict[str, Any], chosen: list[str]) -> tuple[float | None, str | None]:
        """(the seconds TRL row ``v`` gets, None) or (None, why it is skipped): its pair's alignkit time."""
        partner = next(a for a, b in PAIRS if b == v["name"]) if v["algo"] != "grpo" else "ak_grpo"
        if partner not in chosen:  # --only without the pair: the usual cap
            return CAP_S[self.device], None
        ak = self.res["rows"].get(partner) or {}
        if not ak.get("wall_s") or ak.get("rc"):
            return None, f"skipped: its pair's alignkit row {partner} did not run"
        need = ak["wall_s"] * TRL_FACTOR + TRL_SETUP_S
        if self.left() - 5 < need:
            return None, (f"skipped: needs ~{need:.0f} s ({partner} took {ak['wall_s']:.0f} s, x{TRL_FACTOR:g} + "
                          f"{TRL_SETUP_S:g} s), {max(self.left(), 0):.0f} s of the budget left")
        return need, None

    def row_context(self, v: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
        """What every row records: the device, the versions, the attention kernel its packed rows ran."""
        ver = self.res["setup"].get("versions") or {}
        ctx = {"device": ver.get("gpu") or "CPU", "torch": ver.get("torch"), "transformers": ver.get("transformers"),
               "trl": row.get("trl") or (ver.get("trl") if v["side"] == "trl" else None)}
        log_path = self.work / "logs" / f"{v['name']}.log"
        if v["side"] == "alignkit" and log_path.exists():
            lines = [x for x in log_path.read_text(errors="replace").splitlines() if "Attention: " in x]
            ctx["attention"] = lines[0].split("Attention: ", 1)[1].strip() if lines else None
        else:
            ctx["attention"] = row.get("attention")
        return ctx

    def archive(self) -> Path:
        """OUT/bench-logs.tgz: logs, configs, metrics and TRL records (the traces too while it stays small)."""
        w = self.work
        files = [*w.glob("logs/*.log"), *w.glob("*.yaml"), *w.glob("*.json"), *w.glob("runs/*/metrics.jsonl")]
        dest = self.out / OUT_FILES[0]
        for extra in (sorted(w.glob("*.trace.json.gz")), []):
            with tarfile.open(dest, "w:gz") as tar:
                for f in sorted(files) + extra:
                    tar.add(f, arcname=str(f.relative_to(w)))
            if dest.stat().st_size <= ARCHIVE_MAX:
                break
        return dest

    def run_variant(self, v: dict[str, Any], cap: float | None = None) -> dict[str, Any]:
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
        r = self.child(name, cmd, alignkit=v["side"] == "alignkit", cap=cap)
        if r is not None and r["rc"] and probe:  # the speed row matters more than the profile: once more without
            log(f"{name}: failed under the profiler; again without it")
            probe, cmd = [], [py] + target
            shutil.rmtree(self.work / "runs" / name, ignore_errors=True)  # alignkit refuses a used output_dir
            r = self.child(name, cmd, alignkit=v["side"] == "alignkit", cap=cap)
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
        names = [v["name"] for v in chosen]
        for v in chosen:
            cap, why = self.trl_time(v, names) if v["side"] == "trl" and not no_trl else (None, no_trl)
            row = {"skipped": why} if v["side"] == "trl" and why else self.run_variant(v, cap)
            if why and v["side"] == "trl":
                log(f"{v['name']}: {why}")
            self.res["rows"][v["name"]] = {**row, **self.row_context(v, row)}
            self.save()
        self.save()
        print(gpu_report.render(self.res), flush=True)
        log(f"results: {self.out / 'results.json'}, summary.md and {self.archive().name} ({self.res['elapsed_s']} s)")
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
    p.add_argument("--out", default="", help="results folder: results.json, summary.md, bench-logs.tgz only "
                   "(default benchmarks/results/gpu-<time>)")
    p.add_argument("--scratch", default="/tmp/alignkit-bench", help="work folder: wheels, model, data, runs, traces")
    p.add_argument("--dry-run", action="store_true", help="CPU, micro model: check that OUT gets its files")
    p.add_argument("--strict", action="store_true", help="exit 1 when a variant failed")
    a = p.parse_args(argv)
    if a.dry_run:
        a.device, a.size = "cpu", "micro"
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
    bench = Bench(a)
    rc = bench.run()
    if a.dry_run:
        got = sorted(p.name for p in bench.out.iterdir())
        if got != sorted(OUT_FILES):
            log(f"dry run: OUT holds {got}, expected exactly {sorted(OUT_FILES)}")
            return 1
        log(f"dry run: OUT holds {', '.join(got)}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
