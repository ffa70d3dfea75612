"""``storage.tpu()``: copying a torch storage to the device.

``torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)`` gives storages
``is_tpu`` and ``tpu()``, but its ``tpu()`` allocates the copy with
``torch.UntypedStorage(n, device="tpu")``, through a C++ allocator a Python device does not have
(the process crashed), and its ``TypedStorage.tpu()`` accepts only an exact ``UntypedStorage``.
:func:`register` replaces them with :func:`to_tpu` and :func:`typed_to_tpu`.
"""

from __future__ import annotations

import torch

from torch_tpu.runtime import tensor as tensor_mod


def to_tpu(self: torch.UntypedStorage, device: int | str | torch.device | None = None,
           non_blocking: bool = False) -> torch.UntypedStorage:
    """A tpu copy of a host storage's bytes (``self`` when it is already on the device)."""
    torch.tpu.set_device(0 if device is None else device)  # rejects indices other than 0
    if self.device.type == tensor_mod.DEVICE_NAME:
        return self
    return tensor_mod.TpuUntypedStorage(box_of_host_bytes(self))


def box_of_host_bytes(storage: torch.UntypedStorage, dtype: torch.dtype = torch.uint8) -> tensor_mod.StorageBox:
    """A new storage box holding a host storage's bytes read as ``dtype`` elements."""
    host = torch.empty(0, dtype=torch.uint8).set_(storage).view(dtype)
    return tensor_mod.from_cpu(host).storage_box


def typed_to_tpu(self: torch.TypedStorage, device: int | str | torch.device | None = None,
                 non_blocking: bool = False) -> torch.TypedStorage:
    """``TypedStorage.tpu()``: the same dtype over :func:`to_tpu` of its bytes."""
    untyped = to_tpu(self._untyped_storage, device, non_blocking)
    return torch.TypedStorage(wrap_storage=untyped, dtype=self.dtype, _internal=True)


def register() -> None:
    torch.storage._StorageBase.tpu = to_tpu  # type: ignore[attr-defined]
    torch.TypedStorage.tpu = typed_to_tpu  # type: ignore[attr-defined]
