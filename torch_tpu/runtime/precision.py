"""Matmul precision on the device: ``torch.tpu.Precision``, ``torch.tpu.precision(...)`` and the
setter/getter, all mapped onto JAX's ``jax_default_matmul_precision``.

The precision is the ``precision`` attribute XLA puts on every ``dot_general`` and convolution whose
lowering does not pin one (StableHLO ``DEFAULT`` / ``HIGH`` / ``HIGHEST``,
https://openxla.org/stablehlo/spec#dot_general). On a TPU, ``DEFAULT`` multiplies float32 inputs in
one bfloat16 pass, ``HIGH`` in three (about bf16x3, TF32-like) and ``HIGHEST`` in six (full float32);
XLA:CPU computes float32 in every case. Which one applies, first match wins:

1. the innermost ``with torch.tpu.precision(mode):`` block (TorchTPU's name and enum);
2. ``torch.tpu.set_matmul_precision(mode)``, until it is set back to None;
3. ``torch.set_float32_matmul_precision`` (also what ``torch.backends.cuda.matmul.allow_tf32`` /
   ``torch.backends.fp32_precision`` set), mapped as

   ============================  ==========================
   torch float32 precision       device precision
   ============================  ==========================
   ``"highest"`` (torch default)  ``Precision.HIGHEST``
   ``"high"``                     ``Precision.HIGH``
   ``"medium"``                   ``Precision.DEFAULT``
   ============================  ==========================

   so the device computes what torch promises by default (float32 matmuls in float32); set
   ``"medium"`` for the TPU's native one-pass bfloat16 speed.

The setting is process-wide, like torch's own (the ``precision`` block too: autograd runs device
backward on another thread, which must see the same precision). It is JAX's process-wide default
(``jax_default_matmul_precision``), so other JAX code in the process (a JAX embedding backend)
computes its unpinned dots with it too. It applies to eager ops (the
per-op programs are ``jax.jit`` programs, whose cache key includes JAX's precision setting, and to
the ops run plainly) and to compiled graphs and ``train_step`` programs, whose cache keys include
:func:`current_name`: a change of precision recompiles them, a change back reuses the earlier
program. :func:`sync` hands the setting to JAX; the eager dispatcher, compiled graphs and train
steps call it before they run (a string compare when nothing changed).
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Iterator

import torch

from torch_tpu.runtime._jax import jax


class Precision(enum.Enum):
    """StableHLO's dot_general precision (TorchTPU's ``torch.tpu.Precision``). The value is the
    name ``jax.default_matmul_precision`` takes."""

    DEFAULT = "default"
    HIGH = "high"
    HIGHEST = "highest"


FROM_TORCH = {"highest": Precision.HIGHEST, "high": Precision.HIGH, "medium": Precision.DEFAULT}
_ALIASES = {"default": Precision.DEFAULT, "bfloat16": Precision.DEFAULT, "fastest": Precision.DEFAULT,
            "tensorfloat32": Precision.HIGH, "float32": Precision.HIGHEST, **FROM_TORCH}

torch_matmul_precision = torch._C._get_float32_matmul_precision
_lock = threading.Lock()
_stack: list[Precision] = []  # open precision() blocks, innermost last
_explicit: list[Precision | None] = [None]  # set_matmul_precision's value
seen_torch_setting = [""]  # torch's setting when the JAX setting was last decided
_applied = [""]  # the name JAX's default_matmul_precision holds (as set here)


def _parse(mode: Precision | str) -> Precision:
    if isinstance(mode, Precision):
        return mode
    if isinstance(mode, str) and mode.lower() in _ALIASES:
        return _ALIASES[mode.lower()]
    raise ValueError(
        f"expected a torch.tpu.Precision (DEFAULT, HIGH, HIGHEST) or one of {sorted(_ALIASES)}, got {mode!r}")


def get_matmul_precision() -> Precision:
    """The precision float32 matmuls and convolutions on tpu use now (see the module docstring)."""
    if _stack:
        return _stack[-1]
    explicit = _explicit[0]
    return explicit if explicit is not None else FROM_TORCH.get(torch_matmul_precision(), Precision.HIGHEST)


def current_name() -> str:
    """:func:`get_matmul_precision` as JAX names it (a cache key part)."""
    return get_matmul_precision().value


def set_matmul_precision(mode: Precision | str | None) -> None:
    """Set the device's matmul precision (a :class:`Precision`, torch's "highest"/"high"/"medium",
    or JAX's names); None follows ``torch.set_float32_matmul_precision`` again."""
    with _lock:
        _explicit[0] = None if mode is None else _parse(mode)
        _apply()


@contextlib.contextmanager
def precision(mode: Precision | str) -> Iterator[None]:
    """``with torch.tpu.precision(torch.tpu.Precision.HIGHEST):`` — the precision inside the block,
    over every other setting; restored on exit."""
    parsed = _parse(mode)
    with _lock:
        _stack.append(parsed)
        _apply()
    try:
        yield
    finally:
        with _lock:
            _stack.pop()
            _apply()


def _apply() -> None:
    seen_torch_setting[0] = torch_matmul_precision()
    name = current_name()
    if name != _applied[0]:
        jax.config.update("jax_default_matmul_precision", name)
        _applied[0] = name


def sync() -> None:
    """Make JAX's precision setting follow this module's, picking up a change of torch's float32
    matmul precision since the last call (cheap when nothing changed)."""
    if torch_matmul_precision() != seen_torch_setting[0]:
        with _lock:
            _apply()
