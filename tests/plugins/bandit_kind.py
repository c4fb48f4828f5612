"""A toy model kind registered from OUTSIDE the package (the worked example of docs/architecture.md "add
a model kind"): a tabular policy over four discrete actions, not a language model. It picks action a
with probability softmax(table[c])[a], c = the prompt's last token id. GRPO (alignkit's own, unchanged)
trains it: the kind's adapter samples the actions, gives their log-probs and is saved in its own format.

Use: ``plugins: [tests.plugins.bandit_kind]``, ``model.kind: toy_bandit`` and the reward
``tests.plugins.bandit_kind:pick_c`` (1 for action "C"). ``model.name_or_path`` gives the tokenizer that
reads the prompts; a directory this kind saved (``bandit.json``) also gives the table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from alignkit.constants import IGNORE_INDEX
from alignkit.data.batch import Batch
from alignkit.models.generation import Generations, Prompt, SamplingParams
from alignkit.models.kinds import ModelKind, register_kind

ACTIONS = ("A", "B", "C", "D")


class TablePolicy(nn.Module):
    def __init__(self, contexts: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(contexts, len(ACTIONS)))

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        """``(N, 4)`` action log-probs for ``(N,)`` context token ids."""
        return torch.log_softmax(self.table[context], dim=-1)

    def save_pretrained(self, out_dir: str, state_dict: dict[str, Any] | None = None, **_: Any) -> None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in (state_dict or self.state_dict()).items()}, f"{out_dir}/model.safetensors")
        Path(out_dir, "bandit.json").write_text(json.dumps({"contexts": self.table.shape[0]}))


@register_kind("toy_bandit")
class BanditKind(ModelKind):
    def build(self, spec: Any, cfg: Any, dtype: torch.dtype, tokenizer: Any) -> nn.Module:
        saved = Path(spec.source, "bandit.json")
        if not saved.is_file():
            return TablePolicy(len(tokenizer))
        model = TablePolicy(json.loads(saved.read_text())["contexts"])
        model.load_state_dict(load_file(str(Path(spec.source, "model.safetensors"))))
        return model

    def logps(self, module: nn.Module, batch: Batch, *, temperature: float = 1.0, with_entropy: bool = False) -> Any:
        keep = batch["targets"] != IGNORE_INDEX  # the action, predicted at the prompt's last position
        table = module(batch["input_ids"][keep])  # (N, 4) log-probs; at a temperature: log_softmax(logits / T)
        if temperature != 1.0:
            table = torch.log_softmax(table / temperature, dim=-1)
        logps = table.gather(1, batch["targets"][keep][:, None]).squeeze(1)
        if not with_entropy:
            return logps
        return logps, -(table.exp() * table).sum(-1).detach()

    def generate(self, module: nn.Module, engine: Any, prompts: list[Any], params: SamplingParams, *,
                 synced: bool = False) -> Generations:
        last = torch.tensor([(p.ids if isinstance(p, Prompt) else p)[-1] for p in prompts])
        with torch.no_grad():
            logits = module(last) / max(params.temperature, 1e-6)
        actions = logits.argmax(-1) if params.temperature <= 0 else torch.multinomial(logits.softmax(-1), 1)[:, 0]
        ids = [[int(a)] for a in actions]
        return Generations(ids, ["stop"] * len(ids), [ACTIONS[a[0]] for a in ids])


def pick_c(prompts: list[Any], completions: list[str], **_: Any) -> list[float]:
    return [float(c == "C") for c in completions]
