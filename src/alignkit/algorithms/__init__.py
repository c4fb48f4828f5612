"""Algorithms by the name the config's ``algorithm`` key uses.

Importing this package registers every algorithm and its config section (config/sections.py), and every
shipped rollout engine with its section (``vllm:``); entry points that load a config (the CLI, the runner,
scripts) import it first."""

from alignkit.algorithms.agent import AgentGRPO
from alignkit.algorithms.agent_ppo import AgentPPO
from alignkit.algorithms.base import OfflineAlgorithm
from alignkit.algorithms.distill import OnPolicyDistill
from alignkit.algorithms.dpo import DPO
from alignkit.algorithms.flow_grpo import FlowGRPO
from alignkit.algorithms.flow_rtpo import FlowRTPO
from alignkit.algorithms.flow_sft import FlowSFT
from alignkit.algorithms.grpo import GRPO, RLOO, DrGRPO
from alignkit.algorithms.kto import KTO
from alignkit.algorithms.online import OnlineAlgorithm
from alignkit.algorithms.orpo import ORPO
from alignkit.algorithms.ppo import PPO, PPOLag
from alignkit.algorithms.redteam import RedTeam
from alignkit.algorithms.reward import CostModel, RewardModel
from alignkit.algorithms.safe_dpo import SafeDPO
from alignkit.algorithms.sft import SFT
from alignkit.algorithms.vlm import VLMSFT
from alignkit.config.schema import RunConfig
from alignkit.config.sections import ALGORITHMS, register_algorithm
from alignkit.models.roles import Workload
from alignkit.rollout.engine import load_engines

for _name, _cls in (("sft", SFT), ("reward_model", RewardModel), ("cost_model", CostModel), ("dpo", DPO),
                    ("safe_dpo", SafeDPO), ("vlm_sft", VLMSFT), ("flow_sft", FlowSFT), ("orpo", ORPO),
                    ("kto", KTO)):
    register_algorithm(_name)(_cls)
# the online loop's algorithms
for _online in (GRPO, RLOO, DrGRPO, PPO, PPOLag, RedTeam, FlowGRPO, FlowRTPO, AgentGRPO, AgentPPO,
                OnPolicyDistill):
    register_algorithm(_online.name)(_online)
load_engines()  # the engines' sections are read from the config like the algorithms'


def workload_of(cfg: RunConfig) -> Workload:
    """The models ``cfg``'s algorithm declares, as the memory planner reads them."""
    algo = ALGORITHMS.get(cfg.algorithm)
    return Workload(tuple(algo.model_specs(cfg)), algo.sequences_per_example, algo.reserved_memory_fraction(cfg),
                    algo.image_shape(cfg))


__all__ = ["ALGORITHMS", "OfflineAlgorithm", "OnlineAlgorithm", "register_algorithm", "workload_of"]
