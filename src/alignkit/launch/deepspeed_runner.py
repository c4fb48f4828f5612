"""``python -m alignkit.launch.deepspeed_runner ARGS``: DeepSpeed's runner (``deepspeed.launcher.runner ARGS``) with
its launcher child armed with the parent-death signal, as ``alignkit launch --launcher deepspeed`` starts it.

On one node DeepSpeed's chain is runner -> ``deepspeed.launcher.launch`` -> the workers. ``alignkit launch`` arms
the runner (:func:`run.supervise`) and the workers arm themselves against ``launch`` (``LAUNCHED_ENV``), but the
runner neither arms ``launch`` nor, on one node, stops it when it gets SIGTERM: killed with ``alignkit launch``,
the runner died and left ``launch`` and its workers training on. Here the runner's ``subprocess.Popen`` gives the
``launch`` child SIGTERM when the runner dies (:func:`parent_death.preexec`); ``launch``'s own SIGTERM handler then
ends its workers' process trees, as torchrun ends its workers.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from alignkit.launch.parent_death import preexec


class ArmedPopen(subprocess.Popen):  # type: ignore[type-arg]
    """``subprocess.Popen`` whose child gets SIGTERM when this process dies (unless a ``preexec_fn`` is given)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("preexec_fn", preexec())
        super().__init__(*args, **kwargs)


class ArmedSubprocess:
    """The ``subprocess`` module as the runner sees it: :class:`ArmedPopen` for ``Popen``, the rest unchanged."""

    Popen = ArmedPopen

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)


def main(argv: list[str] | None = None) -> None:
    from deepspeed.launcher import runner

    runner.subprocess = ArmedSubprocess()  # the runner's own name for the module, nobody else's
    runner.main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
