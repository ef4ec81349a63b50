"""The CPU LoRA kernel (``kernels/cpu_lora.c`` through ``ricllm.kernels.cpu_lora``) against its float64
reference: odd widths and ranks, several adapters in one batch, rows of no adapter left alone, fp32 and
bf16 activations and weights, outputs that are column slices of a fused row; the same in every kernel
family this CPU runs (each in a child process: the family is chosen once per process), and the torch
reference of the GPU path computing the same update."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from ricllm.engine.runtime.lora_delta import lora_delta
from ricllm.kernels import cpu_library
from ricllm.kernels.cpu_lora import (LoraSegment, apply_lora, from_bf16, kernel_weights, lora_reference,
                                     side_by_side, to_bf16)
from tests.helpers import python_with_env

pytestmark = pytest.mark.skipif(not cpu_library.cpu_kernels_available()[0],
                                reason=f"the CPU kernels do not build here: {cpu_library.cpu_kernels_available()[1]}")

FP32_TOL = 1e-5  # relative to the largest value: only the order of the fp32 sums differs
BF16_ULP = 2 ** -7  # one unit in the last place of a bf16 value, relative


def random_weights(rng: np.random.Generator, rank: int, in_features: int, out_features: int, *,
                   bf16: bool = False):
    return kernel_weights(rng.standard_normal((rank, in_features)) * 0.2,
                          rng.standard_normal((out_features, rank)) * 0.2, rng.uniform(0.25, 4), bf16=bf16)


def batch(rng: np.random.Generator, rows: int, in_features: int, out_features: int, *, bf16: bool):
    x, y = rng.standard_normal((rows, in_features)), rng.standard_normal((rows, out_features))
    return (to_bf16(x), to_bf16(y)) if bf16 else (x.astype(np.float32), y.astype(np.float32))


def segments_with_gaps(rng: np.random.Generator, rows: int, in_features: int, out_features: int, *,
                       bf16_weights: bool = False) -> list[LoraSegment]:
    """Three adapters (ranks 8, 3, 16) on rows split at random, two rows of no adapter between
    them and one at each end where there is room; the second adapter has two segments."""
    cuts = sorted(rng.choice(np.arange(1, rows), size=min(3, rows - 1), replace=False)) if rows > 1 else []
    edges = [0, *cuts, rows]
    adapters = [random_weights(rng, rank, in_features, out_features, bf16=bf16_weights) for rank in (8, 3, 16)]
    segments = []
    for i, (start, end) in enumerate(zip(edges, edges[1:])):
        start, end = (start + 1, end - 1) if end - start > 4 else (start, end)
        segments.append(LoraSegment(start, end, adapters[[0, 1, 2, 1][i % 4]]))
    return segments[::-1]  # any order


def covered(segments: list[LoraSegment], rows: int) -> np.ndarray:
    mask = np.zeros(rows, bool)
    for segment in segments:
        mask[segment.start:segment.end] = True
    return mask


def check_bf16(y: np.ndarray, reference: np.ndarray) -> None:
    """A bf16 output is the reference rounded once: within one bf16 step, and nearly always equal."""
    got = from_bf16(y)
    assert np.all(np.abs(got - reference) <= BF16_ULP * np.abs(reference) + 1e-30)
    assert np.mean(y == to_bf16(reference)) > 0.99


SHAPES = [(1, 64, 64), (3, 97, 131), (5, 576, 192), (9, 37, 1536), (33, 256, 96), (70, 129, 65)]


@pytest.mark.parametrize("rows, in_features, out_features", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_parity_fp32_several_adapters_and_rows_without_one(rows, in_features, out_features, threads):
    rng = np.random.default_rng(rows * 1000 + in_features)
    x, y = batch(rng, rows, in_features, out_features, bf16=False)
    segments = segments_with_gaps(rng, rows, in_features, out_features)
    before, reference = y.copy(), lora_reference(x, y, segments)
    apply_lora(x, y, segments, threads=threads)
    mask = covered(segments, rows)
    np.testing.assert_array_equal(y[~mask], before[~mask])  # bit for bit: never written
    assert np.max(np.abs(y - reference)) <= FP32_TOL * np.max(np.abs(reference))
    assert np.max(np.abs(y[mask] - before[mask])) > 0.1  # the update is there


@pytest.mark.parametrize("rows, in_features, out_features", SHAPES)
@pytest.mark.parametrize("bf16_weights", [False, True], ids=["fp32 weights", "bf16 weights"])
def test_parity_bf16_activations(rows, in_features, out_features, bf16_weights):
    rng = np.random.default_rng(rows + in_features)
    x, y = batch(rng, rows, in_features, out_features, bf16=True)
    segments = segments_with_gaps(rng, rows, in_features, out_features, bf16_weights=bf16_weights)
    before, reference = y.copy(), lora_reference(x, y, segments)
    apply_lora(x, y, segments, threads=2)
    mask = covered(segments, rows)
    np.testing.assert_array_equal(y[~mask], before[~mask])
    check_bf16(y[mask], reference[mask])


def test_parity_bf16_weights_with_fp32_activations():
    """bf16 weights are their rounded values, exactly: the reference reads the same numbers."""
    rng = np.random.default_rng(7)
    x, y = batch(rng, 12, 200, 300, bf16=False)
    segments = [LoraSegment(0, 12, random_weights(rng, 32, 200, 300, bf16=True))]
    assert segments[0].weights.a.dtype == np.uint16 and segments[0].weights.nbytes == 2 * 32 * 500
    reference = lora_reference(x, y, segments)
    apply_lora(x, y, segments)
    assert np.max(np.abs(y - reference)) <= FP32_TOL * np.max(np.abs(reference))


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_parity_on_column_slices_of_a_fused_row(bf16):
    """q, k and v of one fused qkv row, each with its own adapter; the input a slice of a wider row too."""
    rng = np.random.default_rng(11)
    hidden, q_width, kv_width, rows = 96, 96, 32, 6
    wide_x, qkv = batch(rng, rows, hidden + 8, q_width + 2 * kv_width, bf16=bf16)
    x, before = wide_x[:, 4:4 + hidden], qkv.copy()
    columns = {"q": slice(0, q_width), "k": slice(q_width, q_width + kv_width),
               "v": slice(q_width + kv_width, q_width + 2 * kv_width)}
    expected = qkv.astype(np.float32) if not bf16 else from_bf16(qkv)
    for name, where in columns.items():
        width = where.stop - where.start
        segments = [LoraSegment(1, 3, random_weights(rng, 8, hidden, width)),
                    LoraSegment(4, 6, random_weights(rng, 4, hidden, width))]
        expected[:, where] = lora_reference(x, qkv[:, where], segments)
        apply_lora(x, qkv[:, where], segments)
    np.testing.assert_array_equal(qkv[[0, 3]], before[[0, 3]])  # the rows of no adapter, every column
    if bf16:
        check_bf16(qkv[[1, 2, 4, 5]], expected[[1, 2, 4, 5]])
    else:
        assert np.max(np.abs(qkv - expected)) <= FP32_TOL * np.max(np.abs(expected))


def test_parity_one_adapter_on_every_row_and_no_segments():
    rng = np.random.default_rng(3)
    x, y = batch(rng, 64, 576, 1536, bf16=True)
    segments = [LoraSegment(0, 64, random_weights(rng, 64, 576, 1536))]
    reference = lora_reference(x, y, segments)
    apply_lora(x, y, segments, threads=2)
    check_bf16(y, reference)
    before = y.copy()
    apply_lora(x, y, [])
    np.testing.assert_array_equal(y, before)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_any_thread_count_gives_the_same_bits(bf16):
    """The decoder stack shares a projection's update among its product's threads, the per-op path
    runs it on one: the two must agree bit for bit. Widths that split into column ranges with a
    ragged end, and ranks with a remainder past the blocks of A rows."""
    rng = np.random.default_rng(17)
    for rows, in_features, out_features in [(40, 203, 331), (64, 576, 192), (37, 97, 1536)]:
        x, y = batch(rng, rows, in_features, out_features, bf16=bf16)
        segments = segments_with_gaps(rng, rows, in_features, out_features, bf16_weights=bf16)
        one, two = y.copy(), y.copy()
        apply_lora(x, one, segments, threads=1)
        apply_lora(x, two, segments, threads=2)
        np.testing.assert_array_equal(one, two)
        assert not np.array_equal(one, y)


@pytest.mark.parametrize("problem, make, message", [
    ("overlap", lambda w, x, y: ([LoraSegment(0, 4, w), LoraSegment(3, 6, w)], x, y), "overlap"),
    ("outside", lambda w, x, y: ([LoraSegment(2, 9, w)], x, y), "outside the step's 8 rows"),
    ("widths", lambda w, x, y: ([LoraSegment(0, 2, w)], x[:, :16], y), "32 and 48 columns|16 and 48 columns"),
    ("mixed types", lambda w, x, y: ([LoraSegment(0, 2, w), LoraSegment(2, 4, kernel_weights(
        np.ones((2, 32)), np.ones((48, 2)), 1.0, bf16=True))], x, y), "one type"),
    ("strided columns", lambda w, x, y: ([LoraSegment(0, 2, w)], np.ones((8, 64), np.float32)[:, ::2], y),
     "contiguous rows"),
    ("element types", lambda w, x, y: ([LoraSegment(0, 2, w)], x, to_bf16(y)), "one element type"),
])
def test_a_call_that_does_not_fit_is_refused_before_the_kernel_runs(problem, make, message):
    rng = np.random.default_rng(0)
    x, y = batch(rng, 8, 32, 48, bf16=False)
    segments, x, y = make(random_weights(rng, 4, 32, 48), x, y)
    before = y.copy()
    with pytest.raises(ValueError, match=message):
        apply_lora(x, y, segments)
    np.testing.assert_array_equal(y, before)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_the_torch_reference_computes_the_same_update(bf16):
    """``lora_delta`` (the GPU path's reference) against the numpy reference, on the same batch."""
    rng = np.random.default_rng(5)
    rows, in_features, out_features = 21, 77, 50
    x, y = batch(rng, rows, in_features, out_features, bf16=bf16)
    segments = segments_with_gaps(rng, rows, in_features, out_features)
    adapters = list({id(s.weights): s.weights for s in segments}.values())
    index = {id(weights): i for i, weights in enumerate(adapters)}
    x_torch = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) if bf16 else torch.from_numpy(x))
    delta = lora_delta(x_torch, [(s.start, s.end, index[id(s.weights)]) for s in segments],
                       [(torch.from_numpy(w.a), torch.from_numpy(np.ascontiguousarray(w.b_t.T)), w.scale)
                        for w in adapters], out_features)
    assert delta.dtype == torch.float32 and delta.shape == (rows, out_features)
    reference = lora_reference(x, y, segments) - (from_bf16(y) if bf16 else y)
    torch.testing.assert_close(delta, torch.from_numpy(reference), rtol=1e-4, atol=1e-4)
    assert not delta[torch.from_numpy(~covered(segments, rows))].any()


def runs_here(family: str) -> bool:
    return cpu_library.IS_X86 and cpu_library.FAMILIES[family][1] <= cpu_library.cpu_flags()


@pytest.mark.parametrize("family", list(cpu_library.FAMILIES))
def test_the_kernel_compiles_for_every_family(family, tmp_path):
    """Built with each family's flags whatever this CPU runs (an image builds all three)."""
    if not cpu_library.IS_X86:
        pytest.skip("the kernel families are x86-64's")
    source = cpu_library.CSRC / "cpu_lora.c"
    done = subprocess.run([cpu_library._compiler(), *cpu_library.CFLAGS, *cpu_library.FAMILIES[family][0],
                           "-Wall", "-Werror", f"-I{cpu_library.CSRC}", "-c", str(source), "-o",
                           str(tmp_path / "cpu_lora.o")], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("family", list(cpu_library.FAMILIES))
def test_each_family_this_cpu_runs_matches_the_reference(family):
    if not runs_here(family):
        pytest.skip(f"this CPU lacks the {family} family's flags "
                    f"({' '.join(sorted(cpu_library.FAMILIES[family][1] - cpu_library.cpu_flags()))})")
    done = python_with_env({"RICLLM_CPU_KERNELS": family}, "-c", FAMILY_RUN, str(Path(__file__)))
    assert f"family {family}\n" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    passed = re.search(r"(\d+) passed", done.stdout)
    assert done.returncode == 0 and passed and int(passed[1]) >= 28, done.stdout[-3000:] + done.stderr[-2000:]


# a child pytest run of this file's parity tests that first says which family its library is
FAMILY_RUN = """
import sys
import pytest
from ricllm.kernels.cpu_library import cpu_family
print("family", cpu_family(), flush=True)
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", sys.argv[1], "-k", "parity"]))
"""


def test_side_by_side_copies_arrays_one_after_another_each_on_a_cache_line():
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal((3, 7)).astype(np.float32), to_bf16(rng.standard_normal((2, 9))),
              rng.standard_normal(1).astype(np.float32)]
    copies = side_by_side(arrays)
    for array, copy in zip(arrays, copies):
        assert copy.dtype == array.dtype and np.array_equal(copy, array) and copy.flags.c_contiguous
        assert copy.ctypes.data % 64 == 0
    starts = [copy.ctypes.data for copy in copies]
    assert starts == sorted(starts) and starts[-1] - starts[0] == 128 + 64  # 84 and 36 bytes, each padded to lines
