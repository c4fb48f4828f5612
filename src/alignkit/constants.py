"""Names shared by every module (one vocabulary: ``logps``, ``response_mask``, ``dp_size``)."""

#: Label value that marks a position the loss ignores (same as transformers / PyTorch CE).
IGNORE_INDEX = -100

#: Scheme for the data sets shipped inside the package: ``builtin:sft_train.jsonl``.
BUILTIN_PREFIX = "builtin:"
