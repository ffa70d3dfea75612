"""Eager modes, CPU fallback counters/strict switch, and torch-compatible errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import torch_tpu
from torch_tpu.eager import modes


def test_shape_and_dtype_errors_match_cpu():
    cases = [
        lambda d: torch.ones(2, 3, device=d) @ torch.ones(2, 3, device=d),
        lambda d: torch.ones(2, 3, device=d) + torch.ones(4, device=d),
        lambda d: torch.mm(torch.ones(2, 2, device=d), torch.ones(2, 2, dtype=torch.float64, device=d)),
        lambda d: torch.ones(3, dtype=torch.int64, device=d).add_(1.5),
        lambda d: torch.ones(3, device=d).view(2, 2),
        lambda d: torch.ones(2, 3, device=d).t().view(6),
        lambda d: torch.ones(3, device=d).add_(torch.ones(2, 3, device=d)),
        lambda d: torch.cat([torch.ones(2, 2, device=d), torch.ones(3, 3, device=d)], dim=0),
    ]
    for case in cases:
        with pytest.raises(Exception) as cpu_error:
            case("cpu")
        with pytest.raises(type(cpu_error.value)) as tpu_error:
            case("tpu")
        assert str(tpu_error.value).split("\n")[0] == str(cpu_error.value).split("\n")[0]


def test_mixing_devices_raises_like_cuda():
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ones(3, device="tpu") + torch.ones(3)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ones(3).add_(torch.ones(3, device="tpu"))
    # CPU scalars mix with device tensors, as on CUDA
    assert (torch.ones(3, device="tpu") * torch.tensor(2.0)).cpu().tolist() == [2.0, 2.0, 2.0]


def test_fallback_is_counted_and_strict_switch_raises():
    x = torch.tensor([[1.0, 2.0, 2.0], [3.0, 3.0, 0.0]], device="tpu")
    unlowered = torch.ops.aten.mode.default  # no lowering, no decomposition
    assert torch_tpu.get_lowering(unlowered) is None
    torch_tpu.reset_metrics()
    values, indices = torch.mode(x, dim=1)
    expected = torch.mode(x.cpu(), dim=1)
    torch.testing.assert_close(values.cpu(), expected.values)
    torch.testing.assert_close(indices.cpu(), expected.indices)
    assert values.device.type == "tpu"
    assert torch_tpu.fallback_counts() == {"mode.default": 1}
    assert "mode.default: 1" in torch_tpu.metrics_report()
    with torch_tpu.no_fallback(), pytest.raises(torch_tpu.TpuFallbackError, match="mode"):
        torch.mode(x, dim=1)


def test_fallback_writes_back_inplace_mutation():
    unlowered = torch.ops.aten.index_reduce.default  # no lowering, no decomposition: CPU fallback
    assert torch_tpu.get_lowering(unlowered) is None
    y = torch.tensor([[1.0, 5.0], [3.0, 2.0]], device="tpu")
    index, source = torch.tensor([1, 1]), torch.tensor([[2.0, 3.0], [4.0, 5.0]])
    torch_tpu.reset_metrics()
    y.t().index_reduce_(0, index.to("tpu"), source.to("tpu"), "prod")
    ref = torch.tensor([[1.0, 5.0], [3.0, 2.0]])
    ref.t().index_reduce_(0, index, source, "prod")
    torch.testing.assert_close(y.cpu(), ref)
    assert torch_tpu.fallback_counts().get("index_reduce_.default") == 1


def test_debug_mode_names_op_for_nan_and_index_bounds():
    x = torch.tensor([1.0, 0.0], device="tpu")
    with torch_tpu.eager_mode("debug"):
        assert torch_tpu.get_eager_mode() is torch_tpu.EagerMode.DEBUG
        with pytest.raises(FloatingPointError, match="aten.div.Tensor"):
            x / torch.zeros(2, device="tpu")
        with pytest.raises(IndexError, match="index_select.*index 5 is out of bounds for dimension 0 with size 2"):
            torch.index_select(x, 0, torch.tensor([0, 5], device="tpu"))
        with pytest.raises(IndexError, match="embedding"):
            torch.nn.functional.embedding(torch.tensor([3], device="tpu"), torch.ones(2, 2, device="tpu"))
        (x + 1).cpu()  # finite work passes
    assert torch_tpu.get_eager_mode() is torch_tpu.EagerMode.STRICT
    # strict mode does not pay for the checks: division by zero gives inf as on CPU
    assert (x / torch.zeros(2, device="tpu")).cpu().tolist()[0] == float("inf")


def test_mode_selection_errors_and_env_var():
    with pytest.raises(ValueError, match="unknown torch_tpu eager mode 'fast'"):
        torch_tpu.set_eager_mode("fast")
    # without a registered executor (import torch_tpu registers one) the mode is refused
    saved = modes._EXECUTORS.pop(torch_tpu.EagerMode.DEFER_AND_FUSE, None)
    try:
        with pytest.raises(RuntimeError, match="defer_and_fuse"):
            torch_tpu.set_eager_mode("defer_and_fuse")
    finally:
        if saved is not None:
            modes._EXECUTORS[torch_tpu.EagerMode.DEFER_AND_FUSE] = saved
    code = "import torch_tpu; print(torch_tpu.get_eager_mode().value)"
    env = dict(os.environ, TORCH_TPU_EAGER_MODE="debug")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "debug", out.stderr


def test_registered_executor_is_used_per_op():
    seen = []

    def recording(lowering, args, kwargs):
        seen.append(str(lowering.op))
        return lowering.fn(*args, **kwargs)

    saved = modes._EXECUTORS.get(torch_tpu.EagerMode.DEFER_AND_FUSE)
    torch_tpu.register_executor("defer_and_fuse", recording)
    try:
        x = torch.tensor([1.0, 2.0]).to("tpu")
        with torch_tpu.eager_mode("defer_and_fuse"):
            out = (x + 1) * 3
        assert seen == ["aten.add.Tensor", "aten.mul.Tensor"]
        assert out.cpu().tolist() == [6.0, 9.0]
    finally:
        modes._EXECUTORS.pop(torch_tpu.EagerMode.DEFER_AND_FUSE)
        if saved is not None:
            modes._EXECUTORS[torch_tpu.EagerMode.DEFER_AND_FUSE] = saved
