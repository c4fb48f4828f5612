from alignkit.config.loader import (
    BatchPlan,
    ConfigError,
    dump_yaml,
    load_config,
    resolve_batch,
    scaled_learning_rate,
    to_dict,
)
from alignkit.config.schema import RunConfig

__all__ = [
    "BatchPlan",
    "ConfigError",
    "RunConfig",
    "dump_yaml",
    "load_config",
    "resolve_batch",
    "scaled_learning_rate",
    "to_dict",
]
