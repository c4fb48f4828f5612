"""Ops dispatched per optimizer step, and the host syncs among them: alignkit vs TRL on the same model (issue 38,
item 5; the method of ``../shared/gpu/opcount.py``).

Each run executes unchanged (alignkit: ``python -m alignkit train CFG``; TRL: ``gpu_trl.py``) under
``gpu_probe.py --opcount``, which counts every aten op it dispatches (a ``TorchDispatchMode``: on a GPU each is
about one kernel launch) and, among them, the ones that make a GPU wait for the host: ``_local_scalar_dense``
(``.item()``, ``float()``, ``bool()``), ``nonzero``, ``unique``, ``masked_select``, ``equal``, ``is_nonzero``,
``repeat_interleave`` without ``output_size``, a boolean-mask index (a nonzero inside the kernel) and copies
from a device to the CPU (none on a CPU run). ``reads`` counts Python-level reads of a tensor's value
(``tolist``/``item``/``numpy``/``bool()``/``int()``...), host-side tensors included (an upper bound).

Per step = (count of a 6-step run - count of a 3-step run) / 3, so start-up and the end of training cancel;
neither side logs in between (alignkit ``logging_steps`` 1000; TRL 10^6), so these are steady-state steps
without a logging window. The 6-step run's per-step counts (an optimizer-step hook) are shown as a check.

Workload: ``bench_gpu.py``'s (batch 8, max_length 2048, the multi-turn chats, lr 1e-5, alignkit packed SFT with
``loss_on: all``, DPO with a frozen reference) on the ``deep`` model: Qwen2.5-0.5B's 24 layers at width 64, on
CPU, fp32. usage::

    python benchmarks/opcount.py [--only ak_sft,trl_sft_pf] [--out DIR] [--trl-python PY] [--skip-trl]
        [--dtype bf16 --compute-weights cast|autocast]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gpu import VARIANTS, WORKLOADS, alignkit_config, child_env, log, run_child, trl_spec  # noqa: E402

RUNS = ["ak_sft", "ak_dpo", "trl_sft_padded", "trl_sft_pf", "trl_dpo"]
STEPS = (3, 6)
#: sync kinds shown in their own column (the rest are summed under "other")
#: the cast and copy ops (issue 49 item 4: bf16 compute weights cast once per optimizer step)
COPIES = ("_to_copy", "copy_")
SHOWN = ("_local_scalar_dense", "nonzero", "index[bool mask]", "index_put_[bool mask]")


def per_step(a: dict[str, Any], b: dict[str, Any], n: int) -> dict[str, Any]:
    """(b - a) / n for the totals and every sync / read kind of two opcount results."""
    def diff(key: str) -> dict[str, float]:
        keys = set(a[key]) | set(b[key])
        return {k: (b[key].get(k, 0) - a[key].get(k, 0)) / n for k in sorted(keys)}

    row = {"ops": (b["total"] - a["total"]) / n, "syncs": diff("syncs"), "reads": diff("reads")}
    if "top" in a and "top" in b:  # [(op, count)], the most common 60: the cast and copy ops among them
        top_a, top_b = dict(a["top"]), dict(b["top"])
        row["copies"] = sum(top_b.get(k, 0) - top_a.get(k, 0) for k in COPIES) / n
    return row


def hook_steps(result: dict[str, Any]) -> list[int]:
    """Ops between consecutive optimizer steps (the run's own snapshots): steps 2.. of the run."""
    s = [x["ops"] for x in result.get("steps", [])]
    return [b - a for a, b in zip(s, s[1:])]


def measure(name: str, work: Path, trl_python: str, resume: bool = False,
            model: dict[str, str] | None = None) -> dict[str, Any]:
    v = next(x for x in VARIANTS if x["name"] == name)
    wl, paths = WORKLOADS["deep"], {"model": work / "model", "data": work / "data", "prompts": work / "prompts.jsonl"}
    counts = {}
    for n in STEPS:
        tag = f"{name}_{n}"
        if v["side"] == "alignkit":
            cfg = work / f"{tag}.yaml"
            spec = alignkit_config(v, wl, paths, work / "runs" / tag, log_steps=1000, steps=n)
            spec["model"].update(model or {})  # --dtype / --compute-weights
            cfg.write_text(json.dumps(spec))
            py, target = sys.executable, ["-m", "alignkit", "train", str(cfg)]
        else:
            py, target = trl_python, [str(HERE / "gpu_trl.py"), json.dumps(trl_spec(v, wl, paths, work / f"{tag}.json", steps=n))]
        res = work / f"{tag}.opcount.json"
        if resume and res.exists() and json.loads(res.read_text()).get("status") == 0:
            counts[n] = json.loads(res.read_text())
            continue
        r = run_child([py, str(HERE / "gpu_probe.py"), "--opcount", str(res), "--"] + target,
                      child_env("cpu", None, v["side"] == "alignkit"), 1200, work / f"{tag}.log", work)
        log(f"{tag}: rc={r['rc']} {r['wall_s']} s {r['last_line'][:120]}")
        if r["rc"] or not res.exists():
            return {"error": r["tail"]}
        counts[n] = json.loads(res.read_text())
    row = per_step(counts[STEPS[0]], counts[STEPS[1]], STEPS[1] - STEPS[0])
    row["hook_ops_per_step"] = hook_steps(counts[STEPS[1]])
    row["top_ops_6"] = counts[STEPS[1]]["top"][:25]
    return row


def table(rows: dict[str, Any]) -> str:
    head = ("| run | ops / step | `_to_copy` + `copy_` / step | host syncs / step | `_local_scalar_dense` | `nonzero` | bool-mask `index` | "
            "bool-mask `index_put_` | other syncs | Python reads / step | ops per step 2..6 (hook) |")
    out = [head, "|---|" + "---|" * (head.count("|") - 2)]
    for name, r in rows.items():
        if "error" in r:
            out.append(f"| {name} | failed: {'; '.join(r['error'])[-120:]} |")
            continue
        syncs = r["syncs"]
        other = {k: v for k, v in syncs.items() if k not in SHOWN and v}
        out.append(f"| {name} | {r['ops']:,.0f} | {r.get('copies', float('nan')):,.0f} | {sum(syncs.values()):g} | "
                   + " | ".join(f"{syncs.get(k, 0):g}" for k in SHOWN)
                   + f" | {', '.join(f'{k} {v:g}' for k, v in other.items()) or '0'} | {sum(r['reads'].values()):g} "
                   f"({', '.join(f'{k} {v:g}' for k, v in r['reads'].items() if v)}) | "
                   f"{' / '.join(str(x) for x in r['hook_ops_per_step'])} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(RUNS))
    p.add_argument("--out", default=str(HERE / "results" / f"opcount-{time.strftime('%Y%m%d-%H%M%S')}"))
    p.add_argument("--trl-python", default="", help="default: benchmarks/results/.venv-trl (built if missing)")
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument("--resume", action="store_true", help="reuse the counts of runs OUT/work already holds")
    p.add_argument("--keep", default="", help="an earlier opcount.json: its rows not measured now go into the table "
                   "(TRL's rows do not change when alignkit does)")
    p.add_argument("--dtype", default="", help="alignkit's model.dtype (default: the workload's auto = fp32 on CPU)")
    p.add_argument("--compute-weights", default="", help="alignkit's model.compute_weights (cast or autocast)")
    a = p.parse_args(argv)
    model = {k: v for k, v in (("dtype", a.dtype), ("compute_weights", a.compute_weights)) if v}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds run_child, which stops its child
    names = [n for n in a.only.split(",") if n and not (a.skip_trl and n.startswith("trl"))]
    out = Path(a.out).resolve()
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    trl_python = a.trl_python
    if not trl_python and any(n.startswith("trl") for n in names):
        from bench_sft_dpo import ensure_trl_venv

        trl_python = str(ensure_trl_venv(HERE / "results" / ".venv-trl"))
    env = child_env("cpu", None, True)
    for cmd in (["model", str(work / "model"), "deep"], ["data", str(work / "data"), "96"]):
        r = run_child([sys.executable, str(HERE / "gpu_setup.py")] + cmd, env, 600, work / f"setup_{cmd[0]}.log", work)
        if r["rc"]:
            log(f"setup {cmd[0]} failed: {r['tail']}")
            return 1
    rows = {n: measure(n, work, trl_python, a.resume, model) for n in names}
    kept = json.loads(Path(a.keep).read_text()) if a.keep else {"rows": {}}
    rows = {n: rows.get(n) or kept["rows"][n] for n in RUNS if n in rows or n in kept["rows"]}
    commit = __import__("subprocess").run(["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"],
                                          capture_output=True, text=True).stdout.strip()
    text = (f"ops dispatched per optimizer step, deep model (24 layers, width 64), CPU, batch 8, max_length 2048"
            f"{''.join(f', {k} {v}' for k, v in model.items())}; "
            f"alignkit {commit} + working tree, {time.strftime('%Y-%m-%d %H:%M %Z')}"
            + (f"; rows not measured now from {a.keep} (alignkit {kept.get('commit')})" if a.keep else "")
            + "\n\n" + table(rows))
    (out / "opcount.json").write_text(json.dumps({"commit": commit, "rows": rows}, indent=1))
    (out / "opcount.md").write_text(text)
    print(text)
    log(f"results: {out / 'opcount.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
