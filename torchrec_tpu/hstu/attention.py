"""HSTU attention for the model: torch_tpu's jagged op on tpu tensors (and on CPU tensors of long
sequences, :data:`LONG_SEQUENCE`), plain PyTorch elsewhere.

The plain-PyTorch path pads the batch to ``[B, H, L, L]`` scores, as generative-recommenders'
PyTorch kernels do: the CPU baseline (``bench/bench_hstu.py``) and the reference engine. Both
compute the equations of :mod:`torch_tpu.ops.hstu.tiles`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_tpu.ops.hstu import KERNELS, jagged_hstu_attention
from torch_tpu.ops.hstu.tiles import TIME_BUCKET_DIVISOR


def padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                     timestamps: torch.Tensor, num_targets: torch.Tensor, pos_weights: torch.Tensor,
                     time_weights: torch.Tensor, *, max_len: int, max_seq_len: int, alpha: float) -> torch.Tensor:
    """HSTU attention of jagged ``q, k [T, H, Dqk]``, ``v [T, H, Dv]`` over dense ``[B, L, L]``
    scores (``L = max_len``); rows past ``offsets[-1]`` come out zero."""
    total = v.shape[0]
    lengths = offsets[1:] - offsets[:-1]
    positions = torch.arange(max_len, device=q.device)
    index = (offsets[:-1, None] + positions).clamp(max=max(total - 1, 0))
    inside = positions < lengths[:, None]
    ids = torch.minimum(positions[None, :], (lengths - num_targets)[:, None])
    rel = ids[:, :, None] - ids[:, None, :]
    eye = torch.eye(max_len, dtype=torch.bool, device=q.device)
    allowed = ((rel > 0) | eye) & inside[:, :, None] & inside[:, None, :]
    ts = timestamps[index]
    gap = (ts[:, :, None] - ts[:, None, :]).abs().clamp(min=1).float()
    bucket = torch.floor(torch.log(gap) / TIME_BUCKET_DIVISOR).clamp(0, time_weights.numel() - 1).long()
    bias = pos_weights[rel.clamp(0, pos_weights.numel() - 1)] + time_weights[bucket]
    qp, kp, vp = (x[index] * inside[:, :, None, None] for x in (q, k, v))
    scores = alpha * torch.einsum("bihd,bjhd->bhij", qp.float(), kp.float()) + bias[:, None].float()
    weights = F.silu(scores) / max_seq_len * allowed[:, None]
    out = torch.einsum("bhij,bjhd->bihd", weights.to(v.dtype), vp)
    rows = torch.arange(total, device=q.device)
    segment = torch.searchsorted(offsets[1:], rows, right=True).clamp(max=lengths.numel() - 1)
    gathered = out[segment, (rows - offsets[segment]).clamp(0, max_len - 1)]
    return gathered * (rows < offsets[-1])[:, None, None]


LONG_SEQUENCE = 1024  # from this padded length up, CPU tensors are attended by the jagged op too
PADDED = "padded"  # the kernel that is plain PyTorch everywhere, at every length: the CPU baseline
ATTENTION_KERNELS = (*KERNELS, PADDED)


def hstu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
                   num_targets: torch.Tensor, pos_weights: torch.Tensor, time_weights: torch.Tensor, *, max_len: int,
                   max_seq_len: int, alpha: float, kernel: str = "xla") -> torch.Tensor:
    """The jagged op (``kernel``: ``"xla"`` or ``"pallas"``) on tpu tensors; elsewhere
    :func:`padded_attention`, except from ``max_len`` >= :data:`LONG_SEQUENCE` up, where its ``[B, H,
    L, L]`` scores (and their saved copies for backward) would dominate memory: there the inputs go
    to the tpu device for the jagged op and the output comes back (differentiably). ``kernel``
    :data:`PADDED`: :func:`padded_attention` always (the plain-PyTorch baseline)."""
    if kernel != PADDED and (q.device.type == "tpu" or max_len >= LONG_SEQUENCE):
        home = q.device
        tpu = [t.to("tpu") for t in (q, k, v, offsets, timestamps, pos_weights, time_weights, num_targets)]
        out = jagged_hstu_attention(*tpu[:7], max_len=max_len, max_seq_len=max_seq_len, alpha=alpha,
                                    num_targets=tpu[7], kernel=kernel)
        return out.to(home)
    return padded_attention(q, k, v, offsets, timestamps, num_targets, pos_weights, time_weights, max_len=max_len,
                            max_seq_len=max_seq_len, alpha=alpha)
