"""``deepspeed_group.redirect``: a backend's group-less collectives get the trainers' group, and a second run in
the same process (a new group) replaces the first redirect instead of wrapping it."""

from __future__ import annotations

from typing import Any

from alignkit.distributed.strategy.deepspeed_group import redirect


class Backend:
    def all_reduce(self, tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        return group

    def barrier(self, group: Any = None) -> Any:
        return group


def test_redirect_defaults_the_group_and_can_be_applied_again() -> None:
    backend = Backend()
    redirect(backend, "first")
    assert backend.all_reduce("t") == "first" and backend.barrier() == "first"
    assert backend.all_reduce("t", group="mine") == "mine" and backend.barrier("mine") == "mine"
    redirect(backend, "second")  # wrapping the wrapper raised "no group parameter found"
    assert backend.all_reduce("t") == "second" and backend.barrier(None) == "second"
    assert backend.all_reduce("t", None, "mine") == "mine"
