"""One-line errors for a model that cannot be read: a path that does not exist (and is no reachable hub
id), a hub id that cannot be reached, a corrupt or truncated safetensors file (named).

``from_pretrained`` reports these as long tracebacks ("Repo id must be in the form ...", a bare
``SafetensorError`` naming no file); :func:`model_errors` turns them into a :class:`ModelError`.
Without network, huggingface_hub retries every file of a hub id for about a minute (a dozen "Retrying in
Ns" lines) before it fails: :func:`check_hub` asks the Hub once, with a short timeout, first.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

from alignkit.errors import ModelError, UserError

#: seconds the Hub has to answer :func:`check_hub`'s probe (it answers in well under one where it is reachable)
HUB_PROBE_TIMEOUT_S = 3.0
#: what a hub model id looks like: NAME or ORG/NAME
HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


@functools.cache
def hub_unreachable(endpoint: str) -> str | None:
    """Why the Hub at ``endpoint`` cannot be reached (a short phrase), None when it answers; asked once per
    process. Any HTTP answer counts as reachable; through huggingface_hub's own session, so proxies apply."""
    from huggingface_hub.utils import get_session

    try:
        get_session().head(endpoint, timeout=HUB_PROBE_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - whatever the HTTP client raises (DNS, refused, timeout, TLS, proxy)
        return first_line(e)
    return None


def in_hub_cache(repo_id: str) -> bool:
    """Whether the Hugging Face cache holds a downloaded snapshot of model ``repo_id``."""
    from huggingface_hub import constants

    snapshots = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    return snapshots.is_dir() and any(snapshots.iterdir())


def check_hub(source: str) -> None:
    """A hub id that can be neither downloaded nor read from the cache: one line at once, not a minute of
    retries. While the Hub cannot be reached a model the cache holds loads from there (offline mode is switched
    on for this process, as ``HF_HUB_OFFLINE=1`` does); a local path or a reachable Hub pass."""
    from huggingface_hub import constants

    if not HUB_ID.match(source) or Path(source).expanduser().exists():
        return
    cached = in_hub_cache(source)
    if constants.HF_HUB_OFFLINE:
        if not cached:
            raise ModelError(f"model {source!r}: no such local directory, and not in the Hugging Face cache "
                             f"({constants.HF_HUB_CACHE}) while offline mode is on (HF_HUB_OFFLINE): download it "
                             "once with network, or give a local model folder")
        return
    reason = hub_unreachable(constants.ENDPOINT)
    if reason is None:
        return
    if cached:
        constants.HF_HUB_OFFLINE = True  # read at each call by huggingface_hub (and transformers through it)
        os.environ["HF_HUB_OFFLINE"] = "1"  # and by what imports it later or runs as a child process
        logging.getLogger("alignkit").warning(
            f"the Hugging Face Hub ({constants.ENDPOINT}) cannot be reached ({reason}): model {source!r} loads from "
            "the local cache (set HF_HUB_OFFLINE=1 to skip asking the Hub)")
        return
    raise ModelError(f"model {source!r}: no such local directory, not in the Hugging Face cache, and the Hub "
                     f"({constants.ENDPOINT}) cannot be reached ({reason}): connect, or give a local model folder "
                     "(with HF_HUB_OFFLINE=1 a model the cache holds loads without asking the Hub)")


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0].strip() if text else type(e).__name__


def is_safetensors_error(e: BaseException) -> bool:
    return type(e).__name__ == "SafetensorError"  # safetensors' Rust error, whatever module exports it


def unreadable_safetensors(path: Path) -> tuple[Path, str] | None:
    """The first ``*.safetensors`` file in ``path`` whose header does not parse or does not cover the
    file (truncated, corrupt), with safetensors' reason; None if all read."""
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")) if path.is_dir() else []:
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 - SafetensorError and the OSError of an unreadable file
            return f, first_line(e)
    return None


def corrupt_file_error(file: Path, reason: str) -> ModelError:
    return ModelError(f"{file}: not a readable safetensors file ({reason}); it is truncated or corrupt, "
                      "save or download it again")


def translate(e: BaseException, source: str) -> ModelError | None:
    """The ModelError for what loading ``source`` raised, or None when ``e`` is not about the source."""
    local = Path(source).expanduser()
    if is_safetensors_error(e):
        bad = unreadable_safetensors(local)
        if bad is not None:
            return corrupt_file_error(*bad)
        return ModelError(f"model {source!r}: a safetensors file of it is not readable ({first_line(e)})")
    if not isinstance(e, (OSError, ValueError)):
        return None
    if local.exists():
        if isinstance(e, OSError):  # e.g. no config.json / weights in the directory, or an unreadable file
            return ModelError(f"model {source!r}: cannot be loaded from this directory ({first_line(e)})")
        return None
    chain = [e, e.__cause__, e.__context__]
    if any(type(c).__name__ == "HFValidationError" for c in chain if c is not None):
        return ModelError(f"model {source!r}: no such local directory, and not a hub model id either "
                          "(a hub id is NAME or ORG/NAME)")
    if isinstance(e, OSError):
        return ModelError(f"model {source!r}: no such local directory, and no hub model that can be reached "
                          f"({first_line(e)})")
    return None


#: what says a folder holds weights: plain or sharded (their index) checkpoints, a peft adapter's file
WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.safetensors.index.json", "*.bin.index.json")


def listing(path: Path, limit: int = 6) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "") or "nothing"


def check_model_folder(source: str) -> None:
    """A local ``source`` that is no saved transformers model or peft adapter (config.json or adapter_config.json
    and weights): one line naming what the folder holds, before the tokenizer, the data and the weights load
    (transformers' own error comes after all of that, as a 40-line traceback). A hub id passes."""
    path = Path(source).expanduser()
    if not path.is_dir():
        check_hub(source)
        return  # a hub id, or a missing path: translate() words that when loading
    if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
        raise ModelError(f"model {source!r}: no config.json in this folder (it holds {listing(path)}): a model "
                         "folder holds config.json and weights, as save_pretrained or `alignkit tiny-model DIR` "
                         "writes them")
    if not any(next(path.glob(pattern), None) for pattern in WEIGHTS):
        raise ModelError(f"model {source!r}: no weights in this folder (no *.safetensors or *.bin; it holds "
                         f"{listing(path)})")


@contextlib.contextmanager
def model_errors(source: str) -> Iterator[None]:
    """Around loading ``source`` (a local directory or a hub id): a missing or unreachable model and a
    corrupt weights file become a one-line ModelError naming it; anything else passes unchanged."""
    check_hub(source)
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        err = translate(e, source)
        if err is None:
            raise
        raise err from e
