"""``torch_tpu._internal.sync.synchronize``: TorchTPU's name for waiting on the device.

Code written for TorchTPU (TorchRec's TPU kernel tests and benchmarks) calls
``synchronize(wait=True)`` before reading a clock. Ops here reach the device as they are issued,
so nothing waits on the host to be flushed: ``wait=True`` waits until every op dispatched so far
has finished (:func:`torch_tpu.runtime.device.synchronize`), ``wait=False`` returns at once.
"""

from __future__ import annotations

from torch_tpu.runtime.device import synchronize as _wait_for_device

__all__ = ["synchronize"]


def synchronize(wait: bool = True) -> None:
    """Wait until the device has run every op dispatched so far (``wait``); else return at once."""
    if wait:
        _wait_for_device()
