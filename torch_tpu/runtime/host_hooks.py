"""The tpu device's PrivateUse1 hooks, in C++ where a compiler is there (``csrc/host_hooks.cc``).

torch asks the current accelerator's hooks for pinned host memory: ``torch.empty(...,
pin_memory=True)``, ``Tensor.pin_memory()`` / ``is_pinned()``, and DDP's reducer, which stages
its used-parameter map in pinned memory on every step of a ``static_graph=True`` model (stock
TorchRec DMP sets it). torch's Python hook class has no such method, and PyTorch takes one hook
object per process, so :func:`register` builds the C++ hooks (availability plus a pinned host
allocator; built once with the system C++ compiler by ``xla_cache.native_build.build_library`` and
cached) and registers them instead. Without a compiler the Python hooks are registered (one
warning): pinned memory, and so DDP's static graph, then fail on tpu with torch's error.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "host_hooks.cc"
_loaded: list[ctypes.CDLL] = []


def _flags() -> tuple[str, ...]:
    root = Path(torch.__file__).parent
    lib = root / "lib"
    return ("-O2", "-std=c++20", "-shared", "-fPIC", "-w", f"-I{root / 'include'}",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-DTORCH_TPU_TORCH={torch.__version__}",
            f"-L{lib}", "-Wl,--no-as-needed", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}")


def register() -> bool:
    """Register the C++ hooks (True), or return False, having warned why, for the caller to
    register the Python ones. Call once, before any other PrivateUse1 hook is registered."""
    from xla_cache.native_build import NativeUnavailable, build_library

    try:
        library = ctypes.CDLL(str(build_library(SOURCE, "_torch_tpu_host_hooks", _flags(), ".so")),
                              mode=os.RTLD_LOCAL)
    except (NativeUnavailable, OSError) as error:
        warnings.warn(f"torch_tpu: no pinned host memory for the tpu device (the C++ hooks could not be built: "
                      f"{error}); pin_memory() and DDP(static_graph=True) on tpu will fail", RuntimeWarning,
                      stacklevel=2)
        return False
    library.torch_tpu_register_hooks()
    _loaded.append(library)  # the hooks live in the library: keep it loaded
    return True
