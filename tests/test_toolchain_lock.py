"""The venv the tests run in is the locked toolchain (constraints.txt), package for package.

A `>=` range resolves to whatever the registry serves that day, so the same commit's CI could
change when someone publishes a release (transformers 5 brought Hugging Face's `kernels` along).
`scripts/setup.sh --dev` and `--bench` install through the lock; this test says when the venv
has drifted from it: a version that differs, or a distribution the lock does not name.
"""

from __future__ import annotations

import re
import sysconfig
from importlib.metadata import distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "constraints.txt"
NOT_LOCKED = {"ricllm"}
# the venv's own folders: a package may put another folder on sys.path that holds distributions it vendors
# (setuptools does, once imported: its _vendor), which are not installed
SITE_PACKAGES = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(text: str) -> dict[str, str]:
    """Distribution -> pinned version; a line that is neither a comment nor ``name==version`` is an error."""
    pins = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        match = PIN.match(line.strip())
        assert match, f"constraints.txt:{number}: {line!r} is not name==version"
        pins[canonical(match[1])] = match[2]
    return pins


def drift(installed: dict[str, str], locked: dict[str, str]) -> list[str]:
    """What differs: installed at another version than locked, or installed and not locked."""
    problems = []
    for name, version in sorted(installed.items()):
        if name in NOT_LOCKED:
            continue
        if name not in locked:
            problems.append(f"{name} {version} is installed but not locked")
        elif locked[name] != version:
            problems.append(f"{name} {version} is installed, the lock says {locked[name]}")
    return problems


def test_every_installed_distribution_is_the_locked_version() -> None:
    installed = {canonical(d.metadata["Name"]): d.version for d in distributions(path=SITE_PACKAGES)}
    problems = drift(installed, read_lock(LOCK.read_text()))
    assert not problems, ("the venv is not the locked toolchain (rerun `bash scripts/setup.sh --dev`, or upgrade "
                          "the lock with `bash scripts/lock.sh`):\n  " + "\n  ".join(problems))


def test_the_lock_pins_what_the_tests_import_first_of_all_the_oracle() -> None:
    locked = read_lock(LOCK.read_text())
    for name in ("transformers", "torch", "triton", "kernels", "pytest", "pytest-timeout", "hypothesis", "openai",
                 "setuptools",
                 "kubernetes-validate", "llama-cpp-python", "llguidance", "numpy", "gguf"):
        assert name in locked, f"{name} is not locked"
    assert locked["torch"].startswith("2.13.0"), "torch stays 2.13.0 (the CPU build)"


def test_a_drifted_venv_is_named_package_by_package() -> None:
    locked = {"transformers": "5.25.0", "kernels": "0.19.1"}
    installed = {"transformers": "5.26.0", "kernels": "0.19.1", "leftover": "1.0", "ricllm": "0.1.0"}
    assert drift(installed, locked) == ["leftover 1.0 is installed but not locked",
                                        "transformers 5.26.0 is installed, the lock says 5.25.0"]


def test_setup_installs_dev_and_bench_through_the_lock() -> None:
    script = (ROOT / "scripts" / "setup.sh").read_text()
    installs = [line for line in script.splitlines() if line.startswith(".venv/bin/pip install")]
    assert installs and all('"${lock[@]}"' in line for line in installs), installs
    assert "[ ${#groups[@]} -eq 0 ] || lock=(-c constraints.txt)" in script  # --dev or --bench: the lock
