"""Algorithms by the name the config's ``algorithm`` key uses."""

from alignkit.algorithms.base import MetricSums, OfflineAlgorithm
from alignkit.algorithms.dpo import DPO
from alignkit.algorithms.reward import CostModel, RewardModel
from alignkit.algorithms.sft import SFT
from alignkit.registry import Registry

ALGORITHMS: Registry[type[OfflineAlgorithm]] = Registry("algorithm")
ALGORITHMS.register("sft")(SFT)
ALGORITHMS.register("reward_model")(RewardModel)
ALGORITHMS.register("cost_model")(CostModel)
ALGORITHMS.register("dpo")(DPO)

__all__ = ["ALGORITHMS", "MetricSums", "OfflineAlgorithm"]
