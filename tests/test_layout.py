"""The repository's architecture as its folders show it: no import circle among the packages' modules (deferred
imports included), few loose modules at the top of jaxtune/, and the moved modules still
importable by their first names."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxtune", "convert", "pallas_kernels")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports, at its top or inside its functions (an import deferred into a
    function to get around a circle is still one)."""
    modules = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if dep.startswith(node + "."):  # a package importing its own submodules in __init__
                continue
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle():
    graph = _import_graph()
    assert "jaxtune.quant.weights" in graph["jaxtune.moe.experts"]  # the quantized types below the MoE
    assert "jaxtune.qlora" not in graph["jaxtune.moe.experts"] | graph["jaxtune.moe.block"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_top_of_jaxtune_is_packages_by_concern():
    loose = sorted(p.name for p in (ROOT / "jaxtune").glob("*.py"))
    assert loose == ["__init__.py", "cli.py", "errors.py", "generate.py", "qlora.py"], loose
    for package in ("models", "quant", "parallel", "io", "platform", "ops", "moe", "training", "rl", "data"):
        assert (ROOT / "jaxtune" / package / "__init__.py").exists(), package


def test_moved_modules_import_by_their_first_names():
    import jaxtune

    for old, new in jaxtune.MOVED_MODULES.items():
        assert importlib.import_module(f"jaxtune.{old}") is importlib.import_module(f"jaxtune.{new}"), old
    from jaxtune.model import CausalLM
    from jaxtune.qlora import NF4Linear

    assert CausalLM is jaxtune.CausalLM and NF4Linear.__module__ == "jaxtune.quant.weights"
    # and in a fresh interpreter, the old name first
    code = "import jaxtune.sharding as s, jaxtune.parallel.sharding as p; assert s is p"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_benchmarks_are_grouped_and_drivers_apart_from_results():
    """Scripts in folders by what they measure, the lease drivers in drivers/, results/ only data and pages; every
    benchmark script the README and the docs name exists where they say."""
    import re

    bench = ROOT / "benchmarks"
    assert not list(bench.glob("*.py")) and not list(bench.glob("*.sh"))
    assert not [p for p in (bench / "results").rglob("*") if p.suffix in (".py", ".sh")]
    assert len(list((bench / "drivers").glob("*.sh"))) > 50
    for group in ("kernels", "steps", "ladders", "rl", "moe", "accuracy", "tools"):
        assert list((bench / group).glob("*.py")) or list((bench / group).glob("*.sh")), group
    pages = [ROOT / "README.md", bench / "README.md", *(ROOT / "docs").glob("*.md")]
    named = {m for page in pages for m in re.findall(r"benchmarks/[\w/.-]+\.(?:py|sh)", page.read_text())}
    assert named and [n for n in sorted(named) if not (ROOT / n).exists()] == []
