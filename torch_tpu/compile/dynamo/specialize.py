"""Dynamic dims under ``torch.compile(backend="tpu")``: one static program per concrete shape.

XLA programs have static shapes, so a Dynamo graph with symbolic sizes (automatic dynamic shapes
on a recompile, ``torch._dynamo.mark_dynamic``, ``dynamic=True``) is not compiled symbolically:
:class:`SpecializedGraph` keeps the Dynamo graph and, per distinct signature of the call's
arguments (tensor shapes, strides, dtypes, ``requires_grad``; the values of integer arguments),
traces it again through AOTAutograd with concrete fake inputs. Every shape seen is counted; when
one graph has specialized more than ``TORCH_TPU_SPECIALIZE_WARN`` times (default 8) a warning
names the changing dims and points at :func:`torch_tpu.compile.bucketed` (pad to a few sizes,
with a ``valid`` mask).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from tpu_facts import knobs

_log = logging.getLogger(__name__)
WARN_AFTER = knobs.SPECIALIZE_WARN.integer()
_counters = {"specializations": 0}


def specializations() -> int:
    """Concrete-shape programs built for dynamic graphs since the last reset."""
    return _counters["specializations"]


def reset_specializations() -> None:
    _counters["specializations"] = 0


def _symbolic(x: Any) -> bool:
    if isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool):
        return True
    if isinstance(x, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in (*x.shape, *x.stride(), x.storage_offset()))
    return False


def is_symbolic(example_inputs: Sequence[Any]) -> bool:
    """Whether Dynamo handed over symbolic sizes (SymInt inputs or tensors with symbolic shapes)."""
    return any(_symbolic(x) for x in example_inputs)


def _signature(args: Sequence[Any]) -> tuple:
    sig = []
    for x in args:
        if isinstance(x, torch.Tensor):
            sig.append((tuple(x.shape), x.stride(), x.dtype, x.device.type, x.requires_grad))
        else:
            sig.append((type(x), x))
    return tuple(sig)


def _fake_inputs(args: Sequence[Any]) -> list[Any]:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = []
    with mode:
        for x in args:
            if isinstance(x, torch.Tensor):
                fake = torch.empty_strided(tuple(x.shape), x.stride(), dtype=x.dtype, device=x.device)
                fakes.append(fake.requires_grad_(x.requires_grad))
            else:
                fakes.append(x)
    return fakes


class SpecializedGraph:
    """A Dynamo graph with dynamic dims, compiled by ``compile_static`` once per concrete signature."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                 compile_static: Callable[[torch.fx.GraphModule, Sequence[Any]], Callable[..., Any]]) -> None:
        self.gm = gm
        self._compile_static = compile_static
        self._programs: dict[tuple, Callable[..., Any]] = {}
        self._dynamic = [i for i, x in enumerate(example_inputs) if _symbolic(x)]
        self._warned = False

    @property
    def shapes_compiled(self) -> int:
        return len(self._programs)

    def __call__(self, *args: Any) -> Any:
        key = _signature(args)
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = self._compile_static(self.gm, _fake_inputs(args))
            _counters["specializations"] += 1
            self._maybe_warn(args)
        return program(*args)

    def _maybe_warn(self, args: Sequence[Any]) -> None:
        if self._warned or len(self._programs) <= WARN_AFTER:
            return
        self._warned = True
        changing = sorted({(i, d) for key in self._programs for i, d in self._changing_dims(key)})
        _log.warning(
            "torch_tpu.compile: a graph with dynamic dims has been specialized for %d shapes (changing: %s); "
            "each is a separate XLA program: pad the dim to a few sizes with torch_tpu.compile.bucketed",
            len(self._programs), ", ".join(f"input {i} dim {d}" if d is not None else f"int input {i}"
                                           for i, d in changing) or "none")

    def _changing_dims(self, key: tuple) -> list[tuple[int, int | None]]:
        first = next(iter(self._programs))
        out = []
        for i, (a, b) in enumerate(zip(first, key)):
            if a == b:
                continue
            if isinstance(a[0], tuple) and isinstance(b[0], tuple) and len(a[0]) == len(b[0]):
                out.extend((i, d) for d, (p, q) in enumerate(zip(a[0], b[0])) if p != q)
            else:
                out.append((i, None))
        return out
