"""Copies in a memory format (``clone`` / ``contiguous`` / ``.to(memory_format=...)`` and the
``*_like`` factories), laid out as CPU torch lays them out: ``channels_last`` strides when asked
for, and ``preserve_format`` keeping a dense non-contiguous input's strides. Other ops' results stay
contiguous."""

from __future__ import annotations

import math

import torch

from torch_tpu.runtime._jax import jax, jnp
from torch_tpu.runtime.tensor import StorageBox, TpuTensor, from_jax, make_alias, write


def copy_strides(x: torch.Tensor, memory_format: torch.memory_format | None) -> tuple[int, ...] | None:
    """The strides CPU torch gives a copy of ``x`` in ``memory_format``; None for contiguous ones."""
    memory_format = memory_format or torch.preserve_format
    if memory_format is torch.contiguous_format or (memory_format is torch.preserve_format and x.is_contiguous()):
        return None
    like = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    strides = torch.empty_like(like, memory_format=memory_format).stride()
    return None if strides == torch.empty(x.shape, device="meta").stride() else strides


def laid_out(value: jax.Array, strides: tuple[int, ...] | None, dtype: torch.dtype) -> TpuTensor:
    """A new tpu tensor holding ``value`` with ``strides`` (dense, non-overlapping; None: contiguous)."""
    if strides is None:
        return from_jax(value)
    t = make_alias(StorageBox(jnp.zeros((math.prod(value.shape),), value.dtype)), value.shape, strides, 0, dtype)
    write(t, value)
    return t
