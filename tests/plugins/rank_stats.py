"""Every rank writes the statistics of each iteration's experience (``Experience.stats``, the numbers the algorithm
logs for the iteration) to ``$ALIGNKIT_TEST_RANK_STATS/rank_R.json``, so a test can check that every rank computed
the same ones (only rank 0 logs them). Timings and a rank's own time shares are left out.

Use: ``plugins: [tests.plugins.rank_stats]`` with ``ALIGNKIT_TEST_RANK_STATS`` set in the processes' environment.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from alignkit.distributed import comm
from alignkit.train import online_loop

_original = getattr(online_loop.OnlineTrainer, "_unspied_rollout", online_loop.OnlineTrainer._rollout)
online_loop.OnlineTrainer._unspied_rollout = _original
_seen: list[dict] = []


def _spy(self, state):  # type: ignore[no-untyped-def]
    experience, took = _original(self, state)
    folder = os.environ.get("ALIGNKIT_TEST_RANK_STATS")
    if folder:
        _seen.append({k: v for k, v in experience.stats.means().items()
                      if not k.endswith("_s") and "per_s" not in k and "time_share" not in k})
        (Path(folder) / f"rank_{comm.rank()}.json").write_text(json.dumps(_seen))
    return experience, took


online_loop.OnlineTrainer._rollout = _spy
