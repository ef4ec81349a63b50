"""ONNX Runtime GenAI as bench_cpu's peer: its packages, and its int4 CPU model built from the same GGUF.

ORT GenAI's model builder reads a Hugging Face folder, so the GGUF becomes one first: transformers
unpacks it (``from_pretrained(gguf_file=..., quantization_config=GgufConfig(dequantize=True))``)
into a plain fp32 model, which ``save_pretrained`` writes beside the tokenizer. The builder then
writes the int4 CPU model with the settings ORT GenAI recommends for the CPU (Microsoft's
``cpu-int4-rtn-block-32-acc-level-4`` releases): round-to-nearest int4 in blocks of 32, accuracy
level 4 (MatMulNBits quantizes the activations to int8), symmetric, the tied embedding and head
shared; and ``prune_lm_head``, so that a prefill computes the head's logits at the last prompt
position only, as the other engines do. Both folders land in ``$RICLLM_CACHE_DIR/ortgenai/``,
keyed by the GGUF's sha256, the versions that wrote them and the builder's options, so only a first
run builds them. Nothing is downloaded: every step runs with the Hugging Face hub offline, from the
local file.

The packages: an interpreter that imports ``onnxruntime_genai`` and ``onnx_ir`` (the builder's
one need beside torch, transformers and onnx) serves as it is; otherwise ``VERSIONS`` are installed,
without their dependencies, into ``$RICLLM_CACHE_DIR/ortgenai-VERSION`` and put on the peer's
PYTHONPATH. ORT GenAI then loads the ONNX Runtime the venv already has (it requires
``onnxruntime>=1.31.0``; constraints.txt locks 1.31.1, and onnx-ir's own requirements are locked
there too), so the project's venv and its lock stay as they are. They are not in the ``[bench]``
extra: ORT GenAI requires the CPU build ``onnxruntime``, which excludes ``[onnx-gpu]``'s.

Run as a script, this module writes the HF folder (``python ortgenai_peer.py hf-folder GGUF OUT``),
in its own process so that the benchmark's parent never holds the unpacked model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

THIS = Path(__file__).resolve()
VERSIONS = {"onnxruntime-genai": "0.18.0", "onnx-ir": "1.1.0"}  # pinned: the builder's options move between releases
# ORT GenAI's CPU recipe, and the head's logits at each sequence's last prompt position only, as every
# engine in bench_cpu computes them: by default the builder's prefill computes [batch, prompt, vocab]
# fp32 logits (1.6 GB at 32 streams of 256 tokens, the head's product on every prompt row)
BUILDER = ["-p", "int4", "-e", "cpu", "--extra_options", "accuracy_level=4", "block_size=32", "prune_lm_head=true"]
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
ROPE_TABLES = ("cos_cache", "sin_cache")  # read a row per position, not whole per token


@dataclass(frozen=True)
class Peer:
    """What bench_cpu's ORT GenAI children need: the interpreter, their extra environment and the model."""

    python: str
    env: dict
    model_dir: Path
    build: dict  # build.json: versions, the builder's command, its weight and KV bytes, the build's seconds


def progress(message: str) -> None:
    print(f"[bench_cpu] {message}", file=sys.stderr, flush=True)


def package_problem(python: str, env: dict) -> str | None:
    """Why ``python`` (with ``env``) cannot import ORT GenAI and its builder, or None."""
    try:
        check = subprocess.run([python, "-c", "import onnxruntime_genai, onnx_ir"], check=False,
                               capture_output=True, text=True, env=dict(os.environ, **env))
    except OSError as error:
        return str(error)
    return (check.stderr.strip().splitlines() or ["failed"])[-1] if check.returncode else None


def install_into(folder: Path, versions: dict[str, str]) -> str | None:
    """ORT GenAI and onnx-ir at ``versions``, without dependencies, into ``folder`` (pip --target); why it failed."""
    progress(f"installing {', '.join(f'{k}=={v}' for k, v in versions.items())} into {folder} (once)")
    staging = Path(tempfile.mkdtemp(prefix=folder.name + "-", dir=folder.parent))
    step = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(staging),
            *(f"{name}=={version}" for name, version in versions.items())]
    if subprocess.run(step, check=False).returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        return f"`{' '.join(step)}` failed (its output is above)"
    staging.rename(folder)
    return None


def packages(python: str | None, cache: Path, versions: dict[str, str]) -> tuple[str, dict, str | None]:
    """(interpreter, its extra environment, why ORT GenAI cannot run under it or None). ``python``
    named by the user is taken as it is; else this interpreter, with ``versions`` from the
    cache if it lacks them."""
    if python:
        return python, {}, package_problem(python, {})
    if package_problem(sys.executable, {}) is None:
        return sys.executable, {}, None
    folder = cache / f"ortgenai-{versions['onnxruntime-genai']}"
    if not folder.is_dir():
        folder.parent.mkdir(parents=True, exist_ok=True)
        failed = install_into(folder, versions)
        if failed:
            return sys.executable, {}, failed
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}
    return sys.executable, env, package_problem(sys.executable, env)


def write_hf_folder(gguf: Path, out: Path) -> None:
    """The GGUF as a plain fp32 Hugging Face folder (weights, config, tokenizer): unpacked by transformers,
    then loaded into a model built from its config alone, which save_pretrained writes (a model still
    holding its GGUF quantizer refuses to be saved)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    unpacked = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                    quantization_config=GgufConfig(dequantize=True))
    config = type(unpacked.config).from_dict(unpacked.config.to_dict())
    dense = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dense.load_state_dict(unpacked.state_dict(), strict=True)
    dense.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)


def weight_bytes(model_dir: Path) -> int:
    """Bytes of every initializer a decode step reads whole: the int4 layers with their scales, the
    norms, the head (the embedding is the head's codes, looked up); not the RoPE tables."""
    import onnx

    graph = onnx.load(str(model_dir / "model.onnx"), load_external_data=False).graph
    total = 0
    for tensor in graph.initializer:
        if tensor.name not in ROPE_TABLES:
            count = 1
            for dim in tensor.dims:
                count *= dim
            total += count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return total


def kv_bytes_per_token(model_dir: Path) -> int:
    """K and V of every layer for one token, fp32 (the builder's CPU model keeps its cache in fp32)."""
    decoder = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]
    return 2 * decoder["num_hidden_layers"] * decoder["num_key_value_heads"] * decoder["head_size"] * 4


def run_step(command: list[str], env: dict, what: str) -> tuple[float, str | None]:
    """(seconds, why it failed or None); its output (the builder logs every node it quantizes) is shown
    only when it fails."""
    start = time.perf_counter()
    try:
        done = subprocess.run(command, check=False, env=dict(os.environ, **OFFLINE, **env), capture_output=True,
                              text=True)
    except OSError as error:
        return time.perf_counter() - start, f"{what} could not start ({error}): `{' '.join(command)}`"
    if done.returncode:
        print("\n".join((done.stdout + done.stderr).splitlines()[-30:]), file=sys.stderr)
        return time.perf_counter() - start, (f"{what} failed (exit status {done.returncode}; the end of its "
                                             f"output is above): `{' '.join(command)}`")
    return time.perf_counter() - start, None


def model_folder(cache: Path, digest: str, versions: dict[str, str]) -> Path:
    """Where the built model of the GGUF with this sha256 lives: keyed by ORT GenAI's version and BUILDER."""
    options = hashlib.sha256(" ".join(BUILDER).encode()).hexdigest()[:8]
    return cache / "ortgenai" / f"int4-cpu-{digest[:16]}-genai-{versions['onnxruntime-genai']}-{options}"


def build(gguf: Path, digest: str, python: str, env: dict, cache: Path, versions: dict[str, str],
          transformers_version: str) -> tuple[Path | None, str | None]:
    """The int4 model folder for ``gguf`` (built on first use: the HF folder, then the builder); why not."""
    root = cache / "ortgenai"
    hf = root / f"hf-{digest[:16]}-transformers-{transformers_version}"
    model_dir = model_folder(cache, digest, versions)
    if (model_dir / "build.json").is_file():
        return model_dir, None
    root.mkdir(parents=True, exist_ok=True)
    hf_s = None  # the HF folder of an earlier build, reused
    if not (hf / "config.json").is_file():
        progress(f"ORT GenAI: writing {gguf.name} as an fp32 Hugging Face folder into {hf} (once; about a minute)")
        staging = Path(tempfile.mkdtemp(prefix=hf.name + "-", dir=root))
        hf_s, failed = run_step([sys.executable, str(THIS), "hf-folder", str(gguf), str(staging)], {},
                                "writing the HF folder")
        if failed:
            shutil.rmtree(staging, ignore_errors=True)
            return None, failed
        staging.rename(hf)
    progress(f"ORT GenAI: building the int4 CPU model ({' '.join(BUILDER)}) into {model_dir} (once; a minute or two)")
    staging = Path(tempfile.mkdtemp(prefix=model_dir.name + "-", dir=root))
    command = [python, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(staging),
               "-c", str(staging / "builder-cache"), *BUILDER]
    build_s, failed = run_step(command, env, "ORT GenAI's model builder")
    if failed:
        shutil.rmtree(staging, ignore_errors=True)
        return None, failed
    shutil.rmtree(staging / "builder-cache", ignore_errors=True)
    facts = {"gguf": gguf.name, "sha256": digest, "versions": versions, "transformers": transformers_version,
             "builder": " ".join(["python -m onnxruntime_genai.models.builder -i HF -o OUT", *BUILDER]),
             "hf_folder_s": hf_s and round(hf_s, 1), "builder_s": round(build_s, 1),
             "weight_bytes": weight_bytes(staging), "kv_bytes_per_token": kv_bytes_per_token(staging)}
    (staging / "build.json").write_text(json.dumps(facts, indent=1))
    staging.rename(model_dir)
    return model_dir, None


def prepare(gguf: Path, python: str | None, versions: dict[str, str] = VERSIONS) -> tuple[Peer | None, str | None]:
    """The ORT GenAI peer for ``gguf``: its packages and its model, each made once; (peer, None) or
    (None, why it cannot run)."""
    import transformers

    from ricllm.paths import cache_dir, file_digest

    python, env, problem = packages(python, cache_dir(), versions)
    if problem:
        return None, f"ORT GenAI cannot be imported under {python}: {problem}"
    model_dir, problem = build(gguf, file_digest(gguf), python, env, cache_dir(), versions, transformers.__version__)
    if problem:
        return None, problem
    return Peer(python, env, model_dir, json.loads((model_dir / "build.json").read_text())), None


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "hf-folder":
        sys.exit("usage: python ortgenai_peer.py hf-folder GGUF OUT")
    write_hf_folder(Path(sys.argv[2]), Path(sys.argv[3]))
