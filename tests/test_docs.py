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
