"""Per-completion sampling streams: a completion's random numbers come from a seed derived from (the run's
seed, the iteration, the prompt's index in the data set, the completion's index in its group), never from a
process's global generator. The same run therefore draws the same completions whichever process generates them
and however they are batched: one process or several, trainer ranks (``rollout.placement: colocated``) or
generator ranks (``separate``), a resumed run or an uninterrupted one. Engines read the seed off each
:class:`~alignkit.models.generation.Prompt` (``hf``: a ``torch.Generator`` per row, ``vllm``: the request's
``seed``).
"""

from __future__ import annotations

import hashlib
import struct

#: seeds fit a signed 63-bit integer (torch's ``manual_seed`` and vLLM's request seed take it)
SEED_MASK = (1 << 63) - 1


def sample_seed(seed: int, iteration: int, prompt: int, generation: int, stream: str = "") -> int:
    """The seed of completion ``generation`` of data-set prompt ``prompt`` in ``iteration`` of a run seeded
    ``seed``; ``stream`` separates the draws of different roles of one rollout (red-team RL's target). A hash
    (BLAKE2b), so nearby tuples give unrelated streams."""
    key = struct.pack("<4q", seed, iteration, prompt, generation) + stream.encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & SEED_MASK


def completion_seeds(seed: int, iteration: int, prompts: list[int], num_generations: int) -> list[int]:
    """The seeds of an iteration's completions in order: each prompt index of ``prompts`` (a data-set index per
    completion, a group's ``num_generations`` consecutive) with its generation index within the group."""
    return [sample_seed(seed, iteration, p, i % num_generations) for i, p in enumerate(prompts)]


def with_stream(seeds: list[int], stream: str) -> list[int]:
    """``seeds`` re-derived for another ``stream`` of the same completions (a role's own draws); the policy's
    stream (``"policy"``) keeps the seeds as they are."""
    if stream == "policy":
        return list(seeds)
    return [sample_seed(s, 0, 0, 0, stream) for s in seeds]


def turn_seed(seed: int, turn: int) -> int:
    """The seed of a multi-turn trajectory's policy turn ``turn`` (``rollout/agents/trajectory.py``) whose row has
    ``seed``: the row's own for the first turn, then one derived per turn, so every turn draws fresh numbers and
    the same ones wherever (and with whichever other trajectories) it is generated."""
    return seed if turn == 0 else sample_seed(seed, turn, 0, 0, "turn")


def eval_seeds(seed: int, prompts: list[int], samples: int) -> list[int]:
    """The seeds of a sampled evaluation (``rollout.eval_samples``): ``samples`` per eval-set index of ``prompts``,
    in that order, on a stream of their own (``"eval"``), the same at every evaluation of a run (the curve then
    compares the policies on the same draws) and apart from every training completion's."""
    return [sample_seed(seed, 0, p, k, "eval") for p in prompts for k in range(samples)]
