"""Algorithms by the name the config's ``algorithm`` key uses."""

from alignkit.algorithms.base import MetricSums, OfflineAlgorithm
from alignkit.algorithms.dpo import DPO
from alignkit.algorithms.grpo import GRPO, RLOO, DrGRPO
from alignkit.algorithms.online import OnlineAlgorithm
from alignkit.algorithms.ppo import PPO, PPOLag
from alignkit.algorithms.reward import CostModel, RewardModel
from alignkit.algorithms.safe_dpo import SafeDPO
from alignkit.algorithms.sft import SFT
from alignkit.algorithms.vlm import VLMSFT
from alignkit.config.schema import RunConfig
from alignkit.models.roles import Workload
from alignkit.registry import Registry

ALGORITHMS: Registry[type[OfflineAlgorithm] | type[OnlineAlgorithm]] = Registry("algorithm")
ALGORITHMS.register("sft")(SFT)
ALGORITHMS.register("reward_model")(RewardModel)
ALGORITHMS.register("cost_model")(CostModel)
ALGORITHMS.register("dpo")(DPO)
ALGORITHMS.register("safe_dpo")(SafeDPO)
for _online in (GRPO, RLOO, DrGRPO, PPO, PPOLag):  # the online loop's algorithms
    ALGORITHMS.register(_online.name)(_online)
ALGORITHMS.register("vlm_sft")(VLMSFT)



def workload_of(cfg: RunConfig) -> Workload:
    """The models ``cfg``'s algorithm declares, as the memory planner reads them."""
    algo = ALGORITHMS.get(cfg.algorithm)
    return Workload(tuple(algo.model_specs(cfg)), algo.sequences_per_example)


__all__ = ["ALGORITHMS", "MetricSums", "OfflineAlgorithm", "OnlineAlgorithm", "workload_of"]
