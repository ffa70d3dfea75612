"""Bounded dynamic shapes: pad a batch-like dimension to a few bucket sizes so compiles are bounded.

Sizes up to ``limit`` round up to the next power of two (at least ``minimum``); larger sizes round
up to a multiple of ``multiple`` (default: ``limit``). :func:`bucketed` pads every tensor argument
whose ``dim`` has the batch size, passes a boolean ``valid`` mask (True for real rows) when the
function takes one, and slices padded outputs back, so row-wise results are exact; reductions
over the batch must use ``valid`` (e.g. ``(loss * valid).sum() / valid.sum()``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from tpu_facts.sizes import power_of_two_bucket


@dataclasses.dataclass(frozen=True)
class BucketPolicy:
    limit: int = 1024
    multiple: int | None = None
    minimum: int = 1

    def __post_init__(self) -> None:
        if self.limit < 1 or self.limit & (self.limit - 1):
            raise ValueError(f"BucketPolicy.limit must be a power of two >= 1, got {self.limit}")
        if self.multiple is not None and self.multiple < 1:
            raise ValueError(f"BucketPolicy.multiple must be >= 1, got {self.multiple}")

    def bucket(self, size: int) -> int:
        """The padded size for a dimension of ``size`` elements."""
        if size < 0:
            raise ValueError(f"cannot bucket a negative size {size}")
        if size <= self.limit:
            return power_of_two_bucket(size, self.minimum)
        step = self.multiple or self.limit
        return -(-size // step) * step


@dataclasses.dataclass
class BucketStats:
    calls: int = 0
    buckets: set[int] = dataclasses.field(default_factory=set)  # distinct padded sizes seen


def pad_dim(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``t`` with dimension ``dim`` zero-padded at the end to ``size``."""
    missing = size - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


class BucketedFunction:
    """``fn`` called on inputs padded to their bucket; see the module docstring."""

    def __init__(self, fn: Callable[..., Any], policy: BucketPolicy, dim: int) -> None:
        self.fn = fn
        self.policy = policy
        self.dim = dim
        self.stats = BucketStats()
        target = fn.forward if isinstance(fn, torch.nn.Module) else fn
        try:
            self._takes_valid = "valid" in inspect.signature(target).parameters
        except (TypeError, ValueError):
            self._takes_valid = False
        functools.update_wrapper(self, target, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.dim() > self.dim]
        if not tensors:
            raise ValueError(f"bucketed: no tensor argument has a dimension {self.dim} to pad")
        size = tensors[0].shape[self.dim]
        padded = self.policy.bucket(size)
        self.stats.calls += 1
        self.stats.buckets.add(padded)

        def pad(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.dim() > self.dim and x.shape[self.dim] == size:
                return pad_dim(x, self.dim, padded)
            return x

        args, kwargs = pytree.tree_map(pad, (args, kwargs))
        if self._takes_valid:
            kwargs["valid"] = torch.arange(padded, device=tensors[0].device) < size
        out = self.fn(*args, **kwargs)

        def unpad(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.dim() > self.dim and x.shape[self.dim] == padded:
                return x.narrow(self.dim, 0, size)
            return x

        return pytree.tree_map(unpad, out)


def bucketed(fn: Callable[..., Any], policy: BucketPolicy | None = None, dim: int = 0) -> BucketedFunction:
    """Wrap ``fn`` (e.g. a ``torch.compile``'d model) so dimension ``dim`` is padded to buckets."""
    return BucketedFunction(fn, policy or BucketPolicy(), dim)
