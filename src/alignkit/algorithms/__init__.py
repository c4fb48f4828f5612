"""Algorithms by the name the config's ``algorithm`` key uses."""

from alignkit.algorithms.base import MetricSums, OfflineAlgorithm
from alignkit.algorithms.sft import SFT
from alignkit.registry import Registry

ALGORITHMS: Registry[type[OfflineAlgorithm]] = Registry("algorithm")
ALGORITHMS.register("sft")(SFT)

__all__ = ["ALGORITHMS", "MetricSums", "OfflineAlgorithm"]
