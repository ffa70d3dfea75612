"""``torch.Generator(device="tpu")``: explicit generators for the device's random ops.

PyTorch builds a PrivateUse1 generator only through a C++ hook (``getNewGenerator``), which a
Python backend cannot register. :func:`install` therefore makes ``torch.Generator`` a thin
subclass of torch's C generator type whose constructor returns a :class:`TpuGenerator` for a tpu
device and torch's own generator otherwise (``isinstance(g, torch.Generator)`` holds for both).
A tpu generator keeps its state in a CPU Mersenne-Twister generator: ``manual_seed``, ``seed``,
``initial_seed``, ``get_state`` and ``set_state`` are torch's, reproducible as on CPU.

A random op on tpu given ``generator=`` draws its JAX PRNG key from that generator (64 bits per
op, :func:`key_from`) instead of the device's global key: the same seed gives the same values.
The dispatcher hands an op a new Python object for torch's C generator behind the one given, so a
tpu generator is told from a CPU one by that C generator (``_cdata``, :data:`_TPU_GENERATORS`):
an op given a CPU generator raises as CUDA's ops do, and one given the device's default generator
(``torch.tpu.default_generators[0]``) draws from the global stream as with no generator, as on CPU and
CUDA (:func:`checked`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from torch_tpu.runtime._jax import jax

_C_GENERATOR = torch._C.Generator
_GENERATOR_TYPES = ("Generator", "Optional[Generator]")  # as an op schema's argument types print
# the live tpu generators by their C generator's address (an address freed is forgotten with its generator)
_TPU_GENERATORS: weakref.WeakValueDictionary[int, TpuGenerator] = weakref.WeakValueDictionary()


def _is_tpu(device: Any) -> bool:
    if device is None:
        return False
    return torch.device(device).type == "tpu"


class TpuGenerator(_C_GENERATOR):
    """A generator whose ``device`` is ``tpu:0``; its state is a CPU generator's."""

    # the device's default generator is the global stream: an op given it runs as one given none
    is_global_stream: ClassVar[bool] = False

    def __new__(cls, device: Any = "tpu") -> TpuGenerator:
        index = torch.device(device).index
        if index not in (None, 0):
            raise RuntimeError(f"tpu generator for device index {index}: this process drives one device (tpu:0)")
        generator = _C_GENERATOR.__new__(cls, "cpu")
        _TPU_GENERATORS[generator._cdata] = generator
        return generator

    @property
    def device(self) -> torch.device:
        return torch.device("tpu", 0)

    def __repr__(self) -> str:
        return "<torch_tpu TpuGenerator on tpu:0>"


class _GeneratorType(type(_C_GENERATOR)):
    """``torch.Generator``'s type: every torch generator is an instance, as before :func:`install`."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _C_GENERATOR)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _C_GENERATOR)


class Generator(_C_GENERATOR, metaclass=_GeneratorType):
    """``torch.Generator(device=None)``: a :class:`TpuGenerator` for a tpu device, torch's own
    generator otherwise."""

    def __new__(cls, device: Any = None) -> Any:
        if _is_tpu(device):
            return TpuGenerator(device)
        return _C_GENERATOR() if device is None else _C_GENERATOR(device)


def install() -> None:
    """Make ``torch.Generator(device="tpu")`` build a :class:`TpuGenerator` (idempotent)."""
    torch.Generator = Generator


def checked(op: Any, handler: Callable[[Any, tuple, dict], Any]) -> Callable[[Any, tuple, dict], Any]:
    """``handler`` of the aten op ``op`` on tpu tensors, refusing a generator that is not a tpu
    generator as CUDA's ops refuse one that is not CUDA's (``handler`` itself for an op that
    takes no generator)."""
    where = [(i, a.name) for i, a in enumerate(op._schema.arguments) if str(a.type) in _GENERATOR_TYPES]
    if not where:
        return handler

    def run(func: Any, args: tuple, kwargs: dict) -> Any:
        for index, name in where:
            positional = index < len(args)
            generator = args[index] if positional else kwargs.get(name)
            if generator is None:
                continue
            tpu = _TPU_GENERATORS.get(generator._cdata)
            if tpu is None:
                raise RuntimeError(f"Expected a 'tpu' device type for generator but found "
                                   f"'{generator.device.type}' ({func}: pass torch.Generator(device='tpu'))")
            if tpu.is_global_stream:
                if positional:
                    args = (*args[:index], None, *args[index + 1:])
                else:
                    kwargs = {**kwargs, name: None}
        return handler(func, args, kwargs)

    return run


def key_from(generator: Any) -> jax.Array:
    """A JAX PRNG key drawn from the tpu generator ``generator``'s stream (advancing it by one
    64-bit draw)."""
    bits = torch.empty((), dtype=torch.int64).random_(generator=generator)
    return jax.random.key(int(bits) & 0xFFFFFFFFFFFFFFFF)
