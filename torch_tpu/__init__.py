"""torch_tpu: ``torch.device("tpu")`` as a real PyTorch device over JAX/PJRT.

``import torch_tpu`` registers the "tpu" PrivateUse1 backend and the ``torch.tpu`` module. Tensors
on it are :class:`TpuTensor` wrappers whose elements live in JAX arrays on the default JAX backend.

The package is built of rooms (docs/architecture/torch_tpu.md, "The rooms"): ``runtime`` (device and
tensor model), ``ops`` (the op registry: lowerings and composites, torch.library kernels, Pallas),
``eager`` (dispatch, executors, fallback), ``compile`` (graph capture, ``train_step``) and
``distributed``. Every registration happens here, once, through the rooms' ``register()``
functions: importing any submodule later changes nothing by itself. ``_internal`` is TorchTPU's
face, every TorchTPU name (``torch.tpu``'s, its ``tpu::`` ops, ``torch_tpu._internal.pallas``), over
the rooms and never imported by them.
"""

import xla_cache as _xla_cache
from torch_tpu import runtime as _runtime
from tpu_facts import knobs as _knobs

try:
    _knobs.check_set("torch_tpu")  # every numeric knob set, against its range
    _runtime.register()  # the device, torch.tpu, tensor hooks, storage, serialization, autocast, Module.to
    _xla_cache.install()  # the shared persistent compile cache, on by default
    from torch_tpu import eager as _eager  # (reads its knobs: TORCH_TPU_OP_JIT_MAX, ...)
    from torch_tpu import ops as _ops

    _ops.register()  # every lowering and composite into the registry; the PrivateUse1 kernels
    _eager.register()  # __torch_dispatch__ -> eager dispatch; the strict/debug/defer_and_fuse executors
except (_xla_cache.ConfigError, _knobs.KnobError) as _error:  # a bad knob: one line, as the CLI's flags
    import sys as _sys

    print(f"torch_tpu: error: {_error}", file=_sys.stderr)
    raise SystemExit(2) from None

from torch_tpu import _internal  # noqa: E402
from torch_tpu import distributed as _distributed  # noqa: E402, F401  (tpu_dist: TorchTPU's import registers it)

_internal.install()  # TorchTPU's face: its tpu:: ops and aliases, torch.tpu's names, the import hook

from torch_tpu.eager.dispatch import clear_handler_cache  # noqa: E402
from torch_tpu.eager.fallback import (  # noqa: E402
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
from torch_tpu.eager.modes import (  # noqa: E402
    EagerMode,
    eager_mode,
    get_eager_mode,
    register_executor,
    set_eager_mode,
)
from torch_tpu.ops.registry import (  # noqa: E402
    Lowering,
    get_composite,
    get_lowering,
    lowered_ops,
    register_composite,
    register_lowering,
)
from torch_tpu.runtime.tensor import TpuTensor, from_jax, to_jax  # noqa: E402

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
    "get_composite",
    "get_eager_mode",
    "get_lowering",
    "lowered_counts",
    "lowered_ops",
    "metrics_report",
    "no_fallback",
    "register_composite",
    "register_executor",
    "register_lowering",
    "reset_metrics",
    "set_eager_mode",
    "set_fallback_allowed",
    "to_jax",
]
