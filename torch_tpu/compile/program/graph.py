"""One compiled FX graph: translation (cached in memory and on disk), jax.jit, and the torch boundary.

In the ``debug`` eager mode a call first runs the registry's input checks (``register_lowering(...,
check=)``, e.g. the SparseCore ops' CSR bounds) of every op in the graph whose tensor arguments are
all graph inputs, on the concrete inputs; other modes run the program unchecked.

A :class:`CompiledGraph` is what the "tpu" backend hands back to AOTAutograd for each forward,
backward or inference graph. Calls take torch tensors (tpu or CPU), run the single jitted XLA
program and return each output on the device the graph gives it (its traced fake value's device:
``x.cpu()`` inside a graph returns a CPU tensor); outputs without one follow the inputs (tpu when
any input is on tpu); an output that is a graph input is that input tensor itself (AOTAutograd
saves forward inputs for backward that way, and a backward that updates them in place must reach
the caller's tensor). Inputs the graph updates in place (``aten.copy_`` into an input, as
AOTAutograd leaves a backward's updates) get their new values written back after the program ran.
"""

from __future__ import annotations

import hashlib
import importlib.util
import operator
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.fx

import torch_tpu.compile.program.fx_to_jax as fx_to_jax
from torch_tpu.compile.program.executables import CompiledProgram
from torch_tpu.compile.program.fx_to_jax import mutated_inputs, needs_random_key, to_jax_function
from torch_tpu.compile.program.sources import file_identity
from torch_tpu.eager import modes
from torch_tpu.ops import cpu_kernels
from torch_tpu.ops.registry import get_lowering, lowered_ops
from torch_tpu.runtime import persistent_cache as cache
from torch_tpu.runtime import precision
from torch_tpu.runtime import random as tpu_random
from torch_tpu.runtime._jax import jax
from torch_tpu.runtime.dtypes import to_jax_dtype
from torch_tpu.runtime.tensor import TpuTensor, cpu_to_jax, from_jax, to_cpu, to_jax
from tpu_facts import knobs

# translation key -> jax.export.Exported, the most recently used (a long-lived process compiling
# many graphs must not keep every translation)
_MEMORY: OrderedDict[str, Any] = OrderedDict()
_MEMORY_MAX = 256
_registry_digest: list[str] = []


def registry_fingerprint() -> str:
    """The lowered op names and every file of :func:`lowering_files` (its identity,
    :mod:`torch_tpu.compile.program.sources`): a changed lowering must never reuse a stored translation."""
    if not _registry_digest:
        h = hashlib.sha256()
        for op in sorted(lowered_ops(), key=str):
            h.update(str(op).encode())
        for path in sorted(lowering_files()):
            h.update(f"{path}={file_identity(path)};".encode())
        h.update(cpu_kernels.fingerprint().encode())
        _registry_digest.append(h.hexdigest()[:16])
    return _registry_digest[0]


def lowering_files() -> set[Path]:
    """The translation's source, every file defining a lowering, and the modules a lowering names
    in its ``lowering_sources`` (those it computes in, e.g. the SparseCore ops' ``sparsecore.csr_math``)."""
    files = {Path(fx_to_jax.__file__)}
    for op in lowered_ops():
        fn = get_lowering(op).fn
        code = getattr(fn, "__code__", None)
        if code is not None:
            files.add(Path(code.co_filename))
        files.update(_module_file(name) for name in getattr(fn, "lowering_sources", ()))
    return files


def _module_file(name: str) -> Path:
    """The source file of module ``name`` (dotted, a ``.py`` file of a package found on the path),
    found without importing it; a path that does not exist when it is nowhere (hashed as a name)."""
    top, _, rest = name.partition(".")
    spec = importlib.util.find_spec(top)  # a top-level name: found, not imported
    if spec is None or not rest:
        return Path(spec.origin if spec is not None and spec.origin else name)
    return Path(list(spec.submodule_search_locations or ["."])[0], *rest.split(".")).with_suffix(".py")


Spec = jax.ShapeDtypeStruct | int | float | bool


def input_specs(example_inputs: Sequence[Any]) -> list[Spec]:
    """Shape/dtype of each tensor input; the value of each (concrete) number input, which the
    program is specialized on."""
    specs: list[Spec] = []
    for i, x in enumerate(example_inputs):
        if isinstance(x, (bool, int, float)):
            specs.append(x)
            continue
        if not isinstance(x, torch.Tensor) or any(isinstance(s, torch.SymInt) for s in x.shape):
            raise TypeError(
                f"torch.compile(backend='tpu'): graph input {i} is a {type(x).__name__}"
                f"{' with symbolic sizes' if isinstance(x, torch.Tensor) else ''}; the backend compiles "
                "static shapes (torch_tpu.compile.dynamo.specialize builds one program per concrete shape)"
            )
        specs.append(jax.ShapeDtypeStruct(tuple(int(s) for s in x.shape), to_jax_dtype(x.dtype)))
    return specs


def _with_static(fn: Any, specs: Sequence[Spec]) -> Any:
    """``fn`` over the array inputs only, the number inputs filled in from ``specs``."""
    if all(isinstance(s, jax.ShapeDtypeStruct) for s in specs):
        return fn
    template = list(specs)
    slots = [i for i, s in enumerate(specs) if isinstance(s, jax.ShapeDtypeStruct)]

    def run(*arrays: Any) -> Any:
        filled = list(template)
        for i, a in zip(slots, arrays):
            filled[i] = a
        filled.extend(arrays[len(slots):])  # the random key data, when the graph draws numbers
        return fn(*filled)

    return run


def translation_key(gm: torch.fx.GraphModule, specs: Sequence[jax.ShapeDtypeStruct],
                    matmul_precision: str | None = None) -> str:
    """The cache key of a graph's translation: versions, lowerings, the graph, its input specs and
    constants, and the matmul precision its dots are lowered with (default: the current one)."""
    h = hashlib.sha256()
    h.update(jax.__version__.encode())
    h.update(torch.__version__.encode())
    h.update(registry_fingerprint().encode())
    h.update(f"precision={matmul_precision or precision.current_name()};".encode())
    for spec in specs:
        h.update((f"{spec.shape}{spec.dtype};" if isinstance(spec, jax.ShapeDtypeStruct)
                  else f"{type(spec).__name__}={spec!r};").encode())
    _graph_digest(h, gm)
    return h.hexdigest()


def _graph_digest(h: Any, gm: torch.fx.GraphModule) -> None:
    """The graph's code and constants into ``h``; a higher-order op's body (a graph attribute) the same way."""
    h.update(gm.code.encode())
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(gm)
            if isinstance(value, torch.fx.GraphModule):
                h.update(f"graph {node.target}:".encode())
                _graph_digest(h, value)
            else:
                h.update(tensor_digest(value))


def tensor_digest(t: torch.Tensor) -> bytes:
    cpu = to_cpu(t) if type(t) is TpuTensor else t.detach().cpu()
    # a fresh contiguous copy: contiguous() keeps the stride 0 of an empty or one-element tensor
    # (an expanded or lifted constant), which view(uint8) refuses
    raw = cpu.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).digest() + str(cpu.dtype).encode() + str(tuple(cpu.shape)).encode()


def _translate(gm: torch.fx.GraphModule, specs: list[jax.ShapeDtypeStruct], key: str) -> Any:
    exported = _MEMORY.get(key)
    if exported is not None:
        _MEMORY.move_to_end(key)
        cache.counters.fx_memory_hits += 1
        return exported
    exported = cache.load_translation(key)  # None when never stored or corrupt (then removed)
    if exported is not None:
        cache.counters.fx_disk_hits += 1
    else:
        fn = _with_static(to_jax_function(gm), specs)
        arrays = [s for s in specs if isinstance(s, jax.ShapeDtypeStruct)]
        if needs_random_key(gm):
            arrays.append(jax.ShapeDtypeStruct(key_data_shape(), np.uint32))
        exported = export(fn)(*arrays)
        cache.counters.fx_misses += 1
        cache.store_translation(key, bytes(exported.serialize()))
    _MEMORY[key] = exported
    while len(_MEMORY) > _MEMORY_MAX:
        _MEMORY.popitem(last=False)
    return exported


def export(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``jax.export.export(jax.jit(fn))``, admitting the device's own CPU kernels (custom calls
    JAX cannot vouch for: stored programs are keyed by :func:`registry_fingerprint`, which names them)."""
    return jax.export.export(jax.jit(fn), disabled_checks=cpu_kernels.export_checks())


def key_data_shape() -> tuple[int, ...]:
    return tuple(jax.random.key_data(jax.random.key(0)).shape)


class CompiledGraph:
    """A graph compiled to one XLA program per matmul precision (``torch.tpu.precision``: the
    program of the precision current at call time runs; a new one is translated on first use).
    Call with the graph's tensor inputs."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], kind: str) -> None:
        self._gm, self._specs = gm, input_specs(example_inputs)
        self.kind = kind
        self._boxed_call = True  # an instance attribute: Dynamo's wrappers copy __dict__, not the class
        self._on_cpu = _cpu_outputs(gm)
        self._mutated = mutated_inputs(gm)
        self._passthrough = _input_outputs(gm)
        self._checks = _input_checks(gm)
        self._programs: dict[str, tuple[str, Any, Any]] = {}  # precision -> (key, exported, jitted call)
        precision.sync()
        self._use(precision.current_name())
        self.random = len(self.exported.in_avals) > sum(isinstance(s, jax.ShapeDtypeStruct) for s in self._specs)

    def _use(self, matmul_precision: str) -> None:
        """Make the program for ``matmul_precision`` the one :meth:`__call__` runs (translated now
        when this graph has none for it yet)."""
        program = self._programs.get(matmul_precision)
        new = program is None
        if new:
            key = translation_key(self._gm, self._specs, matmul_precision)
            exported = _translate(self._gm, self._specs, key)
            program = self._programs[matmul_precision] = (key, exported, CompiledProgram(exported.call, key=key))
        self.precision, (self.key, self.exported, self._run) = matmul_precision, program
        dump_dir = knobs.DUMP_HLO.text()
        if new and dump_dir:
            try:
                self.dump(dump_dir)
            except OSError as e:  # a file of that name, no permission: name the variable, not the path alone
                raise knobs.KnobError(f"{knobs.DUMP_HLO.name}={dump_dir!r}: expected a folder the StableHLO can be "
                                      f"written into ({e.strerror or e})") from None

    def stablehlo(self) -> str:
        """The program as StableHLO text (MLIR)."""
        return self.exported.mlir_module()

    def dump(self, directory: str | os.PathLike) -> Path:
        """Write ``<kind>-<key>.stablehlo.mlir`` into ``directory`` and return its path."""
        path = Path(directory) / f"{self.kind}-{self.key[:16]}.stablehlo.mlir"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.stablehlo())
        return path

    def __call__(self, args: list[Any]) -> list[Any]:
        precision.sync()
        matmul_precision = precision.current_name()
        if matmul_precision != self.precision:
            self._use(matmul_precision)
        if self._checks and modes.get_eager_mode() is modes.EagerMode.DEBUG:
            _run_checks(self._checks, args)
        on_tpu = any(type(a) is TpuTensor for a in args)
        inputs = [to_jax(a) if type(a) is TpuTensor else cpu_to_jax(a) for a in args if isinstance(a, torch.Tensor)]
        updated = [args[i] for i in self._mutated]
        passed = {out: args[i] for out, i in self._passthrough.items()}
        args.clear()  # boxed calling convention: the inputs can be freed early
        if self.random:
            inputs.append(jax.random.key_data(tpu_random.next_key()))
        with cache.persistent():
            outputs = self._run(*inputs)
        if updated:
            outputs, updates = outputs[: -len(updated)], outputs[-len(updated):]
            with torch.no_grad():
                for target, value in zip(updated, updates):
                    target.copy_(from_jax(value) if type(target) is TpuTensor else _jax_to_cpu(value))
        return [passed[i] if i in passed else None if o is None else _jax_to_cpu(o)
                if self._on_cpu.get(i, not on_tpu) else from_jax(o) for i, o in enumerate(outputs)]


def _cpu_outputs(gm: torch.fx.GraphModule) -> dict[int, bool]:
    """Whether each graph output (by position) is a CPU tensor, for the outputs whose traced value
    says where they live."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = output.args[0] if isinstance(output.args[0], (list, tuple)) else (output.args[0],)
    on_cpu = {}
    for i, v in enumerate(values):
        val = v.meta.get("val") if isinstance(v, torch.fx.Node) else None
        if isinstance(val, torch.Tensor):
            on_cpu[i] = val.device.type == "cpu"
    return on_cpu


def _input_outputs(gm: torch.fx.GraphModule) -> dict[int, int]:
    """Output position -> graph input position, for the outputs that are graph inputs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = output.args[0] if isinstance(output.args[0], (list, tuple)) else (output.args[0],)
    return {i: placeholders.index(v) for i, v in enumerate(values)
            if isinstance(v, torch.fx.Node) and v.op == "placeholder"}


class _GraphInput(int):
    """A graph input's position, standing for it in a recorded op call."""


def _input_checks(gm: torch.fx.GraphModule) -> list[tuple[Any, tuple, dict]]:
    """(check, args, kwargs) of each op of ``gm`` with an eager input check whose tensor arguments are
    all graph inputs (a :class:`_GraphInput` each); calls on tensors computed in the graph are not checked."""
    position = {n: _GraphInput(i) for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    found = []
    for node in gm.graph.nodes:
        lowering = get_lowering(node.target) if node.op == "call_function" else None
        if lowering is None or lowering.check is None:
            continue
        nodes: list[torch.fx.Node] = []
        torch.fx.node.map_arg((node.args, node.kwargs), nodes.append)
        if all(n in position for n in nodes):
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), position.__getitem__)
            found.append((lowering.check, args, kwargs))
    return found


def _run_checks(checks: list[tuple[Any, tuple, dict]], inputs: list[Any]) -> None:
    """Run each recorded check on the concrete graph ``inputs`` (as JAX arrays)."""
    def value(x: Any) -> Any:
        if type(x) is not _GraphInput:
            return x
        given = inputs[x]
        return to_jax(given) if type(given) is TpuTensor else cpu_to_jax(given)

    for check, args, kwargs in checks:
        check(*torch.utils._pytree.tree_map(value, (args, kwargs)))


def _jax_to_cpu(array: jax.Array) -> torch.Tensor:
    return to_cpu(from_jax(array))
