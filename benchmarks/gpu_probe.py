"""Runs a training command unchanged (``-m alignkit train CFG`` or a script with its arguments) inside this
process, with probes keyed to its optimizer steps (a global ``torch.optim`` step hook, so alignkit and TRL's
Trainer are probed the same way, without touching either):

* ``--profile STEP --trace FILE``: ``torch.profiler`` records optimizer step STEP (1-based: from the end of
  step STEP-1 to the end of step STEP; step STEP-1 is the profiler's warm-up) and writes a Chrome trace
  (``.json.gz``). ``gpu_report.trace_summary`` reads it: top CUDA kernels, GPU idle gaps, sync calls.
* ``--opcount FILE``: counts every aten op the run dispatches (``TorchDispatchMode``: a CPU proxy for GPU
  kernel launches), the ops among them that make a GPU wait for the host (``SYNC_OPS``, a boolean-mask
  index, ``repeat_interleave`` without ``output_size``, a copy from a device to the CPU) and the Python-level
  reads of a tensor's value (``Tensor.tolist``/``item``/``bool()``/...: ``TorchFunctionMode``; on a CPU run
  they include reads of host-side tensors, so an upper bound). Totals, and a snapshot at every optimizer step.

usage: python gpu_probe.py [--profile N --trace F] [--opcount F] -- (-m MODULE | SCRIPT) [ARGS...]
The target's exit status is this process's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import runpy
import sys
from typing import Any, Callable

#: aten ops that read device memory on the host (every one a full GPU sync); nonzero_static is not one
SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "argwhere", "unique", "_unique", "_unique2", "unique_dim",
                      "unique_consecutive", "unique_dim_consecutive", "masked_select", "equal", "is_nonzero"})
#: Tensor methods that hand a tensor's value to Python
HOST_READS = frozenset({"tolist", "item", "numpy", "__bool__", "__float__", "__int__", "__index__"})


def sync_kind(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why this aten call would make a GPU wait for the host (a short name), or None."""
    import torch

    name = func.overloadpacket.__name__
    if name in SYNC_OPS:
        return name
    if name == "repeat_interleave" and func._overloadname != "self_int" and kwargs.get("output_size") is None:
        return "repeat_interleave"  # its output size depends on the repeats' values
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
            return f"{name}[bool mask]"  # a mask index is a nonzero inside the kernel
    if name in ("_to_copy", "copy_"):
        src = args[1] if name == "copy_" else args[0]
        dst = args[0].device if name == "copy_" else kwargs.get("device")
        if isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst is not None \
                and torch.device(dst).type == "cpu":
            return "copy to cpu"
    return None


def make_counters() -> tuple[Any, Any]:
    """(dispatch counter, Python-read counter): context managers with ``ops``, ``syncs`` and ``reads`` Counters."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Dispatched(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter[str] = collections.Counter()
            self.syncs: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            self.ops[func.overloadpacket.__name__] += 1
            why = sync_kind(func, args, kwargs)
            if why:
                self.syncs[why] += 1
            return func(*args, **kwargs)

    class Reads(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.reads: collections.Counter[str] = collections.Counter()

        def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            name = getattr(func, "__name__", "")
            if name in HOST_READS:
                self.reads[name] += 1
            return func(*args, **(kwargs or {}))

    return Dispatched(), Reads()


def target_runner(target: list[str]) -> Callable[[], Any]:
    """``-m MODULE ARGS`` or ``SCRIPT ARGS`` run as ``python`` would (sys.argv, sys.path, ``__main__``)."""
    if target[0] == "-m":
        sys.argv = [target[1]] + target[2:]
        return lambda: runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    sys.argv = list(target)
    sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
    return lambda: runpy.run_path(target[0], run_name="__main__")


def start_profiler(step: int, trace: str) -> Any:
    """A profiler whose schedule ends on optimizer step ``step`` (advanced by the step hook)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities, schedule=schedule(wait=max(step - 2, 0), warmup=1, active=1, repeat=1),
                   on_trace_ready=lambda p: p.export_chrome_trace(trace), record_shapes=False, with_stack=False)
    prof.start()
    return prof


def run(a: argparse.Namespace, target: list[str]) -> int:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    prof = start_profiler(a.profile, a.trace) if a.profile else None
    dispatched, reads = make_counters() if a.opcount else (None, None)
    snapshots: list[dict[str, Any]] = []

    def on_step(*_: Any) -> None:
        if prof is not None:
            prof.step()
        if dispatched is not None:
            snapshots.append({"ops": sum(dispatched.ops.values()), "syncs": dict(dispatched.syncs),
                              "reads": dict(reads.reads)})

    register_optimizer_step_post_hook(on_step)
    runner, status = target_runner(target), 0
    try:
        if dispatched is not None:
            with reads, dispatched:
                runner()
        else:
            runner()
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        if prof is not None:
            prof.stop()  # a run shorter than the profiled step writes what it recorded
    if dispatched is not None:
        with open(a.opcount, "w", encoding="utf-8") as f:
            json.dump({"total": sum(dispatched.ops.values()), "syncs": dict(dispatched.syncs), "reads": dict(reads.reads),
                       "steps": snapshots, "top": dispatched.ops.most_common(60), "status": status}, f, indent=1)
    return status


def main() -> None:
    argv = sys.argv[1:]
    if "--" not in argv:
        raise SystemExit(__doc__)
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="gpu_probe.py")
    p.add_argument("--profile", type=int, default=0, help="optimizer step to profile (1-based; 0: none)")
    p.add_argument("--trace", default="", help="the profiled step's Chrome trace (.json or .json.gz)")
    p.add_argument("--opcount", default="", help="write op counts (JSON) here")
    a = p.parse_args(argv[:cut])
    if a.profile and not a.trace:
        p.error("--profile needs --trace")
    sys.exit(run(a, argv[cut + 1:]))


if __name__ == "__main__":
    main()
