"""Rank-0 sinks: console (+ progress bar), metrics.jsonl, TensorBoard, Weights & Biases.

Every rank may call these methods; only rank 0 writes anything. Secrets (W&B API keys and
anything that looks like a token) never reach a sink: the config is scrubbed before logging.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

from alignkit.errors import ConfigError
from alignkit.files import write_text_atomic
from alignkit.progress import make_bar

log = logging.getLogger("alignkit")

#: a key naming a secret: api_key, wandb_api_key, token, hf_token, secret, client_secret, password; a whole word
#: of the key, so max_new_tokens, tokenizer or console_keys are config values, not secrets
_SECRET_KEY = re.compile(r"(?:^|[_.-])(?:api[_-]?key|token|secret|password|passwd)(?:$|[_.-])", re.IGNORECASE)


def quiet_transformers(is_main: bool) -> None:
    """transformers 5 draws its own tqdm bars ("Loading weights" on every from_pretrained, "Writing
    model shards" on every save_pretrained), on every rank and into log files; alignkit's own lines
    say what was loaded and saved. Those bars go off everywhere. The Hugging Face Hub's download
    bars (shared switch) stay as they were on rank 0; other ranks also keep transformers' warnings
    to themselves (rank 0 shows the same ones)."""
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as hf_logging

    downloads_on = not hub_utils.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()  # also switches the hub's bars off
    if is_main and downloads_on:
        hub_utils.enable_progress_bars()
    if not is_main:
        hf_logging.set_verbosity_error()


def setup_console(is_main: bool) -> None:
    """Plain ``alignkit: message`` lines on stderr from rank 0; other ranks only warn."""
    quiet_transformers(is_main)
    if log.handlers:
        log.setLevel(logging.INFO if is_main else logging.WARNING)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO if is_main else logging.WARNING)
    log.propagate = False


def scrub(obj: Any) -> Any:
    """A copy of a nested config with secret-looking values replaced by '***'."""
    if isinstance(obj, dict):
        return {k: ("***" if _SECRET_KEY.search(str(k)) and v else scrub(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub(v) for v in obj]
    return obj


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.3e}"
        return f"{v:.4f}"
    return str(v)


class RunLogger:
    def __init__(
        self,
        *,
        is_main: bool,
        output_dir: Path,
        report_to: list[str],
        run_name: str | None = None,
        wandb_project: str = "alignkit",
        progress_bar: str = "auto",
        config: dict[str, Any] | None = None,
    ) -> None:
        self.is_main = is_main
        self.output_dir: Path | None = output_dir if is_main else None
        self.report_to = set(report_to)
        self._jsonl = None
        self._tb = None
        self._wandb = None
        self._wandb_start: Any = None
        self._bar = None
        self._progress_mode = progress_bar
        if not is_main:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        name = run_name or output_dir.name
        if "jsonl" in self.report_to:
            self._jsonl = (output_dir / "metrics.jsonl").open("a", encoding="utf-8")
        if "tensorboard" in self.report_to:
            self._tb = _tb_writer(output_dir)
        if "wandb" in self.report_to:
            try:
                import wandb
            except ImportError:
                raise ConfigError("logging.report_to has wandb but wandb is not installed: pip install wandb") from None
            # started at the first metrics row, not here: the data are prepared in a forked child before that,
            # and a W&B run already started in the parent fails that child's imports (wandb's ForkedError)
            self._wandb_start = lambda: wandb.init(
                project=wandb_project, name=name, dir=str(output_dir), config=scrub(config or {}), reinit=True
            )

    # -------------------------------------------------------------- text
    def info(self, msg: str) -> None:
        if self.is_main:
            if self._bar is not None:
                self._bar.write(msg, file=sys.stderr)
            else:
                log.info(msg)

    # -------------------------------------------------------------- progress
    def start_progress(self, total: int, initial: int = 0) -> None:
        if not self.is_main:
            return

        on = self._progress_mode == "on" or (self._progress_mode == "auto" and sys.stderr.isatty())
        if on:
            self._bar = make_bar(total, "train", "step", initial)

    def advance(self, postfix: dict[str, Any] | None = None) -> None:
        if self._bar is not None:
            self._bar.update(1)
            if postfix:
                self._bar.set_postfix({k: _fmt(v) for k, v in postfix.items()}, refresh=False)

    # -------------------------------------------------------------- metrics
    def log_metrics(self, step: int, metrics: dict[str, Any], *, prefix: str = "", headline: tuple[str, ...] = ()) -> None:
        """One row to every sink. ``headline``: keys the console line shows first, after a 1-based
        ``Epoch E step N`` (E = the epoch the step belongs to), as the seed guides print it."""
        if not self.is_main:
            return
        row = {(prefix + k if k not in ("step", "epoch") else k): v for k, v in metrics.items()}
        row["step"] = step
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"time": round(time.time(), 3), **clean}) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is None and self._wandb_start is not None:
            self._wandb, self._wandb_start = self._wandb_start(), None
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)
        if "console" in self.report_to:
            keys = [k for k in headline if k in row] + [k for k in row if k not in headline]
            shown = " ".join(f"{k}={_fmt(row[k])}" for k in keys if k not in ("step", "epoch"))
            epoch = row.get("epoch")
            head = f"Epoch {epoch:.2f} step {step}" if isinstance(epoch, float) else f"step {step}"
            if headline and isinstance(epoch, float):
                head = f"Epoch {max(1, math.ceil(epoch))} step {step}"
            self.info(f"{head} {shown}")

    def rewind_metrics(self, step: int) -> dict[str, int]:
        """Resuming at ``step``: drop the rows logged after it from metrics.jsonl and every other log the run
        appends by step (:data:`STEP_LOGS`; they are logged again), so every step appears once; returns
        ``{file name: rows dropped}`` for the files that had any (rank 0 only, else empty). TensorBoard's event
        files are append-only: its writer is reopened with ``purge_step``, which tells TensorBoard's readers to
        drop the earlier files' events from ``step + 1`` on."""
        if not self.is_main or self.output_dir is None:
            return {}
        if self._tb is not None:
            self._tb.close()
            self._tb = _tb_writer(self.output_dir, purge_step=step + 1)
        dropped = {}
        for name in ("metrics.jsonl", *STEP_LOGS):
            path = self.output_dir / name
            if name == "metrics.jsonl" and self._jsonl is not None:
                self._jsonl.close()
            n = truncate_metrics(path, step)
            if name == "metrics.jsonl" and self._jsonl is not None:
                self._jsonl = path.open("a", encoding="utf-8")
            if n:
                dropped[name] = n
        return dropped

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _tb_writer(output_dir: Path, purge_step: int | None = None) -> Any:
    """A TensorBoard writer into ``output_dir/tensorboard``; ``purge_step``: hide the events logged there before
    at that step and after (a resumed run logs them again)."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(output_dir / "tensorboard"), purge_step=purge_step)


#: the logs besides metrics.jsonl that a run appends rows to, each row with its ``step`` (rewound on resume)
STEP_LOGS = ("samples.jsonl",)


def peak_memory_mb(device_type: str) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, peak RSS on CPU (MiB). On Linux the peak is
    ``VmHWM`` (the high-water mark of this process's own memory map), not ``ru_maxrss``, which keeps the peak of
    the process that started this one across ``exec`` (a run started from a large Python process would log
    that process's peak)."""
    if device_type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:  # not Linux: getrusage below
        pass
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1024 if sys.platform != "darwin" else rss / 2**20


def truncate_metrics(path: Path, step: int) -> int:
    """Drop the rows of a step-keyed JSONL log (``metrics.jsonl``, ``samples.jsonl``) logged after ``step`` (a
    resumed run logs them again, so each step appears once); returns how many were dropped. Written atomically.
    Split on "\\n" alone: a sampled completion may hold \\u2028 or \\x85 raw (ensure_ascii=False), which
    str.splitlines would take for line ends."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").split("\n"):
        if not line:
            continue
        try:
            row_step = json.loads(line).get("step", 0)
        except (ValueError, AttributeError):  # a line cut by a crash
            dropped += 1
            continue
        if isinstance(row_step, int) and row_step > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        write_text_atomic(path, "".join(f"{x}\n" for x in kept))
    return dropped
