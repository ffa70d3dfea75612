"""State-dict tensors made when read: a checkpoint streams the tables one at a time.

``model.state_dict()`` under :func:`deferred_tables` gives the sharded modules' local tables and
slots as :class:`DeferredTensor` s (shape and dtype only). torch.distributed.checkpoint asks each
for its value (``__get_tensor_shard__``) as it writes it, so with a file per item
(``FileSystemWriter(single_file_per_rank=False)``) a save holds one table's host copy at a time
instead of all of them beside the live tables. Anything else done to one makes its value first.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils._pytree import tree_map

from tpu_facts.switches import Switch

_DEFERRED = Switch("deferred_tables")


def deferred_tables() -> AbstractContextManager[None]:
    """Within: sharded modules' ``state_dict`` gives :class:`DeferredTensor` tables where it can."""
    return _DEFERRED.on()


def tables_deferred() -> bool:
    """Whether the caller is inside :func:`deferred_tables`."""
    return _DEFERRED.is_on()


class DeferredTensor(torch.Tensor):
    """A float32 host tensor of ``shape`` whose value ``make()`` returns when first read (not kept)."""

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], make: Callable[[], torch.Tensor]) -> DeferredTensor:
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32, device="cpu")

    def __init__(self, shape: tuple[int, ...], make: Callable[[], torch.Tensor]) -> None:
        self._make = make

    def value(self) -> torch.Tensor:
        """The tensor's value, made now (a new host tensor of its shape)."""
        value = self._make()
        if tuple(value.shape) != tuple(self.shape) or value.dtype != self.dtype:
            raise ValueError(f"deferred tensor of shape {tuple(self.shape)} made a {value.dtype} tensor of shape "
                             f"{tuple(value.shape)}")
        return value

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:  # what torch.distributed.checkpoint writes
        return self.value()

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"DeferredTensor(shape={tuple(self.shape)})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten.is_pinned.default:
            return False
        if func is torch.ops.aten.detach.default:
            return args[0]
        made = tree_map(lambda x: x.value() if isinstance(x, DeferredTensor) else x, (args, kwargs or {}))
        return func(*made[0], **made[1])
