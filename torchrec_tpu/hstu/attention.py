"""HSTU attention for the model: torch_tpu's jagged op on the tpu device (kernels ``xla`` and
``pallas``, whatever device the STU stack runs on), or plain PyTorch (kernel :data:`PADDED`).

The plain-PyTorch path pads the batch to ``[B, H, L, L]`` scores, as generative-recommenders'
PyTorch kernels do: the CPU baseline of ``bench/bench_hstu.py``. Both compute the equations of
:mod:`torch_tpu.ops.hstu.tiles`.
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


PADDED = "padded"  # the kernel that is plain PyTorch on the stack's device: the CPU baseline
ATTENTION_KERNELS = (*KERNELS, PADDED)
JAGGED_DEVICE = torch.device("tpu")  # where the jagged op's kernels run


def attention_device(kernel: str, dense_device: torch.device) -> torch.device:
    """Where ``kernel`` attends a stack on ``dense_device``: the tpu device for the jagged op (a CPU
    stack, which XLA:CPU hosts because CPU torch runs its linears and norms faster than eager tpu
    programs, sends q, k, v there and takes the output back), ``dense_device`` itself for
    :data:`PADDED`."""
    return dense_device if kernel == PADDED else JAGGED_DEVICE


def hstu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
                   num_targets: torch.Tensor, pos_weights: torch.Tensor, time_weights: torch.Tensor, *, max_len: int,
                   max_seq_len: int, alpha: float, kernel: str = "xla") -> torch.Tensor:
    """HSTU attention of jagged ``q, k [T, H, Dqk]``, ``v [T, H, Dv]``, on ``q``'s device.

    ``kernel`` ``"xla"`` or ``"pallas"``: the jagged op on the tpu device; tensors elsewhere go
    there (pass ``offsets``, ``timestamps`` and ``num_targets`` already on it to move them once per
    batch, :func:`attention_device`) and the output comes back, differentiably. :data:`PADDED`:
    :func:`padded_attention` where the inputs are."""
    if kernel == PADDED:
        return padded_attention(q, k, v, offsets, timestamps, num_targets, pos_weights, time_weights,
                                max_len=max_len, max_seq_len=max_seq_len, alpha=alpha)
    home = q.device
    moved = [t.to(JAGGED_DEVICE) for t in (q, k, v, offsets, timestamps, pos_weights, time_weights, num_targets)]
    out = jagged_hstu_attention(*moved[:7], max_len=max_len, max_seq_len=max_seq_len, alpha=alpha,
                                num_targets=moved[7], kernel=kernel)
    return out.to(home)
