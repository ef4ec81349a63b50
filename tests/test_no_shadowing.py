"""Nothing run from the repository root takes a folder of ours for an installed package.

`python -m pytest`, a benchmark and the CLI all run with the repository root on ``sys.path``.
A top-level folder that Python imports as a regular package (it has an ``__init__.py``) wins
over an installed package of the same name: Hugging Face's ``kernels``, which transformers
imports, would then be our ``kernels/``. So ``kernels/`` (the C and CUDA sources) and
``scenarios/`` are plain data folders, the kernels' Python side is ``ricllm.kernels``, and the
folders imported by name from the root (``tests``, ``benchmarks``) share no name with an
installed distribution.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA_FOLDERS = ("kernels", "scenarios")  # shipped inside the wheel as ricllm/kernels/csrc and ricllm/scenarios
IMPORTED_FROM_THE_ROOT = ("tests", "benchmarks")  # namespace packages: `from tests.helpers import ...`


def _installed_top_level_names() -> dict[str, list[str]]:
    """Top-level module name -> the installed distributions (other than ricllm) that provide it."""
    return {name: [d for d in dists if d.lower() != "ricllm"]
            for name, dists in packages_distributions().items() if any(d.lower() != "ricllm" for d in dists)}


def test_hugging_faces_kernels_and_ours_import_side_by_side_from_the_repository_root() -> None:
    if "kernels" not in _installed_top_level_names():
        if os.environ.get("CI") == "true":
            pytest.fail("Hugging Face's `kernels` is not installed: the locked test toolchain has it")
        pytest.skip("Hugging Face's `kernels` is not installed (transformers brings it; `scripts/setup.sh --dev`)")
    code = ("import importlib.metadata as md, kernels, ricllm.kernels\n"
            "theirs = {str(md.distribution('kernels').locate_file(f)) for f in md.distribution('kernels').files}\n"
            "print(kernels.__file__); print(ricllm.kernels.__file__)\n"
            "assert kernels.__file__ in theirs, f'import kernels found {kernels.__file__}, not the installed one'\n"
            "import transformers.integrations.hub_kernels\n")  # the import that failed when ours shadowed theirs
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    theirs, ours = done.stdout.split()
    assert not Path(theirs).resolve().is_relative_to(ROOT / "kernels"), theirs
    assert Path(ours).resolve() == ROOT / "ricllm" / "kernels" / "__init__.py"


def test_no_folder_of_ours_is_named_like_an_installed_package() -> None:
    importable = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()} - {"ricllm"}
    importable |= {p.stem for p in ROOT.glob("*.py")} | set(IMPORTED_FROM_THE_ROOT)
    clashes = {name: dists for name, dists in _installed_top_level_names().items() if name in importable}
    assert not clashes, f"top-level folders of ours that an installed distribution also provides: {clashes}"


def test_the_data_folders_are_not_packages_and_nothing_imports_them_by_name() -> None:
    for folder in DATA_FOLDERS:
        assert not list((ROOT / folder).rglob("*.py")), f"{folder}/ holds Python: it would be importable as {folder}"
    importers = []
    for path in [*ROOT.glob("ricllm/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("benchmarks/*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            importers += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in DATA_FOLDERS]
    assert not importers, importers
