"""Every ``alignkit`` sub-command's arguments, and which function runs it: light, so ``alignkit --help`` and
argument errors load no command's implementation (no torch).

A command's parser names its function as ``"module:function"`` (:func:`runs`); :func:`alignkit.cli.main` imports
that module only when the command runs, and the module imports what it needs at module level.
"""

from __future__ import annotations

import argparse
import importlib
import textwrap
from collections.abc import Callable
from typing import Any

from alignkit.config.recipes import recipes

#: ``tiny-model --arch sd3``: VAE fitting steps by default
VAE_STEPS = 300


def runs(sp: argparse.ArgumentParser, target: str) -> None:
    """``sp``'s command runs ``target``, ``"package.module:function"`` taking the parsed arguments."""
    sp.set_defaults(func=target)


def command_function(target: str) -> Callable[[argparse.Namespace], int]:
    """The function a ``"module:function"`` target names, its module imported now."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def with_config(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("config", help="YAML run config")
    sp.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. training.learning_rate=1e-4")
    sp.add_argument("--algorithm", default=None, metavar="NAME",
                    help="the same as the override algorithm=NAME (the seed guides' `main.py --algorithm sft`)")
    sp.add_argument("--stage", default=None, choices=["pretrain", "sft"],
                    help="the VLM stage of a vlm_sft config: the same as the override vlm.stage=STAGE")


def _launch_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=None,
                    help="processes on this node (default: its GPU count, 1 without GPUs); with "
                    "rollout.placement=separate the last rollout.generator_processes of all the launched processes "
                    "generate and the others train (docs/workflows/async-rl.md)")
    sp.add_argument("--nnodes", type=int, default=None,
                    help="number of nodes (default 1; with --slurm: the allocation's, which it must equal)")
    sp.add_argument("--node-rank", "--node_rank", type=int, default=None,
                    help="this node's index in [0, nnodes) (default 0)")
    sp.add_argument("--master-addr", "--master_addr", default=None,
                    help="address of node 0 (required with --nnodes > 1; default 127.0.0.1)")
    sp.add_argument("--master-port", "--master_port", type=int, default=None,
                    help="rendezvous port (default 29500; on one node a free port if 29500 is taken)")
    sp.add_argument("--launcher", default="torchrun", choices=["torchrun", "deepspeed", "accelerate"])
    sp.add_argument("--dry-run", "--dry_run", action="store_true", help="print the command instead of running it")
    sp.add_argument("--slurm", action="store_true",
                    help="in a Slurm job: srun starts the launcher on every node (nodes, GPUs, rendezvous from the "
                    "allocation); outside one, with --dry-run: print the sbatch script")
    sp.add_argument("--k8s", action="store_true",
                    help="print a Kubeflow PyTorchJob manifest for the run (pipe it to kubectl apply -f -); needs --image")
    sp.add_argument("--image", default=None, help="--k8s: the container image every pod runs (alignkit installed)")
    sp.add_argument("--pvc", default=None, metavar="CLAIM",
                    help="--k8s: a PersistentVolumeClaim mounted at /workspace, the pods' working folder (checkpoints "
                    "outlive the pods)")
    sp.add_argument("--partition", default=None,
                    help="--slurm --dry-run: the partition the sbatch script asks for (#SBATCH --partition=NAME)")
    sp.add_argument("--job-name", "--job_name", default=None,
                    help="--slurm / --k8s: the job's name (default alignkit-<config file name>)")


def register_run(sub: Any) -> None:
    sp = sub.add_parser("train", help="train with a YAML config (under any launcher, or alone)")
    with_config(sp)
    runs(sp, "alignkit.cli.run_commands:cmd_train")

    sp = sub.add_parser("validate", help="print the resolved config and the plan, then exit")
    with_config(sp)
    sp.add_argument("--world-size", type=int, default=None, help="plan for N processes (default: the launcher's)")
    runs(sp, "alignkit.cli.validate_command:cmd_validate")

    sp = sub.add_parser("launch", help="run `alignkit train` under torchrun / deepspeed / accelerate (one or several nodes)")
    _launch_options(sp)
    with_config(sp)
    runs(sp, "alignkit.cli.run_commands:cmd_launch")

    sp = sub.add_parser("estimate", help="per-GPU memory of a config under ddp / ZeRO 1-3 / FSDP, and which fit")
    with_config(sp)
    sp.add_argument("--gpus", type=int, default=None, help="number of GPUs (default: the launcher's world size, or 1)")
    sp.add_argument("--gpu-memory", "--gpu_memory", default=None,
                    help="memory per GPU, e.g. 80GB or 64GiB (default: the local GPU's, if any)")
    sp.add_argument("--preset", default=None,
                    help="policy dimensions from a preset (llama-7b, mistral-7b, qwen2-0.5b) instead of model.name_or_path")
    sp.add_argument("--frozen", action="append", default=[], metavar="MODEL",
                    help="add a frozen reward/cost model (preset or local dir); repeat for several")
    runs(sp, "alignkit.cli.estimate_command:cmd_estimate")

    sp = sub.add_parser("eval", help="evaluate a model on the config's data.eval (RM/CM: pairwise accuracy, margin)")
    with_config(sp)
    sp.add_argument("--model", default=None,
                    help="model or adapter dir to evaluate (default: OUTPUT_DIR/final if it exists, else model.name_or_path)")
    sp.add_argument("--out", default=None, help="also write the metrics as one JSON line to this file")
    runs(sp, "alignkit.cli.eval_command:cmd_eval")

    sp = sub.add_parser("prepare", help="read and tokenise the config's data sets into the cache ahead of training")
    with_config(sp)
    runs(sp, "alignkit.cli.prepare_command:cmd_prepare")


def register_migrate(sub: Any) -> None:
    sp = sub.add_parser("migrate", help="rewrite a config's HF TrainingArguments / seed-guide keys as alignkit keys")
    sp.add_argument("config", help="YAML run config")
    sp.add_argument("--out", default=None, help="write the native YAML here (default: stdout); comments are not kept")
    runs(sp, "alignkit.cli.migrate_command:cmd_migrate")


def register_tools(sub: Any) -> None:
    _register_score(sub)
    _register_merge_lora(sub)
    _register_vllm_serve(sub)
    _register_demo(sub)
    _register_tiny_model(sub)
    _register_data(sub)


def _register_score(sub: Any) -> None:
    sp = sub.add_parser("score", help="score every response of a .jsonl/.parquet file with a reward or cost model")
    sp.add_argument("model_dir", help="a trained reward/cost model (full or LoRA adapter directory)")
    sp.add_argument("file", help="rows: prompt/chosen/rejected, PKU-SafeRLHF, prompt/response or messages")
    sp.add_argument("--out", default=None, help="write JSONL here (default: stdout)")
    sp.add_argument("--batch-size", type=int, default=16)
    sp.add_argument("--max-length", type=int, default=None,
                    help="default: data.max_length of the run that trained MODEL_DIR (its config.yaml), else 512")
    sp.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                    help="render string rows with the chat template (default: as MODEL_DIR was trained, else no)")
    runs(sp, "alignkit.cli.tool_commands:cmd_score")


def _register_merge_lora(sub: Any) -> None:
    sp = sub.add_parser("merge-lora", help="merge a LoRA adapter into its base and save a plain HF model")
    sp.add_argument("adapter_dir")
    sp.add_argument("out_dir")
    sp.add_argument("--base", default=None, help="base model (default: the one recorded in adapter_config.json)")
    runs(sp, "alignkit.cli.tool_commands:cmd_merge_lora")


def _register_vllm_serve(sub: Any) -> None:
    sp = sub.add_parser("vllm-serve", help="serve a model with vLLM for training runs' rollouts (vllm.server_url)")
    sp.add_argument("model", help="a Hugging Face model dir (the policy's start)")
    sp.add_argument("--host", default="127.0.0.1")
    sp.add_argument("--port", type=int, default=8000)
    sp.add_argument("--dtype", default="auto", help="auto = bfloat16 on a GPU, float32 on CPU")
    sp.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + completion served")
    sp.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    runs(sp, "alignkit.cli.tool_commands:cmd_vllm_serve")


def _register_demo(sub: Any) -> None:
    sp = sub.add_parser("demo", help="build a tiny model, run SFT on the shipped data, print before/after")
    sp.add_argument("--output-dir", default="runs/demo")
    sp.add_argument("--max-steps", type=int, default=None)
    sp.add_argument("--size", default="micro", choices=["micro", "tiny", "small"],
                    help="the random model trained (default micro: learns the tasks in about a minute on 2 idle CPU cores, "
                         "two on a busy or slower machine)")
    runs(sp, "alignkit.cli.tool_commands:cmd_demo")


def _register_tiny_model(sub: Any) -> None:
    sp = sub.add_parser("tiny-model", help="write a tiny random model + tokenizer in Hugging Face format")
    sp.add_argument("out_dir")
    sp.add_argument("--arch", default="llama", choices=["llama", "llava", "sd3"],
                    help="llava: a vision-language model (small CLIP vision tower + projector + the tiny Llama); sd3: "
                         "a flow-matching text-to-image pipeline in diffusers' format (needs diffusers)")
    sp.add_argument("--size", default="tiny", choices=["micro", "micro64", "tiny", "small"])
    sp.add_argument("--vocab-size", type=int, default=None)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--vae-steps", type=int, default=VAE_STEPS,
                    help="sd3: steps fitting the VAE to the synthetic shapes scenes, so decoded latents are pictures "
                         "(0: a random VAE)")
    sp.add_argument("--overwrite", action="store_true",
                    help="write into OUT_DIR although it holds files (default: refuse a folder that is not empty, "
                         "unless it holds the tiny model of the same arguments, which is kept)")
    runs(sp, "alignkit.cli.tiny_model_command:cmd_tiny_model")


def _register_data(sub: Any) -> None:
    sp = sub.add_parser("data", help="data utilities")
    dsub = sp.add_subparsers(dest="data_command", required=True)
    ss = dsub.add_parser("synth", help="generate synthetic data with programmatically checkable answers")
    ss.add_argument("--kind", required=True, help="sft | sft-pc | pref | safety | prompts (online algorithms: prompt + answer) | redteam (attacker "
                         "instructions) | redteam-attacker / redteam-target (SFT rows of a starting attacker / the trigger-word target) | redteam-judge (toxicity pairs for a cost model) | redteam-context-target (conversations "
                         "of the multi-turn world's target) | vlm (coloured shapes images)")
    ss.add_argument("--tasks", default=None,
                    help="comma-separated tasks: add, reverse, upper, digits (default: the first three; prompts: digits)")
    ss.add_argument("--n", type=int, default=1000)
    ss.add_argument("--seed", type=int, default=0)
    ss.add_argument("--out", required=True, help="output .jsonl or .parquet (vlm: .json LLaVA list or .jsonl)")
    ss.add_argument("--stage", choices=["pretrain", "sft", "preference", "beavertails_v"], default="sft",
                    help="vlm only: pretrain = captions, sft = questions with checkable answers, preference = image + "
                         "text pairs with helpful and safety labels (PKU-SafeRLHF fields), beavertails_v = the same "
                         "pairs in BeaverTails-V's fields")
    ss.add_argument("--split", choices=["train", "eval"], default=None,
                    help="only task instances of this split (train and eval rows never share a question); default both")
    ss.add_argument("--objects", default="1-3",
                    help="vlm only: objects a scene holds, N or LO-HI within 1-3 (e.g. 1: one coloured shape a scene, "
                         "the easiest scenes for a tiny text-to-image model to learn)")
    runs(ss, "alignkit.cli.data_command:cmd_data_synth")


def register_plot(sub: Any) -> None:
    sp = sub.add_parser("plot", help="draw runs' metrics.jsonl against step (loss, lr, grad norm, tokens/s, eval, "
                                     "the algorithm's metrics) into one PNG; several runs are overlaid")
    sp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run's output_dir (holding metrics.jsonl)")
    sp.add_argument("--out", default=None, help="image to write, .png (or .pdf/.svg); default RUN_DIR/plots/summary.png "
                                                "for one run; for several, plots.png in the folder holding them "
                                                "(runs/plots.png for runs/a runs/b)")
    sp.add_argument("--metrics", nargs="+", default=None, metavar="NAME",
                    help="panels by name or glob, in this order, e.g. loss 'rewards/*' 'eval/*' (default: every "
                         "numeric metric)")
    runs(sp, "alignkit.cli.plot_command:cmd_plot")


def register_generate(sub: Any) -> None:
    sp = sub.add_parser("generate", help="write completions of a prompt file (a run config's final model, or a model dir); "
                        "image grids for a text-to-image policy")
    sp.add_argument("target", metavar="CONFIG_OR_MODEL", help="a run config (.yaml) or a model directory / hub id")
    sp.add_argument("file", help=".jsonl / .json / .parquet rows with 'prompt'")
    sp.add_argument("--out", default=None, help="write JSONL here (default: stdout); text-to-image: the output folder")
    sp.add_argument("--max-new-tokens", type=int, default=None, help="default: the config's rollout.max_new_tokens, else 32")
    sp.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the config's, else 0)")
    sp.add_argument("--num-generations", type=int, default=1, help="completions per prompt")
    sp.add_argument("--engine", default=None, help="rollout engine of text prompts: hf | vllm (default: the config's "
                    "rollout.engine, else hf)")
    sp.add_argument("--batch-size", type=int, default=32)
    sp.add_argument("--image-root", default=None,
                    help="vision-language models: folder of the rows' image paths (default: the file's folder)")
    sp.add_argument("--reward", default=None, help="also score each completion with this reward function (e.g. exact_match); "
                    "a text-to-image policy: a model-free image scorer (e.g. shapes_colour)")
    sp.add_argument("--base", default=None, help="text-to-image: the pipeline (dir or hub id) a LoRA-only target applies to")
    sp.add_argument("--num-inference-steps", type=int, default=None,
                    help="text-to-image: ODE denoising steps (default: the config's flow_grpo.eval_num_inference_steps, else 28)")
    sp.add_argument("--guidance-scale", type=float, default=None,
                    help="text-to-image: classifier-free guidance (default: the config's, else 4.5; <= 1 = off)")
    sp.add_argument("--resolution", type=int, default=None, help="text-to-image: image side in px (default: the config's, else 512)")
    sp.add_argument("--max-sequence-length", type=int, default=None,
                    help="text-to-image: T5 prompt tokens (default: the config's flow_grpo.max_sequence_length, else 77); "
                    "render a start and its trained run with the same")
    sp.add_argument("--seed", type=int, default=0, help="text-to-image: seeds every image's noise (with its prompt and index)")
    runs(sp, "alignkit.cli.generate_command:cmd_generate")


#: functions whose ``register(sub)`` adds their sub-commands, in the order ``--help`` lists them
COMMANDS = (register_run, register_migrate, register_tools, register_plot, register_generate)


def command_summary(sub: argparse._SubParsersAction) -> str:
    """``--help``'s first line, read from the registered sub-commands (a command group with sub-commands of
    its own, e.g. ``data``, lists them: ``data synth``), so a new command cannot be left out of it."""
    names = []
    for name, parser in sub.choices.items():
        groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        names += [f"{name} {child}" for g in groups for child in g.choices] or [name]
    return "The alignkit command: " + " | ".join(names) + "."


#: the registered algorithms (``alignkit.algorithms.ALGORITHMS``; a test keeps the two equal): written out here so
#: ``--help`` names them without importing the algorithms (and torch)
ALGORITHM_NAMES = ("sft", "reward_model", "cost_model", "dpo", "safe_dpo", "kto", "orpo", "ppo", "ppo_lag", "grpo",
                   "dr_grpo", "rloo", "grpo_agent", "ppo_agent", "distill", "redteam", "vlm_sft", "flow_sft", "flow_grpo",
                   "flow_rtpo")
DOCS = "docs/index.md (in the repository; `mkdocs serve` shows the site at http://127.0.0.1:8000)"


def help_epilog() -> str:
    """``alignkit --help``'s end: the algorithms, the shipped recipes and where the documentation is."""
    found = recipes()
    shipped = ", ".join(found) if found else "none found here (configs/ of the repository)"
    lines = (f"algorithms (algorithm=NAME in a config): {', '.join(ALGORITHM_NAMES)}",
             f"recipes (configs/, e.g. `alignkit train configs/sft.yaml`): {shipped}", f"documentation: {DOCS}")
    return "\n".join(textwrap.fill(line, width=110, subsequent_indent="  ") for line in lines)


def command_parser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """The parser of sub-command ``command`` (its own usage in an error), else ``parser``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="alignkit", formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for register in COMMANDS:
        register(sub)
    p.description = command_summary(sub)
    p.epilog = help_epilog()
    return p
