"""Matmul precision on tpu (``torch.tpu.precision`` / ``set_matmul_precision`` / torch's float32
setting) and the float8 dtypes. The reference for the precision is the lowered program itself
(the ``precision`` attribute of StableHLO's dot_general / convolution), for the values CPU torch."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import torch_tpu
from torch_tpu.compile import train_step
from torch_tpu.compile.dynamo import backend
from torch_tpu.eager import op_jit
from torch_tpu.runtime import dtypes
from torch_tpu.runtime.precision import Precision

# the tolerance each precision promises for a float32 matmul (a TPU's DEFAULT is one bfloat16 pass)
TOLERANCE = {Precision.HIGHEST: 1e-5, Precision.HIGH: 1e-3, Precision.DEFAULT: 2e-2}


def dot_precisions(text: str) -> list[str]:
    """The precision of every dot_general and convolution in StableHLO text (either printed form:
    ``precision = [HIGH, HIGH]`` or ``#stablehlo<precision HIGH>``; DEFAULT may be left out)."""
    ops = re.findall(r"stablehlo\.(?:dot_general|convolution)[^\n]*", text)
    return [next(iter(re.findall(r"precision(?: = \[| )(\w+)", op)), "DEFAULT") for op in ops]


@pytest.fixture(autouse=True)
def _restore():
    before = torch.get_float32_matmul_precision()
    yield
    torch.tpu.set_matmul_precision(None)
    torch.set_float32_matmul_precision(before)


def test_the_setting_follows_torch_then_the_setter_then_the_block():
    for name, expected in (("highest", Precision.HIGHEST), ("high", Precision.HIGH), ("medium", Precision.DEFAULT)):
        torch.set_float32_matmul_precision(name)
        assert torch.tpu.get_matmul_precision() is expected
    torch.tpu.set_matmul_precision("high")  # torch's name
    assert torch.tpu.get_matmul_precision() is Precision.HIGH
    with torch.tpu.precision(torch.tpu.Precision.HIGHEST):
        with torch.tpu.precision("default"):
            assert torch.tpu.get_matmul_precision() is Precision.DEFAULT
        assert torch.tpu.get_matmul_precision() is Precision.HIGHEST
    assert torch.tpu.get_matmul_precision() is Precision.HIGH
    torch.tpu.set_matmul_precision(None)
    assert torch.tpu.get_matmul_precision() is Precision.DEFAULT  # torch's "medium" again
    with pytest.raises(ValueError, match="Precision"):
        torch.tpu.set_matmul_precision("fast")


def _eager_matmul(ta, tb):
    out = ta @ tb  # op_jit compiles a signature on its first call
    program = op_jit.last_program()
    assert program is not None
    return out, program.lower(torch_tpu.to_jax(ta), torch_tpu.to_jax(tb)).as_text()


@pytest.mark.parametrize("torch_name,expected", [("highest", "HIGHEST"), ("high", "HIGH"), ("medium", "DEFAULT")])
def test_eager_matmul_lowers_with_torchs_float32_precision(torch_name, expected):
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 24, generator=gen), torch.randn(24, 16, generator=gen)
    torch.set_float32_matmul_precision(torch_name)
    out, text = _eager_matmul(a.to("tpu"), b.to("tpu"))
    assert dot_precisions(text) == [expected]
    # each product's relative error is bounded, so the sum's error is bounded by the sum of |products|
    # (a bound relative to the result itself fails wherever the products cancel)
    bound = TOLERANCE[Precision[expected]] * (a.abs() @ b.abs())
    error = (out.cpu() - a @ b).abs()
    assert (error <= bound).all(), f"largest error over bound: {(error / bound).max():.3g}"


def test_precision_block_changes_the_eager_program_and_restores_it():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    ta, tb = a.to("tpu"), b.to("tpu")
    torch.set_float32_matmul_precision("highest")
    assert dot_precisions(_eager_matmul(ta, tb)[1]) == ["HIGHEST"]
    with torch.tpu.precision(Precision.DEFAULT):
        out, text = _eager_matmul(ta, tb)
        assert dot_precisions(text) == ["DEFAULT"]
    torch.testing.assert_close(out.cpu(), a @ b, rtol=2e-2, atol=2e-2)
    assert dot_precisions(_eager_matmul(ta, tb)[1]) == ["HIGHEST"]


def test_compiled_graph_recompiles_per_precision():
    torch.set_float32_matmul_precision("highest")
    x, w = torch.randn(4, 3, 10, 10), torch.randn(5, 3, 3, 3)
    m = torch.randn(5 * 8 * 8, 7)

    def fn(x, w, m):
        return F.conv2d(x, w).flatten(1) @ m

    compiled = torch.compile(fn, backend="tpu")
    backend.reset_compile_stats()
    expected = fn(x, w, m)
    tx, tw, tm = x.to("tpu"), w.to("tpu"), m.to("tpu")
    torch.testing.assert_close(compiled(tx, tw, tm).cpu(), expected, rtol=1e-4, atol=1e-4)
    graph = backend.compiled_graphs()[-1]
    assert dot_precisions(graph.stablehlo()) == ["HIGHEST", "HIGHEST"]  # the convolution and the matmul
    with torch.tpu.precision(Precision.HIGH):  # not one of Dynamo's guards: the graph switches programs
        out = compiled(tx, tw, tm)
        assert graph.precision == "high" and dot_precisions(graph.stablehlo()) == ["HIGH", "HIGH"]
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-2, atol=1e-2)
    compiled(tx, tw, tm)
    assert graph.precision == "highest" and len(graph._programs) == 2  # the first program again
    assert dot_precisions(graph.stablehlo()) == ["HIGHEST", "HIGHEST"]
    torch.set_float32_matmul_precision("medium")  # Dynamo guards torch's setting: a new graph
    compiled(tx, tw, tm)
    assert dot_precisions(backend.compiled_graphs()[-1].stablehlo()) == ["DEFAULT", "DEFAULT"]
    assert backend.compile_stats().recompiles == 0  # no shape recompile is reported


def test_train_step_recompiles_when_the_precision_changes():
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1).to("tpu")
    step = train_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      lambda m, x, y: F.mse_loss(m(x), y))
    x, y = torch.randn(4, 6).to("tpu"), torch.randn(4, 1).to("tpu")
    step(x, y)
    step(x, y)
    assert step.stats.compiles == 1
    with torch.tpu.precision(Precision.DEFAULT):
        step(x, y)
    assert step.stats.compiles == 2
    step(x, y)
    assert step.stats.compiles == 2  # HIGHEST's program is kept
    assert {s.matmul_precision for s in step._programs} == {"highest", "default"}


@pytest.mark.parametrize("dtype", dtypes.FLOAT8_DTYPES, ids=str)
def test_float8_tensors_round_trip_and_convert_as_cpu(dtype):
    x = torch.randn(64) * 4
    if dtype is torch.float8_e8m0fnu:  # unsigned scales: torch drops a negative's sign, XLA gives NaN
        x = x.abs() + 1e-3
    on_cpu = x.to(dtype)
    on_tpu = x.to("tpu").to(dtype)
    assert on_tpu.dtype == dtype
    # the same rounding as torch's conversion, bit for bit, and back to float32 exactly
    assert torch.equal(on_tpu.cpu().view(torch.uint8), on_cpu.view(torch.uint8))
    assert torch.equal(on_cpu.to("tpu").to(torch.float32).cpu(), on_cpu.to(torch.float32))


def test_float8_value_formats_are_autocast_dtypes():
    supported = torch.tpu.get_amp_supported_dtype()
    assert {torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2} <= set(supported)
    assert torch.float8_e8m0fnu not in supported  # block scales, not a compute type
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with torch.autocast("tpu", dtype=torch.float8_e4m3fn):
        out = a.to("tpu") @ b.to("tpu")
    assert out.dtype == torch.float8_e4m3fn
    expected = (a.to(torch.float8_e4m3fn).float() @ b.to(torch.float8_e4m3fn).float()).to(torch.float8_e4m3fn)
    torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=0.125, atol=0.0)
