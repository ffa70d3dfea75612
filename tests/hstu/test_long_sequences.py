"""The model's attention on CPU tensors (the jagged op on the tpu device, at every length) makes no
[L, L]-sized tensor at padded length L = 1,024 (every torch op's output is recorded, forward and
backward) and equals the reference written from the paper's equations (tests/hstu/reference.py),
forward and gradients; kernel "padded" (the bench's plain baseline) still makes them."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_tpu  # noqa: F401  (the tpu device)
from tests.hstu import reference
from torchrec_tpu.hstu.attention import PADDED, hstu_attention

HEADS, QK, DV, MAX_SEQ_LEN = 2, 4, 3, 64
LONG = 1024


class _Shapes(TorchDispatchMode):
    """Every shape a torch op outputs while active."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def test_cpu_attention_at_1024_makes_no_length_squared_tensor_and_equals_reference():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([7, 0, 12, 1])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    total = int(lengths.sum())
    leaves = {"q": torch.randn(total, HEADS, QK, generator=gen), "k": torch.randn(total, HEADS, QK, generator=gen),
              "v": torch.randn(total, HEADS, DV, generator=gen), "pos_w": torch.randn(MAX_SEQ_LEN, generator=gen),
              "ts_w": torch.randn(17, generator=gen)}
    timestamps = 1_700_000_000 + torch.randint(0, 5000, (total,), generator=gen).cumsum(0)
    targets = torch.tensor([2, 0, 3, 1])
    got = {n: t.clone().requires_grad_() for n, t in leaves.items()}
    seq = LONG
    with _Shapes() as seen:
        out = hstu_attention(got["q"], got["k"], got["v"], offsets, timestamps, targets, got["pos_w"], got["ts_w"],
                             max_len=seq, max_seq_len=MAX_SEQ_LEN, alpha=QK ** -0.5)
        out.backward(torch.ones_like(out))
    assert out.device.type == "cpu" and seen.shapes
    squared = [s for s in seen.shapes if sum(d >= seq for d in s) >= 2]
    assert not squared, squared
    ref = {n: t.double().requires_grad_() for n, t in leaves.items()}
    expected = reference.attention(ref["q"], ref["k"], ref["v"], offsets, timestamps, ref["pos_w"], ref["ts_w"],
                                   max_seq_len=MAX_SEQ_LEN, alpha=QK ** -0.5, num_targets=targets)
    expected.backward(torch.ones_like(expected))
    torch.testing.assert_close(out.double(), expected.detach(), atol=1e-5, rtol=1e-5)
    for name, leaf in ref.items():
        torch.testing.assert_close(got[name].grad.double(), leaf.grad, atol=1e-5, rtol=1e-5, msg=name)
    with _Shapes() as plain:  # the padded kernel (the bench's baseline) keeps its [B, L, L] tensors
        hstu_attention(*(leaves[n] for n in ("q", "k", "v")), offsets, timestamps, targets, leaves["pos_w"],
                       leaves["ts_w"], max_len=seq, max_seq_len=MAX_SEQ_LEN, alpha=QK ** -0.5, kernel=PADDED)
    assert (lengths.numel(), seq, seq) in plain.shapes
