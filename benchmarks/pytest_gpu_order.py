"""A pytest plugin (``-p pytest_gpu_order`` with ``benchmarks/`` on the path) that runs the tests named in
``$GPU_TESTS_FIRST`` (node-id prefixes, space-separated) first, in that order, then the rest in collection order.
``gpu_checks.sh`` lists there the gpu tests that no GPU run has reached yet: a run cut by its time limit has
then spent its minutes on them, not on tests that ran before. It sorts after every other plugin (the project's
conftest orders files by weight for xdist)."""

from __future__ import annotations

import os
from typing import Any

import pytest


def rank(nodeid: str, first: list[str]) -> int:
    """The index of the first prefix of ``first`` that names ``nodeid`` (a file, a test, or one parameter set)."""
    for i, prefix in enumerate(first):
        if nodeid == prefix or nodeid.startswith((prefix + "::", prefix + "[")):
            return i
    return len(first)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    first = os.environ.get("GPU_TESTS_FIRST", "").split()
    items.sort(key=lambda item: rank(item.nodeid, first))  # stable: the rest keep their order
