"""Lowerings torch.compile graphs need that the core registry lacks (candidates to move there).

* ``aten.copy``: the functional copy AOTAutograd emits for in-place updates (``param.copy_``).
* ``prims.fma``: fused multiply-add that core-ATen decompositions emit (``a * b + c``).
* ``aten._to_copy`` / ``aten.lift_fresh_copy``: dtype casts and constants lifted into graphs
  (inside one program every value is on the device, so ``device=`` is ignored; eager dispatch
  keeps its dedicated ``_to_copy`` handler).
* ``aten._foreach_pow.ScalarAndTensor``: ``beta ** steps`` of the capturable Adam/AdamW update.
"""

from __future__ import annotations

import torch
import torch._inductor.inductor_prims  # noqa: F401  (defines prims.fma)

from torch_tpu._jax import jnp
from torch_tpu.dispatch import clear_handler_cache
from torch_tpu.lowerings import elementwise as ew
from torch_tpu.lowerings._common import jdtype, promoted
from torch_tpu.registry import get_lowering, register_lowering

aten = torch.ops.aten
prims = torch.ops.prims


def _copy(self, src, non_blocking=False):
    return jnp.broadcast_to(src.astype(self.dtype), self.shape)


def _fma(a, b, c):
    a, b, c = promoted(a, b, c)
    return a * b + c


def _to_copy(self, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    return self.astype(jdtype(dtype, self.dtype))


def _lift_fresh_copy(self):
    return self  # JAX arrays are immutable: sharing is a copy


def _foreach_pow_scalar_and_tensor(self, exponent):
    return [ew.pow(self, e) for e in exponent]


_EXTRA = (
    (aten._foreach_pow.ScalarAndTensor, _foreach_pow_scalar_and_tensor),
    (aten.copy.default, _copy),
    (prims.fma.default, _fma),
    (aten._to_copy.default, _to_copy),
    (aten.lift_fresh_copy.default, _lift_fresh_copy),
)
for _op, _fn in _EXTRA:
    if get_lowering(_op) is None:  # the core may add it later; theirs wins
        register_lowering(_op)(_fn)

clear_handler_cache()  # eager dispatch decided per-op handlers before these existed
