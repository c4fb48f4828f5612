"""``hub.push_to_hub``: the run's ``final/`` (weights or adapter, tokenizer, resolved config, model card, summary
plot) uploaded to the Hugging Face Hub through ``huggingface_hub`` at the end of the run.

Rank 0 only, after the save is complete and the card is final. Publishing is the last courtesy of a finished
run, never a reason to lose it: without a token, without the network, or when the Hub refuses, the push is one
line naming why and the command that uploads the same folder later, and the run exits 0 with its files as they
were. The token is huggingface_hub's own (``HF_TOKEN``, or ``hf auth login``'s) and is never logged;
``HF_ENDPOINT`` names another Hub (a mirror, or a test's fake one). The uploaded ``config.yaml`` has its
secret-looking values masked as the card's copy has (a plugin's section may hold a key); the local one stays whole,
for ``alignkit train config.yaml`` and resume.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from alignkit.config import RunConfig
from alignkit.config.loader import dump_yaml
from alignkit.config.schema import HubConfig
from alignkit.logging import RunLogger, scrub
from alignkit.train.model_card import write_model_card


def publish(cfg: RunConfig, final_dir: Path, plot: Path | None, log: RunLogger, *, source: str) -> None:
    """The end of a run, on rank 0 once ``final_dir`` is saved: its card rewritten to show the run's summary plot
    (drawn after the save), then the push when ``hub.push_to_hub``. ``source``: what the saved role started from."""
    if plot is not None:
        write_model_card(final_dir, dump_yaml(cfg), Path(cfg.output_dir), source=source, plot=plot)
    if cfg.hub.push_to_hub:
        push_final(final_dir, cfg.hub, log, algorithm=cfg.algorithm)


def push_final(final_dir: Path, hub: HubConfig, log: RunLogger, *, algorithm: str) -> str | None:
    """Create ``hub.repo_id`` if missing and upload ``final_dir`` into it; returns the commit's URL, or None after
    one line saying why it was not pushed. Never raises for the Hub's sake (a KeyboardInterrupt still stops)."""
    from huggingface_hub import HfApi, get_token

    flags = (" --private" if hub.private else "") + (f" --revision {hub.revision}" if hub.revision else "")
    later = f"the model is complete in {final_dir}; upload it later with: hf upload {hub.repo_id} {final_dir}{flags}"
    if not get_token():
        log.info(f"Hub push skipped: no Hugging Face token (set HF_TOKEN or run `hf auth login`); {later}")
        return None
    # the endpoint read now, not when huggingface_hub was first imported (transformers imports it early)
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
    try:
        api.create_repo(hub.repo_id, private=hub.private, exist_ok=True)
        if hub.revision:
            api.create_branch(hub.repo_id, branch=hub.revision, exist_ok=True)
        info = api.create_commit(repo_id=hub.repo_id, operations=upload_operations(final_dir), revision=hub.revision,
                                 commit_message=f"alignkit {algorithm}: {final_dir.parent.name}/{final_dir.name}")
    except Exception as e:  # noqa: BLE001 - any failure of the push is reported, the finished run stands
        log.info(f"Hub push to {hub.repo_id} at {api.endpoint} failed ({failure(e)}); {later}")
        return None
    log.info(f"Pushed {final_dir} to the Hub: {info.commit_url}")
    return str(info.commit_url)


#: seconds the start-up check of the token waits for the Hub (a network that drops packets must not hold the run)
CHECK_TIMEOUT_S = 15.0


def check_at_start(hub: HubConfig, log: RunLogger) -> None:
    """``hub.push_to_hub``, rank 0 at start-up: warn at once (one line) what would make the push at the end fail,
    rather than after hours of training: no token; where the Hub answers (``whoami``), a token it refuses, a
    read-only token, or a namespace of ``hub.repo_id`` that is neither the user's nor one of their organisations'.
    Without the network (or offline mode) the check is one line saying it could not be made. Never raises; the
    end-of-run push and its line stay as they are."""
    from huggingface_hub import get_token

    if not hub.push_to_hub:
        return
    if not get_token():
        log.info("hub.push_to_hub: no Hugging Face token (set HF_TOKEN or run `hf auth login`); training goes on, "
                 f"and the push of final/ to {hub.repo_id} at the end will be skipped")
        return
    problem = _token_problem(hub)
    if problem:
        log.info(f"hub.push_to_hub: {problem}")


def _token_problem(hub: HubConfig) -> str | None:
    """What the Hub says against pushing to ``hub.repo_id`` with this token (None: nothing), asked in a thread that
    is given up after :data:`CHECK_TIMEOUT_S`."""
    import threading

    from huggingface_hub import HfApi

    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
    answer: dict[str, Any] = {}

    def ask() -> None:
        try:
            answer["me"] = api.whoami()
        except Exception as e:  # noqa: BLE001 - offline, refused, a mirror without the endpoint: all said in one line
            answer["error"] = e

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(CHECK_TIMEOUT_S)
    later = "the push is tried at the end of the run"
    if "me" not in answer:
        why = failure(answer["error"]) if "error" in answer else f"no answer in {CHECK_TIMEOUT_S:.0f} s"
        status = getattr(getattr(answer.get("error"), "response", None), "status_code", None)
        if status == 401:
            return f"the Hub at {api.endpoint} refuses the token ({why}); the push at the end will fail"
        return f"could not check the token with the Hub at {api.endpoint} ({why}); {later}"
    me = answer["me"]
    user = str(me.get("name", "?"))
    role = ((me.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        return f"the token of {user} is read-only; the push of final/ to {hub.repo_id} at the end will fail"
    owner = hub.repo_id.split("/", 1)[0] if hub.repo_id and "/" in hub.repo_id else user
    orgs = {str(o.get("name")) for o in me.get("orgs") or [] if isinstance(o, dict)}
    if owner != user and owner not in orgs:
        return (f"the token is {user}'s, who is not a member of {owner!r} (organisations: "
                f"{', '.join(sorted(orgs)) or 'none'}); the push to {hub.repo_id} at the end will likely be refused")
    return None


def upload_operations(final_dir: Path) -> list[Any]:
    """One commit's files: every file under ``final_dir`` (as ``upload_folder`` would, ``.git`` and
    ``.cache`` left out), ``config.yaml`` with its secret-looking values masked (``logging.scrub``)."""
    from huggingface_hub import CommitOperationAdd

    ops = []
    for path in sorted(p for p in final_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(final_dir).as_posix()
        if rel.split("/", 1)[0] in (".git", ".cache"):
            continue
        content: Path | bytes = path
        if rel == "config.yaml":
            cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
            if (masked := scrub(cfg)) != cfg:
                content = yaml.safe_dump(masked, sort_keys=False).encode("utf-8")
        ops.append(CommitOperationAdd(path_in_repo=rel, path_or_fileobj=content))
    return ops


def failure(error: BaseException) -> str:
    """The error in one line: its type and the first line of its message (a Hub error's first line is its status
    and URL; the request's headers, where the token is, are never part of it)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
