"""``aiayn.fast.matvec``: linear layers on few rows as a multiply + sum or as (W x^T)^T.

Each must equal ``F.linear`` (eager and compiled, with and without bias, float32 and bfloat16), and
the mode must replace exactly the calls it claims to: few rows of a supported dtype, inside the
traced graph, by the way measured faster for them; larger inputs keep F.linear. ``FastLinear``
(``aiayn.fast.linear``, what ``aiayn.fast.optimize`` swaps in for ``nn.Linear``) takes (W x^T)^T
eager exactly where it was measured faster.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close

from aiayn.fast.linear import FastLinear
from aiayn.fast.matvec import (
    EAGER_TRANSPOSED_ROWS,
    MATVEC_MAX_ROWS,
    TRANSPOSED_MAX_ROWS,
    MatvecLinears,
    mark_for_compile,
    matvec_linear,
    transposed_linear,
    use_eager_transposed,
    use_matvec,
    use_transposed,
)


@pytest.fixture(autouse=True)
def _any_thread_count(monkeypatch):
    """The turned-around product is routed to from two threads (a speed threshold, tested in
    test_fast_routing.py); here it is taken at any thread count, so the kernels are tested alike
    on a machine of any size."""
    from aiayn.fast import matvec

    monkeypatch.setattr(matvec, "MIN_THREADS_TRANSPOSED", 1)

@pytest.mark.parametrize("way", [matvec_linear, transposed_linear])
@pytest.mark.parametrize("bias", [False, True])
def test_ways_equal_f_linear_eager(way: Callable[..., Tensor], bias: bool) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 40), torch.randn(24, 40)  # leading dims kept: (2, 3, 40) -> (2, 3, 24)
    b = torch.randn(24) if bias else None
    assert_close(way(x, w, b), F.linear(x, w, b))


def test_rows_decide_and_dtypes_must_match() -> None:
    w = torch.randn(8, 16)
    assert use_matvec(torch.randn(1, 1, 16), w)
    assert use_matvec(torch.randn(MATVEC_MAX_ROWS[torch.float32], 1, 16), w)
    assert not use_matvec(torch.randn(MATVEC_MAX_ROWS[torch.float32] + 1, 16), w)
    assert not use_matvec(torch.randn(1, 16, dtype=torch.bfloat16), w)  # mixed dtypes: leave to F.linear
    assert not use_matvec(torch.randn(1, 16, dtype=torch.float16), w.half())  # not measured: matmul
    assert not use_matvec(torch.randn(1, 16, device="meta"), w.to("meta"))  # not the CPU: not measured
    rows = MATVEC_MAX_ROWS[torch.float32] + 1
    assert use_transposed(torch.randn(rows, 16), w)
    assert not use_transposed(torch.randn(TRANSPOSED_MAX_ROWS[torch.float32] + 1, 16), w)
    assert not use_transposed(torch.randn(rows, 16, dtype=torch.bfloat16), w.bfloat16())  # measured slower


def traced_ops(fn: Callable[..., Tensor], *args: Tensor) -> list[str]:
    """Compile ``fn`` with a backend that records the traced graph's functions and methods, run it once."""
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Callable[..., object]:
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op in ("call_function", "call_method"))
        return gm.forward

    torch._dynamo.reset()
    mark_for_compile()  # as the code that compiles does (else this test passed only after one that had)
    torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    return seen


def test_mode_replaces_linear_on_few_rows_only() -> None:
    layer = nn.Linear(16, 8).eval()

    def step(x: torch.Tensor) -> torch.Tensor:
        with MatvecLinears():
            return layer(x)

    one_row = traced_ops(step, torch.randn(1, 1, 16))
    assert not any("linear" in op for op in one_row) and any("sum" in op for op in one_row)
    some_rows = traced_ops(step, torch.randn(16, 1, 16))
    assert not any("linear" in op for op in some_rows) and any("matmul" in op for op in some_rows)
    many_rows = traced_ops(step, torch.randn(128, 1, 16))
    assert any("linear" in op for op in many_rows)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 16, 128])  # multiply + sum, (W x^T)^T in float32, F.linear
def test_compiled_mode_equals_f_linear(dtype: torch.dtype, rows: int) -> None:
    """Inductor's fused loop (the path decoding runs) against the matmul, at the dtype's default
    tolerances. Both form exact products and sum them in float32, so they differ by the summation
    order only. Layers side by side, not chained: chained bfloat16 layers round in between, and
    a one-ulp difference there is amplified by cancellation in the next layer."""
    torch.manual_seed(0)
    with_bias, without_bias = nn.Linear(64, 96).to(dtype).eval(), nn.Linear(64, 40, bias=False).to(dtype).eval()
    x = torch.randn(rows, 1, 64, dtype=dtype)

    def step(x: Tensor) -> tuple[Tensor, Tensor]:
        with MatvecLinears():
            return with_bias(x), without_bias(x)

    torch._dynamo.reset()
    mark_for_compile()
    with torch.inference_mode():
        compiled = torch.compile(step, fullgraph=True, dynamic=False)(x)
        assert_close(compiled, (with_bias(x), without_bias(x)))


@pytest.mark.parametrize("rows", [1, 4, 5, 16, 64, 65])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_nn_linear(rows: int, bias: bool) -> None:
    """FastLinear: nn.Linear's parameters and state dict; the same outputs with and without an
    autograd graph; (W x^T)^T taken exactly where EAGER_TRANSPOSED_ROWS says, under inference mode."""
    torch.manual_seed(0)
    reference = nn.Linear(40, 24, bias=bias)
    linear = FastLinear(40, 24, bias=bias)
    linear.load_state_dict(reference.state_dict())
    assert isinstance(linear, nn.Linear) and linear.state_dict().keys() == reference.state_dict().keys()
    x = torch.randn(rows, 1, 40)  # rows x 1 token, as a decode step
    with torch.inference_mode():
        out, expected = linear(x), reference(x)
        low, high = EAGER_TRANSPOSED_ROWS[torch.float32]
        taken = low <= rows <= high
        assert use_eager_transposed(x, linear.weight) == taken
        way = transposed_linear if taken else F.linear
        assert torch.equal(out, way(x, linear.weight, linear.bias))  # the very computation chosen
        assert out.shape == (rows, 1, 24)
    assert_close(out, expected)
    # Several tokens per row (a full forward) and autograd: nn.Linear's forward, bit for bit.
    with torch.inference_mode():
        assert torch.equal(linear(x.reshape(1, rows, 40)), F.linear(x.reshape(1, rows, 40), linear.weight, linear.bias))
    x_grad = x.clone().requires_grad_()
    linear(x_grad).sum().backward()
    assert x_grad.grad is not None and linear.weight.grad is not None


def test_linear_keeps_nn_linear_for_other_dtypes_and_subclasses() -> None:
    linear = FastLinear(16, 8).to(torch.bfloat16)
    x = torch.randn(16, 16, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert not use_eager_transposed(x, linear.weight)
        assert torch.equal(linear(x), F.linear(x, linear.weight, linear.bias))
