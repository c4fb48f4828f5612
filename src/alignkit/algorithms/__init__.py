"""Algorithms by the name the config's ``algorithm`` key uses.

Importing this package registers every algorithm and its config section (config/sections.py); entry
points that load a config (the CLI, the runner, scripts) import it first."""

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
from alignkit.config.sections import register_algorithm_name
from alignkit.models.roles import Workload
from alignkit.registry import Registry

ALGORITHMS: Registry[type[OfflineAlgorithm] | type[OnlineAlgorithm]] = Registry("algorithm")


def _register(name: str, cls: type[OfflineAlgorithm] | type[OnlineAlgorithm]) -> None:
    ALGORITHMS.register(name)(cls)
    register_algorithm_name(name)  # config/ checks the algorithm key against these without importing us


_register("sft", SFT)
_register("reward_model", RewardModel)
_register("cost_model", CostModel)
_register("dpo", DPO)
_register("safe_dpo", SafeDPO)
for _online in (GRPO, RLOO, DrGRPO, PPO, PPOLag):  # the online loop's algorithms
    _register(_online.name, _online)
_register("vlm_sft", VLMSFT)



def workload_of(cfg: RunConfig) -> Workload:
    """The models ``cfg``'s algorithm declares, as the memory planner reads them."""
    algo = ALGORITHMS.get(cfg.algorithm)
    return Workload(tuple(algo.model_specs(cfg)), algo.sequences_per_example)


__all__ = ["ALGORITHMS", "MetricSums", "OfflineAlgorithm", "OnlineAlgorithm", "workload_of"]
