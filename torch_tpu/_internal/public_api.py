"""TorchTPU 0.2.0's public module tree on this project: ``torch.tpu`` and its submodules.

``torch.tpu`` is ``torch_tpu.runtime.device`` (the device module); :func:`install` (called once by
``import torch_tpu``) adds TorchTPU's names that live in other rooms and its submodules, each a
real module in ``sys.modules`` (``import torch.tpu.ops`` and ``from torch.tpu.optimizers import
AdamW`` work):

* ``torch.tpu``: ``EagerMode``, ``topology_aware_mesh`` (TorchTPU's deprecated alias of
  ``torch.tpu.distributed``'s), ``set_eager_mode(mode)`` (a context manager, TorchTPU's form) and
  the ``eager_mode`` property (the process-wide mode, readable and settable) over
  ``torch_tpu.eager.modes``; the ``allow_excess_precision`` property
  (``torch_tpu.runtime.compiler_options``); ``default_generators``;
* ``torch.tpu.ops``: ``torch_tpu._internal.tpu_namespace``;
* ``torch.tpu.compiler``: ``custom_compiler_options``;
* ``torch.tpu.distributed``: ``topology_aware_mesh`` (TorchTPU's signature), ``spmd_safe``,
  ``set_tpu_launch_env`` and the ``window_num_stripes`` / ``window_stripe_chunk_mb`` properties
  (``torch_tpu._internal.tpu_distributed``);
* ``torch.tpu.optimizers``: ``AdamW``, ``Muon``, ``Sgd``, ``Optimizer``, ``SingleTraceTrainer``
  (``torch_tpu.compile.step``);
* ``torch.tpu.pallas``: ``jax_op``, ``get_pallas_mesh`` (``torch_tpu._internal.pallas``);
* ``torch.tpu.profiler``: ``TpuProfilerConfig``.

docs/TORCHTPU_API.md says which names are full implementations and which are XLA stand-ins.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

import torch

from torch_tpu._internal import tpu_distributed, tpu_namespace
from torch_tpu.eager import modes
from torch_tpu.runtime import compiler_options, device, profiler


class _TorchTpuModule(types.ModuleType):
    """``torch.tpu``'s module type: its settable properties."""

    @property
    def eager_mode(self) -> modes.EagerMode:
        """The process-wide eager mode (``torch.tpu.eager_mode = torch.tpu.EagerMode.DEFER_AND_FUSE``)."""
        return modes.get_eager_mode()

    @eager_mode.setter
    def eager_mode(self, value: modes.EagerMode | str) -> None:
        modes.set_eager_mode(value)

    @property
    def allow_excess_precision(self) -> bool:
        """Whether XLA may compute in more precision than the types say (compiled programs)."""
        return compiler_options.allow_excess_precision()

    @allow_excess_precision.setter
    def allow_excess_precision(self, value: bool) -> None:
        compiler_options.set_allow_excess_precision(value)

    @property
    def default_generators(self) -> tuple[torch.Generator, ...]:
        """The device's default generator (one device per process), as ``torch.cuda.default_generators``."""
        return device.get_default_generators()


def _window_property(name: str) -> property:
    """A collective window setting of ``torch.tpu.distributed`` (``tpu_distributed``), readable and settable."""
    return property(lambda self: tpu_distributed.window_setting(name),
                    lambda self, value: tpu_distributed.set_window_setting(name, value),
                    doc=f"TorchTPU's ``{name}`` (validated and kept; changes no transfer here).")


class _DistributedModule(types.ModuleType):
    """``torch.tpu.distributed``'s module type: the window settings as properties."""

    window_num_stripes = _window_property("window_num_stripes")
    window_stripe_chunk_mb = _window_property("window_stripe_chunk_mb")


class _LazyModule(types.ModuleType):
    """A submodule whose names (``"module:attribute"`` targets) are imported on first use:
    ``torch_tpu.compile`` and Pallas are not imported by ``import torch_tpu``."""

    def __getattr__(self, name: str) -> Any:
        target = self.__dict__.get("_targets", {}).get(name)
        if target is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        module, _, attr = target.partition(":")
        value = getattr(importlib.import_module(module), attr)
        setattr(self, name, value)
        return value

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self.__dict__.get("_targets", {})})


_OPTIMIZERS = "torch_tpu.compile.step.functional_optimizers"
_LAZY: dict[str, dict[str, str]] = {
    "optimizers": {"AdamW": f"{_OPTIMIZERS}:AdamW", "Muon": f"{_OPTIMIZERS}:Muon",
                   "Optimizer": f"{_OPTIMIZERS}:Optimizer", "Sgd": f"{_OPTIMIZERS}:Sgd",
                   "SingleTraceTrainer": "torch_tpu.compile.step.single_trace:SingleTraceTrainer"},
    "pallas": {"get_pallas_mesh": "torch_tpu._internal.pallas:get_pallas_mesh",
               "jax_op": "torch_tpu._internal.pallas:jax_op"},
}
_SUBMODULES: dict[str, tuple[type[types.ModuleType], dict[str, Any]]] = {
    "compiler": (types.ModuleType, {"custom_compiler_options": compiler_options.custom_compiler_options}),
    "distributed": (_DistributedModule, {"set_tpu_launch_env": tpu_distributed.set_tpu_launch_env,
                                         "spmd_safe": tpu_distributed.spmd_safe,
                                         "topology_aware_mesh": tpu_distributed.topology_aware_mesh}),
    "profiler": (types.ModuleType, {"TpuProfilerConfig": profiler.TpuProfilerConfig}),
}


def install() -> None:
    """Add TorchTPU's names and submodules to ``torch.tpu`` (idempotent)."""
    tpu = sys.modules[device.__name__]
    if type(tpu) is _TorchTpuModule:
        return
    tpu.__class__ = _TorchTpuModule
    tpu.EagerMode = modes.EagerMode
    tpu.topology_aware_mesh = tpu_distributed.topology_aware_mesh  # TorchTPU's deprecated alias
    tpu.set_eager_mode = modes.eager_mode  # TorchTPU's set_eager_mode(mode) is a context manager
    tpu.ops = sys.modules["torch.tpu.ops"] = tpu_namespace
    submodules = {**_SUBMODULES, **{name: (_LazyModule, {"_targets": targets}) for name, targets in _LAZY.items()}}
    for name, (kind, names) in submodules.items():
        module = kind(f"torch.tpu.{name}", f"TorchTPU's torch.tpu.{name} (torch_tpu._internal.public_api).")
        module.__dict__.update(names)
        module.__all__ = sorted(names.get("_targets", names))
        sys.modules[module.__name__] = module
        setattr(tpu, name, module)
