"""The documentation stays true to the code: the generated reference pages are current, every command the
README and the site show parses with the CLI and names files that exist, and no page names a path of the
machine it was written on."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from alignkit.cli import build_parser

ROOT = Path(__file__).resolve().parents[3]


def _docs_gen():
    """``scripts/docs_gen.py``, the generator of the reference pages (a development tool, outside the package)."""
    spec = importlib.util.spec_from_file_location("docs_gen", ROOT / "scripts" / "docs_gen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


docs_gen = _docs_gen()
PAGES, main, stale_pages = docs_gen.PAGES, docs_gen.main, docs_gen.stale_pages
DOC_PAGES = sorted((ROOT / "docs").rglob("*.md"))
#: the pages a newcomer follows first: every command on them must stay true
START_PAGES = [ROOT / "README.md", ROOT / "docs" / "getting-started.md"]
#: files a command may name that exist in the repository
REPO_FILE = re.compile(r"^(configs|scripts|benchmarks)/[\w./-]+$")


def test_generated_pages_are_current():
    """A stale page: run ``python scripts/docs_gen.py`` and commit the result."""
    assert stale_pages() == [], "regenerate with: python scripts/docs_gen.py"


def test_generator_check_mode(tmp_path, capsys):
    assert main(["--check", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert all(rel in err for rel in PAGES)
    assert main(["--root", str(tmp_path)]) == 0
    assert main(["--check", "--root", str(tmp_path)]) == 0  # regenerates to the same bytes


def test_config_reference_covers_every_key():
    """Every field of the schema and every registered section's field has a row."""
    import dataclasses

    import alignkit.algorithms  # noqa: F401
    from alignkit.config.schema import DistributedConfig, RunConfig, TrainingConfig
    from alignkit.config.sections import SECTIONS
    shipped = docs_gen.shipped

    page = (ROOT / "docs" / "reference" / "config.md").read_text(encoding="utf-8")
    keys = [f"training.{f.name}" for f in dataclasses.fields(TrainingConfig)]
    keys += [f"distributed.{f.name}" for f in dataclasses.fields(DistributedConfig)]
    keys += [f.name for f in dataclasses.fields(RunConfig) if not f.metadata.get("internal")]
    keys += [f"{name}.{f.name}" for name in shipped(SECTIONS) for f in dataclasses.fields(SECTIONS.get(name))]
    missing = [k for k in keys if f"| `{k}` |" not in page]
    assert not missing


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def _commands(path: Path) -> list[list[str]]:
    """The shell commands of a page's bash blocks, as argument lists (comments dropped, split at && and at a
    pipe: ``alignkit launch --k8s ... | kubectl apply -f -`` is two commands)."""
    out = []
    for block in _bash_blocks(path.read_text(encoding="utf-8")):
        for line in block.splitlines():
            tokens = shlex.split(line, comments=True)
            while tokens:
                cut = min([tokens.index(s) for s in ("&&", "|") if s in tokens] or [len(tokens)])
                out.append(tokens[:cut])
                tokens = tokens[cut + 1:]
    return [c for c in out if c]


def _alignkit_args(tokens: list[str]) -> list[str] | None:
    if tokens[0] == "alignkit":
        return tokens[1:]
    if "-m" in tokens and tokens[tokens.index("-m") + 1:][:1] == ["alignkit"]:
        return tokens[tokens.index("-m") + 2:]
    return None


def _parses(args: list[str]) -> None:
    """As ``alignkit.cli.main`` reads argv: options first, then any left-over ``key=value`` overrides."""
    parser = build_parser()
    try:
        _, extra = parser.parse_known_args(args)
    except SystemExit as e:  # argparse's error exit
        raise AssertionError(f"does not parse: alignkit {' '.join(args)}") from e
    assert all("=" in x and not x.startswith("-") for x in extra), f"unrecognized {extra}: alignkit {' '.join(args)}"


def _named_files(tokens: list[str]) -> list[str]:
    values = [t.split("=", 1)[1] if re.match(r"^[A-Z_]+=", t) else t for t in tokens]
    return [v for v in values if REPO_FILE.match(v)]


@pytest.mark.parametrize("page", START_PAGES + DOC_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_parse_and_name_existing_files(page: Path):
    """Each ``alignkit ...`` line parses with the CLI's parser; each config / script it names exists."""
    commands = _commands(page)
    for tokens in commands:
        args = _alignkit_args(tokens)
        if args is not None:
            _parses(args)
        for name in _named_files(tokens):
            assert (ROOT / name).exists(), f"{page.name}: {' '.join(tokens)} names {name}, which does not exist"


def test_start_pages_show_commands():
    """The README and the getting-started page keep their commands (a regex slip would make the check empty)."""
    for page in START_PAGES:
        assert sum(_alignkit_args(c) is not None for c in _commands(page)) >= 3, page
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    # torch from PyTorch's CPU index as an extra index (its 2.13.0+cpu wins over PyPI's Linux wheel, the
    # multi-GB CUDA build; where it cannot be reached, pip takes the torch the machine's own index has)
    assert ('pip install torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu --retries 1 && pip install '
            '-c constraints.txt -e ".[dev]" && alignkit demo') in readme
    assert "python -m pytest -q" in readme


def test_start_pages_state_no_test_counts():
    """A count of the suite's tests ("1317 passed") is stale at the next commit that adds one (issue 50): the start
    pages say what pytest's last line reports instead. (Times stay, as ranges.)"""
    count = re.compile(r"\b\d+ (?:passed|skipped|tests marked)\b")
    for page in START_PAGES:
        assert not count.findall(page.read_text(encoding="utf-8")), page


def test_no_page_names_a_machine_path():
    """Pages speak of the repository, not of the folders of the machine they were written on."""
    pages = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *DOC_PAGES]
    machine = re.compile(r"(?<![\w.])/work/|\.\./shared|/root/|/home/\w")
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in pages
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if machine.search(line)]
    assert not found, found


def test_readme_links_exist():
    """The README links into docs/ (the site's pages as GitHub shows them); each target is a file here."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", readme) if "://" not in t]
    assert len(targets) >= 10
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, missing
