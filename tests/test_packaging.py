"""What each install brings: `pip install ricllm` is the client (no torch), `ricllm[engine]` loads and serves
models, `ricllm[onnx]` serves them through ONNX Runtime without torch, `ricllm[report]` draws the replay report's
plots, `ricllm[dev]` runs the tests. The client-only and ONNX installs are played in this venv by making the
packages they lack fail to import (tests/absent_run.py)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tomllib

from ricllm.extras import EXTRA_OF_MODULE

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
ABSENT_RUN = Path(__file__).with_name("absent_run.py")
IMPORT_NAMES = {"pyyaml": "yaml", "prometheus-client": "prometheus_client", "pyzmq": "zmq",  # where they differ
                "onnxruntime-gpu": "onnxruntime"}
BROUGHT_ALONG = {"anyio": "starlette's own dependency"}
GPU_ONLY = {"triton": "ricllm/kernels/triton_decode.py, imported on a CUDA device only (the dev extra has it)"}


def _distribution(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()


def _import_name(requirement: str) -> str:
    name = _distribution(requirement)
    return IMPORT_NAMES.get(name, name.replace("-", "_"))


def _imports(extra: str | None) -> set[str]:
    """The import names an install of ``extra`` (None: the base install) brings, through the extras it names."""
    requirements = PYPROJECT["dependencies"] if extra is None else PYPROJECT["optional-dependencies"][extra]
    names = set()
    for requirement in requirements:
        included = re.fullmatch(r"ricllm\[([a-z0-9,-]+)\]", requirement)
        names |= (set().union(*map(_imports, included.group(1).split(","))) if included
                  else {_import_name(requirement)})
    return names


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level package -> the files of ricllm/ that import it (anywhere in the file)."""
    found: dict[str, set[str]] = {}
    for folder in ("ricllm",):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top != "ricllm":
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def _client_only() -> set[str]:
    """What `pip install ricllm` lacks: the extras' packages and the test tools."""
    return _imports("engine") | _imports("report") | _imports("adapt") | _imports("dev") | set(GPU_ONLY)


def _onnx_only() -> set[str]:
    """What `pip install 'ricllm[onnx]'` lacks: torch, and every other package that [onnx] does not bring."""
    return _client_only() - _imports("onnx")


def _without(absent: set[str], *args: str, timeout: int = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Python with the packages ``absent`` failing to import as if never installed."""
    return subprocess.run([sys.executable, str(ABSENT_RUN), ",".join(sorted(absent)), *args], cwd=ROOT,
                          check=False, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_the_base_install_is_the_client_and_the_engine_and_plots_are_extras():
    base = _imports(None)
    assert {"zmq", "msgpack", "pydantic"} <= base
    assert not base & {"torch", "numpy", "gguf", "tokenizers", "llguidance", "matplotlib", "pytest"}, base
    assert {"torch", "numpy", "gguf", "tokenizers", "llguidance", "starlette", "uvicorn"} <= _imports("engine")
    assert "matplotlib" in _imports("report") and "matplotlib" not in _imports("engine")
    assert "pytest" in _imports("dev")


def test_the_onnx_extras_are_the_engine_with_onnx_runtime_instead_of_torch():
    for extra in ("onnx", "onnx-gpu"):
        assert "torch" not in _imports(extra)
        assert _imports("engine") - {"torch"} <= _imports(extra), extra
        assert {"onnxruntime", "onnx"} <= _imports(extra)
    gpu = {_distribution(r) for r in PYPROJECT["optional-dependencies"]["onnx-gpu"]}
    cpu = {_distribution(r) for r in PYPROJECT["optional-dependencies"]["onnx"]}
    assert "onnxruntime-gpu" in gpu and "onnxruntime" not in gpu and "onnxruntime" in cpu  # one module, two builds


def test_every_package_ricllm_imports_comes_with_the_base_install_or_the_extra_its_message_names():
    """A missing package's message (ricllm/extras.py) must name the extra that really installs it."""
    for module, files in _third_party_imports().items():
        if module in BROUGHT_ALONG or module in GPU_ONLY or module in _imports(None):
            continue
        assert module in EXTRA_OF_MODULE, f"{module} (imported by {sorted(files)}) is in no extra of ricllm/extras.py"
        extra = EXTRA_OF_MODULE[module]
        assert module in _imports(extra), f"{module} is not in pyproject's [{extra}] extra, which the message names"


def test_no_module_of_ricllm_imports_a_test_tool():
    # jsonschema is in engine and dev, transformers and peft in adapt and dev; triton: see GPU_ONLY
    tools = _imports("dev") - _imports("engine") - _imports("adapt") - set(GPU_ONLY)
    used = {module: files for module, files in _third_party_imports().items() if module in tools}
    assert not used, used


def test_the_client_works_without_the_engine(tmp_path):
    from tests.serve.test_client import FakeServer

    server = FakeServer("tcp://127.0.0.1:*")
    try:
        code = ("import sys, json\n"
                "from ricllm.client import RicClient\n"
                "client = RicClient(sys.argv[1], timeout_s=10)\n"
                "print(json.dumps({'version': client.ping().version, 'text': client.generate('hi').text}))\n"
                "client.close()\n"
                "engine = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'))\n"
                "assert not engine, engine\n")
        done = _without(_client_only(), "-c", code, server.endpoint)
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout) == {"version": "0.1.0", "text": "HI"}
        pinged = _without(_client_only(), "-m", "ricllm.cli", "client", "ping", "--endpoint", server.endpoint)
        assert pinged.returncode == 0 and "Traceback" not in pinged.stderr, pinged.stderr[-3000:]
    finally:
        server.stop()
    keys = _without(_client_only(), "-m", "ricllm.cli", "keys", str(tmp_path), "--name", "client")
    assert keys.returncode == 0, keys.stderr[-3000:]
    assert (tmp_path / "client.key").is_file() and (tmp_path / "client.key_secret").is_file()
    helped = _without(_client_only(), "-m", "ricllm.cli", "--help")
    assert helped.returncode == 0 and "client" in helped.stdout, helped.stderr[-3000:]
    assert re.search(r"replay\s+\(needs ricllm\[engine\], not installed here\)", helped.stdout), helped.stdout


@pytest.mark.parametrize("command", [["serve"], ["replay", "default"], ["replay", "--help"], ["generate", "hi"],
                                     ["prepare"], ["info"]])
def test_an_engine_command_without_the_engine_names_the_extra_to_install(command):
    done = _without(_client_only(), "-m", "ricllm.cli", *command)
    assert done.returncode == 2, done.stdout + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"ricllm: error: `ricllm {command[0]}` needs " in done.stderr
    assert "pip install 'ricllm[engine]'" in done.stderr, done.stderr


def test_a_report_without_matplotlib_is_written_without_plots_and_says_what_to_install(tmp_path):
    from ricllm.report.records import write_report_json
    from tests.report.test_html_report import synthetic_report

    write_report_json(synthetic_report(), tmp_path)
    done = _without({"matplotlib"}, "-m", "ricllm.cli", "report", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "report_plots_skipped" in done.stderr and "pip install 'ricllm[report]'" in done.stderr, done.stderr
    html = (tmp_path / "report.html").read_text()
    assert "No latency CDF plot: this install has no matplotlib" in html and "<img" not in html
    assert not list(tmp_path.glob("*.png"))


PREBUILT_CHECK = """
import json, sys
from ricllm.kernels import cpu_library
cpu_library._compiler = lambda: None  # the image's runtime stage: no C compiler
ok, reason = cpu_library.cpu_kernels_available()
print(json.dumps({"ok": ok, "reason": reason, "packed": ok and cpu_library.quant_gemm_available(8)}))
"""


def test_kernels_built_ahead_load_on_a_machine_without_a_compiler(tmp_path):
    """What the image's build stage does (one library per family) and its runtime stage loads by CPU flags."""
    from ricllm.kernels import cpu_library

    family = cpu_library.cpu_family()
    if family is None or cpu_library._compiler() is None:
        pytest.skip("needs an x86-64-v3 CPU and a C compiler to build the libraries")
    prebuilt = tmp_path / "prebuilt"
    env = {**os.environ, "RICLLM_CACHE_DIR": str(tmp_path / "cache"), cpu_library.PREBUILT_VARIABLE: str(prebuilt)}

    def check() -> dict:
        done = subprocess.run([sys.executable, "-c", PREBUILT_CHECK], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)

    missing = check()  # nothing built ahead yet, and nothing to build with
    assert not missing["ok"] and cpu_library.PREBUILT_VARIABLE in missing["reason"], missing
    [library] = cpu_library.build_prebuilt(prebuilt, (family,))  # the image builds every family; one is enough here
    loaded = check()
    assert loaded == {"ok": True, "reason": f"built ahead at {library}", "packed": True}, loaded
    assert not (tmp_path / "cache" / "kernels").exists()  # nothing compiled on the "node"


@pytest.fixture
def onnx_install(tmp_path) -> dict:
    """An [onnx]-only install's environment: a cache of its own (the graph exported there on first use)
    and no C compiler, as in an image that has none."""
    for module in ("onnxruntime", "onnx"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"python package {module!r} is not installed")
    return {"RICLLM_CACHE_DIR": str(tmp_path / "cache"), "RICLLM_LOG_LEVEL": "warning", "CC": str(tmp_path / "no-cc")}


def _built_no_kernels(install: dict) -> bool:
    """ONNX Runtime brings its own kernels: nothing tried to build ricllm's C library (it builds into the cache)."""
    return not (Path(install["RICLLM_CACHE_DIR"]) / "kernels").exists()


def test_an_onnx_install_exports_generates_and_prepares_without_torch(tiny_gguf, onnx_install, tmp_path):
    out = tmp_path / "tiny.onnx"
    exported = _without(_onnx_only(), "-m", "ricllm.cli", "export-onnx", str(tiny_gguf), str(out), env=onnx_install)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert out.is_file() and out.with_suffix(".onnx.json").is_file()
    generated = _without(_onnx_only(), "-m", "ricllm.cli", "generate", "--model", str(tiny_gguf), "--runtime", "onnx",
                         "--kv-cache-budget", "4MiB", "--max-tokens", "4", "hello", env=onnx_install, timeout=300)
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert "4 generated" in generated.stdout + generated.stderr
    prepared = _without(_onnx_only(), "-m", "ricllm.cli", "prepare", "--model", str(tiny_gguf), "--runtime", "onnx",
                        env=onnx_install, timeout=300)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    assert "already in the weight cache" in prepared.stdout, prepared.stdout
    assert "CPU kernels not used by the onnx runtime on cpu" in prepared.stdout, prepared.stdout
    assert _built_no_kernels(onnx_install)


def test_an_onnx_install_names_the_onnx_runtime_where_the_native_one_needs_torch(tiny_gguf):
    """``auto`` picks the native runtime, which converts the GGUF with torch (once, where the weight cache
    keeps it): without torch, the message says so and names both ways on, with no traceback. The
    session's cache, whose C kernels the native runtime's check reuses."""
    done = _without(_onnx_only(), "-m", "ricllm.cli", "generate", "--model", str(tiny_gguf), "--weights", "int8",
                    "--no-weight-cache", "--max-tokens", "4", "hello", env={"RICLLM_LOG_LEVEL": "warning"},
                    timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "this install has no torch" in done.stderr and "pip install 'ricllm[engine]'" in done.stderr
    assert "--runtime onnx" in done.stderr, done.stderr


def test_an_onnx_install_serves_the_openai_api_without_torch(tiny_gguf, onnx_install, tmp_path):
    from ricllm.engine.latency_model import LatencyModel

    fit = tmp_path / "latency_fit.json"
    LatencyModel([1e-3, 1e-5, 1e-4, 1e-7, 0.0]).save(fit)  # loaded instead of calibrating
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, str(ABSENT_RUN), ",".join(sorted(_onnx_only())), "-m", "ricllm.cli", "serve",
         "--model", str(tiny_gguf), "--runtime", "onnx", "--zmq", f"ipc://{tmp_path}/serve.sock",
         "--http-port", str(port), "--latency-fit", str(fit), "--kv-cache-budget", "4MiB"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**{k: v for k, v in os.environ.items() if k != "CONFIG_FILE"}, **onnx_install})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while _status(base + "/ric/v1/health/ready") != 200:
            assert process.poll() is None and time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.2)
        request = urllib.request.Request(base + "/v1/completions", method="POST",
                                         headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": tiny_gguf.stem, "prompt": "hello", "max_tokens": 4}).encode())
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        assert answer["usage"]["completion_tokens"] == 4, answer
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr[-3000:]
    assert _built_no_kernels(onnx_install)


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None
