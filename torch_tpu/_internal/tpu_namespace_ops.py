"""``torch.tpu.ops``' functions beyond SparseCore (TorchTPU 0.2.0's signatures): pooling,
grouped matmuls, collectives, the optimization barrier, SparseCore gathers and ``splash_sdpa``.

Each calls its raw ``tpu::`` op (``torch_tpu._internal.raw_ops``, ``raw_collectives``);
Dynamo traces into this module, so the calls land in compiled graphs as those ops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "all_gather_dim", "max_pool1d", "max_pool1d_backward", "max_pool2d", "max_pool2d_backward", "max_pool3d",
    "max_pool3d_backward", "optimization_barrier", "ragged_all_to_all", "ragged_dot", "ragged_dot_weight_grad",
    "recv", "reduce_scatter_dim", "send", "sparse_gather", "sparse_gather_backward", "sparse_iota",
    "sparse_map_row", "splash_sdpa",
]


def optimization_barrier(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``inputs``' values, through a barrier the compiler does not move computations across (on
    XLA here: copies, the program's order unchanged)."""
    return torch.ops.tpu._optimization_barrier(list(inputs))


def max_pool1d(input: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int], padding: Sequence[int],
               dilation: Sequence[int], ceil_mode: bool) -> torch.Tensor:
    """``F.max_pool1d`` without indices; one value per spatial dim in each sequence."""
    return torch.ops.tpu._max_pool1d(input, kernel_size, stride, padding, dilation, ceil_mode)


def max_pool1d_backward(grad_output: torch.Tensor, input: torch.Tensor, kernel_size: Sequence[int],
                        stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                        ceil_mode: bool) -> torch.Tensor:
    """The gradient of :func:`max_pool1d` in ``input`` (the maxima found again from ``input``)."""
    return torch.ops.tpu._max_pool1d_backward(grad_output, input, kernel_size, stride, padding, dilation, ceil_mode)


def max_pool2d(input: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int], padding: Sequence[int],
               dilation: Sequence[int], ceil_mode: bool) -> torch.Tensor:
    """``F.max_pool2d`` without indices; one value per spatial dim in each sequence."""
    return torch.ops.tpu._max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode)


def max_pool2d_backward(grad_output: torch.Tensor, input: torch.Tensor, kernel_size: Sequence[int],
                        stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                        ceil_mode: bool) -> torch.Tensor:
    """The gradient of :func:`max_pool2d` in ``input``."""
    return torch.ops.tpu._max_pool2d_backward(grad_output, input, kernel_size, stride, padding, dilation, ceil_mode)


def max_pool3d(input: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int], padding: Sequence[int],
               dilation: Sequence[int], ceil_mode: bool) -> torch.Tensor:
    """``F.max_pool3d`` without indices; one value per spatial dim in each sequence."""
    return torch.ops.tpu._max_pool3d(input, kernel_size, stride, padding, dilation, ceil_mode)


def max_pool3d_backward(grad_output: torch.Tensor, input: torch.Tensor, kernel_size: Sequence[int],
                        stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                        ceil_mode: bool) -> torch.Tensor:
    """The gradient of :func:`max_pool3d` in ``input``."""
    return torch.ops.tpu._max_pool3d_backward(grad_output, input, kernel_size, stride, padding, dilation, ceil_mode)


def ragged_dot(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped matmul: the ``group_sizes[i]`` rows of group i (consecutive) times ``rhs[i]``;
    ``lhs`` (m, k), ``rhs`` (g, k, n) -> (m, n). Differentiable in ``lhs`` and ``rhs`` without ``out``."""
    if out is None:
        return torch.ops.tpu._ragged_dot(lhs, rhs, group_sizes)
    return torch.ops.tpu._ragged_dot.out(lhs, rhs, group_sizes, out=out)


def ragged_dot_weight_grad(lhs: torch.Tensor, grad_output: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`ragged_dot` in ``rhs``: per group, ``lhs_i.T @ grad_output_i``."""
    return torch.ops.tpu._ragged_dot_weight_grad(lhs, grad_output, group_sizes)


def ragged_all_to_all(operand: torch.Tensor, output: torch.Tensor, input_offsets: torch.Tensor,
                      send_sizes: torch.Tensor, output_offsets: torch.Tensor, recv_sizes: torch.Tensor,
                      process_group_name: str, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rank r sends ``operand[input_offsets[j]:][:send_sizes[j]]`` to rank j, written at row
    ``output_offsets[j]`` of j's result (a copy of its ``output``); ``recv_sizes[j]`` rows come from
    rank j. Differentiable in ``operand`` without ``out``. Eager (the sizes are read to the host)."""
    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, process_group_name)
    if out is None:
        return torch.ops.tpu._ragged_all_to_all(*args)
    return torch.ops.tpu._ragged_all_to_all.out(*args, out=out)


def _work(boxed: Any) -> dist.Work:
    return torch._C._distributed_c10d.Work.unbox(boxed)


def send(tensors: Sequence[torch.Tensor], dst: int, tag: int) -> Any:
    """Send ``tensors`` to rank ``dst`` of the default group; returns a ``Work`` (``wait()``)."""
    return _work(torch.ops.tpu._send(list(tensors), dst, tag))


def recv(tensors: Sequence[torch.Tensor], src: int, tag: int) -> Any:
    """Receive into ``tensors`` from rank ``src``; returns a ``Work``: ``wait()`` before reading them."""
    return _work(torch.ops.tpu._recv(list(tensors), src, tag))


def _group_of(group: dist.ProcessGroup | None) -> tuple[int, str]:
    if group is None:
        if not dist.is_initialized():
            raise ValueError("Default process group has not been initialized, please make sure to call "
                             "init_process_group.")
        group = dist.group.WORLD
    return group.size(), group.group_name


def all_gather_dim(input: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's ``input`` concatenated along ``dim`` (no autograd)."""
    size, name = _group_of(group)
    return torch.ops.tpu._all_gather_dim(input, dim, size, name)


def reduce_scatter_dim(input: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None,
                       reduce_op: str = "sum") -> torch.Tensor:
    """``input`` reduced over the ranks (``reduce_op``), this rank's chunk along ``dim`` (no autograd)."""
    size, name = _group_of(group)
    return torch.ops.tpu._reduce_scatter_dim(input, reduce_op, dim, size, name)


def sparse_gather(row_pointers: torch.Tensor, indices: torch.Tensor, operand: torch.Tensor,
                  max_non_zeroes_per_row: int) -> torch.Tensor:
    """``operand``'s rows at ``indices`` (``len(row_pointers) * max_non_zeroes_per_row`` of them);
    differentiable in ``operand`` (backward :func:`sparse_gather_backward`)."""
    return torch.ops.tpu._sparse_gather(row_pointers, indices, operand, max_non_zeroes_per_row)


def sparse_gather_backward(grad_output: torch.Tensor, indices: torch.Tensor,
                           grad_operand: torch.Tensor) -> torch.Tensor:
    """``grad_operand`` with ``grad_output``'s rows added at ``indices``."""
    return torch.ops.tpu._sparse_gather_backward(grad_output, indices, grad_operand)


def sparse_iota(row_pointers: torch.Tensor, max_non_zeroes: int, max_non_zeroes_per_row: int) -> torch.Tensor:
    """Each of the ``max_non_zeroes`` positions' index within its CSR row (0 past the last)."""
    return torch.ops.tpu._sparse_iota(row_pointers, max_non_zeroes, max_non_zeroes_per_row)


def sparse_map_row(csr_tensors: Sequence[torch.Tensor], csr_lengths: Sequence[int], dense_args: Sequence[torch.Tensor],
                   body_mlir: str, dummy_outputs: Sequence[torch.Tensor], max_non_zeroes_per_row: int,
                   pad_value: int, max_pad_per_row: int, wait_threshold: float,
                   result_row_pointer_op_index: int) -> list[torch.Tensor]:
    """Map an MLIR row computation over CSR matrices on SparseCore: TPU only (raises here)."""
    return torch.ops.tpu._sparse_map_row(list(csr_tensors), list(csr_lengths), list(dense_args), body_mlir,
                                         list(dummy_outputs), max_non_zeroes_per_row, pad_value, max_pad_per_row,
                                         wait_threshold, result_row_pointer_op_index)


def splash_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None, is_causal: bool = True,
    local_window_size: int | None = None, enable_gqa: bool = False, block_q: int = 512, block_kv: int = 512,
    block_dkv: int = 512, block_kv_compute: int = 512, block_q_dkv: int = 512, block_kv_dkv: int = 512,
    block_kv_dkv_compute: int = 512, block_q_dq: int | None = None, block_kv_dq: int | None = None,
    use_fused_bwd_kernel: bool = True, use_vmap_bwd: bool = True, q_layout: str = "HEAD_DIM_MINOR",
    k_layout: str = "HEAD_DIM_MINOR", v_layout: str = "HEAD_DIM_MINOR",
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as TorchTPU's splash attention masks it: causal by
    default; with ``local_window_size`` w, query i sees keys ``i - w .. i``; GQA when ``enable_gqa``
    (key/value heads repeated to the query heads). ``q`` (batch, heads, seq, dim).

    Here this is exact attention through XLA (differentiable in q, k and v). On a TPU TorchTPU runs
    the Pallas splash kernel, blocked by the ``block_*`` sizes, with its own backward kernels
    (``use_fused_bwd_kernel``, ``use_vmap_bwd``) and memory layouts (``*_layout``): those only tune
    that kernel and are checked, not used, here; results agree up to the kernel's float
    reassociation."""
    for name, size in (("block_q", block_q), ("block_kv", block_kv), ("block_dkv", block_dkv),
                       ("block_kv_compute", block_kv_compute), ("block_q_dkv", block_q_dkv),
                       ("block_kv_dkv", block_kv_dkv), ("block_kv_dkv_compute", block_kv_dkv_compute),
                       ("block_q_dq", block_q_dq), ("block_kv_dq", block_kv_dq)):
        if size is not None and size < 1:
            raise ValueError(f"splash_sdpa: {name} must be positive, got {size}")
    if local_window_size is not None and local_window_size < 0:  # a query sees keys i - w .. i: w >= 0
        raise ValueError(f"splash_sdpa: local_window_size must be >= 0 (or None), got {local_window_size}")
    for name, layout in (("q_layout", q_layout), ("k_layout", k_layout), ("v_layout", v_layout)):
        if layout not in ("HEAD_DIM_MINOR", "SEQ_MINOR"):
            raise ValueError(f"splash_sdpa: {name} {layout!r} is not 'HEAD_DIM_MINOR' or 'SEQ_MINOR'")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"splash_sdpa: q, k, v must be 4-D (batch, heads, seq, dim), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    heads, kv_heads = q.shape[1], k.shape[1]
    if enable_gqa != (heads != kv_heads):
        raise ValueError(f"enable_gqa ({enable_gqa}) does not match inputs: n_heads={heads}, n_kv_heads={kv_heads}")
    if heads != kv_heads:
        if heads % kv_heads:
            raise ValueError(f"splash_sdpa: {heads} query heads are not a multiple of {kv_heads} key/value heads")
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    seq_q, seq_k = q.shape[2], k.shape[2]
    mask = None
    if local_window_size is not None or is_causal:
        i = torch.arange(seq_q, device=q.device)[:, None]
        j = torch.arange(seq_k, device=q.device)[None, :]
        mask = j <= i
        if local_window_size is not None:
            mask = mask & (j >= i - local_window_size)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).to(q.dtype)
