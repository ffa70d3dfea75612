"""``torch_tpu._internal.pallas.jax_op``: TorchTPU's way to make a JAX function a torch operator.

``jax_op(name, fn)`` registers ``fn`` (parameters annotated ``jax.Array`` for arrays and
``int``/``float``/``bool``/``str`` for static values, as TorchTPU takes them) as the torch op
``name`` through :func:`torch_tpu.ops.pallas.jax_op` and returns the op: called with tpu tensors it
runs ``fn`` on the device (eager or inside ``torch.compile(backend="tpu")``). Off TPU, Pallas
kernels in ``fn`` run in Pallas' TPU interpret mode; a SparseCore kernel, which interpret mode
cannot run, raises :class:`~torch_tpu.eager.fallback.KernelUnavailable`, on which eager
dispatch runs the calling op's CPU kernel (counted in ``torch_tpu.fallback_counts()``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from jax.experimental.pallas import tpu as pltpu

from torch_tpu.eager.fallback import KernelUnavailable
from torch_tpu.ops.pallas.op import jax_op as _register
from torch_tpu.ops.pallas.platform import interpret
from torch_tpu.runtime._jax import jax

__all__ = ["KernelUnavailable", "custom_jax_kernel", "get_default_pallas_mesh", "get_pallas_mesh", "jax_op"]

# jax-tpu-embedding / Pallas ask the device for its SparseCore layout first; off TPU that fails with this
_NO_TPU_INFO = "Unsupported TPU device kind"


def _torch_signature(fn: Callable[..., Any], name: str) -> inspect.Signature:
    signature = inspect.signature(fn, eval_str=True)
    params = []
    for p in signature.parameters.values():
        if p.annotation is jax.Array or p.annotation is torch.Tensor:
            p = p.replace(annotation=torch.Tensor)
        elif p.annotation is inspect.Parameter.empty:
            raise TypeError(f"jax_op {name}: annotate parameter {p.name!r} (jax.Array or int/float/bool/str)")
        params.append(p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD))
    returns = signature.return_annotation
    if returns is jax.Array:
        returns = torch.Tensor
    return inspect.Signature(params, return_annotation=returns)


def _on_this_platform(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` traced as this platform runs Pallas kernels: interpret mode (32-bit, as Mosaic) off TPU."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not interpret():
            return fn(*args, **kwargs)
        try:
            with pltpu.force_tpu_interpret_mode(), jax.enable_x64(False):
                return fn(*args, **kwargs)
        except ValueError as e:
            if _NO_TPU_INFO not in str(e):
                raise
            raise KernelUnavailable(f"{name}: its Pallas kernel needs a TPU's SparseCores, which Pallas interpret "
                                    f"mode on {jax.default_backend()} cannot run ({e})") from e

    return run


def _registered(name: str, fn: Callable[..., Any], mesh: Any) -> Callable[..., Any]:
    if "::" not in name or len(name.split("::")) != 2:
        raise ValueError(f"jax_op: op name {name!r} must be 'namespace::op' (exactly one '::')")
    wrapped = _on_this_platform(fn, name)
    wrapped.__signature__ = _torch_signature(fn, name)
    return _register(name, wrapped)


def jax_op(name: str, fn: Callable[..., Any] | None = None, /, *, donate_argnums: Sequence[int] | None = None,
           mesh: Any = None, input_partition_specs: Any = None, output_partition_specs: Any = None) -> Any:
    """Register ``fn`` as the torch op ``name`` ("namespace::op") and return the op (module
    docstring); without ``fn``, a decorator doing so. ``donate_argnums`` is accepted for
    TorchTPU's signature; inputs are not donated. Each process drives one device, so ``fn`` runs
    on this rank's tensors: ``mesh`` and the partition specs (TorchTPU's SPMD view of a kernel
    over several devices) are accepted, and a kernel that communicates over the mesh's axes is not
    supported."""
    if fn is None:
        return lambda f: _registered(name, f, mesh)
    return _registered(name, fn, mesh)


def custom_jax_kernel(jax_fn: Callable[..., Any] | None = None, name: str | None = None,
                      static_argnums: Sequence[int] = [], donate_argnums: Sequence[int] | None = None,  # noqa: B006
                      input_output_aliases: dict[int, int] | None = None, mesh: Any = None,
                      input_partition_specs: Any = None, output_partition_specs: Any = None, *,
                      static_argnames: Sequence[str] = [], warn_deprecated: bool = True) -> Any:  # noqa: B006
    """TorchTPU's older form of :func:`jax_op` (deprecated there): ``jax_fn`` as the op ``name``
    (default ``custom_jax_kernel::<function name>``); as a decorator without ``jax_fn``. Static
    arguments are the parameters annotated int/float/bool/str (``static_argnums`` /
    ``static_argnames`` must name only those); ``input_output_aliases`` are accepted (no donation)."""
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        params = list(inspect.signature(fn, eval_str=True).parameters.values())
        static = {params[i].name for i in static_argnums} | set(static_argnames)
        arrays = sorted(p.name for p in params if p.name in static and p.annotation in (jax.Array, torch.Tensor))
        if arrays:
            raise ValueError(f"custom_jax_kernel: {arrays} are annotated as arrays but named static")
        return _registered(name or f"custom_jax_kernel::{fn.__name__}", fn, mesh)

    return register if jax_fn is None else register(jax_fn)


def get_pallas_mesh(axis_names: Sequence[str] | str, mesh_shape: Sequence[int] | None = None,
                    process_group: Any = None) -> jax.sharding.Mesh:
    """A ``jax.sharding.Mesh`` whose position i is the device of rank i of ``process_group``
    (default: the world; one process: this device). ``mesh_shape`` defaults to one axis over
    every rank and is required for several axes; its product is the group's size."""
    import numpy as np
    import torch.distributed as dist

    names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    ranks = (dist.get_process_group_ranks(process_group or dist.group.WORLD) if dist.is_initialized()
             else [0])
    shape = tuple(mesh_shape) if mesh_shape is not None else None
    if shape is None:
        if len(names) != 1:
            raise ValueError(f"get_pallas_mesh: mesh_shape is required for {len(names)} axes {names}")
        shape = (len(ranks),)
    if len(shape) != len(names) or int(np.prod(shape)) != len(ranks):
        raise ValueError(f"get_pallas_mesh: mesh_shape {shape} must have one size per axis {names} and "
                         f"{len(ranks)} devices in all (the group's ranks)")
    every = jax.devices()
    devices = [every[r] for r in ranks] if len(every) > max(ranks) else jax.local_devices()[:len(ranks)]
    if len(devices) != len(ranks):
        raise RuntimeError(f"get_pallas_mesh: the group's {len(ranks)} ranks' devices are not all visible to "
                           "this process (start JAX's distributed runtime: the XLA transport)")
    return jax.sharding.Mesh(np.array(devices, dtype=object).reshape(shape), names)


def get_default_pallas_mesh(process_group: Any = None) -> jax.sharding.Mesh:
    """A one-axis mesh ("x") over every rank of ``process_group``."""
    return get_pallas_mesh("x", process_group=process_group)
