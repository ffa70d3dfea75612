"""Bounded dynamic shapes: one XLA program serves every size of a dynamic dim up to a bound.

XLA programs have static shapes. A forward, backward or inference graph that AOTAutograd traced
with symbolic sizes (``torch.compile(..., dynamic=True)``, ``torch._dynamo.mark_dynamic``, Dynamo's
automatic dynamic shapes) is compiled at an upper bound of every size symbol
(:mod:`torch_tpu.compile.dynamo.padded_rewrite`): its inputs are zero-padded to the bounds, the true
sizes enter the program as numbers, the program masks the padding wherever positions mix, and
outputs are sliced back to the true sizes, so results are exact. A bound is the shape
environment's upper bound of the symbol when it has a finite one (``mark_dynamic(x, 0, max=...)``),
else twice the first size seen; a larger size doubles it (one more program).

A graph with an op the rewrite cannot keep exact is compiled once per concrete size instead (the
reason is logged once); :func:`bounded_stats` counts both.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from torch_tpu.compile.dynamo.padded_rewrite import NotBoundable, StaticGraph, evaluate, rewrite, size_exprs
from torch_tpu.compile.program.fx_to_jax import LoweringShapeError

_log = logging.getLogger(__name__)
BOUND_LIMIT = 1 << 31  # a shape environment's upper bound above this is no bound


@dataclasses.dataclass
class BoundedStats:
    bounded_programs: int = 0  # programs compiled at bounds
    exact_programs: int = 0  # programs compiled for one concrete size (graphs the rewrite cannot bound)


_stats = BoundedStats()


def bounded_stats() -> BoundedStats:
    return dataclasses.replace(_stats)


def reset_bounded_stats() -> None:
    _stats.bounded_programs = _stats.exact_programs = 0


CompileStatic = Callable[[torch.fx.GraphModule, Sequence[Any]], Callable[[list[Any]], list[Any]]]


class _Program:
    """One static program of a symbolic graph and how to call it with true-size arguments."""

    def __init__(self, static: StaticGraph, compiled: Callable[[list[Any]], list[Any]]) -> None:
        self.symbols, self.run = static.symbols, compiled


class BoundedGraph:
    """A graph with symbolic sizes, called like a compiled graph (boxed: one list of arguments)."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], kind: str,
                 compile_static: CompileStatic) -> None:
        self.gm, self.kind, self._compile_static = gm, kind, compile_static
        self._boxed_call = True
        self._placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        self._outputs = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
        self._view_bases = _view_bases(self._placeholders, self._outputs)
        self._symbols = sorted({s for x in example_inputs for s in _free_symbols(x)}, key=str)
        self._shape_env = _shape_env(example_inputs)
        self._bounds: dict[sympy.Symbol, int] = {}
        self._programs: dict[tuple, _Program] = {}
        self.exact_reason: str | None = None
        try:  # decided once, from the graph: bounded, or one program per concrete size
            rewrite(gm, _hints(self._shape_env, self._symbols), masked=True)
        except NotBoundable as e:
            self._fall_back(str(e))

    @property
    def programs(self) -> int:
        return len(self._programs)

    def _fall_back(self, reason: str) -> None:
        self.exact_reason = reason
        _log.info("torch_tpu.compile: the %s graph with dynamic sizes runs one program per size: %s",
                  self.kind, reason)

    def __call__(self, args: list[Any]) -> list[Any]:
        values = self._true_sizes(args)
        if self.exact_reason is None:
            try:
                return self._call_bounded(args, values)
            except (NotBoundable, LoweringShapeError) as e:
                self._fall_back(str(e))
        key = ("exact", *(values[s] for s in self._symbols))
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = self._build(values, masked=False)
            _stats.exact_programs += 1
        return self._finish(program.run(self._tensor_args(args)), values, args)

    def _tensor_args(self, args: list[Any], bounds: dict[sympy.Symbol, int] | None = None) -> list[Any]:
        """The static program's arguments: the graph's, without its size arguments, padded to ``bounds``."""
        return [_pad(a, n, bounds) if bounds else a for a, n in zip(args, self._placeholders)
                if not isinstance(n.meta.get("val"), torch.SymInt)]

    def _call_bounded(self, args: list[Any], values: dict[sympy.Symbol, int]) -> list[Any]:
        for s in self._symbols:
            if s not in self._bounds:
                self._bounds[s] = self._first_bound(s, values[s])
            elif values[s] > self._bounds[s]:
                self._bounds[s] = max(values[s], 2 * self._bounds[s])
        key = ("bounded", *(self._bounds[s] for s in self._symbols))
        program = self._programs.get(key)
        if program is None:
            program = self._build(dict(self._bounds), masked=True)
            self._programs[key] = program
            _stats.bounded_programs += 1
        inputs = self._tensor_args(args, self._bounds)
        inputs += [torch.tensor(values[s], dtype=torch.int64) for s in program.symbols]
        return self._finish(program.run(inputs), values, args)

    def _first_bound(self, symbol: sympy.Symbol, size: int) -> int:
        upper = _shape_env_upper(self._shape_env, symbol)
        return upper if upper is not None and size <= upper else 2 * size

    def _build(self, bounds: dict[sympy.Symbol, int], masked: bool) -> _Program:
        static = rewrite(self.gm, bounds, masked)
        example = [n.meta["val"] for n in static.gm.graph.nodes if n.op == "placeholder"]
        return _Program(static, self._compile_static(static.gm, example))

    def _finish(self, outputs: list[Any], values: dict[sympy.Symbol, int], args: list[Any]) -> list[Any]:
        """Outputs sliced to the true sizes; sizes the graph returns, computed here; a graph input
        returned as an output is the caller's tensor. Empties ``args`` (the boxed convention)."""
        results = []
        for node, out in zip(self._outputs, outputs):
            val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
            if isinstance(node, torch.fx.Node) and node.op == "placeholder":
                results.append(args[self._placeholders.index(node)])
            elif isinstance(val, torch.SymInt):
                results.append(evaluate(val.node.expr, values))
            elif isinstance(val, torch.Tensor) and isinstance(out, torch.Tensor):
                sliced = out
                for d, e in enumerate(size_exprs(val)):
                    if e.free_symbols and out.shape[d] != evaluate(e, values):
                        sliced = sliced.narrow(d, 0, evaluate(e, values))
                results.append(out if sliced is out else sliced.contiguous())
            else:
                results.append(out)
        # AOTAutograd rebuilds an output that views an input or another output by the output's own
        # size, stride and offset when its views have symbolic sizes: give it the traced layout
        # over the real base (a program's outputs are fresh contiguous arrays)
        for i, (kind, j) in self._view_bases.items():
            base = args[j] if kind == "input" else results[j]
            val = self._outputs[i].meta["val"]
            layout = [[evaluate(_expr(x), values) for x in xs] for xs in (val.shape, val.stride())]
            results[i] = base.as_strided(*layout, evaluate(_expr(val.storage_offset()), values))
        args.clear()
        return results

    def _true_sizes(self, args: list[Any]) -> dict[sympy.Symbol, int]:
        values: dict[sympy.Symbol, int] = {}
        for node, a in zip(self._placeholders, args):
            val = node.meta.get("val")
            if isinstance(val, torch.SymInt) and isinstance(val.node.expr, sympy.Symbol):
                values[val.node.expr] = int(a)
            elif isinstance(val, torch.Tensor) and isinstance(a, torch.Tensor):
                for d, e in enumerate(size_exprs(val)):
                    if isinstance(e, sympy.Symbol):
                        values[e] = int(a.shape[d])
        missing = [s for s in self._symbols if s not in values]
        if missing:
            raise RuntimeError(
                f"torch.compile(backend='tpu'): the {self.kind} graph's sizes {missing} are not the size of any "
                "input dim; it cannot be run with bounded shapes"
            )
        return values


def _expr(x: Any) -> sympy.Expr:
    return x.node.expr if isinstance(x, torch.SymInt) else sympy.Integer(x)


def _view_bases(placeholders: list[torch.fx.Node], outputs: list[Any]) -> dict[int, tuple[str, int]]:
    """Output position -> ("input" | "output", position) of the tensor whose storage the output
    views, for outputs that view a graph input or (the whole storage of) another output."""
    def storage(node: Any) -> Any:
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.layout != torch.strided:
            return None
        return StorageWeakRef(val.untyped_storage())

    bases: dict[Any, tuple[str, int]] = {}
    for j, node in enumerate(placeholders):
        if (key := storage(node)) is not None:
            bases.setdefault(key, ("input", j))
    for j, node in enumerate(outputs):
        key, val = storage(node), getattr(node, "meta", {}).get("val")
        if key is not None and node.op != "placeholder" and val.storage_offset() == 0 and val.is_contiguous():
            bases.setdefault(key, ("output", j))
    views = {}
    for i, node in enumerate(outputs):
        base = bases.get(storage(node))
        if base is not None and node.op != "placeholder" and base != ("output", i):
            views[i] = base
    return views


def _free_symbols(x: Any) -> set[sympy.Symbol]:
    if isinstance(x, torch.SymInt):
        return set(x.node.expr.free_symbols)
    if isinstance(x, torch.Tensor):
        return {s for e in size_exprs(x) for s in e.free_symbols}
    return set()


def _shape_env(example_inputs: Sequence[Any]) -> Any:
    """The shape environment of the graph's symbolic sizes (None when none is symbolic)."""
    for x in example_inputs:
        sizes = [x] if isinstance(x, torch.SymInt) else [
            s for s in getattr(x, "shape", ()) if isinstance(s, torch.SymInt)]
        if sizes:
            return sizes[0].node.shape_env
    return None


def _hints(env: Any, symbols: list[sympy.Symbol]) -> dict[sympy.Symbol, int]:
    """Each symbol's example value (the shape environment's hint), for the up-front rewrite check."""
    if env is None:
        return {s: 2 for s in symbols}
    known = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val
    return {s: int(known.get(s, 2)) for s in symbols}


def _shape_env_upper(env: Any, symbol: sympy.Symbol) -> int | None:
    """The shape environment's finite upper bound of ``symbol`` (``mark_dynamic``'s ``max``)."""
    value_range = env.var_to_range.get(symbol) if env is not None else None
    if value_range is None:
        return None
    upper = value_range.upper
    return int(upper) if upper.is_finite and upper < BOUND_LIMIT else None


def _pad(x: Any, node: torch.fx.Node, bounds: dict[sympy.Symbol, int]) -> Any:
    """``x`` zero-padded at the end of every dim of dynamic size to its bound."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(x, torch.Tensor):
        return x
    widths = []
    for d in reversed(range(x.dim())):
        e = size_exprs(val)[d]
        widths += [0, evaluate(e, bounds) - x.shape[d] if e.free_symbols else 0]
    return torch.constant_pad_nd(x, widths) if any(widths) else x
