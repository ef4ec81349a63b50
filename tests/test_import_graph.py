"""No import circle in ricllm/, and every import goes down the package's layers.

The graph is read from the sources with ``ast``, so it counts every import a module can make:
at module level, inside functions and under ``if TYPE_CHECKING:``. A circle through a
function-level import still ties two modules together: neither can be understood, moved or
tested without the other. Edges: ``import a.b`` -> ``a.b``; ``from a import b`` -> ``a.b`` when
that is a module, else ``a``; relative imports are resolved. The parent packages Python imports
on the way (``a`` for ``a.b``) are not edges: every module would otherwise depend on its
package's ``__init__``. A module named in a string (``importlib.import_module``: the CLI's command
groups) is no edge; the CLI sits at the top, so what it loads that way lies below it anyway.

The layers (``LAYERS``, lowest first) follow a request's way through the code: request ->
admission -> scheduler -> model runner -> attention -> cache, and the output back. A unit is a
name directly under ``ricllm/``: a subpackage or a top-level module (``ricllm`` itself is the
package's ``__init__``, the public names). A module may import its own unit and any unit of a
lower layer; units that share a layer are peers and import neither each other nor anything
above. Why each layer sits where it does:

- ``errors``: the exception types every layer raises.
- ``paths``, ``units``, ``version``, ``logging``, ``extras``, ``faults``, ``affinity``: the process
  and the machine (cache folders, byte counts, events, pip extras, the noisy neighbour, which
  CPUs the engine computes on); each knows nothing of LLMs.
- ``kernels``: the C, Triton and CUDA kernels' Python side; of ricllm it needs only errors and
  paths (where the built libraries lie).
- ``config``: the settings, the engine's and the service's, each an input model and what it
  resolves to; resolving ``dtype: auto`` asks the kernels what the CPU runs, and ``engine_cpus``
  is checked by ``affinity``. It knows nothing of the engine or the server that read it.
- ``model``: a model's files: the shape (``ModelSpec``), the tokenizer, loading, the weight
  formats. The networks that run those weights, and the caches of their converted weights, are
  execution, in ``engine/runtime``.
- ``structured``: constrained answers; a grammar is compiled against the model's tokenizer.
- ``sampling_params``, ``template``, ``outputs``, ``kv_window``, ``lora_request``: a request as it
  is asked (its knobs, its template and constraint, its KV window, its adapter) and what it gives back.
- ``sequence``: the request as the engine holds it (``Sequence``): its tokens, its window, its
  blocks. Admission, the scheduler and the cache all speak of it, so it lies below them all.
- ``cache``: the paged KV pool and its block tables; it sizes rows from the model's shape.
- ``attention``: attention over the paged cache, reading its row format.
- ``engine``: admission, the scheduler, the runtimes (model runner, the torch and native
  networks, their weight conversion, the ONNX graph and its ONNX Runtime session) and the step
  loop: what puts the layers below to work.
- ``ricllm``: the public names (``LLM``, ``SamplingParams``, ...), which load the engine.
- ``protocol``: the wire protocol; it carries the engine's stats records as they are.
- ``client``: ``RicClient`` over the wire protocol, with no engine in the process.
- ``report``: ``report.json``'s records, targets and aggregates, rendered from the file alone.
- ``replay``, ``serve``, ``plan``: what the commands run: scenario replay (in process or as a
  client), the xApp service (its HTTP side is a client of its own socket), the capacity planner.
- ``cli``: the ``ricllm`` command over all of them.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"ricllm": ROOT / "ricllm"}

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("paths", "units", "version", "logging", "extras", "faults", "affinity"),
    ("kernels",),
    ("config",),
    ("model",),
    ("structured",),
    ("sampling_params", "template", "outputs", "kv_window", "lora_request"),
    ("sequence",),
    ("cache",),
    ("attention",),
    ("engine",),
    ("ricllm",),
    ("protocol",),
    ("client",),
    ("report",),
    ("replay", "serve", "plan"),
    ("cli",),
)


@dataclass(frozen=True)
class Edge:
    """One import: ``module`` imports ``target`` at ``path:line``."""

    module: str
    target: str
    path: Path
    line: int


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


def import_edges(module: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    """Every import of a project module in ``module``'s file, with its line."""
    edges = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, module, path.name == "__init__.py")
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        edges += [Edge(module, target, path, node.lineno) for target in set(targets)
                  if target in modules and target != module]
    return sorted(edges, key=lambda edge: (edge.line, edge.target))


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``module`` imports anywhere in its file."""
    return {edge.target for edge in import_edges(module, path, modules)}


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


def unit_of(module: str) -> str:
    """The name directly under the root package (``pkg.a.b`` -> ``a``); the root is its own."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_violations(packages: dict[str, Path], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """``file:line: from-unit -> to-unit ...`` for every import of a higher layer or of a peer, and
    a line for each unit that no layer places (a new package must be given its place)."""
    layer_of = {unit: index for index, names in enumerate(layers) for unit in names}
    modules = module_files(packages)

    def shown(path: Path, module: str) -> str:
        return path.relative_to(packages[module.split(".")[0]].parent).as_posix()

    unplaced = sorted({f"{shown(path, module)}: {unit_of(module)} is in no layer"
                       for module, path in modules.items() if unit_of(module) not in layer_of})
    upward = []
    for module, path in modules.items():
        for edge in import_edges(module, path, modules):
            source, target = unit_of(module), unit_of(edge.target)
            if source == target or source not in layer_of or target not in layer_of:
                continue
            if layer_of[target] >= layer_of[source]:
                kind = "a peer" if layer_of[target] == layer_of[source] else "a higher layer"
                upward.append(f"{shown(path, module)}:{edge.line}: {source} -> {target} imports {kind} "
                              f"({edge.module} -> {edge.target})")
    return unplaced + upward


def test_no_module_of_ricllm_or_kernels_imports_itself_back():
    graph = import_graph(PACKAGES)
    assert "ricllm.engine.runtime.choice" in graph and "ricllm.kernels.cpu_library" in graph  # both trees read
    cycles = find_cycles(graph)
    assert not cycles, f"import cycles:\n{_describe(cycles)}"


def test_every_import_goes_to_a_lower_layer():
    problems = layer_violations(PACKAGES, LAYERS)
    assert not problems, "imports against the layers (LAYERS, lowest first):\n" + "\n".join(problems)


def test_every_unit_of_the_layers_exists_once():
    units = [unit for names in LAYERS for unit in names]
    assert len(units) == len(set(units)), f"a unit in two layers: {sorted(u for u in units if units.count(u) > 1)}"
    present = {unit_of(module) for module in module_files(PACKAGES)}
    assert not set(units) - present, f"LAYERS names what ricllm/ does not hold: {sorted(set(units) - present)}"


def test_the_architecture_page_lists_these_layers():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").split("\n## Layers\n", 1)[1]
    items = re.findall(r"^\d+\. (.*)$", text.split("\n## ", 1)[0], flags=re.M)
    listed = tuple(tuple(name.rstrip("/") for name in re.findall(r"`([^`]+)`", item.split(": ", 1)[0]))
                   for item in items)
    assert listed == LAYERS, "docs/architecture.md's Layers list differs from LAYERS"


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


def test_upward_and_peer_imports_are_named_with_their_line_even_in_a_function_or_type_check(tmp_path):
    packages = _write_package(tmp_path, {
        "__init__.py": "",
        "low.py": "import os\n\ndef late():\n    from pkg.top.app import run\n    return run\n",
        "peer.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import other\n",
        "other.py": "",
        "top/__init__.py": "",
        "top/app.py": "from pkg.low import late\nfrom ..peer import TYPE_CHECKING\nrun = late\n",
    })
    layers = (("low",), ("peer", "other"), ("top", "pkg"))
    assert layer_violations(packages, layers) == [
        "pkg/low.py:4: low -> top imports a higher layer (pkg.low -> pkg.top.app)",
        "pkg/peer.py:3: peer -> other imports a peer (pkg.peer -> pkg.other)",
    ]
    assert find_cycles(import_graph(packages)) == [["pkg.low", "pkg.top.app", "pkg.low"]]


def test_a_unit_in_no_layer_is_named(tmp_path):
    packages = _write_package(tmp_path, {"__init__.py": "", "low.py": "", "new/__init__.py": "from pkg import low\n"})
    assert layer_violations(packages, (("low",), ("pkg",))) == ["pkg/new/__init__.py: new is in no layer"]
