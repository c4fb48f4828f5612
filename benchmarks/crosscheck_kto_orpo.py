#!/usr/bin/env python
"""alignkit's KTO and ORPO losses against TRL 1.16's on the same fixed tensors (values and gradients).

    python benchmarks/crosscheck_kto_orpo.py            # creates/reuses benchmarks/results/.venv-trl
    python benchmarks/crosscheck_kto_orpo.py --trl-venv PATH --out results/crosscheck_kto_orpo.json

The parent (this interpreter, alignkit installed) draws the inputs, computes alignkit's side, and runs
this file again with the TRL venv's python (``--child``; TRL is never a dependency of alignkit), which
runs TRL's OWN code on the same numbers:

* ORPO (``trl.experimental.orpo.ORPOTrainer``): ``concatenated_forward`` (its log-prob averaging and its
  NLL) on fixed logits through a stand-in model that returns them, then ``get_batch_loss_metrics``
  (``odds_ratio_loss`` and the total loss); alignkit: ``ops.token_logps_from_logits`` per-sequence sums
  and ``losses.orpo_loss``. Two inputs: ``varied`` (prompts of several tokens, responses of different
  lengths) compares the odds-ratio term, the log odds and the rewards; TRL's NLL is a token mean over the
  micro-batch's chosen sequences prompt included, alignkit's the paper's per-response mean over response
  tokens (a documented difference), so the total loss is compared on ``equal_nll`` (a 1-token prompt,
  chosen responses of one length), where both NLL definitions give the same number.
* KTO (``trl.KTOTrainer._compute_loss``, ``loss_type="kto"``, precomputed reference log-probs): fixed
  per-token log-probs of the completions and of the mismatched KL completions through a stand-in model;
  alignkit: ``losses.kto_reference_point`` over the KL pairs and ``losses.kto_loss``, batch mean.

Reports the max absolute difference of each quantity and of the gradient with respect to the per-token
log-probs (ORPO: the logits). This file's top level imports only the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

V, B, T = 13, 6, 12  # vocabulary, pairs / examples, sequence length (padded)
ORPO_BETA = 0.2
KTO = {"beta": 0.3, "desirable_weight": 1.3, "undesirable_weight": 0.7}


# ====================================================================== inputs (parent)
def orpo_inputs(seed: int, equal_nll: bool) -> dict[str, Any]:
    """2B sequences (chosen rows, then rejected): ids, attention, labels (-100 on prompt and padding), logits."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (2 * B, T), generator=g)
    attn = torch.zeros(2 * B, T, dtype=torch.long)
    labels = torch.full((2 * B, T), -100)
    for i in range(2 * B):
        prompt = 1 if equal_nll else int(torch.randint(2, 5, (1,), generator=g))
        resp = T - 1 - 2 if equal_nll and i < B else int(torch.randint(2, T - prompt + 1, (1,), generator=g))
        attn[i, : prompt + resp] = 1
        labels[i, prompt : prompt + resp] = ids[i, prompt : prompt + resp]
    logits = 2.0 * torch.randn(2 * B, T, V, generator=g)
    return {"ids": ids.tolist(), "attn": attn.tolist(), "labels": labels.tolist(), "logits": logits.tolist()}


def kto_inputs(seed: int) -> dict[str, Any]:
    """Per-token log-probs (0 off the completion) of B completions and of their B mismatched KL completions."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {"label": [bool(x) for x in (torch.rand(B, generator=g) < 0.5).tolist()]}
    out["label"][0], out["label"][1] = True, False  # both kinds present
    for part in ("main", "kl"):
        mask = torch.zeros(B, T, dtype=torch.long)
        for i in range(B):
            start = int(torch.randint(1, 5, (1,), generator=g))
            mask[i, start : start + int(torch.randint(2, T - start + 1, (1,), generator=g))] = 1
        out[f"{part}_mask"] = mask.tolist()
        logps = -torch.rand(B, T - 1, generator=g) * 3 * mask[:, 1:]
        out[f"{part}_logps"] = logps.tolist()
        # the reference: the policy's sums moved by -0.5 .. 1.5 per sequence (policy above it on average: z0 > 0)
        out[f"{part}_ref"] = (logps.sum(1) - (2 * torch.rand(B, generator=g) - 0.5)).tolist()
    return out


# ====================================================================== alignkit (parent)
def alignkit_orpo(x: dict[str, Any]) -> dict[str, Any]:
    import torch

    from alignkit.losses import orpo_loss
    from alignkit.ops.logprobs import token_logps_from_logits

    logits = torch.tensor(x["logits"], requires_grad=True)
    labels = torch.tensor(x["labels"])
    tok = token_logps_from_logits(logits[:, :-1], labels[:, 1:])
    sums, lengths = tok.sum(1), (labels[:, 1:] != -100).sum(1).float()
    losses, m = orpo_loss(sums[:B], sums[B:], lengths[:B], lengths[B:], beta=ORPO_BETA)
    loss = losses.mean()  # one micro-batch: the mean over pairs
    loss.backward()
    return {"loss": loss.item(), "or_term": (-ORPO_BETA * m["log_odds_ratio"]).tolist(),
            "log_odds_chosen": m["log_odds_chosen"].tolist(), "rewards_chosen": m["rewards/chosen"].tolist(),
            "rewards_rejected": m["rewards/rejected"].tolist(), "nll": m["nll"].mean().item(),
            "grad": logits.grad.reshape(-1).tolist()}


def alignkit_kto(x: dict[str, Any]) -> dict[str, Any]:
    import torch

    from alignkit.losses import kto_loss, kto_reference_point

    logps = torch.tensor(x["main_logps"], requires_grad=True)
    kl_logps = torch.tensor(x["kl_logps"]).sum(1)
    kl_diff = kl_logps - torch.tensor(x["kl_ref"])
    z0 = kto_reference_point(kl_diff.sum(), torch.tensor(float(B)))
    desirable = torch.tensor(x["label"])
    losses, m = kto_loss(logps.sum(1), torch.tensor(x["main_ref"]), desirable, z0, **KTO)
    loss = losses.mean()
    loss.backward()
    r = m["rewards"]
    return {"loss": loss.item(), "kl": z0.item(), "rewards_chosen": r[desirable].mean().item(),
            "rewards_rejected": r[~desirable].mean().item(), "grad": logps.grad.reshape(-1).tolist()}


# ====================================================================== TRL (child, in the TRL venv)
class _Out:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class _Accelerator:
    device = "cpu"

    @staticmethod
    def gather_for_metrics(t: Any) -> Any:
        return t


def trl_orpo(x: dict[str, Any]) -> dict[str, Any]:
    import functools
    import types

    import torch
    from trl.experimental.orpo import ORPOTrainer

    logits = torch.tensor(x["logits"], requires_grad=True)
    ids, attn, labels = torch.tensor(x["ids"]), torch.tensor(x["attn"]), torch.tensor(x["labels"])
    batch = {"chosen_input_ids": ids[:B], "chosen_attention_mask": attn[:B], "chosen_labels": labels[:B],
             "rejected_input_ids": ids[B:], "rejected_attention_mask": attn[B:], "rejected_labels": labels[B:]}
    me = types.SimpleNamespace(beta=ORPO_BETA, accelerator=_Accelerator(), is_encoder_decoder=False, padding_value=0,
                               aux_loss_enabled=False, concatenated_inputs=ORPOTrainer.concatenated_inputs,
                               get_batch_logps=ORPOTrainer.get_batch_logps)
    me.concatenated_forward = functools.partial(ORPOTrainer.concatenated_forward, me)
    me.odds_ratio_loss = functools.partial(ORPOTrainer.odds_ratio_loss, me)
    model = lambda *a, **k: _Out(logits=logits)  # noqa: E731  (the stand-in model: the fixed logits)
    chosen, rejected, _, _, nll = me.concatenated_forward(model, batch)
    per_pair, rc, rr, _, _ = me.odds_ratio_loss(chosen, rejected)
    from trl.experimental.orpo.orpo_trainer import log1mexp

    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    loss, _ = ORPOTrainer.get_batch_loss_metrics(me, model, batch)
    loss.backward()
    return {"loss": loss.item(), "or_term": (-per_pair).tolist(), "log_odds_chosen": log_odds.tolist(),
            "rewards_chosen": rc.tolist(), "rewards_rejected": rr.tolist(), "nll": nll.item(),
            "grad": logits.grad.reshape(-1).tolist()}


def trl_kto(x: dict[str, Any]) -> dict[str, Any]:
    import collections
    import functools
    import types

    import torch
    from trl import KTOTrainer

    logps = torch.tensor(x["main_logps"], requires_grad=True)
    kl_logps = torch.tensor(x["kl_logps"])
    main_mask, kl_mask = torch.tensor(x["main_mask"]), torch.tensor(x["kl_mask"])
    main_ids, kl_ids = torch.ones(B, T, dtype=torch.long), torch.full((B, T), 2, dtype=torch.long)

    def model(input_ids: Any, **_: Any) -> _Out:  # the stand-in model: fixed per-token log-probs
        lp = kl_logps if bool((input_ids == 2).all()) else logps
        return _Out(log_probs=lp, entropy=torch.zeros(B, T - 1), mean_logits=torch.zeros(B, T - 1))

    me = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=_Accelerator(), calculate_KL=True,
        aux_loss_enabled=False, precompute_ref_logps=True, loss_type="kto", _tp_size=1, _total_train_tokens=0,
        _metrics={"train": collections.defaultdict(list)}, **KTO)
    me._compute_kl_logps = functools.partial(KTOTrainer._compute_kl_logps, me)
    inputs = {"input_ids": main_ids, "attention_mask": torch.ones(B, T, dtype=torch.long), "completion_mask": main_mask,
              "KL_input_ids": kl_ids, "KL_attention_mask": torch.ones(B, T, dtype=torch.long),
              "KL_completion_mask": kl_mask, "label": torch.tensor(x["label"]),
              "ref_logps": torch.tensor(x["main_ref"]), "ref_KL_logps": torch.tensor(x["kl_ref"])}
    loss = KTOTrainer._compute_loss(me, model, inputs, return_outputs=False)
    loss.backward()
    met = me._metrics["train"]
    return {"loss": loss.item(), "kl": met["kl"][-1], "rewards_chosen": met["rewards/chosen"][-1],
            "rewards_rejected": met["rewards/rejected"][-1], "grad": logps.grad.reshape(-1).tolist()}


def child(spec: dict[str, Any]) -> None:
    import trl

    out = {"trl_version": trl.__version__, "orpo": {k: trl_orpo(v) for k, v in spec["orpo"].items()},
           "kto": {k: trl_kto(v) for k, v in spec["kto"].items()}}
    print("CROSSCHECK " + json.dumps(out))


# ====================================================================== compare (parent)
def max_diff(a: Any, b: Any) -> float:
    a, b = (a if isinstance(a, list) else [a]), (b if isinstance(b, list) else [b])
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trl-venv", default=str(HERE / "results" / ".venv-trl"))
    ap.add_argument("--out", default=str(HERE / "results" / "crosscheck_kto_orpo.json"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        return child(json.loads(Path(a.child).read_text()))
    from bench_sft_dpo import ensure_trl_venv

    spec = {"orpo": {"varied": orpo_inputs(0, False), "equal_nll": orpo_inputs(1, True)},
            "kto": {"seed0": kto_inputs(2), "seed1": kto_inputs(3)}}
    ours = {"orpo": {k: alignkit_orpo(v) for k, v in spec["orpo"].items()},
            "kto": {k: alignkit_kto(v) for k, v in spec["kto"].items()}}
    py = ensure_trl_venv(Path(a.trl_venv))
    out_path = Path(a.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path = out_path.with_suffix(".inputs.json")
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([str(py), str(Path(__file__).resolve()), "--child", str(spec_path)], capture_output=True,
                          text=True, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"),
                               "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    lines = [x for x in proc.stdout.splitlines() if x.startswith("CROSSCHECK ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"the TRL side failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    theirs = json.loads(lines[-1][len("CROSSCHECK "):])
    report: dict[str, Any] = {"trl_version": theirs["trl_version"], "max_abs_diff": {}}
    for algo in ("orpo", "kto"):
        for case, mine in ours[algo].items():
            other = theirs[algo][case]
            keys = [k for k in mine if not (algo == "orpo" and case == "varied" and k in ("loss", "nll", "grad"))]
            diffs = {k: max_diff(mine[k], other[k]) for k in keys}
            if algo == "orpo" and case == "varied":  # the NLL definitions differ here (module docstring)
                diffs["nll (alignkit - TRL, by design)"] = mine["nll"] - other["nll"]
            report["max_abs_diff"][f"{algo}/{case}"] = diffs
            print(f"{algo:4s} {case:9s} " + "  ".join(f"{k}={v:.2e}" for k, v in diffs.items()))
    out_path.write_text(json.dumps(report, indent=1))
    print(f"TRL {theirs['trl_version']}; report: {out_path}")


if __name__ == "__main__":
    main()
