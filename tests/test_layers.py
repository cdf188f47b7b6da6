"""Imports point one way, and no two files import each other.

    shared  ←  services/scheduler/core  ←  services  ←  cli, supervisor, flags, admin_cli
            ←  bench/report  ←  bench (the simulator, live load, micro-benchmarks)

Read from the source with `ast`: every import counts, at module level, in a function or under
`if TYPE_CHECKING:`, and `importlib.import_module("literal")` too. A module may import its own
layer and the layers below it, never one above; the import graph between the project's files
has no cycle. The one door upward is `superinfer bench`, which loads a benchmark by name only
when one is run (`services.cli.BENCHMARKS`), so that no other command pays for torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from services import cli

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "services", "bench")
LAYERS = ("shared", "core", "services", "cli", "report", "bench")  # lowest first
CLI_LAYER = {"services.cli", "services.supervisor", "services.flags", "services.admin_cli"}


def project_modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def layer(module: str) -> int:
    if module.split(".")[0] == "shared":
        return LAYERS.index("shared")
    if module.startswith("services.scheduler.core"):
        return LAYERS.index("core")
    if module in CLI_LAYER:
        return LAYERS.index("cli")
    if module.split(".")[0] == "services":
        return LAYERS.index("services")
    if module.startswith("bench.report"):  # reports read rows: they do not run what made them
        return LAYERS.index("report")
    return LAYERS.index("bench")


def imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that `module` imports, anywhere in its file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names += [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names.append(node.args[0].value)
    out = set()
    for name in names:
        while name and name not in modules:  # `import a.b.c` of a name inside a module
            name = name.rpartition(".")[0]
        if name and name != module:
            out.add(name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {m: imported(m, p, modules) for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_the_projects_files():
    assert [sorted(c) for c in cycles(import_graph())] == []


def test_no_import_from_a_lower_layer_into_a_higher_one():
    graph = import_graph()
    upward = sorted(
        f"{m} ({LAYERS[layer(m)]}) imports {t} ({LAYERS[layer(t)]})"
        for m, targets in graph.items()
        for t in targets
        if layer(t) > layer(m)
    )
    assert upward == []


def test_the_checker_sees_function_level_type_checking_and_string_imports(tmp_path):
    modules = {"services.a": tmp_path / "a.py", "services.b": tmp_path / "b.py", "bench.c": tmp_path / "c.py"}
    modules["services.a"].write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from services.b import X\n"
        "def f():\n    import importlib\n    importlib.import_module('bench.c')\n"
    )
    assert imported("services.a", modules["services.a"], modules) == {"services.b", "bench.c"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_benchmarks_are_loaded_by_name_only_when_one_runs():
    modules = project_modules()
    for name, (module, _) in cli.BENCHMARKS.items():
        assert module.startswith("bench.") and module in modules, name
    code = (
        "import sys\nfrom services.cli import build_parser\nbuild_parser().parse_args(['serve'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('bench', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
