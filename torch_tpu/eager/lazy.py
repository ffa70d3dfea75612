"""The ``defer_and_fuse`` eager executor: record lowered ops, run them as one fused jax.jit program.

Ops dispatched in this mode return :class:`LazyArray` placeholders (shape and dtype known, no
value). The recorded graph runs when a value is needed: a host read (``.cpu()``, ``.item()``,
``print``, Python control flow on a value), any other use of the array outside a lowering
(strided view reads/writes, ``torch.tpu.synchronize``), an op whose output shape depends on
values, or the size cap (``TORCH_TPU_DEFER_MAX_OPS``, default 512 ops). The program is compiled
once per graph structure (ops, constants, input shapes, which results are still referenced) and
only results that are still referenced are returned, so dead intermediates never materialize.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from functools import lru_cache
from typing import Any

import numpy as np

from torch_tpu.ops.registry import Lowering
from torch_tpu.runtime._jax import jax
from tpu_facts import knobs

_MAX_OPS = knobs.DEFER_MAX_OPS.integer()


@dataclasses.dataclass
class DeferStats:
    ops_deferred: int = 0
    flushes: int = 0
    programs_compiled: int = 0  # distinct graph structures built
    program_cache_hits: int = 0


_stats = DeferStats()


def defer_stats() -> DeferStats:
    return dataclasses.replace(_stats)


def reset_defer_stats() -> None:
    for field in dataclasses.fields(DeferStats):
        setattr(_stats, field.name, 0)


class LazyArray(jax.Array):
    """A recorded op's result; any access beyond shape/dtype runs the pending graph."""

    __slots__ = ("_recorder", "_aval", "_index", "_value", "__weakref__")

    def __init__(self, recorder: _Recorder, aval: jax.ShapeDtypeStruct, index: int) -> None:
        self._recorder = recorder
        self._aval = aval
        self._index = index
        self._value: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self._aval.shape

    @property
    def dtype(self) -> np.dtype:
        return self._aval.dtype

    @property
    def ndim(self) -> int:
        return len(self._aval.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self._aval.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self._aval.dtype.itemsize

    def concrete(self) -> jax.Array:
        if self._value is None:
            self._recorder.flush()
        return self._value

    def __getattr__(self, name: str) -> Any:  # array attributes jax.Array does not declare
        return getattr(self.concrete(), name)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.concrete(), dtype=dtype)

    def __repr__(self) -> str:
        state = "pending" if self._value is None else "ready"
        return f"LazyArray({self._aval.dtype}{list(self._aval.shape)}, {state})"


def _delegate(name: str) -> Any:
    def method(self: LazyArray, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.concrete(), name)(*args, **kwargs)

    method.__name__ = name
    return method


def _delegate_property(name: str) -> property:
    return property(lambda self: getattr(self.concrete(), name))


# jax.Array declares its methods abstract; route each one not defined above to the value.
for _name, _attr in vars(jax.Array).items():
    if _name in vars(LazyArray) or _name in ("__init__", "__new__", "__slots__", "__weakref__", "__doc__",
                                             "__module__"):
        continue
    if isinstance(_attr, property):
        setattr(LazyArray, _name, _delegate_property(_name))
    elif callable(_attr):
        setattr(LazyArray, _name, _delegate(_name))


def _spec_of(array: jax.Array) -> jax.ShapeDtypeStruct:
    if type(array) is LazyArray:
        return array._aval
    return jax.ShapeDtypeStruct(array.shape, array.dtype, weak_type=getattr(array, "weak_type", False))


def _rebuild(treedef: Any, refs: tuple, inputs: Any, env: Any) -> tuple[tuple, dict]:
    leaves = [inputs[i] if kind == "i" else env[i] if kind == "v" else i for kind, i in refs]
    return jax.tree_util.tree_unflatten(treedef, leaves)


@lru_cache(maxsize=8192)
def _output_specs(lowering: Lowering, treedef: Any, specs: tuple) -> Any:
    """Output shapes/dtypes of one op for these argument specs (traced once per signature)."""
    arrays = [s for s in specs if isinstance(s, jax.ShapeDtypeStruct)]

    def run(*xs: jax.Array) -> Any:
        it = iter(xs)
        leaves = [next(it) if isinstance(s, jax.ShapeDtypeStruct) else s for s in specs]
        args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        return lowering.fn(*args, **kwargs)

    return jax.eval_shape(run, *arrays)


class _Recorder:
    """The pending graph of one thread."""

    def __init__(self) -> None:
        self._programs: dict[Any, Any] = {}
        self._reset()

    def _reset(self) -> None:
        # node: (lowering, argument treedef, argument refs, output treedef, output value indices)
        self.nodes: list[tuple[Lowering, Any, tuple, Any, tuple[int, ...]]] = []
        self.inputs: list[jax.Array] = []
        self.input_slots: dict[int, int] = {}  # id(array) -> input position
        self.values: list[weakref.ref] = []  # value index -> its LazyArray
        self.value_specs: list[jax.ShapeDtypeStruct] = []

    def record(self, lowering: Lowering, args: Any, kwargs: dict) -> Any:
        """Append one op; returns its outputs as LazyArrays."""
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        refs, specs = [], []
        for leaf in leaves:
            if type(leaf) is LazyArray and leaf._value is None and leaf._recorder is self:
                refs.append(("v", leaf._index))
                specs.append(leaf._aval)
            elif isinstance(leaf, jax.Array):
                leaf = leaf.concrete() if type(leaf) is LazyArray else leaf
                slot = self.input_slots.get(id(leaf))
                if slot is None:
                    slot = self.input_slots[id(leaf)] = len(self.inputs)
                    self.inputs.append(leaf)
                refs.append(("i", slot))
                specs.append(_spec_of(leaf))
            else:
                refs.append(("c", leaf))
                specs.append(leaf)
        out_leaves, out_def = jax.tree_util.tree_flatten(_output_specs(lowering, treedef, tuple(specs)))
        lazies = [LazyArray(self, spec, len(self.values) + k) for k, spec in enumerate(out_leaves)]
        self.values.extend(weakref.ref(x) for x in lazies)
        self.value_specs.extend(out_leaves)
        self.nodes.append((lowering, treedef, tuple(refs), out_def, tuple(x._index for x in lazies)))
        _stats.ops_deferred += 1
        result = jax.tree_util.tree_unflatten(out_def, lazies)
        if len(self.nodes) >= _MAX_OPS:
            self.flush()
        return result

    def flush(self) -> None:
        """Run the pending graph; every still-referenced LazyArray receives its value."""
        if not self.nodes:
            return
        alive = [(i, x) for i, ref in enumerate(self.values) if (x := ref()) is not None]
        nodes, inputs = self.nodes, self.inputs
        self._reset()
        wanted = tuple(i for i, _ in alive)
        key = (
            tuple((n[0].op, n[1], n[2], n[4]) for n in nodes),
            tuple(_spec_of(x) for x in inputs),
            wanted,
        )
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = jax.jit(_replay_function(nodes, wanted))
            _stats.programs_compiled += 1
        else:
            _stats.program_cache_hits += 1
        _stats.flushes += 1
        for (_, lazy), value in zip(alive, program(*inputs)):
            lazy._value = value


def _replay_function(nodes: list, wanted: tuple[int, ...]) -> Any:
    plan = [(n[0].fn, n[1], n[2], n[4]) for n in nodes]

    def replay(*inputs: jax.Array) -> list[jax.Array]:
        env: dict[int, jax.Array] = {}
        for fn, treedef, refs, out_indices in plan:
            args, kwargs = _rebuild(treedef, refs, inputs, env)
            env.update(zip(out_indices, jax.tree_util.tree_leaves(fn(*args, **kwargs))))
        return [env[i] for i in wanted]

    return replay


_local = threading.local()


def _recorder() -> _Recorder:
    rec = getattr(_local, "recorder", None)
    if rec is None:
        rec = _local.recorder = _Recorder()
    return rec


def flush() -> None:
    """Run everything recorded so far on this thread (a no-op when nothing is pending)."""
    _recorder().flush()


def run_deferred(lowering: Lowering, args: Any, kwargs: dict) -> Any:
    """The defer_and_fuse executor (``torch_tpu.eager.modes`` calling convention)."""
    _used[0] = True
    if lowering.static_shape:
        try:
            return _recorder().record(lowering, args, kwargs)
        except TypeError as error:  # an unhashable constant argument: run this op on its own
            if "unhashable" not in str(error):
                raise
    return lowering.fn(*materialized(args), **materialized(kwargs))


_used = [False]  # whether any LazyArray may exist (keeps the other modes' fast path untouched)


def materialized(tree: Any) -> Any:
    """``tree`` with every LazyArray replaced by its value."""
    return jax.tree_util.tree_map(lambda x: x.concrete() if type(x) is LazyArray else x, tree)


def materializing(executor: Any) -> Any:
    """Wrap another mode's executor so it accepts tensors produced under defer_and_fuse."""

    def run(lowering: Lowering, args: Any, kwargs: dict) -> Any:
        if _used[0]:
            args, kwargs = materialized(args), materialized(kwargs)
        return executor(lowering, args, kwargs)

    return run
