"""Dynamo's runtime interface for device "tpu" (``torch._dynamo.device_interface``).

Torch registers an interface named "tpu" for torch_xla's TPUs, whose device queries
(``current_device``, ``device_count``, ``synchronize`` ...) raise NotImplementedError.
:func:`register` replaces it with one answering from ``torch.tpu`` (keeping torch's dtype and
Pallas answers for the name).
"""

from __future__ import annotations

from torch._dynamo import device_interface

from torch_tpu.runtime import device as tpu


class TpuDeviceInterface(device_interface.TpuInterface):
    """torch's "tpu" interface with the device queries of ``torch.tpu``."""

    device = staticmethod(tpu.device)  # type: ignore[assignment]
    current_device = staticmethod(tpu.current_device)
    set_device = staticmethod(tpu.set_device)
    device_count = staticmethod(tpu.device_count)
    is_available = staticmethod(tpu.is_available)
    synchronize = staticmethod(tpu.synchronize)
    memory_allocated = staticmethod(tpu.memory_allocated)

    @staticmethod
    def exchange_device(device: int) -> int:
        """Make ``device`` current and return the previous one (always 0: one device)."""
        tpu.set_device(device)
        return 0

    maybe_exchange_device = exchange_device


def register() -> None:
    device_interface.get_registered_device_interfaces()  # torch's table first: it would overwrite ours
    device_interface.register_interface_for_device(tpu.DEVICE_NAME, TpuDeviceInterface)
