"""The package's shape: folders in one order of layers, imports only downwards (function-level imports
included), no import cycle between modules, few modules at the top level and none too long."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "minedraft"

# lowest first; a unit (a top-level folder, or a top-level module) may import itself and any unit below it
LAYERS = [
    {"errors", "cores", "config", "kv_budget", "outputs", "grammar_check", "sampling_params"},  # shared basics
    {"pipeline"},  # the two-batch rhythm, I/O-free: the drafter process runs it, the engine's baselines drive it
    {"ipc"},       # the typed messages and tensor slots between processes
    {"sampling"},  # speculative-sampling maths
    {"controls"},  # output controls and grammars on logits
    {"cache"},     # paged KV cache and block accounting
    {"runner"},    # the forward pass and its layers
    {"drafting"},  # every proposer and its loading
    {"workers"},   # the worker processes
    {"models"},    # model folders: checks, pulling
    {"engine"},    # the caller's process: Engine, scheduler
    {"serving"},   # front ends
    {"bench"},     # the benchmark
    {"cli"},       # the command line
    {"client", "__init__", "__main__"},  # public faces
]
RANK = {u: i for i, layer in enumerate(LAYERS) for u in layer}


def modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out["minedraft." + ".".join(parts) if parts != ("__init__",) else "minedraft"] = p
    return out


def imports_of(name: str, path: Path, known) -> set[str]:
    """Every minedraft module `name` imports, at any depth of the file."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                mod = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def unit(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def graph():
    mods = modules()
    return {m: imports_of(m, p, mods) for m, p in mods.items()}


def test_every_unit_has_a_layer():
    assert {unit(m) for m in modules()} <= set(RANK), {unit(m) for m in modules()} - set(RANK)


def test_no_upward_import():
    up = [f"{m} -> {t}" for m, ts in graph().items() for t in ts if RANK[unit(t)] > RANK[unit(m)]]
    assert not up, "imports pointing up:\n" + "\n".join(sorted(up))


def test_no_import_cycle():
    g = graph()
    # package __init__ files are entered by importing any submodule: they stay out of the cycle check
    files = modules()
    plain = {m for m, p in files.items() if p.name != "__init__.py"}
    g = {m: ts & plain for m, ts in g.items() if m in plain}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(g[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_top_level_is_small_and_modules_short():
    top = [p for p in PKG.glob("*.py")]
    assert len(top) <= 12, sorted(p.name for p in top)
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long


def test_the_pipeline_core_does_no_io():
    """minedraft/pipeline.py imports no sockets, processes, shared memory or torch (at any depth of the file)."""
    tree = ast.parse((PKG / "pipeline.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in names if m.split(".")[0] in ("zmq", "multiprocessing", "torch", "socket", "asyncio")}
    assert len((PKG / "pipeline.py").read_text().splitlines()) < 400
