"""Block-quantised weights (``aiayn.fast.q4``, ``aiayn.interop.gguf_blocks``): every GGUF block
type aiayn packs unpacks to exactly the floats ``gguf.quants.dequantize`` gives, and the C++ kernel
multiplies within its stated bound.

The bound (module docstring of ``aiayn.fast.q4``): the kernel rounds each activation to the
nearest multiple of dx = max|x| / 127 over its block of 16 or 32, so each activation is off by at
most dx / 2, and each output by at most sum_b dx_b / 2 * sum_{k in b} |w_k - min_b| (the min part of
a block multiplies the exact float sum of x). The integer sums are exact; float32 rounding of the
per-block products and the final sum adds a relative 1e-6 or so, allowed for separately below.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.testing import assert_close

from aiayn.fast import plain_torch
from aiayn.fast.q4 import BlockLinear, BlockWeight, quantize_blocks_q4
from aiayn.fast.q4_build import kernel_ops
from aiayn.interop.gguf_blocks import SUPPORTED, unpack

gguf = pytest.importorskip("gguf")
from q4_helpers import assert_kernel_arithmetic, assert_within_bound, block_weight  # noqa: E402

# The 4-bit blocks and their C++ kernel are CPU code (aiayn.fast.q4): once, on the CPU.
pytestmark = pytest.mark.cpu_only


def test_the_kernel_builds_with_vnni_where_the_cpu_has_it():
    ops = kernel_ops()
    assert ops is not None, "the C++ kernel did not build (a C++ compiler and ninja are needed)"
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    assert ops.has_vnni() == ("avx512_vnni" in flags and "avx512bw" in flags)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K"])
def test_the_kernel_splits_its_work_over_torch_threads_with_the_same_result(kind):
    """Built with OpenMP: without it ATen's parallel_for runs serially, and the kernel used one thread
    whatever torch.set_num_threads said. Its output does not depend on the thread count (each thread
    owns whole output rows), at one activation row (a decode step) and at several (a prefill)."""
    ops = kernel_ops()
    assert ops is not None and ops.parallel(), "the kernel was built without OpenMP: it runs on one thread"
    weight, _ = block_weight(kind, 1024, 512)  # 64 groups of 16 rows: split even at one activation row
    layer = BlockLinear(weight)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(2))
    before = torch.get_num_threads()
    try:
        outputs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outputs.append((layer(x[:1]), layer(x)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])
    assert_within_bound(outputs[1][1], x, weight)


@pytest.mark.parametrize("kind", list(SUPPORTED))
def test_each_gguf_type_unpacks_exactly_and_multiplies_within_its_bound(kind):
    rows, cols = 40, 512  # 512: two K-quant super-blocks, eight 64-input chunks
    weight, reference = block_weight(kind, rows, cols)
    ours = weight.dequantize_rows()
    assert torch.equal(ours, torch.from_numpy(reference)), "not gguf.quants.dequantize's floats"
    with plain_torch():  # the torch code's unpacking, against the kernel's
        assert torch.equal(weight.dequantize_rows(), ours)
        assert torch.equal(weight.dequantize_rows(torch.tensor([39, 0, 17])), ours[[39, 0, 17]])
    assert torch.equal(weight.dequantize_rows(torch.tensor([39, 0, 17])), ours[[39, 0, 17]])
    layer = BlockLinear(weight)
    g = torch.Generator().manual_seed(1)
    for m in (1, 3, 4, 5, 16):  # the kernel's row tiles of 4 and their remainders
        x = torch.randn(m, cols, generator=g)
        x[:, 7] *= 30  # one outlier channel, as LLaMA activations have
        assert_within_bound(layer(x), x, weight)
        assert_kernel_arithmetic(layer(x), x, weight)
    x = torch.randn(40, cols, generator=g)  # a prefill's many rows: the same kernel
    assert_within_bound(layer(x), x, weight)
    assert_kernel_arithmetic(layer(x), x, weight)
    with plain_torch():  # the plain path: F.linear on the dequantised matrix
        assert_close(layer(x[:2]), x[:2] @ ours.T)


def test_bits_per_weight_and_storage():
    q41, _ = block_weight("Q4_1", 16, 512)
    q80, _ = block_weight("Q8_0", 16, 512)
    assert q41.nibbles and q41.q.shape == (1, 16 * 256) and q41.mins is not None  # one group of 16 rows
    assert not q80.nibbles and q80.q.shape == (1, 16 * 512) and q80.mins is None and q80.offset == 128
    # GGUF's float16 scales are kept as float16: the bytes of the file, 5 and 8.5 bits per weight
    assert q41.scale.dtype == q41.mins.dtype == q80.scale.dtype == torch.float16
    assert 8 * q41.nbytes / (16 * 512) == 5.0
    assert 8 * q80.nbytes / (16 * 512) == 8.5
    q4k, _ = block_weight("Q4_K", 16, 512)  # d * sub-scale products: float32 unless all are float16 values
    exact16 = torch.equal(q4k.scale.float().half().float(), q4k.scale.float())
    assert q4k.scale.dtype == (torch.float16 if exact16 else torch.float32)


def test_row_counts_not_a_multiple_of_16_are_padded():
    torch.manual_seed(0)
    w = torch.randn(7, 96)
    weight = quantize_blocks_q4(w)
    assert weight.q.shape == (1, 16 * 48) and weight.scale.shape == (1, 16 * 3)  # padded to 16 rows
    assert (weight.dequantize_rows() - w).abs().max() <= weight.scale.max() / 2 + 1e-6
    x = torch.randn(3, 96)
    assert_within_bound(BlockLinear(weight)(x), x, weight)


def test_q4_quantisation_rounds_by_at_most_half_a_step():
    torch.manual_seed(0)
    linear = nn.Linear(64, 33)
    layer = BlockLinear.from_linear(linear)
    err = (layer.dequantized() - linear.weight).abs().reshape(33, 2, 32)
    step = layer.weight_blocks.row_scales()[0][:, :, None]
    assert (err <= step / 2 + 1e-6).all()
    assert layer(torch.randn(2, 5, 64)).shape == (2, 5, 33)


def test_bad_values_and_shapes_are_refused():
    with pytest.raises(ValueError, match="blocks of 32 inputs cannot tile rows of 40"):
        BlockWeight.from_values(torch.zeros(2, 40, dtype=torch.uint8), torch.ones(2, 1), None, offset=0, block=32,
                                kind="x")
    with pytest.raises(ValueError, match=r"block values must lie in \[0, 16\)"):
        BlockWeight.from_values(torch.full((2, 32), 16, dtype=torch.uint8), torch.ones(2, 1), None, offset=0,
                                block=32, kind="x", nibbles=True)
    with pytest.raises(ValueError, match="IQ4_NL blocks are not supported; aiayn packs Q4_0, Q4_1"):
        unpack("IQ4_NL", np.zeros((1, 18), np.uint8), 1, 32)


def test_a_compiler_without_openmp_gets_the_serial_build_and_no_compiler_the_fallback(monkeypatch):
    """The build tries -fopenmp first, then the serial kernel; when both fail it warns and returns
    None (block layers then dequantise per call)."""
    import torch.utils.cpp_extension as cpp_extension

    from aiayn.fast import q4_build

    tried: list[list[str]] = []

    def failing_build(name, *, extra_cflags, extra_ldflags, **kwargs):
        tried.append(list(extra_ldflags))
        raise RuntimeError("c++: error: unrecognized command-line option")

    monkeypatch.setattr(cpp_extension, "load_inline", failing_build)
    with pytest.warns(UserWarning, match="could not be built .*unrecognized command-line option"):
        assert q4_build._build() is None
    assert tried == [["-fopenmp"], []]

    def refuses_openmp(name, *, extra_cflags, extra_ldflags, **kwargs):  # builds (here: nothing) without it
        tried.append(list(extra_ldflags))
        if "-fopenmp" in extra_cflags:
            raise RuntimeError("c++: error: unrecognized command-line option '-fopenmp'")

    tried.clear()
    monkeypatch.setattr(cpp_extension, "load_inline", refuses_openmp)
    monkeypatch.setattr(q4_build, "_register_fakes", lambda: None)  # registered once per process
    with pytest.warns(UserWarning, match="built without OpenMP.*one thread"):
        assert q4_build._build() is torch.ops.aiayn_q4
    assert tried == [["-fopenmp"], []]


def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_one():
    """torch's build lock is a file: a process killed while it built or checked the kernel leaves it
    behind, and torch alone would make every later process wait for it forever (a test suite hung
    so). The next process removes it under aiayn's OS lock and loads the kernel."""
    import subprocess
    import sys

    from torch.utils.cpp_extension import _get_build_directory

    from aiayn.fast import q4_build

    stale = Path(_get_build_directory(q4_build.build_name([*q4_build.FLAGS, q4_build.OPENMP]), False)) / "lock"
    stale.write_text("")  # what a killed builder leaves
    try:
        loads = subprocess.run([sys.executable, "-c", "from aiayn.fast.q4_build import kernel_ops; "
                                "print(kernel_ops() is not None)"], capture_output=True, text=True, timeout=300)
        removed = not stale.exists()
    finally:
        stale.unlink(missing_ok=True)  # never leave it for the rest of the suite
    assert loads.returncode == 0 and loads.stdout.strip() == "True", loads.stderr[-2000:]
    assert removed


def test_the_cached_build_is_named_by_the_cpu_it_was_built_for(monkeypatch):
    """-march=native code may not run on another CPU: a home folder shared by two machines keeps
    one build per CPU instead of loading the other's (an illegal instruction)."""
    from aiayn.fast import q4_build

    here = q4_build.build_name(q4_build.FLAGS)
    assert q4_build.cpu_identity()  # this machine names its CPU
    monkeypatch.setattr(q4_build, "cpu_identity", lambda: "model name : another CPU\nflags : sse2")
    assert q4_build.build_name(q4_build.FLAGS) != here
