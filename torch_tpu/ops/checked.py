"""Value checks CPU torch makes and a device path would skip: where the tpu path runs a
decomposition (or torch's functional composite) that does not look at index values, these add the
check CPU's kernel makes, on the host, raising CPU's exception, so that no call returns a result
where CPU raises.

* ``index_copy`` (composite): indices in ``[0, size)``; PyTorch's decomposition goes through
  ``index_put``, which would accept ``-1`` and count it from the end;
* ``index_fill``: a complex value for a non-complex tensor is refused (a bool one took it);
* ``one_hot`` (AutogradPrivateUse1 kernel): class values in ``[0, num_classes)``. The op is
  CompositeImplicitAutograd and takes torch's functional path (``eq`` with an ``arange``, no checks)
  for tensors with a Python key, so it is intercepted above autograd.

Each check costs one device->host read of the index extremes, in eager only: under
``torch.compile`` (fake tensors) the unchecked decomposition is traced (docs/architecture/torch_tpu_device.md).
"""

from __future__ import annotations

import torch

from torch_tpu.ops.registry import register_composite
from torch_tpu.runtime.tensor import TpuTensor

aten = torch.ops.aten
_libs: list[torch.library.Library] = []


def _extremes(t: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty integer tensor, in one read."""
    lo, hi = torch.aminmax(t)
    return tuple(int(v) for v in torch.stack([lo, hi]).tolist())


@register_composite(aten.index_copy.default)
def index_copy(self, dim, index, source):
    rank = max(self.dim(), 1)
    if isinstance(index, TpuTensor) and index.numel() and -rank <= dim < rank and index.dtype == torch.long:
        size = self.shape[dim] if self.dim() else 1
        lo, hi = _extremes(index)
        if lo < 0 or hi >= size:
            bad = lo if lo < 0 else hi
            raise IndexError(f"index_copy_(): index {bad} is out of bounds for dimension {dim % rank} with size {size}")
    from torch._decomp import decomposition_table

    return decomposition_table[aten.index_copy.default](self, dim, index, source)


@register_composite(aten.index_fill.int_Scalar)
def index_fill(self, dim, index, value):
    """CPU refuses a complex value for a non-complex tensor; the decomposition let a bool one take it."""
    if isinstance(value, complex) and not self.is_complex():
        raise RuntimeError("index_fill_(): Converting complex Scalar to non-complex type is not supported")
    from torch._decomp import decomposition_table

    return decomposition_table[aten.index_fill.int_Scalar](self, dim, index, value)


def _one_hot(self: torch.Tensor, num_classes: int = -1) -> torch.Tensor:
    if self.dtype == torch.long and self.numel() and isinstance(self, TpuTensor):
        lo, hi = _extremes(self)
        if lo < 0:
            raise RuntimeError("Class values must be non-negative.")
        if num_classes != -1 and hi >= num_classes:
            raise RuntimeError("Class values must be smaller than num_classes.")
    with torch._C._AutoDispatchBelowAutograd():
        return aten.one_hot.default.decompose(self, num_classes)


def register() -> None:
    """Install the AutogradPrivateUse1 ``one_hot`` kernel (once)."""
    if _libs:
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("one_hot", _one_hot, "AutogradPrivateUse1")
    _libs.append(lib)
