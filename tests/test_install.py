"""What the xApp image does: `pip install .` (not editable), then run ricllm outside the repository.
The installed package must carry everything it needs at run time: the kernel sources the CPU
library is compiled from, the bundled scenarios, the `ricllm` command."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_an_installed_ricllm_prepares_and_generates_outside_the_repository(tiny_gguf, tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "ricllm", "kernels", "scenarios"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                             if (ROOT / name).is_dir() else {}))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    built = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "wheel"),
                            str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    site = tmp_path / "site"
    wheel = next((tmp_path / "wheel").glob("ricllm-*.whl"))
    installed = subprocess.run([*pip, "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    assert list((site / "ricllm" / "kernels" / "csrc").glob("*.c")), "kernel sources missing from the wheel"
    assert (site / "ricllm" / "scenarios" / "default.yaml").is_file()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "RICLLM_CACHE_DIR": str(tmp_path / "cache")}

    def ricllm(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ricllm.cli", *args], cwd=elsewhere, env=env,
                              capture_output=True, text=True, timeout=300)

    code = "import ricllm, ricllm.kernels as k; print(ricllm.__file__, k.__file__)"
    where = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True,
                           timeout=120)
    assert where.returncode == 0 and where.stdout.count(str(site)) == 2, where.stdout + where.stderr
    code = ("from ricllm.replay.loading import bundled_scenarios, load_scenario\n"
            "names = bundled_scenarios()\n"
            "print(names, [str(load_scenario(name).path) for name in names])\n")
    bundled = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True,
                             timeout=120)
    assert bundled.returncode == 0, bundled.stderr[-2000:]
    assert bundled.stdout.startswith("['capacity', 'default', 'link', 'overload', 'stress', 'templates']"), bundled.stdout
    assert bundled.stdout.count(str((site / "ricllm" / "scenarios").resolve())) == 6, bundled.stdout  # not the repo
    prepared = ricllm("prepare", "--model", str(tiny_gguf), "--dtype", "bfloat16")
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    if shutil.which("cc") or shutil.which("gcc"):  # built from the sources the wheel carries
        assert f"CPU kernels built at {tmp_path / 'cache' / 'kernels'}" in prepared.stdout, prepared.stdout
    generated = ricllm("generate", "hello", "--model", str(tiny_gguf), "--dtype", "bfloat16", "--max-tokens", "3",
                       "--ignore-eos", "--json")
    assert generated.returncode == 0, generated.stderr[-2000:]
