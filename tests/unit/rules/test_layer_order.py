"""The package's floors: a module imports alignkit modules on its own floor or below, never above.

Every import of an alignkit module is read off the source with ``ast``: at module level, under ``if
TYPE_CHECKING:`` and inside functions (a function-local import still makes the lower floor depend on the
upper one; it only hides the cycle from the interpreter). docs/architecture.md names the floors.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[3] / "src" / "alignkit"

#: bottom to top; a module's floor is that of its longest listed prefix
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("alignkit", "alignkit.errors", "alignkit.registry", "alignkit.constants", "alignkit.resources",
              "alignkit.progress", "alignkit.files")),
    ("config", ("alignkit.config",)),
    # the distributed runtime: the launcher's environment and the collectives (the strategies are "engines")
    ("kernels and runtime", ("alignkit.ops", "alignkit.losses", "alignkit.logging", "alignkit.metrics", "alignkit.plot",
                             "alignkit.plot_axes", "alignkit.distributed")),
    # the estimator's arithmetic: pure numbers from model dimensions, no model built
    ("estimator arithmetic", ("alignkit.planner", "alignkit.planner.model_dims", "alignkit.planner.pipeline_dims",
                              "alignkit.planner.activations", "alignkit.planner.plan",
                              "alignkit.planner.plan_report")),
    ("data", ("alignkit.data",)),
    ("models", ("alignkit.models",)),
    # the planner asks the model kinds for their dimensions; the kinds never ask it back
    ("planner", ("alignkit.planner.auto", "alignkit.planner.preflight")),
    ("engines", ("alignkit.distributed.strategy",)),
    # rewards and scorers: reward functions, the scorer registry, the signals, CVaR; below the rollout that calls them
    ("rewards", ("alignkit.rewards",)),
    ("rollout", ("alignkit.rollout",)),
    ("algorithms", ("alignkit.algorithms",)),
    ("train", ("alignkit.train",)),
    ("entry points", ("alignkit.cli", "alignkit.__main__", "alignkit.demo", "alignkit.launch")),
)

#: (importing module, imported module) pairs that still run up a floor, each with why it is left; the test
#: fails on any other, and on an entry here that no longer occurs (remove it then). None is left: the kinds name
#: the generation types of models/generation.py (the engines' re-exported), the Models bundle models/handle.py's
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


#: modules whose functions import alignkit modules when called, how many such imports, and why; any other
#: module imports alignkit at module level only (a new late import is a failure: hoist it, or say why here)
LATE_IMPORTS: dict[str, tuple[int, str]] = {
    "alignkit.cli": (1, ("start-up: distributed.comm loads torch, which `alignkit --help` must not; it is needed "
                         "only to end a process of a multi-process run, where torch is loaded already")),
    "alignkit.rollout.vllm_engine": (1, "cycle: rollout/vllm_server.py (the server's client) imports vllm_engine"),
}


def floor_of(module: str) -> int:
    best, floor = -1, None
    for i, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, floor = len(p), i
    assert floor is not None, f"{module} is on no floor: add it to FLOORS"
    return floor


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def alignkit_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, where) of every import of an alignkit module in ``path``, relative ones resolved;
    ``from alignkit.x import y`` counts ``alignkit.x.y`` where that is a module, else ``alignkit.x``. ``where``:
    ``module`` (runs on import), ``typing`` (under ``if TYPE_CHECKING:``) or ``function`` (runs when called)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    where: dict[int, str] = {}
    for outer in ast.walk(tree):
        kind = ("function" if isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else
                "typing" if isinstance(outer, ast.If) and "TYPE_CHECKING" in ast.unparse(outer.test) else None)
        if kind:
            for node in ast.walk(outer):  # outer nodes come first: the innermost function or block wins
                where[id(node)] = kind
    out = []
    for node in ast.walk(tree):
        at = where.get(id(node), "module")
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, at) for a in node.names if a.name.split(".")[0] == "alignkit"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            if base.split(".")[0] != "alignkit":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                is_module = (PKG.parent / Path(*sub.split("."))).with_suffix(".py").is_file() or (
                    PKG.parent / Path(*sub.split(".")) / "__init__.py").is_file()
                out.append((node.lineno, sub if is_module else base, at))
    return out


def upward_imports() -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for f in sorted(PKG.rglob("*.py")):
        importer = module_name(f)
        for line, imported, _ in alignkit_imports(f):
            if floor_of(imported) > floor_of(importer):
                where = found.setdefault((importer, imported), [])
                if f"{f.relative_to(PKG)}:{line}" not in where:  # ``from x import a, b`` is one import
                    where.append(f"{f.relative_to(PKG)}:{line}")
    return found


def test_no_import_runs_up_a_floor() -> None:
    found = upward_imports()
    new = [f"{where[0]}: {a} (floor {FLOORS[floor_of(a)][0]}) imports {b} (floor {FLOORS[floor_of(b)][0]})"
           for (a, b), where in found.items() if (a, b) not in KNOWN_UPWARD]
    assert not new, "imports that run up a floor:\n" + "\n".join(new)
    gone = [pair for pair in KNOWN_UPWARD if pair not in found]
    assert not gone, f"no longer upward, remove from KNOWN_UPWARD: {gone}"


def test_every_module_is_on_a_floor() -> None:
    modules = [module_name(f) for f in PKG.rglob("*.py")]
    assert len(modules) > 100, "the rule must look at real files"
    for m in modules:
        floor_of(m)


def test_the_rule_sees_function_local_and_relative_imports(tmp_path: Path, monkeypatch) -> None:
    pkg = tmp_path / "alignkit" / "data"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "io.py").write_text("")
    (pkg / "m.py").write_text("from . import io\n\ndef f():\n    from alignkit.train.step import x\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", tmp_path / "alignkit")
    assert alignkit_imports(pkg / "m.py") == [(1, "alignkit.data.io", "module"), (4, "alignkit.train.step", "function")]
    assert floor_of("alignkit.train.step") > floor_of("alignkit.data.m")
    assert floor_of("alignkit.planner.auto") > floor_of("alignkit.models.kinds") > floor_of(
        "alignkit.planner.plan")
    with pytest.raises(AssertionError, match="alignkit.data.m .floor data. imports alignkit.train.step"):
        test_no_import_runs_up_a_floor()  # the function-local import above runs up from data to train
    (pkg / "io.py").write_text("from alignkit.data.m import f\n")  # io -> m -> io at module level
    with pytest.raises(AssertionError, match="alignkit.data.io -> alignkit.data.m -> alignkit.data.io"):
        test_no_import_cycle_at_module_level()
    (pkg / "m.py").write_text("from . import io\n\ndef f():\n    from alignkit.data import io\n")
    with pytest.raises(AssertionError, match="alignkit.data.m: 1 function-local alignkit imports"):
        test_late_imports_are_few_and_each_says_why()


def test_late_imports_are_few_and_each_says_why() -> None:
    counts: dict[str, int] = {}
    for f in sorted(PKG.rglob("*.py")):
        late = [line for line, _, at in alignkit_imports(f) if at == "function"]
        if late:
            counts[module_name(f)] = len(set(late))
    over = [f"{m}: {n} function-local alignkit imports (allowed: {LATE_IMPORTS.get(m, (0, ''))[0]})"
            for m, n in counts.items() if n > LATE_IMPORTS.get(m, (0, ""))[0]]
    assert not over, "\n".join(over)
    gone = [m for m in LATE_IMPORTS if m not in counts]
    assert not gone, f"no function-local alignkit imports left, remove from LATE_IMPORTS: {gone}"
    assert sum(counts.values()) <= sum(n for n, _ in LATE_IMPORTS.values()) < 60


def test_no_import_cycle_at_module_level() -> None:
    """The imports that run when a module is imported form no cycle (a late import no longer hides one)."""
    graph = {module_name(f): {m for _, m, at in alignkit_imports(f) if at == "module"} for f in PKG.rglob("*.py")}
    state: dict[str, int] = {}  # 1 on the path, 2 done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if d == m or d not in graph:
                continue
            if state.get(d) == 1:
                return [*path, m, d]
            if d not in state and (cycle := visit(d, [*path, m])):
                return cycle
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m, [])
            assert cycle is None, " -> ".join(cycle[cycle.index(cycle[-1]):])
