"""nn.EmbeddingBag on tpu, lowered end to end (no CPU fallback): outputs and gradients vs CPU."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import torch_tpu

INDICES = torch.tensor([1, 2, 4, 5, 2, 3, 2, 9, 2, 2, 7, 7])
OFFSETS = torch.tensor([0, 2, 2, 5, 8])  # bag 1 is empty
CASES = [  # mode, padding_idx, include_last_offset, per_sample_weights, scale_grad_by_freq
    (mode, pad, last, psw, freq)
    for mode, pad, last, psw, freq in itertools.product(("sum", "mean", "max"), (None, 2), (False, True),
                                                        (False, True), (False, True))
    if not (psw and mode != "sum") and not (freq and mode == "max")
]


def _step(device, weight, mode, pad, last, psw, freq, dtype=torch.float32):
    torch.manual_seed(0)
    bag = torch.nn.EmbeddingBag(10, 4, mode=mode, padding_idx=pad, include_last_offset=last,
                                scale_grad_by_freq=freq, dtype=dtype).to(device)
    with torch.no_grad():
        bag.weight.copy_(weight.to(device, dtype))
    offsets = torch.cat([OFFSETS, torch.tensor([INDICES.numel()])]) if last else OFFSETS
    weights = torch.linspace(0.5, 2, INDICES.numel(), dtype=dtype).to(device).requires_grad_() if psw else None
    out = bag(INDICES.to(device), offsets.to(device), per_sample_weights=weights)
    cotangent = torch.arange(out.numel(), dtype=dtype).reshape(out.shape).sin().to(device)
    out.backward(cotangent)
    return [out, bag.weight.grad] + ([weights.grad] if psw else [])


# Default run: every mode with every option at least once; the full product is slow.
_DEFAULT = {("sum", 2, True, True, True), ("sum", None, False, False, False), ("mean", 2, False, False, True),
            ("mean", None, True, False, False), ("max", 2, True, False, False), ("max", None, False, False, False)}


@pytest.mark.parametrize("mode,pad,last,psw,freq", [
    pytest.param(*case, marks=() if case in _DEFAULT else pytest.mark.slow) for case in CASES], ids=str)
def test_embedding_bag_matches_cpu_without_fallback(mode, pad, last, psw, freq):
    weight = torch.randn(10, 4, generator=torch.Generator().manual_seed(1))
    weight[7] = weight[3]  # ties between rows in max mode: the first entry wins, as on CPU
    # CPU's scale_grad_by_freq divides some rows by another row's count (torch 2.13): the reference
    # is the unscaled CPU gradient divided by each row's frequency in the batch, as documented
    expected = _step("cpu", weight, mode, pad, last, psw, False)
    if freq:
        expected[1] = expected[1] / torch.bincount(INDICES, minlength=10).clamp(min=1)[:, None]
    torch_tpu.reset_metrics()
    with torch_tpu.no_fallback():
        actual = _step("tpu", weight, mode, pad, last, psw, freq)
    assert torch_tpu.fallback_counts() == {}
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.cpu(), e, rtol=1e-5, atol=1e-6)


def test_embedding_bag_2d_input_and_bfloat16():
    weight = torch.randn(10, 4, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[1, 2, 3], [4, 4, 9]])
    for dtype in (torch.float32, torch.bfloat16):
        expected = F.embedding_bag(ids, weight.to(dtype), mode="mean")
        actual = F.embedding_bag(ids.to("tpu"), weight.to("tpu", dtype), mode="mean")
        torch.testing.assert_close(actual.cpu(), expected)


def test_embedding_bag_aux_outputs_follow_the_meta_kernel():
    """Shapes and dtypes as PyTorch's meta kernel gives them for a non-CPU device (what compiled
    graphs are traced with); values as CPU computes them where CPU fills them in."""
    weight = torch.randn(10, 4, generator=torch.Generator().manual_seed(3))
    for mode, pad, last in itertools.product((0, 1, 2), (-1, 2), (False, True)):
        offsets = torch.cat([OFFSETS, torch.tensor([INDICES.numel()])]) if last else OFFSETS
        args = (False, mode, False, None, last, pad)
        meta = torch.ops.aten._embedding_bag(weight.to("meta"), INDICES.to("meta"), offsets.to("meta"), *args)
        actual = torch.ops.aten._embedding_bag(weight.to("tpu"), INDICES.to("tpu"), offsets.to("tpu"), *args)
        cpu = torch.ops.aten._embedding_bag(weight, INDICES, offsets, *args)
        counts = torch.ops.aten._embedding_bag(weight, INDICES, offsets, False, 1, False, None, last, pad)[2]
        for a, m in zip(actual, meta):
            assert (a.shape, a.dtype) == (m.shape, m.dtype), (mode, pad, last)
        bags = counts.shape[0]
        torch.testing.assert_close(actual[0].cpu(), cpu[0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(actual[1].cpu(), torch.ops.aten._embedding_bag(
            weight, INDICES, offsets, False, 1, False, None, last, pad)[1])  # mean mode fills offset2bag
        torch.testing.assert_close(actual[2].cpu()[:bags], counts)
        assert not actual[2].cpu()[bags:].any()
        if mode == 2:
            torch.testing.assert_close(actual[3].cpu(), cpu[3])
