"""Counting the host syncs of a training step on CPU (ARCHITECTURE 9b).

On a GPU, an op whose result the host must read (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``,
``nonzero``, ``unique``, ``masked_select``, ``repeat_interleave`` without ``output_size``, a copy to the CPU)
makes the host wait until the device has run everything queued before it, and the device then idles while
the host launches the next kernels. On a CPU nothing waits, so such code looks free there: this counts the
ops anyway, and boolean-mask indexing (``x[mask]``: a ``nonzero`` inside the kernel). :class:`SyncCounter` is a ``TorchDispatchMode`` that records every such op with the alignkit
line that asked for it; ``.tolist()`` and ``.numpy()`` do not dispatch an op on a CPU tensor, so they are
counted by wrapping the ``Tensor`` methods while a counter is active. :func:`host_side` marks code that
works on host data (a collator's CPU tensors, loss-unit counts): it is not counted.
"""

from __future__ import annotations

import collections
import contextlib
import traceback
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

#: ops that need their input's values on the host (a device->host read, i.e. a sync on an accelerator)
SYNC_OPS = frozenset({"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "nonzero_static", "unique",
                      "_unique", "_unique2", "unique_dim", "unique_consecutive", "masked_select"})

_ACTIVE: list["SyncCounter"] = []


def _where() -> str:
    """The innermost alignkit frame (file:line function) of the current stack."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/alignkit/" in frame.filename and "host_syncs" not in frame.filename:
            return f"{frame.filename.split('/alignkit/')[-1]}:{frame.lineno} {frame.name}"
    return "?"


class SyncCounter(TorchDispatchMode):
    """Counts host-sync ops (see the module doc) while active; ``syncs`` maps op -> Counter of call sites."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.ops = 0
        self.paused = 0

    def record(self, name: str) -> None:
        if not self.paused:
            self.syncs[name][_where()] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.ops += 1
        if name in SYNC_OPS:
            self.record(name)
        elif name == "repeat_interleave" and isinstance(args[1] if len(args) > 1 else None, torch.Tensor) \
                and kwargs.get("output_size") is None:
            self.record("repeat_interleave without output_size")
        elif name in ("index", "index_put", "index_put_", "_index_put_impl_") and _bool_index(args):
            self.record("boolean-mask indexing")  # x[mask] needs the mask's count on the host (a nonzero)
        elif name in ("_to_copy", "copy_") and _to_host(func, args, kwargs):
            self.record("copy to the CPU")
        return func(*args, **kwargs)

    def total(self) -> int:
        return sum(sum(c.values()) for c in self.syncs.values())

    def report(self) -> str:
        return "; ".join(f"{op} x{n} at {where}" for op, sites in self.syncs.items() for where, n in sites.items())

    def __enter__(self) -> "SyncCounter":
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)
        super().__exit__(*exc)


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """A copy from an accelerator tensor to the CPU (never true on a CPU-only run: there is nothing to copy)."""
    src = args[1] if func.overloadpacket.__name__ == "copy_" else args[0]
    dst = args[0].device if func.overloadpacket.__name__ == "copy_" else kwargs.get("device")
    return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst is not None and \
        torch.device(dst).type == "cpu"


def _counting(method: Callable[..., Any], label: str) -> Callable[..., Any]:
    def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        for counter in _ACTIVE:
            counter.record(label)
        return method(self, *args, **kwargs)

    return wrapper


@contextlib.contextmanager
def count_syncs() -> Iterator[SyncCounter]:
    """A :class:`SyncCounter` for the block, with ``Tensor.tolist`` / ``Tensor.numpy`` counted too."""
    originals = {"tolist": torch.Tensor.tolist, "numpy": torch.Tensor.numpy}
    counter = SyncCounter()
    try:
        for name, method in originals.items():
            setattr(torch.Tensor, name, _counting(method, f".{name}()"))
        with counter:
            yield counter
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


def host_side(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run outside every active counter: code that reads host data by design (collation, unit counts)."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for counter in _ACTIVE:
            counter.paused += 1
        try:
            with _disable_current_modes():
                return fn(*args, **kwargs)
        finally:
            for counter in _ACTIVE:
                counter.paused -= 1

    return wrapper
