"""The ``alignkit`` parser is built from light specs: ``--help`` and argument errors load no command's
implementation (no torch), and every command's ``"module:function"`` names a function that exists."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from alignkit.cli.parser import build_parser, command_function

SRC = Path(__file__).resolve().parents[3] / "src"

#: run in a fresh interpreter: what ``alignkit ARGS`` imports before it exits
PROBE = """
import json
import sys
from alignkit.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith("alignkit."))))
"""


def imported_by(*argv: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120,
                          check=False, env={"PYTHONPATH": str(SRC), "PATH": ""})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def targets(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from ((f"{name} {n}".strip(), t) for n, t in targets(child))
    if parser.get_default("func"):
        yield "", parser.get_default("func")


def test_help_and_a_bad_argument_load_no_command_and_no_torch() -> None:
    for argv in (["--help"], ["train", "--help"], ["train"], ["no-such-command"]):
        loaded = imported_by(*argv)
        assert "torch" not in loaded, (argv, loaded)
        commands = [m for m in loaded if m.startswith("alignkit.cli.") and m != "alignkit.cli.parser"]
        assert commands == [], (argv, commands)


def test_a_command_loads_its_own_module_only(tmp_path: Path) -> None:
    loaded = imported_by("data", "synth", "--kind", "sft", "--n", "2", "--out", str(tmp_path / "x.jsonl"))
    assert (tmp_path / "x.jsonl").is_file()
    assert "alignkit.cli.data_command" in loaded and "alignkit.cli.run_commands" not in loaded


def test_every_command_names_a_function_that_exists() -> None:
    found = dict(targets(build_parser()))
    assert {"train", "validate", "launch", "estimate", "eval", "prepare", "migrate", "score", "merge-lora",
            "vllm-serve", "demo", "tiny-model", "data synth", "plot", "generate"} <= set(found), found
    for command, target in found.items():
        module, _, name = target.partition(":")
        assert module.startswith("alignkit.cli.") and name.startswith("cmd_"), (command, target)
        assert callable(command_function(target)), (command, target)
