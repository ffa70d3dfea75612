"""Per-op jit cache for eager execution: one compiled XLA program per op call signature.

Calling a lowering directly runs each of its jnp calls as a separate small XLA dispatch. This
cache instead runs a lowering as one ``jax.jit`` program, keyed by the op overload, the argument
structure, every input's aval (shape, dtype, weak type) and the values of all non-tensor arguments.

* A key is compiled on its first sight, so every call of a signature runs the same program: the
  plain lowering (op by op) and a jitted program can round differently (XLA contracts a multiply
  and an add into one FMA inside a program), and an op must give the same bits on each call (a
  resumed training run repeats the uninterrupted run's updates bit for bit).
* Float arguments that keep changing (a learning rate, Adam's bias corrections) would compile a
  program per value: once a call site has seen more than ``PROMOTE_AFTER`` distinct float values,
  its floats become traced inputs of one program, provided tracing them gives the same output
  shapes and dtypes as the constant values (torch's promotion of Python scalars is kept).
* At most ``TORCH_TPU_OP_JIT_MAX`` programs (default 1024) are kept, least recently used first out.
* Once a signature has its program, the dispatcher (``torch_tpu.eager.dispatch``) finds it by the torch
  call itself (``fast``: op, argument avals or values) and calls it with the tensors'
  arrays, skipping the handler, the unwrapping, this module's key building and the executor
  seam: about 2.8x -> 2.25-2.3x a raw ``jax.jit`` call for small ops, where a no-op
  ``__torch_dispatch__`` running the jitted op costs 1.9x (bench/bench_torch_tpu_ops.py).
* ``TORCH_TPU_OP_JIT=0`` switches the cache off (every op runs its plain lowering);
  :func:`set_enabled` does the same at run time.

Lowerings registered with ``static_shape=False`` always run plainly. A signature whose lowering
cannot be traced (it reads a value on the host), or whose program would only hand back its inputs
(``clone``), runs the plain lowering for good.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections import OrderedDict
from typing import Any

import torch

from torch_tpu.ops.registry import Lowering
from torch_tpu.runtime._jax import ARRAY_TYPE, jax, jax_core
from tpu_facts import knobs

PROMOTE_AFTER = 3
_FLOAT_SITES_MAX = 8192
_ARRAY = ARRAY_TYPE
_PLAIN = object()  # program slot of a signature that does not trace: run the lowering itself
_TRACED = "traced floats"  # float-values part of the key once a site's floats are traced inputs
_PLAIN_TYPES = frozenset({int, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})
_flatten = jax.tree_util.tree_flatten
_unflatten = jax.tree_util.tree_unflatten


@dataclasses.dataclass
class OpJitStats:
    """Counters since the last :func:`reset_stats` (a call is either a hit or a miss)."""

    hits: int = 0  # calls served by a compiled program
    misses: int = 0  # calls that ran the plain lowering (untraceable, uncacheable)
    compiles: int = 0  # programs built
    evictions: int = 0  # programs dropped by the size cap
    promotions: int = 0  # call sites whose float arguments became traced inputs
    untraceable: int = 0  # signatures that failed to trace and run plainly from then on


counters = OpJitStats()


def _env_enabled() -> bool:
    return knobs.OP_JIT.on()


settings = {"enabled": _env_enabled(), "max_entries": knobs.OP_JIT_MAX.integer()}
_programs: OrderedDict[tuple, Any] = OrderedDict()  # (site, float key) -> jitted program (LRU)
_float_values: dict[tuple, set | None] = {}  # site -> distinct float keys seen (None: keep constant)
_promoted: set[tuple] = set()  # sites whose floats are traced inputs
_last = threading.local()  # .program: what the thread's last call ran (see last_program)
# the dispatcher's fast path (torch_tpu.eager.dispatch): its call signature -> (op, a program of
# _programs, op name, in place) (see torch_tpu.eager.handlers); emptied whenever programs are evicted
# or cleared, so it never holds one the cap dropped
fast: dict[tuple, tuple] = {}


def stats() -> OpJitStats:
    """A snapshot of the cache counters."""
    return dataclasses.replace(counters)


def reset_stats() -> None:
    for field in dataclasses.fields(OpJitStats):
        setattr(counters, field.name, 0)


def enabled() -> bool:
    return settings["enabled"]


def set_enabled(flag: bool) -> None:
    """Switch the cache on or off for the process (``TORCH_TPU_OP_JIT`` sets the initial state)."""
    settings["enabled"] = bool(flag)


def set_max_entries(n: int) -> None:
    """Keep at most ``n`` compiled programs (``TORCH_TPU_OP_JIT_MAX``); evicts down to it now."""
    if n < 1:
        raise ValueError(f"op jit cache size must be at least 1, got {n}")
    settings["max_entries"] = n
    _evict()


def size() -> int:
    """Compiled programs (and untraceable markers) held now."""
    return len(_programs)


def clear() -> None:
    """Forget every program and float-value record (after lowerings changed)."""
    fast.clear()
    _programs.clear()
    _float_values.clear()
    _promoted.clear()


def _evict() -> None:
    if len(_programs) <= settings["max_entries"]:
        return
    while len(_programs) > settings["max_entries"]:
        try:
            _programs.popitem(last=False)
        except KeyError:  # emptied by another thread
            break
        counters.evictions += 1
    fast.clear()


def last_program() -> Any:
    """The compiled program the calling thread's last :func:`call` ran, taking the call's array
    leaves in order (None: it ran the plain lowering, or a program over traced floats). The same
    program serves every shape of those arguments (``jax.jit`` specializes it per shape)."""
    return getattr(_last, "program", None)


def call(lowering: Lowering, args: Any, kwargs: dict) -> Any:
    """Run ``lowering`` on JAX arguments, through a cached jitted program when one applies."""
    _last.program = None
    if not settings["enabled"] or not lowering.static_shape:
        return lowering.fn(*args, **kwargs)
    leaves, treedef = _flatten((args, kwargs))
    sig, arrays, floats = [], [], []
    for leaf in leaves:
        kind = type(leaf)
        if kind is _ARRAY:
            arrays.append(leaf)
            sig.append(leaf.aval)
        elif kind is float:
            floats.append(leaf)
            sig.append(float)
        elif kind not in _PLAIN_TYPES and isinstance(leaf, jax.Array):
            arrays.append(leaf)
            sig.append(leaf.aval)
        else:
            sig.append((kind, leaf))
    site = (lowering.fn, treedef, tuple(sig))  # ops sharing a fn share its programs
    try:
        traced = site in _promoted
    except TypeError:  # an unhashable argument: no key
        counters.misses += 1
        return lowering.fn(*args, **kwargs)
    key = (site, _TRACED if traced else _float_key(floats))
    program = _programs.get(key)
    if program is not None:
        try:
            _programs.move_to_end(key)
        except KeyError:  # evicted meanwhile by another thread (autograd's device thread)
            pass
        if program is _PLAIN:
            counters.misses += 1
            return lowering.fn(*args, **kwargs)
        counters.hits += 1
        if traced:
            return program(*arrays, *floats)
        _last.program = program
        return program(*arrays)
    if traced:  # the site's traced-floats program was evicted: build it again (not one over these values)
        program = _jitted(lowering, treedef, leaves, traced_floats=True)
        counters.compiles += 1
        return _store_and_run(site, _TRACED, program, arrays + floats, args, kwargs, lowering)
    if floats and _note_float_values(site, key[1]):
        program = _promote(lowering, treedef, leaves, site)
        if program is not None:
            return _store_and_run(site, _TRACED, program, arrays + floats, args, kwargs, lowering)
    program = _jitted(lowering, treedef, leaves, traced_floats=False)
    counters.compiles += 1
    return _store_and_run(site, key[1], program, arrays, args, kwargs, lowering)


def _float_key(floats: list[float]) -> tuple:
    key = tuple(floats)
    if 0.0 in key:  # 0.0 == -0.0, but they give different results (signed zeros, 1/x)
        key += tuple(math.copysign(1.0, f) for f in floats)
    return key


def _note_float_values(site: tuple, fkey: tuple) -> bool:
    """Record a float key for ``site``; True when the site now has too many to compile each."""
    if len(_float_values) > _FLOAT_SITES_MAX:
        _float_values.clear()
    seen = _float_values.setdefault(site, set())
    if seen is None:
        return False
    seen.add(fkey)
    return len(seen) > PROMOTE_AFTER


def _jitted(lowering: Lowering, treedef: Any, leaves: list, traced_floats: bool) -> Any:
    """A jitted program over the array leaves (and the float leaves when ``traced_floats``)."""
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
    if traced_floats:
        slots += [i for i, leaf in enumerate(leaves) if type(leaf) is float]
    # the slots' leaves left out: a cached program must not keep its first call's arrays alive
    template = list(leaves)
    for i in slots:
        template[i] = None
    fn = lowering.fn

    def program(*inputs: Any) -> Any:
        filled = list(template)
        for i, x in zip(slots, inputs):
            filled[i] = x
        args, kwargs = _unflatten(treedef, filled)
        return fn(*args, **kwargs)

    program.__name__ = f"op_jit[{lowering.op}]"
    return jax.jit(program)


def _promote(lowering: Lowering, treedef: Any, leaves: list, site: tuple) -> Any:
    """The traced-floats program for ``site``, or None when tracing floats changes the result type."""
    arrays = [x for x in leaves if isinstance(x, jax.Array)]
    floats = [x for x in leaves if type(x) is float]
    traced = _jitted(lowering, treedef, leaves, traced_floats=True)
    constant = _jitted(lowering, treedef, leaves, traced_floats=False)
    try:
        same = _out_types(traced.eval_shape(*arrays, *floats)) == _out_types(constant.eval_shape(*arrays))
    except Exception:  # noqa: BLE001 - a float the lowering branches on cannot be traced
        same = False
    if not same:
        _float_values[site] = None  # keep compiling per value; decided once per site
        return None
    _float_values.pop(site, None)
    _promoted.add(site)
    counters.compiles += 1
    counters.promotions += 1
    return traced


def _out_types(out: Any) -> tuple:
    leaves, treedef = _flatten(out)
    return treedef, tuple((x.shape, x.dtype, getattr(x, "weak_type", False)) for x in leaves)


def _computes_nothing(closed: Any) -> bool:
    """Whether a traced program only hands back its inputs (a clone) or closed-over constants
    (``arange`` of constant bounds, whose values the plain lowering makes on the host instead of
    baking them into a program). A 0-d constant output (``ones_like`` of a 0-d tensor: a literal)
    does count: one cached program beats the lowering's op-by-op dispatch."""
    jaxpr = closed.jaxpr
    return not jaxpr.eqns and not any(isinstance(out, jax_core.Literal) for out in jaxpr.outvars)


def _store_and_run(
    site: tuple, fkey: Any, program: Any, inputs: list, args: Any, kwargs: dict, lowering: Lowering
) -> Any:
    key = (site, fkey)
    try:
        if not _computes_nothing(program.trace(*inputs).jaxpr):
            out = program(*inputs)
            _programs[key] = program
            if fkey is not _TRACED:
                _last.program = program
            counters.hits += 1
            _evict()
            return out
    except Exception:  # noqa: BLE001 - not traceable (host read, non-array output): run plainly
        counters.untraceable += 1
    _programs[key] = _PLAIN
    counters.compiles -= 1
    counters.misses += 1
    _evict()
    return lowering.fn(*args, **kwargs)
