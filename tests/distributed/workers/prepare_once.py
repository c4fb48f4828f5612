"""Under torchrun with 2 processes: rank 0 tokenises the data set, rank 1 never does (it counts every
tokenizer call) and memory-maps the same cache folder; both hold the same examples.

Usage: ``torchrun --nproc_per_node=2 prepare_once.py MODEL_DIR CACHE_DIR``
"""

import logging
import os
import sys

import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from alignkit.algorithms import ALGORITHMS
from alignkit.config import load_config
from alignkit.distributed import comm
from alignkit.models.loading import load_tokenizer

model, cache = sys.argv[1:3]
dist.init_process_group("gloo")
rank = dist.get_rank()
calls = [0]
real_call = PreTrainedTokenizerBase.__call__


def counted(self, *args, **kwargs):  # every tokenisation of a row goes through __call__
    calls[0] += 1
    return real_call(self, *args, **kwargs)


PreTrainedTokenizerBase.__call__ = counted
lines: list[str] = []
handler = logging.Handler()
handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
logging.getLogger("alignkit").addHandler(handler)
logging.getLogger("alignkit").setLevel(logging.INFO)

cfg = load_config(None, ["algorithm=dpo", f"model.name_or_path={model}", "data.train=builtin:pref_train.jsonl",
                         "data.eval=builtin:pref_eval.jsonl", "data.max_length=40", f"data.cache_dir={cache}",
                         "training.per_device_batch_size=2"], notes=False)
algo = ALGORITHMS.get("dpo")(cfg, load_tokenizer(cfg.model))
train = algo.data.build_dataset(cfg.data.train, "train")
evals = algo.data.build_dataset(cfg.data.eval, "eval")
got = comm.all_gather_object((calls[0], len(train), train[17], evals[3], train.rows.cache_files[0]["filename"]))
assert got[1][0] == 0, f"rank 1 tokenised {got[1][0]} times"
assert got[0][0] >= 2 * (2000 + 200), got[0][0]  # rank 0 did: two sides of every pair
assert got[0][1:] == got[1][1:], "the ranks hold different examples"
if rank == 0:
    assert any("memory-mapped by 2 ranks on one node" in x for x in lines), lines
    print(f"rank 1 never tokenised; rank 0 made {got[0][0]} tokenizer calls", flush=True)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
