"""Calibrate the step-latency model by a short profiling sweep, and cache the fit on disk.

The sweep runs real steps of the loaded engine: prefill-only steps of several sizes, decode
steps at several batch sizes and contexts, prompts joining a running decode batch (mixed steps),
chunks behind a cached prefix (a prompt's tail after its template, alone and a burst of them in one
step) and decodes of constrained answers (where the runtime narrows the head, the head's term is set
apart by them), then fits ``LatencyModel``; last, a few steps that each follow a pause measure what
a first step after an idle gap runs from the fit (the after-idle seed of ``StepErrors``). The fit
depends on the model file, dtype, weight format, attention backend, device, thread count and ricllm version,
which together key the cache file, so a second start pays nothing.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path

import numpy as np

from ricllm.engine.latency_model import LatencyModel, Roofline, after_idle_ratio, fit
from ricllm.errors import ConfigError, InvalidRequestError
from ricllm.logging import get_logger
from ricllm.paths import cache_dir, file_digest
from ricllm.sampling_params import SamplingParams
from ricllm.version import __version__

log = get_logger("ricllm.calibration")

CALIBRATION_VERSION = 15  # bump when the sweep or the model's form changes: old cached fits are ignored
PREFILL_LENGTHS = (32, 128, 512, 1024)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32)
DECODE_CONTEXTS = (64, 256)
MIXED = ((16, 48), (16, 96), (16, 400))  # (decoding sequences of 64 tokens, length of the prompt that joins)
# (cached prefix, chunk): a prompt's tail after a template's cached blocks, and a template's own later chunks
PREFIX_CHUNKS = ((512, 8), (512, 32), (512, 200))
# (requests, tail, whole prompt beside them): requests of one cached prefix seated in one step, each prefilling
# its tail, as a burst of one template's requests is; past the kernel's limits each tail reads the prefix apart
PREFIX_BURSTS = ((16, 1, 0), (8, 12, 0), (16, 4, 0), (4, 4, 200))
BURST_PREFIX = 512
# decodes whose grammar allows a few tokens a step: where the runtime narrows the head, their steps
# compute a sliver of it, which sets the head's term apart from the decode rows'
CONSTRAINED_BATCHES = (1, 8, 32)
CONSTRAINED_ANSWER = {"regex": "[0-9]{16}"}
AFTER_IDLE_PAUSES = 4  # steps measured after a pause: a seed, which the first real gaps then refine
AFTER_IDLE_PAUSE_S = 0.3  # well past IDLE_GAP_S: long enough for the clock to ramp down and caches to cool
AFTER_IDLE_PREFIX = 512  # cached tokens before each after-pause step's tail: a request behind a template


def fit_key(engine) -> dict:
    """What a step's time depends on: a cached fit is reused only when all of it is the same."""
    kernels = None
    if engine.runtime.attention_backend == "cpu":  # the C kernels' sources, compiler and CPU
        from ricllm.kernels.cpu_library import library_identity

        kernels = library_identity()
    return {
        "model_sha256": file_digest(engine.model_path), "dtype": str(engine.runtime.dtype),
        "weights": list(engine.runtime.weight_formats), "attention_backend": engine.runtime.attention_backend,
        "device": str(engine.runtime.device), "threads": engine.runtime.threads, "ricllm": __version__,
        "calibration": CALIBRATION_VERSION, "kernels": kernels,
        "max_packed_rows": engine.config.max_packed_rows, "runtime": engine.runtime.name,
        "decoder_stack": engine.runtime.name == "native" or engine.runtime.model.decoder_stack is not None,
        "block_size": engine.config.block_size, "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "capabilities": repr(engine.runtime.capabilities), "pin_threads": engine.config.pin_threads,
    }


def fit_cache_path(key: dict) -> Path:
    """Where the fit for this key (``fit_key(engine)``) is cached."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "latency" / f"{digest}.json"


def load_or_calibrate(engine) -> LatencyModel:
    """A given fit file, else the cached fit for this key, else a fresh sweep (then cached)."""
    if engine.config.latency_fit:
        return load_fit(Path(engine.config.latency_fit))
    key = fit_key(engine)
    path = fit_cache_path(key)
    if path.is_file():
        log.info("latency_fit_loaded", path=str(path))
        return load_fit(path)
    model = calibrate(engine)
    model.save(path, key)
    log.info("latency_fit_saved", path=str(path))
    return model


def load_fit(path: Path) -> LatencyModel:
    try:
        return LatencyModel.load(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot read latency fit {str(path)!r}: {exc}") from exc


def measure_bandwidth(device, megabytes: int = 128) -> float:
    """Bytes per second of a large copy (read + write), the roofline's bandwidth: with torch's
    (threaded) copy on a torch device, with numpy's (one thread: a lower bound, so a more
    cautious floor) for the native runtime's ``"cpu"``."""
    if isinstance(device, str):
        source = np.ones(megabytes << 18, dtype=np.float32)
        target = source.copy()
        start = time.perf_counter()
        for _ in range(3):
            np.copyto(target, source)
        return 3 * 2 * source.nbytes / (time.perf_counter() - start)
    import torch

    source = torch.empty(megabytes << 18, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    target.copy_(source)
    start = time.perf_counter()
    for _ in range(3):
        target.copy_(source)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 3 * 2 * source.nbytes / (time.perf_counter() - start)


def roofline_of(engine) -> Roofline:
    """Bytes a small-batch step must read: packed weights where a layer has them, else dense; the
    head's among them, since a step reads only what its sampled rows need of it."""
    per_token = engine.kv_cache.geometry.kv_format.bytes_per_token(engine.spec)  # every layer's K and V
    if engine.runtime.name == "onnx":  # the graph's weights, as compact as the file stores them; the head among them
        return Roofline(float(engine.runtime.model.weight_bytes()), float(per_token), measure_bandwidth("cpu"), 0.0)
    if engine.runtime.name == "native":
        weights = engine.runtime.model.weights
        return Roofline(float(weights.weight_bytes()), float(per_token), measure_bandwidth("cpu"),
                        float(weights.head.decode_bytes))
    from ricllm.model.packed_linear import PackedLinear

    model = engine.runtime.model
    shadowed = {id(m.weight) for m in model.modules() if isinstance(m, PackedLinear) and m.weight is not None}
    embedding = getattr(model.embed, "weight", None)  # none when served from the packed head
    embedding_is_head = model.lm_head is None and model.packed_head is None
    if embedding is not None and not embedding_is_head:
        shadowed.add(id(embedding))  # only looked up, row by row, unless it is the head
    # rope tables: rows looked up; 8-bit offsets: recomputed from the weights by one- and two-row products
    tensors = [(name, t) for name, t in model.named_buffers()
               if not name.startswith("rope.") and not name.endswith("packed_offsets")] + [
        (name, t) for name, t in model.named_parameters() if id(t) not in shadowed]
    head_names = ("lm_head.", "packed_head.") + (("embed.",) if embedding_is_head else ())
    weight_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
    head_bytes = sum(t.numel() * t.element_size() for name, t in tensors if name.startswith(head_names))
    return Roofline(float(weight_bytes), float(per_token), measure_bandwidth(engine.runtime.device), float(head_bytes))


def calibrate(engine, budget_s: float = 20.0) -> LatencyModel:
    """Run the sweep within about ``budget_s`` seconds and fit the model."""
    from tqdm import tqdm

    started = time.perf_counter()
    generator = random.Random(1234)
    vocab = engine.spec.vocab_size
    budget = engine.config.max_num_batched_tokens
    shapes = [s for s in [(1, n, 1, 0) for n in PREFILL_LENGTHS if n <= budget]
              + [(b, ctx, 8, 0) for ctx in DECODE_CONTEXTS for b in DECODE_BATCHES if b <= engine.config.max_num_seqs]
              + [(b, 64, 12, n) for b, n in MIXED if b < engine.config.max_num_seqs and n <= budget]
              if _fits(engine, *s)]
    samples = []
    _warm_up(engine, generator, vocab)

    def prompt(length: int) -> list[int]:
        return [generator.randrange(10, vocab - 10) for _ in range(length)]

    for batch, length, new_tokens, joining in tqdm(shapes, desc="calibrating latency model", unit="shape",
                                                   disable=None):
        if time.perf_counter() - started > budget_s * 0.75:
            break
        engine.step_history.clear()
        for _ in range(batch):
            engine.add_request(prompt(length), SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        if joining:  # once the batch decodes, a prompt joins it: steps that mix prefill and decodes
            engine.step()
            engine.add_request(prompt(joining), SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        samples += [(r.features, r.duration_s) for r in engine.step_history]
    samples += _prefix_chunk_samples(engine, prompt)
    samples += _prefix_burst_samples(engine, prompt)
    samples += _constrained_samples(engine, prompt, started, budget_s)
    model = fit(samples, roofline_of(engine), engine.runtime.capabilities.kernel_limits)
    model = LatencyModel(model.coefficients, model.roofline,
                         {**model.residuals, "after_idle": _after_idle_ratios(engine, model, prompt)},
                         kernel_limits=model.kernel_limits)
    model.errors.extend((t - model.base(f)) / t for f, t in samples)  # in-sample error, reported below
    _reset_counters(engine)
    log.info("latency_model_calibrated", seconds=round(time.perf_counter() - started, 1),
             coefficients=[f"{c:.3g}" for c in model.coefficients], **model.error_summary())
    return model


def _warm_up(engine, generator: random.Random, vocab: int) -> None:
    """One small request first: the first steps of a process pay one-off costs (allocator, JIT)."""
    engine.add_request([generator.randrange(10, vocab - 10) for _ in range(16)],
                       SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def _run(engine, token_ids: list[int]) -> list:
    """Serve one request of one token alone; its steps."""
    engine.step_history.clear()
    engine.add_request(token_ids, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return list(engine.step_history)


def _prefix_chunk_samples(engine, prompt) -> list:
    """Steps that prefill a chunk behind cached blocks: the tail of a prompt whose template is in
    the cache, attending to all of it (none when the engine caches no prefixes)."""
    samples = []
    for prefix_length, chunk in PREFIX_CHUNKS:
        prefix = prompt(prefix_length)
        if not engine.config.enable_prefix_caching or not _fits(engine, 1, prefix_length + chunk, 1):
            continue
        _run(engine, prefix)
        samples += [(r.features, r.duration_s) for r in _run(engine, prefix + prompt(chunk))]
    return samples


def _prefix_burst_samples(engine, prompt) -> list:
    """The first step of each of ``PREFIX_BURSTS``: requests of one cached prefix prefilling their
    tails together (with a whole prompt beside them where one is given)."""
    samples = []
    for requests, tail, whole in PREFIX_BURSTS:
        blocks = engine.cache.blocks_for_tokens(BURST_PREFIX) + requests * engine.cache.blocks_for_tokens(tail + 1)
        if (not engine.config.enable_prefix_caching or requests + bool(whole) > engine.config.max_num_seqs
                or requests * tail + whole > engine.config.max_num_batched_tokens
                or blocks + engine.cache.blocks_for_tokens(whole + 1) > engine.kv_cache.geometry.num_blocks
                or not _fits(engine, 1, BURST_PREFIX + tail, 1)):
            continue
        prefix = prompt(BURST_PREFIX)
        _run(engine, prefix)
        engine.step_history.clear()
        for _ in range(requests):
            engine.add_request(prefix + prompt(tail), SamplingParams(max_tokens=1, ignore_eos=True))
        if whole:
            engine.add_request(prompt(whole), SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        samples += [(r.features, r.duration_s) for r in engine.step_history]
    return samples


def _constrained_samples(engine, prompt, started: float, budget_s: float) -> list:
    """Decode steps of constrained answers, batches of ``CONSTRAINED_BATCHES`` (within the sweep's
    budget)."""
    samples = []
    params = SamplingParams(max_tokens=8, ignore_eos=True, structured=CONSTRAINED_ANSWER)
    for batch in CONSTRAINED_BATCHES:
        if (time.perf_counter() - started > budget_s * 0.75 or batch > engine.config.max_num_seqs
                or not _fits(engine, batch, 64, 8)):
            break
        engine.step_history.clear()
        try:
            seqs = [engine.add_request(prompt(64), params) for _ in range(batch)]
        except InvalidRequestError as exc:  # a vocabulary without digits: no constrained steps to time
            log.info("latency_calibration_without_constrained_steps", reason=str(exc))
            break
        while engine.has_unfinished():
            engine.step()
        if any(seq.rejection is not None for seq in seqs):
            break
        samples += [(r.features, r.duration_s) for r in engine.step_history]
    return samples


def _after_idle_ratios(engine, model: LatencyModel, prompt) -> list[float]:
    """measured / fitted (``after_idle_ratio``) of the first step after each of a few pauses: a short
    tail behind a cached prefix, as a request behind a pinned template arrives."""
    prefix = prompt(AFTER_IDLE_PREFIX) if _fits(engine, 1, AFTER_IDLE_PREFIX + 17, 1) else []
    if prefix:
        _run(engine, prefix)
    ratios = []
    for _ in range(AFTER_IDLE_PAUSES):
        time.sleep(AFTER_IDLE_PAUSE_S)
        first = _run(engine, prefix + prompt(16))[0]
        ratios.append(float(f"{after_idle_ratio(first.duration_s, max(model.base(first.features), 1e-9)):.4g}"))
    return ratios


def _fits(engine, batch: int, length: int, new_tokens: int, joining: int = 0) -> bool:
    """The shape runs without preemption: inside the context and, all at once, inside the pool."""
    blocks = engine.cache.blocks_for_tokens(length + new_tokens) * batch
    if joining:
        blocks += engine.cache.blocks_for_tokens(joining + 1)
    longest = max(length + new_tokens, joining + 1)
    return longest <= engine.max_model_len and blocks <= engine.kv_cache.geometry.num_blocks


def _reset_counters(engine) -> None:
    engine.cache.prefix_queries_tokens = engine.cache.prefix_hits_tokens = 0
    engine.cache.peak_used_blocks = engine.cache.pool.num_used
    engine.scheduler.num_preemptions = engine.scheduler.num_waits = 0
    engine.step_history.clear()
