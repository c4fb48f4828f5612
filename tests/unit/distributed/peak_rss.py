"""Peak-RSS measurement in a fresh child process, for the tests that check the planner's CPU estimate.

Why not ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` in the child: Linux keeps a process's peak RSS across
``execve`` (the old memory map's high-water mark is folded into ``ru_maxrss``), and ``subprocess`` starts the
child with ``vfork``/``fork`` + ``exec`` from the calling process. So the child's ``ru_maxrss`` is at least the
*parent's* peak: inside a pytest-xdist worker that has run heavier tests, that is the worker's peak, not the
measured step's (``tests/unit/distributed``'s cast check read 435 MB in a full run, 357 alone). ``VmHWM`` in
``/proc/self/status`` is the high-water mark of the child's own memory map, which starts with ``exec``; the
child also resets it to its current RSS just before its baseline (``/proc/self/clear_refs``: ``5``), so the
peak is the step's, after the imports.

The child's environment is built, not inherited: only what finds Python and the package, the allocator and
thread settings the measurement pins, nothing a previous test left in ``os.environ``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from tests.conftest import REPO

#: Python source the measuring script starts with: ``reset_peak()`` then ``peak_bytes()``.
PEAK_HELPERS = '''
def _status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(field + " not in /proc/self/status")


def reset_peak():
    try:  # 5: reset the peak RSS to the current RSS (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # VmHWM then includes the imports' peak, still below the step's


def peak_bytes():
    return _status_bytes("VmHWM")
'''

#: passed through when set: where Python, the package and (offline) Hugging Face files are found
_KEEP = ("PATH", "HOME", "TMPDIR", "LANG", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VIRTUAL_ENV")


def measure_env(threads: int) -> dict[str, str]:
    """The child's whole environment: glibc returns freed activations' pages at once (otherwise its mmap
    threshold rises after the first free and the heap keeps them: ~+0.3 GB RSS), ``threads`` intra-op threads."""
    env = {k: os.environ[k] for k in _KEEP if k in os.environ}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p)
    n = str(threads)
    env.update({"MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n,
                "TOKENIZERS_PARALLELISM": "false"})
    return env


def measure(script: str, threads: int, timeout: float) -> dict[str, Any]:
    """Run ``PEAK_HELPERS + script`` in a fresh interpreter; its last stdout line is the JSON it prints."""
    out = subprocess.run([sys.executable, "-c", PEAK_HELPERS + script], capture_output=True, text=True,
                         env=measure_env(threads), timeout=timeout, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])
