"""Under torchrun with 2 processes: rank 0 tokenises the data set, rank 1 never does (it counts every
tokenizer call) and memory-maps the same cache folder; both hold the same examples.

Usage: ``torchrun --nproc_per_node=2 prepare_once.py MODEL_DIR CACHE_DIR [two-nodes]``

``two-nodes`` plays two nodes without a shared file system: each rank has its own host name, local
rank 0 and cache folder; then each "node" prepares its own copy and the log says so.
"""

import logging
import os
import socket
import sys

import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from alignkit.algorithms import ALGORITHMS
from alignkit.config import load_config
from alignkit.distributed import comm
from alignkit.models.loading import load_tokenizer

model, cache = sys.argv[1:3]
two_nodes = sys.argv[3:] == ["two-nodes"]
dist.init_process_group("gloo")
rank = dist.get_rank()
if two_nodes:
    os.environ["LOCAL_RANK"] = "0"
    socket.gethostname = lambda: f"node{rank}"  # type: ignore[assignment]
    cache = f"{cache}/node{rank}"
    if rank == 1:  # node 1 cannot see node 0's disk
        from pathlib import Path

        real_is_file = Path.is_file
        Path.is_file = lambda self: "/node0/" not in str(self) and real_is_file(self)  # type: ignore[method-assign]
# preparation runs in a forked child of the rank: the calls are counted in a file (one byte each) so the
# child's count reaches the rank
os.makedirs(sys.argv[2], exist_ok=True)
count_file = os.path.join(sys.argv[2], f"tokenizer_calls.{rank}")
real_call = PreTrainedTokenizerBase.__call__


def counted(self, *args, **kwargs):  # every tokenisation of a row goes through __call__
    with open(count_file, "a") as fh:
        fh.write(".")
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
calls = os.path.getsize(count_file) if os.path.exists(count_file) else 0
got = comm.all_gather_object((calls, len(train), train[17], evals[3], train.files[0]))
assert got[0][0] >= 2000 + 200, got[0][0]  # rank 0 tokenised every row
if two_nodes:  # each node made its own copy, with the same examples
    assert got[1][0] == got[0][0], got
    assert got[0][1:4] == got[1][1:4] and got[0][4] != got[1][4], "the nodes hold different examples"
    if rank == 0:
        assert any("prepared once per node (2 nodes" in x for x in lines), lines
        print("each node prepared its own copy", flush=True)
else:
    assert got[1][0] == 0, f"rank 1 tokenised {got[1][0]} times"
    assert got[0][1:] == got[1][1:], "the ranks hold different examples"
    if rank == 0:
        assert any("memory-mapped by 2 ranks on one node" in x for x in lines), lines
        print(f"rank 1 never tokenised; rank 0 made {got[0][0]} tokenizer calls", flush=True)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
