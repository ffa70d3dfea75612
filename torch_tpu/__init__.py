"""torch_tpu: ``torch.device("tpu")`` as a real PyTorch device over JAX/PJRT.

``import torch_tpu`` registers the "tpu" PrivateUse1 backend and the ``torch.tpu`` module. Tensors
on it are :class:`TpuTensor` wrappers whose elements live in JAX arrays on the default JAX backend.
"""

from torch_tpu import device as _device

_device.register()

import xla_cache as _xla_cache  # noqa: E402

_xla_cache.install()  # the shared persistent compile cache, on by default

from torch_tpu import attention as _attention  # noqa: E402,F401  (SDPA overrideable composites)
from torch_tpu import autocast as _autocast  # noqa: E402
from torch_tpu import dispatch as _dispatch  # noqa: E402
from torch_tpu import kernels as _kernels  # noqa: E402,F401
from torch_tpu import lowerings as _lowerings  # noqa: E402,F401  (fills the registry)
from torch_tpu import module_conversion as _module_conversion  # noqa: E402
from torch_tpu import serialization as _serialization  # noqa: E402
from torch_tpu import sparse as _sparse  # noqa: E402
from torch_tpu import storage as _storage  # noqa: E402
from torch_tpu import transformer as _transformer  # noqa: E402,F401  (fast-path composites)

_serialization.register()  # torch.load(map_location="tpu")
_storage.register()  # storage.tpu()
_autocast.register()  # torch.autocast("tpu")
_module_conversion.install()  # Module.to("tpu") keeps Parameter objects (weight ties)
_sparse.register()  # sparse COO tensors on tpu (sparse embedding gradients)
from torch_tpu.fallback import (  # noqa: E402
    TpuFallbackError,
    decomposed_counts,
    fallback_allowed,
    fallback_counts,
    lowered_counts,
    metrics_report,
    no_fallback,
    reset_metrics,
    set_fallback_allowed,
)
from torch_tpu.modes import EagerMode, eager_mode, get_eager_mode, register_executor, set_eager_mode  # noqa: E402
from torch_tpu.registry import Lowering, get_lowering, lowered_ops, register_lowering  # noqa: E402
from torch_tpu.tensor import TpuTensor, from_jax, to_jax  # noqa: E402

clear_handler_cache = _dispatch.clear_handler_cache

__all__ = [
    "EagerMode",
    "Lowering",
    "TpuFallbackError",
    "TpuTensor",
    "clear_handler_cache",
    "decomposed_counts",
    "eager_mode",
    "fallback_allowed",
    "fallback_counts",
    "from_jax",
    "get_eager_mode",
    "get_lowering",
    "lowered_counts",
    "lowered_ops",
    "metrics_report",
    "no_fallback",
    "register_executor",
    "register_lowering",
    "reset_metrics",
    "set_eager_mode",
    "set_fallback_allowed",
    "to_jax",
]
