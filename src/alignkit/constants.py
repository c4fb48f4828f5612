"""Names shared by every module (one vocabulary: ``logps``, ``response_mask``, ``dp_size``)."""

from pathlib import Path

#: Label value that marks a position the loss ignores (same as transformers / PyTorch CE).
IGNORE_INDEX = -100

#: Scheme for the data sets shipped inside the package: ``builtin:sft_train.jsonl``.
BUILTIN_PREFIX = "builtin:"

#: The recipes of the repository (``configs/*.yaml``), where the package runs from a clone's ``src/`` folder (the
#: README's editable install); absent from a wheel
RECIPES_DIR = Path(__file__).resolve().parents[2] / "configs"
