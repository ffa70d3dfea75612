"""The ``torch.compile(backend="tpu")`` backend: Dynamo -> AOTAutograd (core ATen) -> registry -> XLA.

AOTAutograd splits training graphs into a forward and a backward graph; each becomes one
:class:`~torch_tpu.compile.program.graph.CompiledGraph` (one ``jax.jit`` program). Graphs with dynamic
dims (Dynamo's automatic dynamic shapes, ``mark_dynamic``, ``dynamic=True``) run padded to an upper
bound of each size, one program for a range of sizes (:mod:`torch_tpu.compile.dynamo.bounded`); a graph
whose symbolic trace fails is traced per concrete shape (:mod:`torch_tpu.compile.dynamo.specialize`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import unset_fake_temporarily

from torch_tpu.compile.collectives.collectives import SegmentedGraph, has_collectives, plan_steps
from torch_tpu.compile.collectives.fused_collectives import FusedGraph, NotFusable, fusing
from torch_tpu.compile.dynamo.bounded import BoundedGraph
from torch_tpu.compile.dynamo.specialize import SpecializedGraph, is_symbolic
from torch_tpu.compile.program.graph import CompiledGraph
from torch_tpu.ops import decompositions

BACKEND_NAME = "tpu"
_log = logging.getLogger(__name__)


@dataclasses.dataclass
class CompileStats:
    """What the backend compiled since the last :func:`reset_compile_stats`."""

    graphs: int = 0  # forward/backward/inference graphs handed to the backend
    recompiles: int = 0  # graphs whose ops were compiled before for other input shapes/dtypes


_stats = CompileStats()
_seen_structures: dict[str, set[str]] = {}  # graph code digest -> translation keys compiled for it
# weak: a graph (and its loaded executables) lives as long as Dynamo's cache holds it, not as long
# as the process (a process compiling many modules ran out of memory mappings); oldest first
_compiled: dict[int, weakref.ref] = {}
_compiled_ids = itertools.count()


def compile_stats() -> CompileStats:
    """A snapshot of the compile counters."""
    return dataclasses.replace(_stats)


def reset_compile_stats() -> None:
    _stats.graphs = 0
    _stats.recompiles = 0
    _seen_structures.clear()
    _compiled.clear()


def compiled_graphs() -> list[CompiledGraph | FusedGraph]:
    """Every program compiled since the last reset and still in use, oldest first (their
    ``stablehlo()`` is the program): a graph split at its collectives contributes one per segment."""
    return [graph for graph in (ref() for ref in list(_compiled.values())) if graph is not None]


def _note_compiled(graph: CompiledGraph | FusedGraph) -> None:
    key = next(_compiled_ids)
    _compiled[key] = weakref.ref(graph, lambda _, key=key: _compiled.pop(key, None))


def _graph_compiler(kind: str):
    def compile_graph(gm: torch.fx.GraphModule,
                      example_inputs: Sequence[Any]) -> CompiledGraph | SegmentedGraph | BoundedGraph:
        if is_symbolic(example_inputs):
            return BoundedGraph(gm, example_inputs, kind, compile_static)
        return compile_static(gm, example_inputs)

    def compile_static(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> CompiledGraph | SegmentedGraph:
        if has_collectives(gm):
            return _with_collectives(gm, example_inputs, kind)
        with unset_fake_temporarily():  # graph constants are real tensors: read their values
            compiled = CompiledGraph(gm, example_inputs, kind)
        # a graph compiled again for another matmul precision (Dynamo guards torch's) is no shape recompile
        structure = hashlib.sha256(f"{gm.code}\0{compiled.precision}".encode()).hexdigest()
        keys = _seen_structures.setdefault(structure, set())
        if keys and compiled.key not in keys:
            _stats.recompiles += 1
            shapes = [tuple(x.shape) for x in example_inputs if isinstance(x, torch.Tensor)]
            _log.warning(
                "torch_tpu.compile: recompiling the %s graph for new input shapes %s (%d recompiles so far); "
                "bound them with torch_tpu.compile.bucketed", kind, shapes, _stats.recompiles,
            )
        keys.add(compiled.key)
        _stats.graphs += 1
        _note_compiled(compiled)
        return compiled

    return compile_graph


def _with_collectives(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                      kind: str) -> SegmentedGraph | FusedGraph:
    """A graph with ``_c10d_functional`` collectives: one program per run of ops between them, the
    collectives run by the process group between them; inside ``fuse_collectives()`` one program
    with the collectives in it, where the graph allows."""
    steps = plan_steps(gm)
    if fusing():
        try:
            with unset_fake_temporarily():
                fused = FusedGraph(gm, kind, steps, list(example_inputs))
            _stats.graphs += 1
            _note_compiled(fused)
            return fused
        except NotFusable as e:
            _log.warning("torch_tpu.compile.fuse_collectives: the %s graph runs split at its collectives: %s",
                         kind, e)

    def compile_segment(sub: torch.fx.GraphModule, example_inputs: list[Any]) -> CompiledGraph:
        with unset_fake_temporarily():
            compiled = CompiledGraph(sub, example_inputs, kind)
        _note_compiled(compiled)
        return compiled

    segmented = SegmentedGraph(gm, kind, compile_segment, steps)
    _stats.graphs += 1
    return segmented


def _aot(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    return aot_autograd(
        fw_compiler=_graph_compiler("forward"),
        bw_compiler=_graph_compiler("backward"),
        inference_compiler=_graph_compiler("inference"),
        decompositions=decompositions.compile_table(gm.graph),
    )(gm, example_inputs)


_MAX_DYNAMIC_BUCKETS = 8
# TorchTPU's torch.compile(backend="tpu", options={...}) keys -> the check of the value
_OPTIONS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "async_compile": (lambda v: isinstance(v, bool), "a bool"),
    "num_dynamic_buckets": (lambda v: v is None or (type(v) is int and 1 <= v <= _MAX_DYNAMIC_BUCKETS),
                            f"an integer between 1 and {_MAX_DYNAMIC_BUCKETS}"),
    "bucket_size": (lambda v: v is None or (type(v) is int and v > 0), "a positive integer"),
    "serializable": (lambda v: isinstance(v, bool), "a bool"),
    "debug_callback": (lambda v: v is None or callable(v), "callable"),
    "custom_module_name": (lambda v: v is None or isinstance(v, str), "a str"),
    "name": (lambda v: v is None or isinstance(v, str), "a str"),
}


def check_options(options: Mapping[str, Any] | None) -> None:
    """TorchTPU's backend options, checked. The programs are the same with any of them: dynamic
    sizes get this backend's own bounds (``num_dynamic_buckets`` / ``bucket_size`` are TorchTPU's
    bucket layout), compilation is synchronous (``async_compile``), programs go to the persistent
    cache either way (``serializable``), and ``debug_callback`` / names are not used."""
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"torch.compile(backend='tpu'): options must be a dict of option names to values "
                        f"(known: {sorted(_OPTIONS)}), got {type(options).__name__} {options!r}")
    for key, value in (options or {}).items():
        if key not in _OPTIONS:
            raise ValueError(f"torch.compile(backend='tpu'): unknown option {key!r}; known: {sorted(_OPTIONS)}")
        ok, wanted = _OPTIONS[key]
        if not ok(value):
            raise ValueError(f"torch.compile(backend='tpu'): option {key!r} must be {wanted}, got {value!r}")


def _refuse_nested_inputs(example_inputs: Sequence[Any]) -> None:
    """A nested tensor graph input has a nested-int size the backend's symbolic shapes cannot hold
    (it failed with ``'NestedIntNode' object has no attribute 'expr'``); one built in the graph is fine."""
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.is_nested:
            raise NotImplementedError(
                f"torch.compile(backend='tpu'): an input is a nested tensor ({x.layout}, shape "
                f"{tuple(x.shape)}), which this backend does not take as a graph input; pass its "
                f"values() and offsets() and build it inside the compiled function "
                f"(torch.nested.nested_tensor_from_jagged)")


def tpu_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None) -> Any:
    """The Dynamo backend "tpu": FX graphs of tpu tensors -> compiled JAX programs. ``options``:
    ``torch.compile(backend="tpu", options={...})``, TorchTPU's keys (:func:`check_options`)."""
    check_options(options)
    _refuse_nested_inputs(example_inputs)
    torch.autograd.set_multithreading_enabled(False)  # device backward on a worker thread aborts under jax
    if is_symbolic(example_inputs):
        try:
            return _aot(gm, example_inputs)  # its graphs are BoundedGraphs
        except torch._dynamo.exc.RestartAnalysis:
            raise  # Dynamo's own control flow (it retraces with a float specialized)
        except Exception as e:  # noqa: BLE001 - any failure of the symbolic trace: trace per concrete shape
            _log.info("torch_tpu.compile: tracing with symbolic sizes failed (%s: %s); one trace per shape",
                      type(e).__name__, e)
            return SpecializedGraph(gm, example_inputs, _aot)
    return _aot(gm, example_inputs)


def register() -> None:
    """Make ``torch.compile(..., backend="tpu")`` available (idempotent). Without this import the
    name resolves too, through the ``torch_dynamo_backends`` entry point (pyproject.toml), whose
    loading imports this module: the name then already maps to the entry point and is left to it."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if BACKEND_NAME not in _BACKENDS:
        register_backend(tpu_backend, name=BACKEND_NAME)
