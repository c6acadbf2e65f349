"""The library's house rules that a reader checks by its imports: no module of ``ckptconv``
imports one that imports it back (directly or around a longer circle), and every import points
down the pipeline's floors (commands over write over plan over families over read over the shared
top-level modules), counting imports inside functions too, since a lazy import is still a dependency."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import ckptconv

ROOT = os.path.dirname(ckptconv.__file__)


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(ROOT))[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _imports(path: str, modules: set[str]) -> set[str]:
    """The ``ckptconv`` modules a file imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found.update(n for n in names if n in modules)
    return found


def _graph() -> dict[str, set[str]]:
    paths = [os.path.join(d, f) for d, _, fs in os.walk(ROOT) for f in fs if f.endswith(".py")]
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) - {_module_name(p)} for p in paths}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the list of modules around it, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycle_inside_the_library():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


# Package -> floor. An import may point to the same floor or lower, never higher. The top-level
# modules (errors, units, monitor, progress, layout, locations, rssplot) are floor 0, except the CLI.
FLOORS = {"read": 1, "families": 2, "plan": 3, "write": 4, "commands": 5, "cli": 6, "__main__": 7}


def _floor(module: str) -> int:
    parts = module.split(".")
    return FLOORS.get(parts[1], 0) if len(parts) > 1 else 0


def test_every_import_points_down_the_pipeline():
    upward = sorted(f"{m} -> {d}" for m, deps in _graph().items() for d in deps
                    if d != "ckptconv" and _floor(d) > _floor(m))
    assert upward == []


def test_every_package_says_what_it_owns():
    for name in ("read", "families", "plan", "write", "commands"):
        init = os.path.join(ROOT, name, "__init__.py")
        doc = ast.get_docstring(ast.parse(open(init, encoding="utf-8").read()))
        assert doc and len(doc) > 40, f"ckptconv/{name}/__init__.py needs a docstring saying what it owns"


def test_opening_a_local_source_imports_no_cloud_client(tmp_path):
    """The cloud clients are imported only when a gs:// or hf:// source is opened."""
    code = ("import sys; from ckptconv.read import open_source; open_source(sys.argv[1]); "
            "print(sorted(m for m in ('gcsfs', 'huggingface_hub', 'google.cloud.storage') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
