"""ARCHITECTURE.md rule 3: algorithms, losses and data never touch the distributed engine or name a device."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[3] / "src" / "alignkit"
FORBIDDEN = re.compile(r"torch\.distributed|import deepspeed|from deepspeed|[\"']cuda[\"']|[\"']nccl[\"']|\.cuda\(")


def test_no_engine_or_device_names_in_algorithm_code() -> None:
    offenders = []
    for sub in ("algorithms", "losses", "data"):
        for f in sorted((PKG / sub).rglob("*.py")):
            for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), start=1):
                if FORBIDDEN.search(line):
                    offenders.append(f"{f.relative_to(PKG)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
    assert list((PKG / "algorithms").glob("*.py")), "the rule must look at real files"


def test_files_stay_small() -> None:
    big = [f"{f.relative_to(PKG)} ({n} lines)" for f in PKG.rglob("*.py")
           if (n := len(f.read_text(encoding="utf-8").splitlines())) > 600]
    assert not big, big


#: what config/ may not import: it is the bottom floor, and the modules above it import config
ABOVE_CONFIG = ("algorithms", "models", "data", "train", "rollout", "distributed", "cli", "launch", "demo",
                "logging", "scoring", "losses", "ops")


def _imported_modules(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``tree``, module level or late inside a function."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the module's package
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def test_config_imports_nothing_above_it() -> None:
    offenders = []
    files = sorted((PKG / "config").rglob("*.py"))
    for f in files:
        for line, module in _imported_modules(ast.parse(f.read_text(encoding="utf-8")), "alignkit.config"):
            parts = module.split(".")
            if parts[0] == "alignkit" and len(parts) > 1 and parts[1] in ABOVE_CONFIG:
                offenders.append(f"config/{f.relative_to(PKG / 'config')}:{line}: {module}")
    assert not offenders, "\n".join(offenders)
    assert len(files) > 3, "the rule must look at real files"


def test_a_config_read_before_the_registrations_fails_clearly() -> None:
    """config/ does not import the algorithms; loading a config without them says so instead of
    calling ``dpo:`` an unknown key or handing out a section's defaults."""
    code = ("import sys\n"
            "from alignkit.config import load_config\n"
            "assert not [m for m in sys.modules if m.startswith('alignkit.algorithms')], 'config imported algorithms'\n"
            "load_config(None, ['algorithm=dpo', 'model.name_or_path=m', 'data.train=x.jsonl', 'dpo.beta=0.2'])\n")
    env = {**os.environ, "PYTHONPATH": str(PKG.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0
    assert "RuntimeError: no algorithms are registered: import alignkit.algorithms" in proc.stderr, proc.stderr


def test_library_code_reads_algorithm_sections_typed() -> None:
    """``cfg.section(DPOConfig)``, not ``cfg.dpo``: the attribute form (RunConfig.__getattr__) is ``Any``
    to a type checker and stays for users' scripts and tests only."""
    import alignkit.algorithms  # noqa: F401  (registers the sections)
    from alignkit.config.sections import SECTIONS

    names = set(SECTIONS.names())
    offenders = []
    for f in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in names:
                owner = ast.unparse(node.value).split(".")[-1]
                if owner in ("cfg", "config", "run_cfg", "run_config"):
                    offenders.append(f"{f.relative_to(PKG)}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, "\n".join(offenders)
    assert {"dpo", "rollout", "reward"} <= names

