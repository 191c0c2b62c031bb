"""The docs say what the code is: the module table lists every module, no doc cites an issue readers cannot see."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_architecture_table_lists_every_module():
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = "\n".join(line for line in doc.splitlines() if line.startswith("|"))
    named = set(re.findall(r"`(minedraft/[\w/]+(?:\.py|/))`", table))
    missing = []
    for f in sorted((ROOT / "minedraft").rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        if f.name == "__init__.py" and f.parent != ROOT / "minedraft":
            continue  # a subpackage's __init__ is covered by its folder
        if rel not in named and not any(rel.startswith(n) for n in named if n.endswith("/")):
            missing.append(rel)
    assert not missing, f"docs/ARCHITECTURE.md's module table lacks {missing}"


def test_docs_cite_no_issue():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        assert not re.search(r"the issue'?s?\b", text, re.I), doc.name


def test_architecture_table_names_each_module_once():
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    rows = [m.group(1) for m in re.finditer(r"^\| `(minedraft/[\w/]+\.py)` \|", doc, re.M)]
    assert rows, "no module rows found"
    assert sorted({m for m in rows if rows.count(m) > 1}) == []
    assert [m for m in rows if not (ROOT / m).exists()] == []


def test_docs_cite_scripts_that_exist():
    """Every `scripts/...` path the docs, the package and the scripts name exists, and where the tool takes a
    subcommand (a COMMANDS table) the word after it is one of them."""
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "minedraft" / "models" / "README.md",
             *sorted((ROOT / "minedraft").rglob("*.py")), *sorted((ROOT / "scripts").rglob("*.py")),
             *sorted((ROOT / "scripts").rglob("*.sh")), ROOT / ".ci" / "run"]
    bad = []
    for doc in texts:
        for m in re.finditer(r"scripts/([\w/]+\.(?:py|sh))(?: ([a-z][\w-]*))?", doc.read_text()):
            tool = ROOT / "scripts" / m.group(1)
            if not tool.is_file():
                bad.append(f"{doc.name}: {m.group(0)}")
                continue
            commands = re.search(r"^COMMANDS = \{(.*)\}$", tool.read_text(), re.M)
            if commands and m.group(2) and m.group(2) not in re.findall(r'"([\w-]+)":', commands.group(1)):
                bad.append(f"{doc.name}: {m.group(0)}")
    assert bad == []


# a file path (minedraft/x/y.py, or the short form x/y.py inside the package), a dotted module name, a bare name
PATH = re.compile(r"(?<![\w/.-])((?:[\w-]+/)+\w+\.py)\b")
DOTTED = re.compile(r"(?<![\w./'\"])minedraft((?:\.\w+)+)")  # not in quotes: logger and file names
BARE = re.compile(r"(?<![\w/.-])(\w+\.py)\b")


def _prose_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "minedraft" / "models" / "README.md",
            *sorted((ROOT / "minedraft").rglob("*.py")), *sorted((ROOT / "scripts").rglob("*.py"))]


def _without_rename_tables(text: str) -> str:
    """A table whose header says "former" maps old names to new ones: the old names are its point."""
    out, skipping = [], False
    for line in text.splitlines():
        skipping = line.startswith("|") and (skipping or "former" in line.lower())
        if not skipping:
            out.append(line)
    return "\n".join(out)


def stale_references(text: str, bare: bool = True) -> list[str]:
    """Module paths, dotted module names and (with bare) bare file names in text that name no file of this
    checkout."""
    pkg = ROOT / "minedraft"
    text = _without_rename_tables(text)
    names = {p.name for d in ("minedraft", "scripts", "tests", "clients") for p in (ROOT / d).rglob("*.py")}
    bad = [m.group(1) for m in PATH.finditer(text)
           if not ((ROOT / m.group(1)).is_file() or (pkg / m.group(1)).is_file())]
    bad += [m.group(1) for m in BARE.finditer(text) if bare and m.group(1) not in names]
    for m in DOTTED.finditer(text):
        where = pkg
        for part in m.group(1).strip(".").split("."):
            if part.startswith("__"):
                break
            if (where / part / "__init__.py").is_file():
                where = where / part
                continue
            if (where / f"{part}.py").is_file():
                break
            # else a name in the package reached so far (a class, a function, a re-export)
            if not re.search(rf"\b{re.escape(part)}\b", (where / "__init__.py").read_text()):
                bad.append(m.group(0))
            break
    return bad


def test_stale_module_paths_are_caught():
    found = stale_references("see minedraft/engine/no_such_module.py and spec/suffix.py, minedraft.spec.rng, "
                             "server_peers.py and minedraft.workers.tp_node")
    assert sorted(found) == sorted(["minedraft/engine/no_such_module.py", "spec/suffix.py", "server_peers.py",
                                    "minedraft.spec.rng", "minedraft.workers.tp_node"])
    assert stale_references("minedraft/pipeline.py, minedraft/config.py, minedraft.pipeline.Pipeline, "
                            "scripts/bench/tetris.py, tests/conftest.py, conftest.py, minedraft.Engine") == []


def test_docs_and_docstrings_name_no_stale_module():
    """README, docs, the package and the scripts; the tests too, but for bare names (they write scripts of their
    own, e.g. unguarded.py)."""
    tests = [f for f in sorted((ROOT / "tests").rglob("*.py")) if f.name != "test_docs.py"]
    bad = {str(f.relative_to(ROOT)): found for f, bare in [*((f, True) for f in _prose_files()),
                                                            *((f, False) for f in tests)]
           if (found := stale_references(f.read_text(), bare))}
    assert bad == {}
