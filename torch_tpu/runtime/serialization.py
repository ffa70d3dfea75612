"""``torch.save`` / ``torch.load`` of tpu tensors, honouring ``map_location`` both ways.

Saving: a tpu tensor pickles as its CPU value plus its device, rebuilt by torch's own
``_rebuild_device_tensor_from_cpu_tensor`` (as torch does for other storage-less devices), which
maps the device through ``torch.load``'s ``map_location``: ``map_location="cpu"`` gives CPU
tensors on a machine without the device. A tpu ``nn.Parameter`` pickles as torch pickles a CPU
one (``_rebuild_parameter`` over its data), so it loads as a Parameter with its
``requires_grad``, in a state dict or a whole module (``TpuTensor.__reduce_ex__``).

Loading onto the device: torch restores a saved storage to a PrivateUse1 location by allocating a
storage there (``UntypedStorage(n, device="tpu")``), which needs a C++ allocator a Python device
does not have (the process crashed). :func:`_restore`, registered ahead of torch's own handler,
keeps the bytes in a :class:`LoadedHostStorage` (host memory reporting the tpu device); torch then
rebuilds each tensor with ``set_`` on a tpu tensor, which takes them as one JAX array per storage
and dtype (tensors saved as views of one storage load as views of one storage).
"""

from __future__ import annotations

import re

import torch

from torch_tpu.runtime import tensor as tensor_mod
from torch_tpu.runtime.storage import box_of_host_bytes

_LOCATION = re.compile(rf"{tensor_mod.DEVICE_NAME}(:0)?")
# before torch's PrivateUse1 handler (23), after its CPU one (10)
_PRIORITY = 19


class LoadedHostStorage(torch.UntypedStorage):
    """Loaded bytes bound for the tpu device: host memory whose ``device`` is tpu, turned into a
    tpu storage (one per dtype it is read as) by the first tensor ``set_`` onto it."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return tensor_mod.DEVICE

    def tpu_storage(self, dtype: torch.dtype) -> tensor_mod.TpuUntypedStorage:
        boxes = self.__dict__.setdefault("_boxes", {})
        if dtype not in boxes:
            boxes[dtype] = box_of_host_bytes(self, dtype)
        return tensor_mod.TpuUntypedStorage(boxes[dtype])


def _tag(obj: object) -> None:
    return None  # tpu tensors never reach torch's storage-level saving (see the module docstring)


def _restore(storage: torch.UntypedStorage, location: str) -> LoadedHostStorage | None:
    if not _LOCATION.fullmatch(location):
        return None
    loaded = LoadedHostStorage(storage.nbytes())
    loaded.copy_(storage)
    return loaded


def register() -> None:
    torch.serialization.register_package(_PRIORITY, _tag, _restore)
    torch.serialization.add_safe_globals([tensor_mod._rebuild_tpu_tensor])  # torch.load(weights_only=True)
