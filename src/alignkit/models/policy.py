"""The trainable policy module: an HF causal LM whose forward returns per-token log-probs.

Log-probs are computed inside ``forward`` (so DDP / FSDP see every parameter use) from the
final hidden states at the positions that have a target, through the chunked LM-head op: the
(batch, seq, vocab) logits tensor is never built.
"""

from __future__ import annotations

import torch
from torch import nn

from alignkit.constants import IGNORE_INDEX
from alignkit.models.loading import split_lm
from alignkit.ops.logprobs import chunked_token_logps


class CausalLMLogps(nn.Module):
    def __init__(self, hf_model: nn.Module, chunk_size: int = 1024) -> None:
        super().__init__()
        self.hf_model = hf_model
        self.chunk_size = chunk_size

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """log p(targets) at every position whose target is not IGNORE_INDEX.

        input_ids, targets: (B, T); returns (N,) float32 in row-major order of those positions.
        """
        backbone, head = split_lm(self.hf_model)
        out = backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state  # (B, T, H)
        keep = targets != IGNORE_INDEX
        return chunked_token_logps(
            hidden[keep], head.weight, targets[keep], bias=getattr(head, "bias", None), chunk_size=self.chunk_size
        )
