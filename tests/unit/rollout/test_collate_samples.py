"""``collate_samples`` (one tensor per field from Python rows) equals the per-sample layout it replaced,
field by field and dtype by dtype; the scalar-model batches of a rollout are collated only when used."""

from __future__ import annotations

import random

import pytest
import torch

from alignkit.algorithms.ppo import PPO
from alignkit.constants import IGNORE_INDEX
from alignkit.rollout.context import LazyBatches
from alignkit.rollout.experience import collate_samples

#: every per-token field a shipped algorithm declares (PPO's: the shared ones and its critics'), and two sequence fields
TOKEN_FIELDS, SEQUENCE_FIELDS = PPO.token_fields, ("rewards", "costs")


def reference_collate(samples: list[dict], pad: int) -> dict[str, torch.Tensor]:
    """The per-sample loop collate_samples had before (a tensor per sample and field)."""
    lengths = [len(s["prompt_ids"]) + len(s["completion_ids"]) for s in samples]
    B, T = len(samples), max(lengths)
    ids = torch.full((B, T), pad, dtype=torch.long)
    targets = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    fields = [f for f in TOKEN_FIELDS if f in samples[0]]
    extra = {f: torch.zeros((B, T), dtype=torch.float32) for f in fields}
    for b, s in enumerate(samples):
        p, c = len(s["prompt_ids"]), len(s["completion_ids"])
        ids[b, : p + c] = torch.tensor(s["prompt_ids"] + s["completion_ids"])
        attn[b, : p + c] = 1
        targets[b, p - 1 : p - 1 + c] = torch.tensor(s["completion_ids"], dtype=torch.long)
        for f in fields:
            extra[f][b, p - 1 : p - 1 + c] = torch.as_tensor(s[f], dtype=torch.float32)
    out = {"input_ids": ids, "attention_mask": attn, "targets": targets,
           "seq_index": torch.arange(B).unsqueeze(1).expand(-1, T).masked_fill(attn == 0, -1),
           "response_lengths": torch.tensor([len(s["completion_ids"]) for s in samples]), **extra}
    for f in SEQUENCE_FIELDS:
        if f in samples[0]:
            out[f] = torch.tensor([float(s[f]) for s in samples], dtype=torch.float32)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_collate_samples_equals_the_per_sample_layout(seed: int) -> None:
    rng = random.Random(seed)
    samples = []
    for _ in range(rng.randint(1, 9)):
        p, c = rng.randint(1, 12), rng.randint(0 if seed else 1, 10)
        s = {"prompt_ids": [rng.randint(0, 99) for _ in range(p)], "completion_ids": [rng.randint(0, 99) for _ in range(c)],
             "advantages": [rng.gauss(0, 1) for _ in range(c)], "loss_mask": [float(rng.random() > 0.3)] * c,
             "rewards": rng.random()}
        if seed % 2:
            s["old_logps"] = [rng.gauss(-2, 1) for _ in range(c)]
        samples.append(s)
    got, want = collate_samples(samples, 7, TOKEN_FIELDS, SEQUENCE_FIELDS), reference_collate(samples, 7)
    assert set(got.keys()) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_collate_samples_takes_the_declared_fields_only() -> None:
    """A field is in the micro-batch when the algorithm declares it (a plugin's own name too), at the completion
    positions; a key no one declares (PPO's per-token ``kl``, a sample's ``log``) stays out."""
    samples = [{"prompt_ids": [5, 6], "completion_ids": [7, 8, 9], "advantages": [1.0, 2.0, 3.0], "bonus": [0.5, 0.25, 0.0],
                "kl": [9.0, 9.0, 9.0], "novelty": 0.75, "log": {"x": 1}}]
    plain = collate_samples(samples, 0)
    assert "advantages" in plain and not {"bonus", "kl", "novelty", "log"} & set(plain.keys())
    got = collate_samples(samples, 0, ("advantages", "bonus"), ("novelty",))
    assert got["bonus"].tolist() == [[0.0, 0.5, 0.25, 0.0, 0.0]] and "kl" not in got
    assert got["novelty"].tolist() == [0.75] and got["novelty"].dtype == torch.float32


def test_lazy_batches_collate_once_on_first_use() -> None:
    calls = []

    def make() -> list[dict]:
        calls.append(1)
        return [{"a": 1}, {"a": 2}]

    lazy = LazyBatches(make)
    assert calls == []
    assert [b["a"] for b in lazy] == [1, 2] and len(lazy) == 2 and lazy[1] == {"a": 2}
    assert calls == [1]
