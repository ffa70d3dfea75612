"""Aliasing, in-place and copy semantics of tpu tensors, checked against the same program on CPU."""

from __future__ import annotations

import pytest
import torch

import torch_tpu

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.uint8]


def _both(program):
    """Run ``program(device)`` on cpu and tpu; return both results as CPU tensors."""
    cpu = program("cpu")
    tpu = program("tpu")
    return [t.cpu() if t.device.type == "tpu" else t for t in tpu], cpu


def _assert_same(program):
    tpu, cpu = _both(program)
    for a, b in zip(tpu, cpu):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_writes_through_views_alias_like_cpu():
    def program(device):
        base = torch.arange(24.0, device=device).reshape(4, 6)
        row = base[1]
        col = base[:, 2]
        row += 100  # x[i] += ..
        col.mul_(-1)
        base.t()[3].copy_(torch.arange(4.0))  # copy_ into a transposed view
        base[2, 4] = 7.5
        base.view(-1)[::5].fill_(0)
        base.select(1, 5).add_(base[:, 0])
        sub = base[1:3, 1:5]
        sub.as_strided((2, 2), (1, 6), 1).sub_(3)
        return [base, row, col, sub]

    _assert_same(program)


def test_view_ops_share_storage_and_report_metadata_like_cpu():
    def program(device):
        x = torch.arange(2 * 3 * 4, device=device).reshape(2, 3, 4)
        views = [x.transpose(0, 2), x.permute(2, 0, 1), x[:, 1:, ::2], x.unsqueeze(1), x.view(6, 4),
                 x[0].expand(5, 3, 4), x.flatten()[3:].unfold(0, 4, 3), x.diagonal(0, 1, 2),
                 x.narrow(2, 1, 2), x.squeeze(), *x.unbind(1), *x.split(2, dim=2)]
        x.add_(1000)  # every view must see this
        for v in views:
            assert v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        return [torch.tensor([v.storage_offset(), *v.stride(), *v.shape]) for v in views] + [
            v.contiguous() for v in views
        ]

    _assert_same(program)


def test_inplace_on_non_contiguous_and_expanded_reads():
    def program(device):
        x = torch.ones(3, 4, device=device)
        y = torch.arange(4.0, device=device).expand(3, 4)
        x.t().addcmul_(y.t(), y.t(), value=0.5)
        z = torch.zeros(4, 3, device=device).t()
        z.copy_(y)
        return [x, z, z.t().clone()]

    _assert_same(program)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_and_factories_keep_dtype(dtype):
    cpu = (torch.arange(12) % 3).to(dtype).reshape(3, 4)
    t = cpu.to("tpu")
    assert t.device == torch.device("tpu", 0) and t.dtype == dtype
    torch.testing.assert_close(t.cpu(), cpu, rtol=0, atol=0)
    torch.testing.assert_close(torch.tensor(cpu.tolist(), dtype=dtype, device="tpu").cpu(), cpu, rtol=0, atol=0)
    for made in (torch.zeros(2, 3, dtype=dtype, device="tpu"), torch.ones(2, 3, dtype=dtype, device="tpu"),
                 torch.full((2, 3), 1, dtype=dtype, device="tpu"), torch.empty(2, 3, dtype=dtype, device="tpu")):
        assert made.dtype == dtype and made.shape == (2, 3) and made.device.type == "tpu"


def test_int64_and_float64_keep_full_precision():
    big = torch.tensor([2**40 + 1, -(2**50) - 3], dtype=torch.int64)
    assert (big.to("tpu") * 2).cpu().tolist() == [2 * (2**40 + 1), 2 * (-(2**50) - 3)]
    precise = torch.tensor([1.0 + 2**-40], dtype=torch.float64)
    assert (precise.to("tpu") - 1).item() == 2**-40


def test_factories_under_device_context_and_tensor_methods():
    with torch.device("tpu"):
        a = torch.randn(3, 3)
        b = torch.arange(5)
        c = torch.linspace(0, 1, 5)
    assert {a.device.type, b.device.type, c.device.type} == {"tpu"}
    torch.testing.assert_close(b.cpu(), torch.arange(5))
    torch.testing.assert_close(c.cpu(), torch.linspace(0, 1, 5))
    assert torch.randn(2).tpu().device.type == "tpu"
    m = torch.nn.Linear(2, 2).to("tpu")
    assert m.weight.device.type == "tpu" and isinstance(m.weight, torch.nn.Parameter)


def test_manual_seed_makes_device_random_reproducible():
    torch.manual_seed(123)
    a = torch.randn(8, device="tpu").cpu()
    torch.manual_seed(123)
    b = torch.randn(8, device="tpu").cpu()
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a, torch.randn(8, device="tpu").cpu())
    u = torch.rand(10000, device="tpu")
    assert 0 <= u.min().item() and u.max().item() < 1 and abs(u.mean().item() - 0.5) < 0.02


def test_untyped_storage_resize_like_fsdp2():
    p = torch.arange(6.0, device="tpu").reshape(2, 3)
    storage = p.untyped_storage()
    ptr = storage.data_ptr()
    assert ptr != 0 and storage.size() == 6 * 4
    storage.resize_(0)
    assert p.untyped_storage().size() == 0
    p.untyped_storage().resize_(6 * 4)
    p.copy_(torch.full((2, 3), 5.0))
    assert p.untyped_storage().data_ptr() == ptr
    torch.testing.assert_close(p.cpu(), torch.full((2, 3), 5.0))
    other = torch.zeros(2, device="tpu")
    assert other.untyped_storage().data_ptr() != ptr
    assert p[1].data_ptr() == ptr + 3 * 4


def test_param_data_assignment_and_deepcopy():
    m = torch.nn.Linear(3, 2).to("tpu")
    new = torch.ones(2, 3, device="tpu")
    m.weight.data = new
    new.add_(1)
    torch.testing.assert_close(m.weight.detach().cpu(), torch.full((2, 3), 2.0))
    import copy

    clone = copy.deepcopy(m)
    clone.weight.data.mul_(0)
    torch.testing.assert_close(m.weight.detach().cpu(), torch.full((2, 3), 2.0))
    assert clone.weight.untyped_storage().data_ptr() != m.weight.untyped_storage().data_ptr()


def test_to_jax_from_jax_round_trip():
    import jax.numpy as jnp

    t = torch.arange(6.0, device="tpu").reshape(2, 3)
    arr = torch_tpu.to_jax(t.t())
    assert arr.shape == (3, 2) and float(arr[2, 1]) == 5.0
    back = torch_tpu.from_jax(jnp.ones((2, 2), jnp.bfloat16))
    assert back.dtype == torch.bfloat16 and back.device.type == "tpu"
    with pytest.raises(TypeError, match="tpu tensor"):
        torch_tpu.to_jax(torch.ones(1))


def test_is_pinned_is_false_without_a_fallback():
    """DCP and ``Tensor.to`` ask every tensor whether it is pinned (host) memory."""
    with torch_tpu.no_fallback():
        assert torch.ones(2, device="tpu").is_pinned() is False
