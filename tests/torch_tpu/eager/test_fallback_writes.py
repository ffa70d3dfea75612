"""The CPU fallback writes back every input the op changed, annotated in its schema or not, and
nothing else; checked against the same op run on CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_tpu.eager import fallback

aten = torch.ops.aten

_LIB = torch.library.Library("tpu_fallback_test", "DEF")
# A loose schema, like native_batch_norm's: ``x`` is updated but not marked Tensor(a!).
_LIB.define("scale_quietly(Tensor x, Tensor y, float s) -> Tensor")
_LIB.impl("scale_quietly", lambda x, y, s: x.mul_(s).add(y), "CPU")


def _tpu(*tensors):
    return [t.to("tpu") for t in tensors]


def test_native_batch_norm_running_stats_written_back():
    """native_batch_norm's schema does not mark running_mean/var as mutated; the fallback copies them."""
    x, w, b = torch.randn(6, 3, 4), torch.randn(3), torch.randn(3)
    mean, var = torch.randn(3), torch.rand(3) + 0.5
    buffer = torch.cat([mean, var]).to("tpu")
    t_x, t_w, t_b = _tpu(x, w, b)
    t_mean, t_var = buffer[:3], buffer[3:]  # views: the write must reach the shared storage
    args = (x, w, b, mean, var, True, 0.2, 1e-5)
    expected = aten.native_batch_norm.default(*args)
    actual = fallback.run_on_cpu(aten.native_batch_norm.default, (t_x, t_w, t_b, t_mean, t_var, True, 0.2, 1e-5), {})
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.cpu(), e)
    torch.testing.assert_close(buffer.cpu(), torch.cat([mean, var]))
    torch.testing.assert_close(t_x.cpu(), x)  # inputs the op only read keep their value


def test_unannotated_custom_op_mutation_written_back():
    x, y = torch.randn(5), torch.randn(5)
    t_x, t_y = _tpu(x, y)
    fallback.reset_metrics()
    out = torch.ops.tpu_fallback_test.scale_quietly(t_x, t_y, 3.0)
    expected = torch.ops.tpu_fallback_test.scale_quietly(x, y, 3.0)
    assert fallback.fallback_counts() == {"scale_quietly.default": 1}
    torch.testing.assert_close(out.cpu(), expected)
    torch.testing.assert_close(t_x.cpu(), x)  # scaled in place on both devices
    torch.testing.assert_close(t_y.cpu(), y)


def test_unchanged_inputs_are_not_rewritten():
    """Read-only inputs keep their storage value object: nothing is copied back needlessly."""
    x, y = torch.randn(4, 4).to("tpu"), torch.randn(4).to("tpu")
    before = (x.storage_box.array, y.storage_box.array)
    out = fallback.run_on_cpu(aten.add.Tensor, (x, y), {})
    assert (x.storage_box.array, y.storage_box.array) == before
    torch.testing.assert_close(out.cpu(), x.cpu() + y.cpu())


def test_nan_inputs_unchanged_are_not_rewritten():
    x = torch.tensor([float("nan"), 1.0]).to("tpu")
    before = x.storage_box.array
    fallback.run_on_cpu(aten.isnan.default, (x,), {})
    assert x.storage_box.array is before


def test_embedding_max_norm_renorms_tpu_weight():
    """embedding with max_norm renormalizes the weight rows in place (embedding_renorm_)."""
    torch.manual_seed(0)
    weight = torch.randn(6, 3) * 3
    idx = torch.tensor([[0, 2], [2, 5]])
    t_weight = weight.to("tpu")
    expected = F.embedding(idx, weight, max_norm=1.0)
    actual = F.embedding(idx.to("tpu"), t_weight, max_norm=1.0)
    torch.testing.assert_close(actual.cpu(), expected)
    torch.testing.assert_close(t_weight.cpu(), weight)


def test_fused_moving_avg_observer_state_written_back():
    """_fused_moving_avg_obs_fq_helper updates running_min/max, scale and zero_point."""
    torch.manual_seed(0)
    x = torch.randn(4, 5)
    state = [torch.tensor([float("inf")]), torch.tensor([float("-inf")]), torch.tensor([1.0]),
             torch.tensor([0], dtype=torch.int32)]
    on = torch.tensor([1], dtype=torch.long)
    tpu_state = _tpu(*state)
    args = (0.01, 0, 255, -1)
    expected = aten._fused_moving_avg_obs_fq_helper(x, on, on, *state, *args)
    actual = aten._fused_moving_avg_obs_fq_helper(*_tpu(x, on, on), *tpu_state, *args)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.cpu(), e)
    for t, c in zip(tpu_state, state):
        torch.testing.assert_close(t.cpu(), c)
    assert float(state[0]) != float("inf")  # the op did update the state



def test_under_inference_mode():
    """CPU copies made under inference_mode have no version counter: their bytes are compared."""
    x, y = torch.randn(5), torch.randn(5)
    t_x, t_y = _tpu(x, y)
    with torch.inference_mode():
        out = torch.ops.tpu_fallback_test.scale_quietly(t_x, t_y, 2.0)
        expected = torch.ops.tpu_fallback_test.scale_quietly(x, y, 2.0)
    torch.testing.assert_close(out.cpu(), expected)
    torch.testing.assert_close(t_x.cpu(), x)


def test_a_tpu_kernel_registered_after_the_first_call_is_used_from_then_on():
    """TorchRec registers its Pallas kernels when ``pallas/impl.py`` is imported, possibly after its
    ops ran once on the CPU fallback: the next call runs the library's tpu kernel."""
    lib = torch.library.Library("tpu_late_kernel_test", "DEF")
    lib.define("double(Tensor x) -> Tensor")
    lib.impl("double", lambda x: x * 2, "CPU")
    x = torch.arange(4.0)
    fallback.reset_metrics()
    torch.testing.assert_close(torch.ops.tpu_late_kernel_test.double(x.to("tpu")).cpu(), x * 2)
    assert fallback.fallback_counts() == {"double.default": 1}
    lib.impl("double", lambda x: x + x, "PrivateUse1")  # computed on the device, no fallback
    fallback.reset_metrics()
    torch.testing.assert_close(torch.ops.tpu_late_kernel_test.double(x.to("tpu")).cpu(), x * 2)
    assert fallback.fallback_counts() == {}
