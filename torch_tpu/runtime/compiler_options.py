"""XLA compiler options for the programs compiled next: ``torch.tpu.compiler.custom_compiler_options``
and ``torch.tpu.allow_excess_precision`` (TorchTPU's names).

Options are XLA's (``DebugOptions`` fields such as ``xla_cpu_enable_fast_math``, or
``exec_time_optimization_effort``), values given as strings as TorchTPU takes them ("true",
"3", "0.5"); the special keys ``xla_optimization_level`` / ``xla_memory_fitting_level`` take
``'O0'..'O3'`` (XLA's ``EffortLevel``). Nested blocks merge, the inner value winning.

They apply to the whole programs the compile room builds while they are set (``torch.compile``
graphs, ``train_step``; ``torch_tpu.compile.program.executables``, keyed into their caches); eager
ops' per-op programs keep XLA's defaults. An unknown option fails when the next program compiles,
with XLA's error naming it; TPU-only options (``xla_tpu_*``) are left out off a TPU, with one warning.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import warnings
from collections.abc import Iterator, Mapping

_EFFORT = {"O0": 9, "O1": 10, "O2": 20, "O3": 30}  # xla.proto EffortLevel
_SPECIAL = {"xla_optimization_level": "optimization_level", "xla_memory_fitting_level": "memory_fitting_level"}
_scoped: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar("tpu_compiler_options",
                                                                                     default=())
_EXCESS = "xla_allow_excess_precision"
_process: dict[str, str] = {}


def _value(key: str, text: str) -> bool | int | float | str:
    if key in _SPECIAL:
        if text not in _EFFORT:
            raise ValueError(f"custom_compiler_options: {key} must be one of {list(_EFFORT)}, got {text!r}")
        return _EFFORT[text]
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


@contextlib.contextmanager
def custom_compiler_options(options: dict[str, str]) -> Iterator[None]:
    """Programs compiled inside the block get ``options`` (module docstring)."""
    if not isinstance(options, Mapping):
        raise TypeError(f"custom_compiler_options: options must be a dict of str to str, got {type(options).__name__}")
    for key, value in options.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"custom_compiler_options: options must map str to str, got {key!r}: {value!r}")
        _value(key, value)  # checks the special keys now
    merged = dict(_scoped.get())
    merged.update(options)
    token = _scoped.set(tuple(sorted(merged.items())))
    try:
        yield
    finally:
        _scoped.reset(token)


def key() -> tuple[tuple[str, str], ...]:
    """The options in force now, as given (cheap: a program's executables are keyed by it)."""
    scoped = _scoped.get()
    return (*sorted(_process.items()), *scoped) if _process else scoped


# XLA:CPU's copy insertion orders ops by their data dependencies only, so a donated parameter that an
# op independent of its in-place update reads (a weight read by the backward's input-gradient GEMM
# as well as by the forward's, then updated by the optimizer) kept a copy made every run: all the
# dense weights but the first layer's each step, 64 MB at the mlperf preset. Region analysis proves
# the program's order and drops them; the thunk executor still orders a buffer's reads before its
# write. The values are the same bit for bit.
_TPU_ONLY_PREFIX = "xla_tpu_"
_PLATFORM_DEFAULTS = {"cpu": (("xla_cpu_copy_insertion_use_region_analysis", "true"),)}


def with_platform_defaults(options: tuple[tuple[str, str], ...], platform: str) -> tuple[tuple[str, str], ...]:
    """``options`` (a :func:`key`) over the defaults of programs compiled for ``platform``; off a
    TPU, TPU-only options (``xla_tpu_*``, e.g. TorchTPU's ``xla_tpu_enable_deduplicated_calls``)
    are left out, with one warning per set of them (XLA would refuse them)."""
    if platform != "tpu":
        tpu_only = tuple(k for k, _ in options if k.startswith(_TPU_ONLY_PREFIX))
        if tpu_only:
            _warn_ignored(tpu_only, platform)
            options = tuple((k, v) for k, v in options if not k.startswith(_TPU_ONLY_PREFIX))
    defaults = _PLATFORM_DEFAULTS.get(platform, ())
    return tuple(sorted({**dict(defaults), **dict(options)}.items())) if defaults else options


@functools.cache
def _warn_ignored(keys: tuple[str, ...], platform: str) -> None:
    warnings.warn(f"custom_compiler_options: {', '.join(keys)} apply on TPU only; ignored on XLA:{platform.upper()}",
                  RuntimeWarning, stacklevel=2)


def for_jax(options: tuple[tuple[str, str], ...]) -> dict[str, bool | int | float | str] | None:
    """``options`` (a :func:`key`) as ``jax``'s ``Lowered.compile(compiler_options=)`` takes them."""
    return {_SPECIAL.get(k, k): _value(k, v) for k, v in dict(options).items()} or None


def allow_excess_precision() -> bool:
    """Whether XLA may keep values in more precision than their type (e.g. bf16 math in f32): the
    value set, else ``--xla_allow_excess_precision`` in ``XLA_FLAGS``, else False."""
    if _EXCESS in _process:
        return _process[_EXCESS] == "true"
    for flag in os.environ.get("XLA_FLAGS", "").split():
        name, _, value = flag.lstrip("-").partition("=")
        if name == _EXCESS:
            return value.lower() in ("", "true", "1")
    return False


def set_allow_excess_precision(value: bool) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"allow_excess_precision must be True or False, got {value!r}")
    _process[_EXCESS] = "true" if value else "false"
