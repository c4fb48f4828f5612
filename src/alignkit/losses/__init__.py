"""Pure loss functions: tensors in, ``(losses, metrics)`` out; normalisers are arguments."""

from alignkit.losses.cost import cost_model_loss
from alignkit.losses.dpo import DPO_LOSSES, dpo_loss
from alignkit.losses.kl import KL_ESTIMATORS, kl_estimate
from alignkit.losses.kto import kto_loss, kto_reference_point
from alignkit.losses.orpo import orpo_loss
from alignkit.losses.reward import bradley_terry_loss
from alignkit.losses.safe_dpo import (
    SAFE_DPO_VARIANTS,
    dynamic_beta,
    lagrange_update,
    pid_lagrange_update,
    safe_dpo_loss,
    safe_rows_loss,
)
from alignkit.losses.sft import sft_loss

__all__ = [
    "DPO_LOSSES",
    "KL_ESTIMATORS",
    "SAFE_DPO_VARIANTS",
    "bradley_terry_loss",
    "cost_model_loss",
    "dpo_loss",
    "dynamic_beta",
    "kl_estimate",
    "kto_loss",
    "kto_reference_point",
    "lagrange_update",
    "orpo_loss",
    "pid_lagrange_update",
    "safe_dpo_loss",
    "safe_rows_loss",
    "sft_loss",
]
