"""The memory estimate as a plain-text table: a row per component, a column per strategy (``alignkit estimate``,
``validate`` and the start-up line of a run that does not fit)."""

from __future__ import annotations

from alignkit.planner.plan import GB, MemoryEstimate, MemoryInputs, fits

_ROWS = ("policy weights", "master weights (fp32)", "gradients", "optimizer states",
         "other trainable models", "zero3 working set", "reference model", "frozen models", "frozen pipeline parts", "activations",
         "optimizer step temp", "compute gradients (bf16)", "overhead", "process baseline")


def format_table(inputs: MemoryInputs, estimates: dict[str, MemoryEstimate],
                 device_memory_bytes: int | None = None, headroom: float = 0.9,
                 worst_case: dict[str, MemoryEstimate] | None = None) -> str:
    """Plain-text table: a row per component, a column per strategy, GB = 1e9 bytes. ``worst_case``: the same
    estimates at ``per_device_batch x max_length`` tokens, shown as two more rows when ``estimates`` were sized
    from the run's largest drawn micro-batch."""
    cols = list(estimates)
    d = inputs.policy
    mode = f"LoRA r={inputs.lora_r} {'+'.join(inputs.lora_targets)}" if inputs.lora_r else "full"
    lines = [f"per-GPU memory in GB (1 GB = 1e9 bytes); policy {d.n_params / 1e9:.2f}B {mode}, "
             f"{inputs.param_dtype}{' + fp32 master' if inputs.master_weights_fp32 else ''}, "
             f"{inputs.optimizer} ({inputs.optimizer_state_dtype} states), n_gpus={inputs.n_gpus}, "
             f"tokens/micro-batch={inputs.tokens}" + ("" if worst_case is None else " (largest drawn)")
             + f", GC={'on' if inputs.gradient_checkpointing else 'off'}"]
    width = max(22, *(len(c) + 2 for c in cols))
    fmt = lambda label, vals: f"{label:<24}" + "".join(f"{v:>{width}}" for v in vals)
    lines.append(fmt("component", cols))
    for row in _ROWS:
        if any(e.gpu.get(row) for e in estimates.values()):  # all-zero rows are left out
            lines.append(fmt(row, [f"{e.gpu[row] / GB:.1f}" if row in e.gpu else "-"
                                   for e in estimates.values()]))
    lines.append(fmt("total", [f"{e.total / GB:.1f}" for e in estimates.values()]))
    if worst_case is not None:
        label = f"worst case ({inputs.worst_case_tokens} tok)"
        lines.append(fmt("  activations", [f"{worst_case[c].gpu['activations'] / GB:.1f}" for c in cols]))
        lines.append(fmt(f"  {label}"[:24], [f"{worst_case[c].total / GB:.1f}" for c in cols]))
    if any(e.cpu for e in estimates.values()):
        lines.append(fmt("host RAM per rank", [f"{e.cpu_total / GB:.1f}" if e.cpu else "-"
                                               for e in estimates.values()]))
    if device_memory_bytes is not None:
        label = f"fits (<= {headroom * device_memory_bytes / GB:.1f})"
        lines.append(fmt(label, ["yes" if fits(e, device_memory_bytes, headroom) else "no"
                                 for e in estimates.values()]))
    cast = any(e.gpu.get("compute gradients (bf16)") for e in estimates.values())
    lines.append("total = persistent rows + max(activations, optimizer step temp"
                 + (", compute gradients (bf16))" if cast else ")"))
    return "\n".join(lines)
