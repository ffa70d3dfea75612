"""c10d collectives (``dist.all_reduce``, ``broadcast``, ``send`` ...) on tpu tensors in eager dispatch.

A ``tpu_dist`` group (a ``ProcessGroupTPU``) takes these calls itself and never gets here. A
group of another backend (plain ``gloo``) hands them to the dispatcher as ``c10d::<op>`` ops,
which reach ``TpuTensor.__torch_dispatch__`` first. The CPU fallback would run them on host
copies and drop the copies before the (asynchronous) collective wrote them: every rank would keep
its own values, silently. Instead they go on to the op's PrivateUse1 kernel, as a C++ backend's
tensors would: it calls the group's backend for tpu tensors, and a group without one gets an
error naming ``tpu_dist``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_PRIVATEUSE1 = torch._C.DispatchKey.PrivateUse1


def is_collective(func: Any) -> bool:
    """Whether ``func`` is a c10d op that calls a process group's backend for its tensors' device."""
    return (isinstance(func, torch._ops.OpOverload) and func.namespace == "c10d"
            and func.has_kernel_for_dispatch_key(_PRIVATEUSE1))


def run_collective(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run the c10d op ``func`` on tpu tensors through its group's tpu backend, or raise naming tpu_dist."""
    group = _process_group(func, args, kwargs)
    # a group implemented in Python (tpu_dist's own) registers no per-device backends: its kernel decides
    if group is not None and group._device_types and not any(d.type == "tpu" for d in group._device_types):
        devices = ", ".join(sorted(d.type for d in group._device_types))
        raise RuntimeError(
            f"{func._schema.name} on tpu tensors: process group {group.group_name!r} "
            f"({group._get_backend_name()}, for {devices} tensors) has no backend for tpu tensors; "
            "create it with the tpu_dist backend (import torch_tpu.distributed, then "
            "dist.init_process_group('tpu_dist') or dist.new_group(backend='tpu_dist')), or move the tensors to cpu"
        )
    return func._op_dk(_PRIVATEUSE1, *args, **kwargs)


def _process_group(func: Any, args: tuple, kwargs: dict) -> dist.ProcessGroup | None:
    names = [a.name for a in func._schema.arguments]
    if "process_group" not in names:
        return None
    index = names.index("process_group")
    boxed = kwargs["process_group"] if "process_group" in kwargs else args[index]
    return dist.ProcessGroup.unbox(boxed)
