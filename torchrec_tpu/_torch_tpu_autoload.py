"""Entry point for PyTorch's device-backend autoload (the ``torch.backends`` entry-point group).

PyTorch calls every registered autoload hook at the end of ``import torch`` unless
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (``TORCH_TPU_AUTOLOAD=0`` turns this hook alone off). As
TorchTPU's entry point does, it makes the "tpu" device available, but lightly: it names PyTorch's
PrivateUse1 device "tpu" (when no one else renamed it) and leaves torch_tpu (jax, the device
runtime) unimported until the device is used: the first op on a tpu device (a PrivateUse1
fallback kernel), the first ``torch.tpu`` attribute or a graph with tpu inputs under
``torch.compile`` loads it. ``torch.compile`` with no backend sends graphs with tpu inputs to the
"tpu" backend, the others to PyTorch's default (Inductor). It lives outside the ``torch_tpu``
package because importing any ``torch_tpu`` submodule runs the package's registration.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import threading
import types
from pathlib import Path
from typing import Any

from tpu_facts import knobs

_device_type = "tpu"  # the device's name (PrivateUse1's), as torch_tpu names it
_lock = threading.RLock()  # re-entered: torch_tpu's registration hands over while load() imports it
_fallback: list[Any] = []  # the PrivateUse1 fallback's library until torch_tpu is loaded


def autoload() -> None:
    """The hook: "tpu" as PrivateUse1's name, ``torch.tpu`` and the device loading torch_tpu on first
    use, and ``torch.compile``'s default routing (nothing when turned off or PrivateUse1 is taken)."""
    import torch

    from torchrec_tpu import torchrun_exit

    torchrun_exit.install()  # torchrun running the CLI: a rank's one error line is the job's last word
    if not knobs.AUTOLOAD.on() or torch._C._get_privateuse1_backend_name() != "privateuseone":
        return
    torch.utils.rename_privateuse1_backend(_device_type)
    _register_hooks()  # torch's accelerator calls (dist.barrier's) ask the named device's hooks at once
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
    torch._register_device_module(_device_type, _LazyDeviceModule(f"torch.{_device_type}"))
    library = torch.library.Library("_", "IMPL")
    library.fallback(_load_and_run, "PrivateUse1")
    _fallback.append(library)
    torch.compile = _compile_with_default_routing(torch.compile)


def _register_hooks() -> None:
    """torch_tpu's device hooks and guard (``torch_tpu/runtime/host_hooks.py``), loaded alone: the
    package's import runs its whole registration (jax, the runtime). The module is entered under
    its own name, so torch_tpu finds it (and that the hooks are registered) when it loads."""
    name = "torch_tpu.runtime.host_hooks"
    if name not in sys.modules:
        package = importlib.util.find_spec("torch_tpu")  # finds, does not import
        path = Path(package.submodule_search_locations[0]) / "runtime" / "host_hooks.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    sys.modules[name].register()


class _LazyDeviceModule(types.ModuleType):
    """``torch.tpu`` until torch_tpu is loaded: any attribute loads it and is read from the real one."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(load(), name)

    def hand_over(self) -> None:
        """Called by torch_tpu's registration: drop this stand-in and the fallback kernel."""
        import torch

        with _lock:
            if _fallback:
                _fallback.pop()._destroy()
            if getattr(torch, _device_type, None) is self:
                delattr(torch, _device_type)
                sys.modules.pop(f"torch.{_device_type}", None)


def load() -> types.ModuleType:
    """Import torch_tpu (its registration replaces the stand-ins) and return the real ``torch.tpu``."""
    import torch

    with _lock:
        import torch_tpu  # noqa: F401
    return getattr(torch, _device_type)


def _load_and_run(op, *args, **kwargs):
    """The PrivateUse1 fallback: the first op on a tpu device loads torch_tpu, then runs again."""
    load()
    return op(*args, **kwargs)


def _compile_with_default_routing(compile_fn):
    @functools.wraps(compile_fn)
    def compile_(*args, **kwargs):
        if kwargs.get("backend") is None:
            kwargs["backend"] = default_backend
        return compile_fn(*args, **kwargs)

    return compile_


def default_backend(graph_module, example_inputs, **kwargs):
    """``torch.compile``'s backend when none is given: "tpu" for a graph with a tpu input (TorchTPU's
    rule), else PyTorch's default, Inductor."""
    import torch
    from torch._dynamo.backends.registry import lookup_backend
    from torch.utils import _pytree

    if any(isinstance(x, torch.Tensor) and x.device.type == _device_type for x in _pytree.tree_leaves(example_inputs)):
        return lookup_backend(_device_type)(graph_module, example_inputs, **kwargs)
    # torch.compile's own default: mode and options become Inductor's configuration
    inductor = torch._TorchCompileInductorWrapper(kwargs.get("mode"), kwargs.get("options"), None)
    return inductor(graph_module, example_inputs)
