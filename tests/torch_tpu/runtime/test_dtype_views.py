"""``Tensor.view(dtype)`` on tpu: same layout as CPU and real aliasing in both directions."""

from __future__ import annotations

import pytest
import torch

import torch_tpu  # noqa: F401

CASES = [
    (torch.float32, torch.int32, (3, 4)),
    (torch.float32, torch.int16, (3, 4)),  # size-changing: last dim doubles
    (torch.bfloat16, torch.int16, (2, 6)),
    (torch.int64, torch.int32, (2, 3)),
    (torch.int16, torch.float32, (2, 4)),  # last dim halves
    (torch.int32, torch.uint8, (2, 2)),
    (torch.uint8, torch.bool, (5,)),
    (torch.complex64, torch.float32, (3,)),
    (torch.float32, torch.complex64, (3, 4)),
]


def _same(tpu: torch.Tensor, cpu: torch.Tensor) -> None:
    assert tpu.device.type == "tpu" and tpu.dtype == cpu.dtype
    assert tpu.shape == cpu.shape and tpu.stride() == cpu.stride()
    assert tpu.storage_offset() == cpu.storage_offset()
    torch.testing.assert_close(tpu.cpu(), cpu, rtol=0, atol=0, equal_nan=True)


def _base(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    torch.manual_seed(0)
    if dtype == torch.uint8:
        return torch.randint(0, 2, shape, dtype=dtype)
    return (torch.randn(shape) * 100).to(dtype)


@pytest.mark.parametrize("src,dst,shape", CASES, ids=lambda x: str(x))
def test_view_dtype_matches_cpu_and_aliases_both_ways(src, dst, shape):
    cpu = _base(src, shape)
    tpu = cpu.to("tpu")
    cpu_view, tpu_view = cpu.view(dst), tpu.view(dst)
    _same(tpu_view, cpu_view)

    one = True if dst == torch.bool else 1
    cpu_view[0].fill_(one)
    tpu_view[0].fill_(one)  # a write through the view shows in the base
    _same(tpu, cpu)

    cpu.view(-1)[-1] = 7
    tpu.view(-1)[-1] = 7  # a write to the base shows in the view
    _same(tpu_view, cpu_view)


def test_view_dtype_of_strided_views_and_views_of_it():
    def program(device):
        base = torch.arange(24, dtype=torch.int64, device=device).reshape(4, 6)
        halves = base[1:3, 2:5].view(torch.int32)  # non-contiguous rows, last dim doubles
        halves[:, ::2] = -1
        back = halves.view(torch.int64)
        back.t()[0].add_(5)  # a view of a dtype view, written in place
        return [base, halves.contiguous(), back.contiguous(), base.view(torch.float64)[0].view(torch.int64)]

    cpu, tpu = program("cpu"), program("tpu")
    for a, b in zip(tpu, cpu):
        torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0)


def test_view_dtype_keeps_bytes_beyond_the_view_and_rejects_what_cpu_rejects():
    cpu = torch.arange(3, dtype=torch.int16)
    tpu = cpu.to("tpu")
    cpu[:2].view(torch.int32).add_(70000)
    tpu[:2].view(torch.int32).add_(70000)  # the third int16 is not part of any int32
    _same(tpu, cpu)
    with pytest.raises(RuntimeError, match="storage_offset"):
        tpu[1:].view(torch.int32)
    with pytest.raises(RuntimeError, match="stride"):
        torch.zeros(4, 4, device="tpu").t().view(torch.int16)
