"""The size limits the project keeps (ARCHITECTURE.md rule 10): no module over 400 lines, no function over 60."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[3] / "src" / "alignkit"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def oversized(root: Path, max_file: int = MAX_FILE_LINES, max_function: int = MAX_FUNCTION_LINES) -> list[str]:
    """Each module under ``root`` longer than ``max_file`` lines and each function (def to its last line,
    decorators excluded) longer than ``max_function``, as ``path (n lines)`` / ``path:line name (n lines)``."""
    out = []
    for f in sorted(root.rglob("*.py")):
        text = f.read_text(encoding="utf-8")
        rel = f.relative_to(root)
        if (n := len(text.splitlines())) > max_file:
            out.append(f"{rel} ({n} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > max_function:
                    out.append(f"{rel}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_module_or_function_over_the_limits() -> None:
    assert len(list(PKG.rglob("*.py"))) > 50, "the rule must look at real files"
    big = oversized(PKG)
    assert not big, "over the limits:\n" + "\n".join(big)


def test_the_limits_are_measured_as_stated(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(4))
    (tmp_path / "m.py").write_text(f"@decorator\ndef f():\n{body}\n\n\ndef g():\n    pass\n" + "# pad\n" * 5)
    # f: def + 4 lines = 5 (the decorator is not counted); the file: 15 lines
    assert oversized(tmp_path, max_file=15, max_function=5) == []
    assert oversized(tmp_path, max_file=14, max_function=4) == ["m.py (15 lines)", "m.py:2 f (5 lines)"]
