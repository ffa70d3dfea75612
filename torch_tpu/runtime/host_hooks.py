"""The tpu device's PrivateUse1 hooks, in C++ where a compiler is there (``csrc/host_hooks.cc``).

torch asks the current accelerator's hooks for pinned host memory: ``torch.empty(...,
pin_memory=True)``, ``Tensor.pin_memory()`` / ``is_pinned()``, and DDP's reducer, which stages
its used-parameter map in pinned memory on every step of a ``static_graph=True`` model (stock
TorchRec DMP sets it). torch's Python hook class has no such method, and PyTorch takes one hook
object per process, so :func:`register` builds the C++ hooks (availability plus a pinned host
allocator; built once with the system C++ compiler by ``xla_cache.native_build.build_library`` and
cached) and registers them instead. Without a compiler the Python hooks are registered (one
warning): pinned memory, and so DDP's static graph, then fail on tpu with torch's error. This module
imports nothing of torch_tpu: the ``import torch`` hook (``torchrec_tpu._torch_tpu_autoload``)
loads it alone to register the hooks when it names the device.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "host_hooks.cc"


def _flags() -> tuple[str, ...]:
    root = Path(torch.__file__).parent
    lib = root / "lib"
    return ("-O2", "-std=c++20", "-shared", "-fPIC", "-w", f"-I{root / 'include'}",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-DTORCH_TPU_TORCH={torch.__version__}",
            f"-L{lib}", "-Wl,--no-as-needed", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}")


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    """The Python hooks: the device is there (no pinned host memory)."""

    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id: int) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _DeviceGuard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


_registered: list[object] = []  # what was registered, kept alive: the C++ side holds raw references


def register() -> None:
    """Register the device's hooks and device guard, once per process (later calls do nothing): the
    C++ hooks where they can be built, else the Python ones, having warned why. torch's accelerator
    calls (``dist.barrier``'s, pinned memory) need them as soon as PrivateUse1 is named "tpu", so the
    ``import torch`` hook calls this before torch_tpu is loaded."""
    if _registered:
        return
    from xla_cache.native_build import NativeUnavailable, build_library

    try:
        library = ctypes.CDLL(str(build_library(SOURCE, "_torch_tpu_host_hooks", _flags(), ".so")),
                              mode=os.RTLD_LOCAL)
    except (NativeUnavailable, OSError) as error:
        warnings.warn(f"torch_tpu: no pinned host memory for the tpu device (the C++ hooks could not be built: "
                      f"{error}); pin_memory() and DDP(static_graph=True) on tpu will fail", RuntimeWarning,
                      stacklevel=2)
        hooks: object = _Hooks()
        torch._C._acc.register_python_privateuseone_hook(hooks)
    else:
        library.torch_tpu_register_hooks()
        hooks = library  # the hooks live in the library: keep it loaded
    guard = _DeviceGuard()
    torch._C._acc.register_python_privateuseone_device_guard(guard)
    _registered.extend([hooks, guard])
