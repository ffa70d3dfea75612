"""``_foreach_*`` lowerings, generated from the per-tensor lowerings (one list entry at a time).

List arguments (``Tensor[]``, ``Scalar[]``) are zipped; a single scalar or tensor is broadcast to
every entry, except the ``scalars`` tensor of ``addcmul/addcdiv.Tensor``, indexed per entry.
"""

from __future__ import annotations

import torch

import torch_tpu.ops.lowerings.elementwise as ew
import torch_tpu.ops.lowerings.reductions as reductions
from torch_tpu.ops.lowerings._common import cast
from torch_tpu.ops.registry import get_lowering, register_lowering

aten = torch.ops.aten


def _foreach(fn, per_entry_tensor: bool = False):
    def lowering(*args, **kwargs):
        n = len(args[0])

        def pick(a, i):
            if isinstance(a, (list, tuple)):
                return a[i]
            if per_entry_tensor and hasattr(a, "ndim") and a.ndim == 1:
                return a[i]
            return a

        return [fn(*(pick(a, i) for a in args), **kwargs) for i in range(n)]

    return lowering


def _registered(name):
    return get_lowering(getattr(aten, name).default).fn


def _register(packet_name, fn, per_entry_tensor=False):
    packet = getattr(aten, packet_name)
    for overload in packet.overloads():
        if overload.endswith("out") or overload == "ScalarAndTensor":
            continue
        register_lowering(getattr(packet, overload))(_foreach(fn, per_entry_tensor))


for _name, _fn in [("add", ew.add), ("sub", ew.sub), ("mul", ew.mul), ("div", ew.div), ("pow", ew.pow),
                   ("clamp_min", ew.clamp_min), ("clamp_max", ew.clamp_max), ("lerp", ew.lerp)]:
    _register(f"_foreach_{_name}", _fn)
for _name in ("maximum", "minimum"):
    _register(f"_foreach_{_name}", _registered(_name))
_register("_foreach_addcmul", ew.addcmul, per_entry_tensor=True)
_register("_foreach_addcdiv", ew.addcdiv, per_entry_tensor=True)
for _name in ("sqrt", "rsqrt", "exp", "log", "neg", "abs", "sign", "reciprocal", "sigmoid", "tanh",
              "floor", "ceil", "trunc", "round", "frac", "log1p", "expm1", "sin", "cos", "zero"):
    _register(f"_foreach_{_name}", _registered(_name))
_register("_foreach_norm", lambda x, ord=2, dtype=None: reductions.linalg_vector_norm(x, ord, dtype=dtype))
_register("_foreach_copy", lambda self, src, non_blocking=False: cast(src, self.dtype).reshape(self.shape))
