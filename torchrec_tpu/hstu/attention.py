"""HSTU attention for the model: torch_tpu's jagged op on the tpu device (kernels ``xla`` and
``pallas``: for a stack on the tpu device, and for a CPU stack from :data:`CPU_JAGGED_FROM` up), or
plain PyTorch (kernel :data:`PADDED`, and shorter batches of a CPU stack).

The plain-PyTorch path pads the batch to ``[B, H, L, L]`` scores, as generative-recommenders'
PyTorch kernels do: the CPU baseline of ``bench/bench_hstu.py``. Both compute the equations of
:mod:`torch_tpu.ops.hstu.tiles`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_tpu.ops.hstu import KERNELS, jagged_hstu_attention
from torch_tpu.ops.hstu.jagged import packed_jagged_hstu_attention
from torch_tpu.ops.hstu.tiles import TIME_BUCKET_DIVISOR


def padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                     timestamps: torch.Tensor, num_targets: torch.Tensor, pos_weights: torch.Tensor,
                     time_weights: torch.Tensor, *, max_len: int, max_seq_len: int, alpha: float) -> torch.Tensor:
    """HSTU attention of jagged ``q, k [T, H, Dqk]``, ``v [T, H, Dv]`` over dense ``[B, L, L]``
    scores (``L = max_len``); rows outside ``[offsets[0], offsets[-1])`` come out zero.
    ``timestamps``: ``[T]`` or ``[T, 2]`` (query time, key time), as the jagged op takes them."""
    total = v.shape[0]
    lengths = offsets[1:] - offsets[:-1]
    positions = torch.arange(max_len, device=q.device)
    index = (offsets[:-1, None] + positions).clamp(max=max(total - 1, 0))
    inside = positions < lengths[:, None]
    ids = torch.minimum(positions[None, :], (lengths - num_targets)[:, None])
    rel = ids[:, :, None] - ids[:, None, :]
    eye = torch.eye(max_len, dtype=torch.bool, device=q.device)
    allowed = ((rel > 0) | eye) & inside[:, :, None] & inside[:, None, :]
    times = timestamps if timestamps.dim() == 2 else timestamps[:, None].expand(-1, 2)
    ts = times[index]  # [B, L, 2]: the query times, the key times
    gap = (ts[:, :, None, 0] - ts[:, None, :, 1]).abs().clamp(min=1).float()
    bucket = torch.floor(torch.log(gap) / TIME_BUCKET_DIVISOR).clamp(0, time_weights.numel() - 1).long()
    bias = pos_weights[rel.clamp(0, pos_weights.numel() - 1)] + time_weights[bucket]
    qp, kp, vp = (x[index] * inside[:, :, None, None] for x in (q, k, v))
    scores = alpha * torch.einsum("bihd,bjhd->bhij", qp.float(), kp.float()) + bias[:, None].float()
    weights = F.silu(scores) / max_seq_len * allowed[:, None]
    out = torch.einsum("bhij,bjhd->bihd", weights.to(v.dtype), vp)
    rows = torch.arange(total, device=q.device)
    segment = torch.searchsorted(offsets[1:], rows, right=True).clamp(max=lengths.numel() - 1)
    gathered = out[segment, (rows - offsets[segment]).clamp(0, max_len - 1)]
    return gathered * ((rows >= offsets[0]) & (rows < offsets[-1]))[:, None, None]


PADDED = "padded"  # the kernel that is plain PyTorch on the stack's device: the CPU baseline
ATTENTION_KERNELS = (*KERNELS, PADDED)
JAGGED_DEVICE = torch.device("tpu")  # where the jagged op's kernels run
# From this padded length up a stack off the tpu device attends by the jagged op; below, by the padded
# attention where it is. Measured on XLA:CPU (CPU time of a training step, 2 STU layers, dim 64,
# users x padded length): with the jagged op the step is 1.27x as fast as with the padded attention
# at 16 x 256, as fast at 32 x 128 and 5% slower at 128 x 64, where moving q, k, v and their
# gradients (~5 ms a layer, then 12 copies; :func:`stu_attention` now packs them into 6) costs what
# the op saves. From 1,024 up it also keeps [B, H, L, L] scores out of memory.
CPU_JAGGED_FROM = 256


def uses_jagged_op(kernel: str, dense_device: torch.device, max_len: int) -> bool:
    """Whether ``kernel`` attends a batch of padded length ``max_len`` by the jagged op for a stack
    on ``dense_device``: on the tpu device always, elsewhere from :data:`CPU_JAGGED_FROM` up; never
    for :data:`PADDED`."""
    return kernel != PADDED and (dense_device.type == JAGGED_DEVICE.type or max_len >= CPU_JAGGED_FROM)


def attention_device(kernel: str, dense_device: torch.device, max_len: int) -> torch.device:
    """Where that batch is attended: the tpu device for the jagged op (a CPU stack, which XLA:CPU
    hosts because CPU torch runs its linears and norms faster than eager tpu programs, sends q, k, v
    there and takes the output back), else ``dense_device``."""
    return JAGGED_DEVICE if uses_jagged_op(kernel, dense_device, max_len) else dense_device


def describe(kernel: str, dense_device: torch.device) -> str:
    """Where and how ``kernel`` attends for a stack on ``dense_device``, in words (layout lines)."""
    if kernel == PADDED:
        return f"padded PyTorch on {dense_device.type}"
    jagged = f"jagged op ({kernel} kernel) on {JAGGED_DEVICE.type}"
    if dense_device.type == JAGGED_DEVICE.type:
        return jagged
    return f"{jagged} from padded length {CPU_JAGGED_FROM} up, padded PyTorch on {dense_device.type} below"


def hstu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
                   num_targets: torch.Tensor, pos_weights: torch.Tensor, time_weights: torch.Tensor, *, max_len: int,
                   max_seq_len: int, alpha: float, kernel: str = "xla", in_program: bool = False) -> torch.Tensor:
    """HSTU attention of jagged ``q, k [T, H, Dqk]``, ``v [T, H, Dv]``, on ``q``'s device.

    By the jagged op (``kernel`` ``"xla"`` or ``"pallas"``) on the tpu device where
    :func:`uses_jagged_op` says so: tensors elsewhere go there (pass ``offsets``, ``timestamps``
    and ``num_targets`` already on :func:`attention_device` to move them once per batch) and the
    output comes back, differentiably. Otherwise :func:`padded_attention` where the inputs are.
    ``in_program``: traced into a compiled tpu step (fake CPU tensors standing for tpu ones)."""
    if not uses_jagged_op(kernel, JAGGED_DEVICE if in_program else q.device, max_len):
        return padded_attention(q, k, v, offsets, timestamps, num_targets, pos_weights, time_weights,
                                max_len=max_len, max_seq_len=max_seq_len, alpha=alpha)
    if in_program:
        return jagged_hstu_attention(q, k, v, offsets, timestamps, pos_weights, time_weights, max_len=max_len,
                                     max_seq_len=max_seq_len, alpha=alpha, num_targets=num_targets, kernel=kernel)
    home = q.device
    moved = [t.to(JAGGED_DEVICE) for t in (q, k, v, offsets, timestamps, pos_weights, time_weights, num_targets)]
    out = jagged_hstu_attention(*moved[:7], max_len=max_len, max_seq_len=max_seq_len, alpha=alpha,
                                num_targets=moved[7], kernel=kernel)
    return out.to(home)


def stu_attention(vqk: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor, num_targets: torch.Tensor,
                  pos_weights: torch.Tensor, time_weights: torch.Tensor, *, heads: int, qk_dim: int, max_len: int,
                  max_seq_len: int, alpha: float, kernel: str = "xla", in_program: bool = False) -> torch.Tensor:
    """:func:`hstu_attention` of the STU layer's ``vqk [T, H * (Dv + 2 Dqk)]`` (V, Q, K columns):
    ``[T, H, Dv]``. A stack off the tpu device that attends by the jagged op sends ``vqk`` and the
    two bias tables over as one tensor each and takes their gradients back likewise
    (:func:`~torch_tpu.ops.hstu.jagged.packed_jagged_hstu_attention`): 6 copies a layer and step,
    not 12. ``in_program``: traced into a compiled tpu step, no copies."""
    rows, hq = vqk.shape[0], heads * qk_dim
    if not in_program and uses_jagged_op(kernel, vqk.device, max_len) and vqk.device.type != JAGGED_DEVICE.type:
        out = packed_jagged_hstu_attention(
            vqk.to(JAGGED_DEVICE), offsets.to(JAGGED_DEVICE), timestamps.to(JAGGED_DEVICE),
            torch.cat([pos_weights, time_weights]).to(JAGGED_DEVICE), heads=heads, qk_dim=qk_dim,
            pos_buckets=pos_weights.numel(), max_len=max_len, max_seq_len=max_seq_len, alpha=alpha,
            num_targets=num_targets.to(JAGGED_DEVICE), kernel=kernel)
        return out.to(vqk.device)
    hv = vqk.shape[1] - 2 * hq
    v, q, k = torch.split(vqk, [hv, hq, hq], dim=-1)
    return hstu_attention(q.reshape(rows, heads, qk_dim), k.reshape(rows, heads, qk_dim),
                          v.reshape(rows, heads, hv // heads), offsets, timestamps, num_targets, pos_weights,
                          time_weights, max_len=max_len, max_seq_len=max_seq_len, alpha=alpha, kernel=kernel,
                          in_program=in_program)
