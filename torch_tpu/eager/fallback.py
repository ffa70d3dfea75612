"""CPU fallback for ops without a lowering, with per-op counters and a metrics report.

Mutated arguments are copied back to their tpu tensors: those the schema marks ``Tensor(a!)``,
and any other whose CPU copy the op changed (some kernels update inputs without an alias
annotation: ``native_batch_norm``'s running stats, custom ops with loose schemas); nothing else
is written, so unchanged tensors keep their value and storage.

Like PyTorch/XLA's ``aten::`` counters: every op that falls back is counted; lowered ops and ops
run as decompositions (``torch_tpu.ops.decompositions``) are counted too, so a report shows the three
tiers of a workload. ``set_fallback_allowed(False)`` (or
``TORCH_TPU_NO_FALLBACK=1``, or the ``no_fallback()`` context) turns fallback into an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from torch_tpu.runtime._jax import jax
from torch_tpu.runtime.tensor import DEVICE, TpuTensor, array_to_cpu, cpu_to_jax, from_cpu, resize, to_jax, write
from tpu_facts import knobs

_fallback_counts: Counter[str] = Counter()
LOWERED_COUNTS: Counter[str] = Counter()
_decomposed_counts: Counter[str] = Counter()
_allowed = [not knobs.NO_FALLBACK.on()]


class KernelUnavailable(RuntimeError):
    """A kernel this platform cannot run (a Pallas SparseCore kernel off TPU: JAX's Pallas interpret
    mode has no SparseCore). Eager dispatch then runs the calling op's CPU kernel, counted here."""


class TpuFallbackError(RuntimeError):
    """An op without a TPU lowering ran while CPU fallback is disabled."""


def set_fallback_allowed(allowed: bool) -> None:
    """Allow (default) or forbid running unlowered ops on CPU."""
    _allowed[0] = bool(allowed)


def fallback_allowed() -> bool:
    return _allowed[0]


@contextlib.contextmanager
def no_fallback() -> Iterator[None]:
    """Within the block, an unlowered op raises TpuFallbackError instead of running on CPU."""
    previous = _allowed[0]
    _allowed[0] = False
    try:
        yield
    finally:
        _allowed[0] = previous


def count_lowered(op: Any) -> None:
    LOWERED_COUNTS[op.__name__] += 1


def count_decomposed(op: Any) -> None:
    _decomposed_counts[op.__name__] += 1


def fallback_counts() -> dict[str, int]:
    """Op name -> number of times it ran through the CPU fallback."""
    return dict(_fallback_counts)


def lowered_counts() -> dict[str, int]:
    """Op name -> number of times it ran through its JAX lowering."""
    return dict(LOWERED_COUNTS)


def decomposed_counts() -> dict[str, int]:
    """Op name -> number of times it ran as its decomposition into other tpu ops."""
    return dict(_decomposed_counts)


def reset_metrics() -> None:
    _fallback_counts.clear()
    LOWERED_COUNTS.clear()
    _decomposed_counts.clear()


def metrics_report() -> str:
    """Human-readable counters of the three tiers (CPU fallback, decomposed, lowered), most
    frequent first. A decomposed op's constituent ops are counted in their own tiers too."""
    lines = [f"torch_tpu metrics: {sum(LOWERED_COUNTS.values())} lowered op calls "
             f"({len(LOWERED_COUNTS)} ops), {sum(_decomposed_counts.values())} decomposed op calls "
             f"({len(_decomposed_counts)} ops), {sum(_fallback_counts.values())} CPU fallbacks "
             f"({len(_fallback_counts)} ops)"]
    for title, counter in (("CPU fallback", _fallback_counts), ("decomposed", _decomposed_counts),
                           ("lowered", LOWERED_COUNTS)):
        lines.append(f"{title}:")
        lines.extend(f"  {name}: {n}" for name, n in counter.most_common())
    return "\n".join(lines)


def run_on_cpu(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` on CPU copies of the tpu arguments; write back mutated ones; move outputs back."""
    if not _allowed[0]:
        raise TpuFallbackError(
            f"{func} has no TPU lowering and CPU fallback is disabled "
            "(torch_tpu.set_fallback_allowed(True) or unset TORCH_TPU_NO_FALLBACK to allow it)"
        )
    _fallback_counts[func.__name__] += 1
    originals: dict[int, torch.Tensor] = {}
    copies: list[_HostCopy] = []
    sparse_copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (CPU copy, sparse tpu tensor)
    out_targets = {id(t) for t in pytree.tree_leaves(_out_args(func, kwargs)) if isinstance(t, TpuTensor)}

    def to_host(x: Any) -> Any:
        if isinstance(x, TpuTensor):
            value = to_jax(x)
            c = array_to_cpu(value)
            if id(x) in out_targets:
                c = c.clone()  # a storage the CPU kernel may resize, as out= tensors are
            originals[id(c)] = x
            copies.append(_HostCopy(c, x, value, _version(c)))
            return c
        if isinstance(x, torch.Tensor) and x.is_sparse and x.device == DEVICE:
            c = x.cpu()
            originals[id(c)] = x
            sparse_copies.append((c, x))
            return c
        return x

    cpu_args, cpu_kwargs = pytree.tree_map(to_host, (args, kwargs))
    out = func(*cpu_args, **cpu_kwargs)
    if func.namespace == "_c10d_functional":
        # The host result of a functional collective is filled asynchronously; it must be complete
        # before it is copied to the device (a later wait_tensor on the tpu copy is then a no-op).
        out = pytree.tree_map_only(torch.Tensor, torch.ops._c10d_functional.wait_tensor, out)
    annotated = {id(v) for v in pytree.tree_leaves(_mutated_args(func, cpu_args, cpu_kwargs))}
    for copy in copies:
        if id(copy.cpu) not in annotated and not copy.changed():
            continue
        if tuple(copy.cpu.shape) != tuple(copy.target.shape) and id(copy.target) in out_targets:
            resize(copy.target, tuple(copy.cpu.shape))  # CPU already warned if it had elements
        elif tuple(copy.cpu.shape) != tuple(copy.target.shape):
            raise RuntimeError(
                f"{func}: CPU fallback resized a tpu tensor from {list(copy.target.shape)} to "
                f"{list(copy.cpu.shape)}; resizing tpu tensors in place is not supported"
            )
        write(copy.target, cpu_to_jax(copy.cpu))
    for c, target in sparse_copies:
        if id(c) in annotated:
            torch.ops.aten.copy_sparse_to_sparse_(target, c.to(DEVICE))

    def to_device(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            original = originals.get(id(x))
            if original is not None:
                return original
            return x.to(DEVICE) if x.is_sparse else from_cpu(x)
        return x

    return pytree.tree_map(to_device, out)


@dataclasses.dataclass
class _HostCopy:
    """The CPU copy of one tpu argument, with the value and version it started from."""

    cpu: torch.Tensor
    target: TpuTensor
    before: jax.Array
    version: int | None

    def changed(self) -> bool:
        """Whether the op wrote into the copy: its version counter moved (an annotated in-place
        kernel) or its bytes differ (kernels that write inputs without telling autograd, such as
        ``native_batch_norm`` updating ``running_mean``/``running_var``)."""
        cpu = self.cpu
        if _version(cpu) != self.version or tuple(cpu.shape) != self.before.shape or not cpu.is_contiguous():
            return True
        after = cpu.reshape(-1).view(torch.uint8).numpy()
        return not np.array_equal(np.asarray(self.before).reshape(-1).view(np.uint8), after)


def _version(t: torch.Tensor) -> int | None:
    """The tensor's version counter; None for inference tensors (they have none)."""
    return None if t.is_inference() else t._version


def _out_args(func: Any, kwargs: dict) -> list[Any]:
    """The out= arguments of ``func`` (keyword-only arguments it writes) given in ``kwargs``."""
    return [kwargs[a.name] for a in func._schema.arguments
            if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write and a.name in kwargs]


def _mutated_args(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    mutated = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        if arg.name in kwargs:
            mutated.append(kwargs[arg.name])
        elif i < len(args) and not arg.kwarg_only:
            mutated.append(args[i])
    return mutated
