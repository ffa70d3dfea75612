"""PrivateUse1 kernels: the entry points reached without a tpu tensor argument.

Factories (``torch.empty/zeros/randn(..., device="tpu")``) allocate through ``empty.memory_format``
/ ``empty_strided``; ``torch.tensor(data, device="tpu")`` and CPU->tpu ``.to()`` copy through
``_copy_from``; ``torch.tensor([tpu_scalar])`` reads its elements through ``_local_scalar_dense``
with Python dispatch excluded. Factories with their own CPU/CUDA kernels and no ``out=`` variant
(``triu_indices``) run their registered lowering. Everything else reaches
``TpuTensor.__torch_dispatch__``. Plus the Meta kernels torch lacks for ops compiled graphs trace.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from torch_tpu.ops.registry import get_lowering
from torch_tpu.runtime import device as tpu_device
from torch_tpu.runtime._jax import jnp
from torch_tpu.runtime.dtypes import to_jax_dtype
from torch_tpu.runtime.tensor import (
    StorageBox,
    TpuTensor,
    cpu_to_jax,
    from_jax,
    make_alias,
    resize,
    to_cpu,
    to_jax,
    write,
    zeros,
)

_libs: list[torch.library.Library] = []  # the registered kernels live as long as their library


# Copies into tpu tensors and scalar reads, as handlers ``(func, args, kwargs)``: eager dispatch's
# dedicated handlers of copy_ / _copy_from / _local_scalar_dense, and the kernels below.
def copy_kernel(func: Any, args: tuple, kwargs: dict) -> Any:
    dst, src = args[0], args[1]
    if type(dst) is not TpuTensor:
        dst.copy_(to_cpu(src))
        return dst
    value = to_jax(src) if isinstance(src, TpuTensor) else cpu_to_jax(src)
    value = value.astype(to_jax_dtype(dst.dtype))
    if value.shape != tuple(dst.shape):
        try:
            value = jnp.broadcast_to(value, tuple(dst.shape))
        except ValueError:
            torch.empty(dst.shape, device="meta").copy_(torch.empty(src.shape, device="meta"))
            raise
    tpu_device.note_output(value)
    write(dst, value)
    return dst


def copy_from_kernel(func: Any, args: tuple, kwargs: dict) -> Any:
    src, dst = args[0], args[1]
    return copy_kernel(func, (dst, src), {})



def local_scalar_dense_kernel(func: Any, args: tuple, kwargs: dict) -> Any:
    value = np.asarray(to_jax(args[0])).reshape(-1)[0]
    if value.dtype == np.bool_:
        return bool(value)
    if np.issubdtype(value.dtype, np.integer):
        return int(value)
    if np.issubdtype(value.dtype, np.complexfloating):
        return complex(value)
    return float(value)





def _check_device(device: torch.device | None) -> None:
    if device is not None and device.index not in (None, 0):
        raise RuntimeError(
            f"tpu device index {device.index} is invalid: torch_tpu drives one device per process (index 0)"
        )


def empty_memory_format(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    _check_device(device)
    if memory_format not in (None, torch.contiguous_format, torch.preserve_format):
        stride = torch.empty(size, device="meta", memory_format=memory_format).stride()
        return empty_strided(size, stride, dtype)
    return from_jax(zeros(tuple(size), to_jax_dtype(dtype or torch.get_default_dtype())))


def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    _check_device(device)
    size, stride = tuple(size), tuple(stride)
    numel = 0 if math.prod(size) == 0 else 1 + sum((s - 1) * st for s, st in zip(size, stride))
    dt = dtype or torch.get_default_dtype()
    contiguous = numel == math.prod(size)
    box = StorageBox(zeros(size if contiguous else (numel,), to_jax_dtype(dt)))
    return make_alias(box, size, stride, 0, dt)


def efficient_zero_tensor(size, dtype=None, layout=None, device=None, pin_memory=None):
    """Autograd's symbolic zeros: a dense zero tensor on tpu (same values, no ZeroTensor key)."""
    _check_device(device)
    return from_jax(zeros(tuple(size), to_jax_dtype(dtype or torch.get_default_dtype())))


def copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    return copy_kernel(None, (dst, src), {})


def copy_from_and_resize(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    resize(dst, tuple(src.shape))
    return copy_kernel(None, (dst, src), {})


def lowered_factory(op: torch._ops.OpOverload):
    """A PrivateUse1 kernel for factory ``op``: its lowering's array as a new tpu tensor."""

    def kernel(*args, **kwargs):
        _check_device(kwargs.get("device"))
        return from_jax(get_lowering(op).fn(*args, **kwargs))

    return kernel


def fractional_max_pool3d_backward_meta(grad_output, self, kernel_size, output_size, indices):
    return torch.empty_like(self)


def register() -> None:
    """Install the PrivateUse1 kernels (and the missing Meta kernel); ``import torch_tpu`` calls it once."""
    if _libs:
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("empty.memory_format", empty_memory_format, "PrivateUse1")
    lib.impl("empty_strided", empty_strided, "PrivateUse1")
    lib.impl("_efficientzerotensor", efficient_zero_tensor, "PrivateUse1")
    lib.impl("_copy_from", copy_from, "PrivateUse1")
    lib.impl("_copy_from_and_resize", copy_from_and_resize, "PrivateUse1")
    lib.impl("_local_scalar_dense", lambda t: local_scalar_dense_kernel(None, (t,), {}), "PrivateUse1")
    # torch has no fake kernel for it (the 2d one has): compiled FractionalMaxPool3d training traces it
    lib.impl("fractional_max_pool3d_backward", fractional_max_pool3d_backward_meta, "Meta")
    # ones/zeros/full build their array at once: torch's composite (empty, then fill_) held two
    for name in ("triu_indices", "tril_indices", "ones", "zeros", "full"):
        lib.impl(name, lowered_factory(getattr(torch.ops.aten, name).default), "PrivateUse1")
    _libs.append(lib)
