"""No import circle in ricllm/.

The graph is read from the sources with ``ast``, so it counts every import a module can make:
at module level, inside functions and under ``if TYPE_CHECKING:``. A circle through a
function-level import still ties two modules together: neither can be understood, moved or
tested without the other. Edges: ``import a.b`` -> ``a.b``; ``from a import b`` -> ``a.b`` when
that is a module, else ``a``; relative imports are resolved. The parent packages Python imports
on the way (``a`` for ``a.b``) are not edges: every module would otherwise depend on its
package's ``__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"ricllm": ROOT / "ricllm"}


def module_files(packages: dict[str, Path]) -> dict[str, Path]:
    """Every module's dotted name -> its file (a package is its ``__init__.py``)."""
    modules = {}
    for package, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _from_base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a ``from ... import`` names (``from . import x`` in ``a.b`` -> ``a``)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``module`` imports anywhere in its file."""
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, module, path.name == "__init__.py")
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in modules else base)
    return {target for target in targets if target in modules and target != module}


def import_graph(packages: dict[str, Path]) -> dict[str, set[str]]:
    modules = module_files(packages)
    return {module: imports_of(module, path, modules) for module, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per back edge of a depth-first search (``[a, b, a]``): none exactly when the
    graph has no cycle, and every strongly connected knot shows at least once."""
    cycles, on_path, done = [], [], set()

    def visit(module: str) -> None:
        on_path.append(module)
        for target in sorted(graph.get(module, ())):
            if target in on_path:
                cycles.append(on_path[on_path.index(target):] + [target])
            elif target not in done:
                visit(target)
        on_path.pop()
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module)
    return cycles


def _describe(cycles: list[list[str]]) -> str:
    return "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_no_module_of_ricllm_or_kernels_imports_itself_back():
    graph = import_graph(PACKAGES)
    assert "ricllm.engine.runtime.choice" in graph and "ricllm.kernels.cpu_library" in graph  # both trees read
    cycles = find_cycles(graph)
    assert not cycles, f"import cycles:\n{_describe(cycles)}"


def _write_package(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, source in files.items():
        (root / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "pkg" / name).write_text(source)
    return {"pkg": root / "pkg"}


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    packages = _write_package(tmp_path, {
        "__init__.py": "",
        "a.py": "from pkg.b import helper\n",
        "b.py": "def helper():\n    from pkg import a\n    return a\n",
    })
    assert _describe(find_cycles(import_graph(packages))) == "pkg.a -> pkg.b -> pkg.a"


def test_type_checking_and_relative_imports_count_and_a_package_root_is_an_edge(tmp_path):
    packages = _write_package(tmp_path, {
        "__init__.py": "def __getattr__(name):\n    from pkg.sub.engine import Engine\n    return Engine\n",
        "sub/__init__.py": "",
        "sub/engine.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .model import Model\n",
        "sub/model.py": "import pkg\nVERSION = pkg.__name__\n",
    })
    graph = import_graph(packages)
    assert graph["pkg.sub.engine"] == {"pkg.sub.model"} and graph["pkg.sub"] == set()
    assert _describe(find_cycles(graph)) == "pkg -> pkg.sub.engine -> pkg.sub.model -> pkg"


def test_parent_packages_are_not_edges_and_a_chain_is_no_cycle(tmp_path):
    packages = _write_package(tmp_path, {
        "__init__.py": "from pkg.a import run\n",
        "a.py": "from pkg.b import step\nrun = step\n",
        "b.py": "import os\nfrom . import c\nstep = c\n",
        "c.py": "",
    })
    graph = import_graph(packages)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": set()}
    assert find_cycles(graph) == []
