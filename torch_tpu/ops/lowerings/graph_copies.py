"""Lowerings of the functional copies, casts and fused forms that torch.compile graphs carry.

* ``aten.copy``: the functional copy AOTAutograd emits for in-place updates (``param.copy_``).
* ``prims.fma``: fused multiply-add that core-ATen decompositions emit (``a * b + c``); registered
  by name: ``torch._inductor.inductor_prims`` defines the op (and loading it loads Dynamo).
* ``aten._to_copy`` / ``aten.lift_fresh_copy``: dtype casts and constants lifted into graphs
  (inside one program every value is on the device, so ``device=`` is ignored). ``graph_only``:
  eager dispatch keeps its dedicated handlers for both (devices, memory formats).
* ``prims.convert_element_type``: the cast PyTorch's scalar tensorification puts into graphs with
  symbolic sizes.
* ``aten._foreach_pow.ScalarAndTensor``: ``beta ** steps`` of the capturable Adam/AdamW update.
"""

from __future__ import annotations

import torch

import torch_tpu.ops.lowerings.elementwise as ew
from torch_tpu.ops.lowerings._common import jdtype, promoted
from torch_tpu.ops.registry import register_lowering
from torch_tpu.runtime._jax import jnp

aten = torch.ops.aten


@register_lowering(aten.copy.default)
def _copy(self, src, non_blocking=False):
    return jnp.broadcast_to(src.astype(self.dtype), self.shape)


@register_lowering("prims::fma.default")
def _fma(a, b, c):
    a, b, c = promoted(a, b, c)
    return a * b + c


@register_lowering(aten._to_copy.default, graph_only=True)
def _to_copy(self, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    return self.astype(jdtype(dtype, self.dtype))


@register_lowering(torch.ops.prims.convert_element_type.default, graph_only=True)
def _convert_element_type(a, dtype):
    return a.astype(jdtype(dtype, a.dtype))  # tensorified size arithmetic (``2.0 / batch``) casts with it


@register_lowering(aten.lift_fresh_copy.default, graph_only=True)
def _lift_fresh_copy(self):
    return self  # JAX arrays are immutable: sharing is a copy


@register_lowering(aten._foreach_pow.ScalarAndTensor)
def _foreach_pow_scalar_and_tensor(self, exponent):
    return [ew.pow(self, e) for e in exponent]
