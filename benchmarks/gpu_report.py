"""The numbers of ``bench_gpu.py`` (standard library only: the parent process never imports torch):
tok/s over the timed steps from alignkit's ``metrics.jsonl`` or a TRL child's step stamps, MFU against the
measured GEMM peak, and what a ``torch.profiler`` trace of one step shows (top CUDA kernels, GPU idle gaps,
host sync calls; top CPU ops by self time when there is no GPU)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

#: FLOPs per parameter per token of each kind of row (attention FLOPs not counted), as in the issue's table
FLOPS_PER_TOKEN = {"sft": 6, "dpo": 8, "lora": 4}
#: a gap between two GPU activities at least this long (us) is counted as the GPU waiting for the host
GAP_US = 10.0
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
#: the TRL SFT rows TRL-best is chosen from (a padding-free row under plain SDPA is not a correct training)
TRL_SFT = ("trl_sft_padded", "trl_sft_pf", "trl_sft_pf_liger")


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def alignkit_speed(run_dir: Path, warm: int) -> dict[str, Any] | None:
    """Mean ``tokens_per_s`` of the logged windows after step ``warm`` (summarize.py's reading), peak memory,
    first and last loss. GRPO rows (``time/*_s``): seconds and samples per iteration instead."""
    f = run_dir / "metrics.jsonl"
    if not f.exists():
        return None
    rows = [r for r in _rows(f) if "step" in r]
    win = [r for r in rows if r["step"] > warm]
    if not win:
        return None
    out: dict[str, Any] = {"peak_mib": max(r.get("peak_mem_mb", 0.0) for r in rows), "steps": [r["step"] for r in win],
                           "loss_first": rows[0].get("loss"), "loss_last": win[-1].get("loss")}
    if any(k.startswith("time/") for k in win[0]):
        secs = [sum(v for k, v in r.items() if k.startswith("time/") and k.endswith("_s")) for r in win]
        out["s_per_step"] = sum(secs) / len(secs)
        out["generate_s"] = sum(r.get("time/generate_s", 0.0) for r in win) / len(win)
        out["update_s"] = sum(r.get("time/update_s", 0.0) for r in win) / len(win)
        return out
    out["tok_s"] = sum(r["tokens_per_s"] for r in win) / len(win)
    start = [r["time"] for r in rows if r["step"] == warm and "time" in r]
    if start and "time" in win[-1]:  # wall clock between the log lines of steps warm and last: everything
        out["s_per_step"] = (win[-1]["time"] - start[0]) / (win[-1]["step"] - warm)
    return out


def trl_speed(result: Path, warm: int) -> dict[str, Any] | None:
    """Tokens (or GRPO samples) of steps warm+1.. over the time from the end of step ``warm`` to the last."""
    if not result.exists():
        return None
    r = json.loads(result.read_text(encoding="utf-8"))
    t, k = r["step_end"], r["step_tokens"]
    if len(t) <= warm or warm < 1:
        return None
    window = t[-1] - t[warm - 1]
    out = {"tok_s": sum(k[warm:]) / window, "s_per_step": window / (len(t) - warm), "peak_mib": r.get("peak_mem_mib"),
           "steps": list(range(warm + 1, len(t) + 1)), "tokens_per_step": sum(k[warm:]) / (len(t) - warm),
           "trl": r.get("trl"), "optim": r.get("optim"), "attention": r.get("attention"),
           "frozen_dtype": r.get("frozen_dtype"), "liger": r.get("liger")}
    if r.get("spec", {}).get("algo") == "grpo":
        out["samples_per_s"] = out.pop("tok_s")
    return out


def mfu(kind: str | None, n_params: float, tok_s: float | None, peak_tflops: float | None) -> float | None:
    if not kind or not tok_s or not peak_tflops:
        return None
    return FLOPS_PER_TOKEN[kind] * n_params * tok_s / (peak_tflops * 1e12)


# ---------------------------------------------------------------- profiler traces
def _load_events(trace: Path) -> list[dict[str, Any]]:
    opener = gzip.open if trace.suffix == ".gz" else open
    with opener(trace, "rt", encoding="utf-8") as f:  # type: ignore[operator]
        return json.load(f).get("traceEvents", [])


def _self_times(ops: list[dict[str, Any]]) -> dict[str, list[float]]:
    """name -> [calls, self us] of CPU ops (an op's time less that of the ops nested in it, per thread)."""
    out: dict[str, list[float]] = {}
    by_tid: dict[Any, list[dict[str, Any]]] = {}
    for e in ops:
        by_tid.setdefault(e.get("tid"), []).append(e)
    for events in by_tid.values():
        events.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0))))
        stack: list[list[Any]] = []  # [end, name, time of nested ops, duration]
        for e in events + [{"ts": float("inf"), "dur": 0, "name": None}]:
            ts = float(e["ts"])
            while stack and stack[-1][0] <= ts:
                end, name, child, dur = stack.pop()
                acc = out.setdefault(name, [0, 0.0])
                acc[0] += 1
                acc[1] += dur - child
                if stack:
                    stack[-1][2] += dur
            if e["name"] is not None:
                dur = float(e.get("dur", 0))
                stack.append([ts + dur, e["name"], 0.0, dur])
    return out


def gpu_gaps(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Busy time (union over streams), span and idle gaps of GPU activities (kernels, copies, memsets)."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("name", "")) for e in events)
    busy, gaps = 0.0, []
    cur_start, cur_end, last_name = spans[0][0], spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append((start - cur_end, last_name, name))
            cur_start = start
        if end >= cur_end:
            cur_end, last_name = end, name
    busy += cur_end - cur_start
    span = cur_end - spans[0][0]
    big = [g for g in gaps if g[0] >= GAP_US]
    return {"gpu_span_ms": span / 1e3, "gpu_busy_ms": busy / 1e3, "gpu_idle_ms": (span - busy) / 1e3,
            "gpu_idle_frac": (span - busy) / span if span else 0.0, f"gaps_over_{GAP_US:g}us": len(big),
            "idle_in_gaps_over_10us_ms": sum(g[0] for g in big) / 1e3,
            "largest_gaps": [{"us": round(g[0], 1), "after": g[1][:70], "before": g[2][:70]}
                             for g in sorted(gaps, reverse=True)[:5]]}


def trace_summary(trace: Path, top: int = 12) -> dict[str, Any]:
    """What one profiled step did: its wall time, kernel launches, top kernels, GPU gaps and sync calls."""
    events = [e for e in _load_events(trace) if e.get("ph") == "X"]
    cat = lambda e: str(e.get("cat", "")).lower()  # noqa: E731
    steps = [e for e in events if cat(e) == "user_annotation" and str(e.get("name", "")).startswith("ProfilerStep#")]
    cpu_ops = [e for e in events if cat(e) == "cpu_op"]
    out: dict[str, Any] = {"step_ms": sum(float(e["dur"]) for e in steps) / 1e3 if steps else None,
                           "cpu_ops": len(cpu_ops)}
    selfs = sorted(_self_times(cpu_ops).items(), key=lambda kv: -kv[1][1])[:top]
    out["top_cpu_ops"] = [{"name": n[:70], "calls": int(c), "self_ms": round(t / 1e3, 2)} for n, (c, t) in selfs]
    gpu = [e for e in events if cat(e) in GPU_CATS]
    if not gpu:
        return out
    kernels: dict[str, list[float]] = {}
    for e in gpu:
        acc = kernels.setdefault(str(e.get("name", "")), [0, 0.0])
        acc[0] += 1
        acc[1] += float(e.get("dur", 0))
    total = sum(v[1] for v in kernels.values()) or 1.0
    out["kernels"] = sum(1 for e in gpu if cat(e) == "kernel")
    out["top_kernels"] = [{"name": n[:90], "calls": int(c), "ms": round(t / 1e3, 3), "share": round(t / total, 4)}
                          for n, (c, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]]
    out.update(gpu_gaps(gpu))
    runtime = [str(e.get("name", "")) for e in events if cat(e) == "cuda_runtime"]
    syncs = [n for n in runtime if "Synchronize" in n or n in ("cudaMemcpy", "cudaStreamQuery")]
    out["sync_calls"] = {n: syncs.count(n) for n in sorted(set(syncs))}
    out["dtoh_copies"] = sum(1 for e in gpu if cat(e) == "gpu_memcpy" and "DtoH" in str(e.get("name", "")))
    return out


# ---------------------------------------------------------------- the summary
def pairs(rows: dict[str, Any], names: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """alignkit / TRL speed and peak-memory ratios of the pairs that both ran."""
    out = []
    for a, b in names:
        ra, rb = rows.get(a) or {}, rows.get(b) or {}
        key = "samples_per_s" if "samples_per_s" in ra or "samples_per_s" in rb else "tok_s"
        if ra.get(key) and rb.get(key):
            mem = ra["peak_mib"] / rb["peak_mib"] if ra.get("peak_mib") and rb.get("peak_mib") else None
            out.append({"alignkit": a, "trl": b, "speed": ra[key] / rb[key], "memory": mem})
    return out


def _fmt(x: Any, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _profile_lines(name: str, p: dict[str, Any]) -> list[str]:
    lines = [f"### {name}: one profiled step", ""]
    if "error" in p:
        return lines + [f"trace not readable: {p['error']}", ""]
    lines.append(f"step {_fmt(p.get('step_ms'), '.1f')} ms wall, {p.get('cpu_ops')} CPU ops"
                 + (f", {p['kernels']} kernels, {p.get('dtoh_copies', 0)} device-to-host copies" if "kernels" in p else ""))
    if "gpu_busy_ms" in p:
        lines += [f"GPU busy {p['gpu_busy_ms']:.1f} ms of a {p['gpu_span_ms']:.1f} ms span: idle {p['gpu_idle_ms']:.1f} ms "
                  f"({p['gpu_idle_frac']:.0%}), {p.get(f'gaps_over_{GAP_US:g}us')} gaps >= {GAP_US:g} us holding "
                  f"{p['idle_in_gaps_over_10us_ms']:.1f} ms; sync calls {p.get('sync_calls')}", "",
                  "| top CUDA kernels | calls | ms | share |", "|---|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['calls']} | {k['ms']:.2f} | {k['share']:.1%} |" for k in p["top_kernels"]]
        lines += ["", "largest gaps (us, between): " + "; ".join(
            f"{g['us']:.0f} ({g['after'][:40]} -> {g['before'][:40]})" for g in p["largest_gaps"])]
    lines += ["", "top CPU ops by self time: " + ", ".join(f"{o['name']} {o['self_ms']:.1f} ms x{o['calls']}"
                                                          for o in p.get("top_cpu_ops", [])[:8]), ""]
    return lines


def _note(r: dict[str, Any]) -> str:
    """Why a row is empty (skipped, with the reason; the error's tail), its frozen weights' dtype, Liger."""
    parts = [r["skipped"]] if r.get("skipped") else []
    parts += ["; ".join(r.get("error") or [])[-160:]] if r.get("rc") else []
    parts += [f"frozen {r['frozen_dtype']}"] if r.get("frozen_dtype") else []
    parts += ["use_liger_kernel"] if r.get("liger") else []
    return "; ".join(parts)


def render(res: dict[str, Any]) -> str:
    """The markdown summary: the speed table, the ratios, GRPO, the profiles."""
    setup, rows = res.get("setup", {}), res.get("rows", {})
    gemm, model, ver = setup.get("gemm") or {}, setup.get("make_model") or {}, dict(setup.get("versions") or {})
    ver["trl"] = ver.get("trl") or next((r["trl"] for r in rows.values() if r.get("trl")), None)
    out = [f"# bench_gpu.py ({res.get('started')}, alignkit {setup.get('commit')}, {res.get('elapsed_s')} s)", "",
           f"device: {ver.get('gpu') or 'CPU'}; torch {ver.get('torch')} (CUDA {ver.get('cuda')}), transformers "
           f"{ver.get('transformers')}, peft {ver.get('peft')}, TRL {ver.get('trl')}, python {ver.get('python')}",
           f"model: {model.get('size')} ({_fmt(model.get('n_params'), ',')} parameters); GEMM peak "
           f"{_fmt(gemm.get('gemm_tflops'), '.3g')} TFLOP/s ({gemm.get('gemm')}); MFU = k*N*tok/s / peak "
           "(k: SFT 6, DPO 8, LoRA 4; attention FLOPs not counted)", "",
           "every row's device, versions and attention kernel: results.json; frozen = the DPO reference / LoRA base",
           "", "| run | tok/s | MFU | peak MiB | s/step | window | loss first -> last | wall s | attention | note |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if name.endswith("grpo"):
            continue
        out.append(f"| {name} | {_fmt(r.get('tok_s'), ',.0f')} | {_fmt(r.get('mfu'), '.1%')} | "
                   f"{_fmt(r.get('peak_mib'), ',.0f')} | {_fmt(r.get('s_per_step'), '.3f')} | {r.get('timed_window', '')} | "
                   f"{_fmt(r.get('loss_first'), '.4g')} -> {_fmt(r.get('loss_last'), '.4g')} | {_fmt(r.get('wall_s'), '.0f')} "
                   f"| {r.get('attention') or '-'} | {_note(r)} |")
    grpo = {k: v for k, v in rows.items() if k.endswith("grpo")}
    if grpo:
        out += ["", "| GRPO run | s/iteration | samples/s | generate s | update s | peak MiB | wall s | note |",
                "|---|---|---|---|---|---|---|---|"]
        for name, r in grpo.items():
            note = _note(r)
            out.append(f"| {name} | {_fmt(r.get('s_per_step'), '.3f')} | {_fmt(r.get('samples_per_s'), '.1f')} | "
                       f"{_fmt(r.get('generate_s'), '.3f')} | {_fmt(r.get('update_s'), '.3f')} | "
                       f"{_fmt(r.get('peak_mib'), ',.0f')} | {_fmt(r.get('wall_s'), '.0f')} | {note} |")
    fair = {k: r for k, r in rows.items() if k in TRL_SFT and r.get("tok_s")
            and "not a correct" not in str(r.get("attention"))}
    if fair and (rows.get("ak_sft") or {}).get("tok_s"):
        best = max(fair, key=lambda k: fair[k]["tok_s"])
        out += ["", f"SFT TRL-best (the fastest correct TRL SFT row): {best}; ak_sft / {best}: "
                    f"{rows['ak_sft']['tok_s'] / fair[best]['tok_s']:.2f}x"]
    out += ["", "alignkit / TRL: " + ("; ".join(f"{p['alignkit']} / {p['trl']}: speed {p['speed']:.2f}x, memory "
                                                 f"{_fmt(p['memory'], '.2f')}x" for p in res.get("pairs", [])) or "-"), ""]
    for name, r in rows.items():
        if r.get("profile"):
            out += _profile_lines(name, r["profile"])
    return "\n".join(out) + "\n"
