"""Shared fixtures: tiny models built once per session, and launching the CLI (alone or under torchrun)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

# the algorithms and their config sections are registered by their import, as the CLI does before it
# loads a config (config/ itself never imports them): tests load configs directly
import alignkit.algorithms  # noqa: F401, E402

REPO = Path(__file__).resolve().parents[1]


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject's addopts): one worker per core, at most 4 (each worker holds its own tiny models
    and warm starts, and the 2-process tests start two more processes each)."""
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first: ``--dist loadfile`` hands whole files to free workers in collection order (with
    pyproject's ``--no-loadscope-reorder``, xdist 3.8+; by default xdist orders files by their number of tests, and a
    one-test learning file of ten minutes starts last and runs alone at the end). A file's weight is its tests'
    ``slow`` marks (``seconds=``: the test's measured time on 2 idle cores; 1 without it); files of equal weight
    (unmarked ones: 0) go by their number of tests, most first. The order within a file is kept."""
    weight: dict[Any, float] = {}
    count: dict[Any, int] = {}
    for item in items:
        mark = item.get_closest_marker("slow")
        weight[item.path] = max(weight.get(item.path, 0.0), 0.0 if mark is None else mark.kwargs.get("seconds", 1.0))
        count[item.path] = count.get(item.path, 0) + 1
    items.sort(key=lambda item: (-weight[item.path], -count[item.path]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # one thread per process: two gloo ranks share the machine's two cores
    env.update({"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_cli(args: list[str], *, nproc: int = 1, timeout: int = 300, cwd: Path | None = None,
            env: dict[str, str] | None = None, fresh: bool = False,
            prelude: str | None = None) -> subprocess.CompletedProcess[str]:
    """``alignkit ARGS`` as a child process; with nproc > 1 under torchrun on a free port (gloo).

    One process: forked from a fork server that has torch and transformers imported (``tests/cli_child.py``), so
    each run skips ~7 s of CPU of imports; ``fresh=True`` (or ALIGNKIT_TEST_FRESH_CLI=1 for every run) starts a
    new interpreter instead, for what only a new interpreter shows (import-time settings, what gets imported).
    ``prelude``: Python source run in the child before alignkit's ``main`` (a fault injected into its code), one
    process only."""
    env = env or child_env()
    if prelude is not None:
        if nproc > 1:
            raise ValueError("a prelude runs in one process")
        if not (fresh or os.environ.get("ALIGNKIT_TEST_FRESH_CLI") == "1"):
            return _forked_cli(args, timeout=timeout, cwd=cwd, env=env, prelude=prelude)
        code = f"{prelude}\nimport sys\nfrom alignkit.cli import main\nsys.exit(main(sys.argv[1:]))\n"
        return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                              cwd=cwd, env=env, check=False)
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", "-m", "alignkit", *args]
    elif fresh or os.environ.get("ALIGNKIT_TEST_FRESH_CLI") == "1":
        cmd = [sys.executable, "-m", "alignkit", *args]
    else:
        return _forked_cli(args, timeout=timeout, cwd=cwd, env=env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def _forked_cli(args: list[str], *, timeout: int, cwd: Path | None, env: dict[str, str],
                prelude: str | None = None) -> subprocess.CompletedProcess[str]:
    import multiprocessing
    import tempfile

    from tests import cli_child

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.cli_child", *cli_child.PRELOAD])
    with tempfile.TemporaryDirectory(prefix="alignkit-cli-") as out:
        stdout, stderr = os.path.join(out, "stdout"), os.path.join(out, "stderr")
        child = ctx.Process(target=cli_child.run, args=(list(args), None if cwd is None else str(cwd), dict(env),
                                                         stdout, stderr, prelude))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(["alignkit", *args], timeout)
        text = [Path(p).read_text(encoding="utf-8", errors="backslashreplace") for p in (stdout, stderr)]
    return subprocess.CompletedProcess(["alignkit", *args], child.exitcode, text[0], text[1])


def run_script(path: Path, *, nproc: int = 1, timeout: int = 300, args: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """A Python worker script, alone or under torchrun (gloo)."""
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", str(path), *(args or [])]
    else:
        cmd = [sys.executable, str(path), *(args or [])]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env())


def run_nodes(cmds: list[list[str]], *, timeout: int = 300, cwd: Path | None = None,
              envs: list[dict[str, str]] | None = None) -> list[tuple[str, str]]:
    """The commands of several "nodes" on this machine, together (``envs``: each one's environment, default
    ``child_env()``); each must exit 0; (stdout, stderr) of each."""
    envs = envs or [child_env() for _ in cmds]
    nodes = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=e)
             for c, e in zip(cmds, envs)]
    try:
        results = [n.communicate(timeout=timeout) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    for n, (stdout, stderr) in zip(nodes, results):
        assert n.returncode == 0, f"exit {n.returncode}\n{stdout[-2000:]}\n{stderr[-4000:]}"
    return results


def assert_ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-6000:]}"


def write_config(path: Path, cfg: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return path


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tokenised data sets are cached in a folder of this test session (children inherit it), not in
    the user's ~/.cache: runs in parallel sessions never share or clean each other's cache."""
    path = tmp_path_factory.mktemp("data_cache")
    os.environ["ALIGNKIT_DATA_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def micro_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~0.2M-parameter random Llama + tokenizer in HF format (built once per session)."""
    from alignkit.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "micro", size="micro", seed=0)


@pytest.fixture
def sft_config(micro_model: Path, tmp_path: Path) -> dict[str, Any]:
    """A small SFT config on the micro model and the shipped data (callers adjust keys)."""
    return {
        "algorithm": "sft",
        "output_dir": str(tmp_path / "run"),
        "model": {"name_or_path": str(micro_model)},
        "data": {"train": "builtin:sft_train.jsonl", "max_length": 96, "max_train_examples": 64},
        "training": {"per_device_batch_size": 4, "learning_rate": 1e-3, "max_steps": 4,
                     "lr_scheduler": "constant", "seed": 0},
        "logging": {"logging_steps": 1, "report_to": ["jsonl"]},
        "checkpoint": {"save_final": False},
    }


@pytest.fixture(scope="session")
def micro_llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LLaVA (CLIP tower on 32x32 images, the micro Llama, projector) + processor (built once)."""
    from alignkit.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "micro-llava", arch="llava", size="micro", seed=0)


@pytest.fixture(scope="session")
def micro_sd3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random SD3 pipeline in diffusers' format (built once; skips where diffusers is not installed)."""
    pytest.importorskip("diffusers")
    from alignkit.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "micro-sd3", arch="sd3", size="micro", seed=0)


@pytest.fixture(scope="session")
def flow_warm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny SD3 pipeline that draws the one-object shapes scenes, for the Flow-GRPO tests: ``{"model", "train",
    "eval"}`` (train: 256 one-object caption rows, eval: 16 held-out ones). Its VAE is fitted to the scenes (200
    steps: with fewer it decodes every colour to a brown-yellow), then flow_sft teaches its transformer (the
    ``tiny`` size, 0.29M parameters; the micro one draws colour noise) 800 steps of 32 images from the cached
    encodings. It then puts a shape of about the asked colour in the asked cell (about 3 in 4 images), so
    Flow-GRPO's reward has scenes to improve. Built once per session (about 3 minutes on 2 cores)."""
    pytest.importorskip("diffusers")
    from alignkit.data.synth_vlm import generate_vlm

    root = tmp_path_factory.mktemp("flow-warm")
    # in a CLI child (one thread, a fresh process), as the SFT below: fitted in the test worker, the VAE depended
    # on what ran there before (its thread count), and so did the warm start (held-out shapes_hit 0.36 to 0.66)
    assert_ok(run_cli(["tiny-model", str(root / "fitted"), "--arch", "sd3", "--size", "tiny", "--seed", "0",
                       "--vae-steps", "200"], timeout=900))
    train = generate_vlm(256, 0, root / "captions.json", stage="pretrain", split="train", objects=(1, 1))
    evals = generate_vlm(16, 1, root / "eval.json", stage="pretrain", split="eval", objects=(1, 1))
    proc = run_cli(["train", str(REPO / "configs" / "flow_sft.yaml"), f"model.name_or_path={root / 'fitted'}",
                    f"data.train={train}", "data.image_root=null", f"output_dir={root / 'sft'}",
                    "training.max_steps=800",
                    "training.global_batch_size=32", "training.epochs=1000", "training.learning_rate=2e-3",
                    "flow_sft.cache_encodings=true", "checkpoint.save_steps=null",
                    # test_flow_grpo's learning bars were measured from this warm start trained with foreach AdamW
                    "training.optimizer_impl=foreach",
                    "logging.logging_steps=50", "logging.report_to=[jsonl]", "logging.plot=false"], timeout=900)
    assert_ok(proc)
    return {"model": root / "sft" / "final", "train": Path(train), "eval": Path(evals)}


@pytest.fixture(scope="session")
def processor(micro_llava: Path) -> Any:
    """The micro LLaVA's processor (image processor + tokenizer with ``<image>``)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(micro_llava)


def jsonl(path: Path) -> list[dict]:
    """The rows of a JSONL file, split on newlines only: an attack may hold \\x85 or \\u2028, which
    attacks.jsonl keeps raw (ensure_ascii=False) and str.splitlines would split on."""
    return [json.loads(x) for x in path.read_text(encoding="utf-8").split("\n") if x]
