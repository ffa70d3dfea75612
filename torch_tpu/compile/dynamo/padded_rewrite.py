"""Rewrite an ATen graph traced with symbolic sizes into a static graph at given sizes.

``bounds`` gives every size symbol a static value. Exact (``masked=False``): the bounds are the true
sizes and every symbolic size becomes that integer. Masked: the bounds are upper bounds; the graph
then runs on inputs zero-padded to them, the true sizes arrive as extra 0-d int64 inputs (one per
symbol, in :attr:`StaticGraph.symbols` order), and positions past a true size ("padding") hold
arbitrary values. The rewrite keeps the real positions exact:

- row-local ops (pointwise, layout, per-row ops) need nothing: padding stays in padding;
- reductions and contractions over a padded dim mask the padding with their identity (0 for sums
  and products of contractions, -inf for max and softmax, ...), means divide by the true count,
  ``nll_loss`` ignores padded targets;
- a size used as a number (``loss / batch``) reads the true size; a size used as a shape the bound.

An op this module does not know to keep real positions exact raises :class:`NotBoundable`.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._sympy.functions import FloorDiv

aten = torch.ops.aten


class NotBoundable(Exception):
    """The graph has an op (or a use of a size) the masked rewrite cannot keep exact."""


def size_exprs(value: Any) -> list[sympy.Expr]:
    """The sympy expression of every dim of a (fake) tensor."""
    return [s.node.expr if isinstance(s, torch.SymInt) else sympy.Integer(s) for s in value.shape]


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
# runtime checks of size relations, which Dynamo's guards already made
_SIZE_ASSERTS = {aten._assert_scalar.default, aten.sym_constrain_range_for_size.default}


def evaluate(expr: sympy.Expr, values: dict[sympy.Symbol, int]) -> Any:
    """``expr`` at ``values``: an int, a float or a bool as the expression is."""
    v = expr.xreplace({s: sympy.Integer(v) for s, v in values.items()})
    if v.is_Boolean:
        return bool(v)
    return int(v) if v.is_Integer else float(v)


@dataclasses.dataclass(frozen=True)
class _Size:
    """A SymInt-valued node of the source graph: its expression over the size symbols."""

    expr: sympy.Expr


@dataclasses.dataclass
class StaticGraph:
    gm: torch.fx.GraphModule
    symbols: list[sympy.Symbol]  # the trailing size inputs of a masked graph, in order (empty when exact)


_SUMS = {aten.sum.dim_IntList, aten.sum.default}
_MEANS = {aten.mean.dim, aten.mean.default}
_IDENTITY_REDUCTIONS: dict[Any, str] = {
    **{op: "zero" for op in _SUMS},
    aten.prod.default: "one", aten.prod.dim_int: "one",
    aten.amax.default: "low", aten.amin.default: "high", aten.max.dim: "low", aten.min.dim: "high",
    aten.argmax.default: "low", aten.argmin.default: "high", aten.logsumexp.default: "low",
    aten.any.default: "false", aten.any.dim: "false", aten.any.dims: "false",
    aten.all.default: "true", aten.all.dim: "true", aten.all.dims: "true",
}
# ops whose every output position reads the same positions of the inputs along any dim (or the
# whole of a dim that is static); the checked ones verify their dim arguments
_LAYOUT = {
    aten.stack.default,
    aten.full.default, aten.empty.memory_format, aten.zeros.default, aten.ones.default, aten.scalar_tensor.default,
    aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
    aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default,
    aten.new_empty_strided.default, aten.empty_strided.default, aten.arange.default, aten.arange.start,
    aten.arange.start_step,
    aten.embedding.default, aten.gather.default, aten.cumsum.default, aten.cumprod.default,
}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
# op -> position of its dim argument, which must not name a dim of dynamic size
_DIM_MUST_BE_STATIC = {
    aten.select.int: 1, aten.cat.default: 1, aten.split.Tensor: 2, aten.split_with_sizes.default: 2,
    aten.unbind.int: 1, aten.index_select.default: 1, aten.scatter.value: 1, aten.scatter.src: 1,
    aten.scatter_add.default: 1, aten.scatter_reduce.two: 1,
}
# positions that may carry a size as a shape (the bound), per op; elsewhere a size in an int
# argument is an index or count whose value would change with the bound
_SHAPE_ARGS = {
    **{op: {1} for op in _VIEWS}, aten.expand.default: {1}, aten.full.default: {0}, aten.zeros.default: {0},
    aten.ones.default: {0}, aten.empty.memory_format: {0}, aten.empty_strided.default: {0},
    aten.new_zeros.default: {1}, aten.new_ones.default: {1}, aten.new_full.default: {1}, aten.new_empty.default: {1},
    aten.new_empty_strided.default: {1, 2}, aten.arange.default: {0}, aten.arange.start: {0, 1},
    aten.arange.start_step: {0, 1, 2},
    aten.slice.Tensor: {3},
}
_NUMBER_TYPES = ("number", "Tensor", "Optional[number]")


Layout = list[tuple[sympy.Expr, ...]]  # per dim: the sizes it is a row-major flattening of


def natural(value: Any) -> Layout:
    """Each dim its own size: real positions first along each dim."""
    return [(e,) for e in size_exprs(value)]


class _Rewriter:
    def __init__(self, gm: torch.fx.GraphModule, bounds: dict[sympy.Symbol, int], masked: bool) -> None:
        self.src, self.bounds, self.masked = gm, bounds, masked
        self.graph = torch.fx.Graph()
        self.env: dict[torch.fx.Node, Any] = {}
        self.layouts: dict[torch.fx.Node, Any] = {}  # a node's Layout (a list of them for several outputs)
        self.sizes: dict[sympy.Symbol, torch.fx.Node] = {}
        self._values: dict[sympy.Expr, Any] = {}
        self._fake_mode = FakeTensorMode(allow_non_fake_inputs=True)

    # -- sizes ---------------------------------------------------------------------------------
    def bound(self, expr: sympy.Expr) -> int:
        return evaluate(expr, self.bounds)

    def value(self, expr: sympy.Expr) -> Any:
        """The true value of ``expr`` inside the program: an int when it is constant (or the
        rewrite is exact), else a 0-d int64 tensor node."""
        if not self.masked or not expr.free_symbols:
            return self.bound(expr)
        if expr in self._values:
            return self._values[expr]
        if isinstance(expr, sympy.Symbol):
            out = self.sizes[expr]
        elif isinstance(expr, (sympy.Add, sympy.Mul)):
            op = aten.add.Tensor if isinstance(expr, sympy.Add) else aten.mul.Tensor
            terms = [self.value(a) for a in expr.args]
            tensors = [t for t in terms if isinstance(t, torch.fx.Node)]
            out = tensors[0]
            for t in tensors[1:] + [t for t in terms if not isinstance(t, torch.fx.Node)]:
                out = self.graph.call_function(op, (out, t))
        elif isinstance(expr, FloorDiv):
            out = self.graph.call_function(aten.div.Tensor_mode, (self.value(expr.args[0]), self.value(expr.args[1])),
                                           {"rounding_mode": "floor"})
        else:
            raise NotBoundable(f"the size expression {expr} ({type(expr).__name__})")
        self._values[expr] = out
        return out

    # -- layouts -------------------------------------------------------------------------------
    def layout(self, node: Any) -> Layout:
        if not isinstance(node, torch.fx.Node) or not isinstance(node.meta.get("val"), torch.Tensor):
            return []
        return self.layouts.get(node) or natural(node.meta["val"])

    def is_natural(self, node: Any) -> bool:
        if not isinstance(node, torch.fx.Node) or not isinstance(node.meta.get("val"), torch.Tensor):
            return True
        layout = self.layout(node)
        return layout == natural(node.meta["val"]) or not any(e.free_symbols for dim in layout for e in dim)

    def relayout(self, src: torch.fx.Node, dim: int, to: tuple[sympy.Expr, ...],
                 new: torch.fx.Node | None = None) -> torch.fx.Node:
        """``src``'s rewritten node (or ``new``) with ``dim`` laid out as a flattening of ``to``
        instead of its own components (the same sizes grouped otherwise): a gather whose indices
        come from the true sizes."""
        new = self.env[src] if new is None else new
        have = self.layout(src)[dim]
        device = src.meta["val"].device
        position = self.graph.call_function(aten.arange.start, (0, self.bound(sympy.Mul(*to))),
                                            {"dtype": torch.int64, "device": device})
        # the true row-major index of each target position, then its position in the source layout
        index = self._ravel(self._unravel(position, to, by_bounds=True), to, by_bounds=False)
        source = self._ravel(self._unravel(index, have, by_bounds=False), have, by_bounds=True)
        source = self.graph.call_function(aten.clamp.default, (source, 0, self.bound(sympy.Mul(*have)) - 1))
        return self.graph.call_function(aten.index_select.default, (new, dim, source))

    def _unravel(self, flat: torch.fx.Node, comps: tuple[sympy.Expr, ...], by_bounds: bool) -> list[torch.fx.Node]:
        coords = []
        for c in reversed(comps):
            size = self.bound(c) if by_bounds else self.value(c)
            coords.append(self.graph.call_function(aten.remainder.Tensor, (flat, size)))
            flat = self.graph.call_function(aten.div.Tensor_mode, (flat, size), {"rounding_mode": "floor"})
        return coords[::-1]

    def _ravel(self, coords: list[torch.fx.Node], comps: tuple[sympy.Expr, ...], by_bounds: bool) -> torch.fx.Node:
        flat = coords[0]
        for coord, c in zip(coords[1:], comps[1:]):
            size = self.bound(c) if by_bounds else self.value(c)
            flat = self.graph.call_function(aten.add.Tensor, (self.graph.call_function(aten.mul.Tensor, (flat, size)),
                                                              coord))
        return flat

    def natural_node(self, src: torch.fx.Node) -> torch.fx.Node:
        """``src``'s rewritten node with every dim laid out naturally (real positions first)."""
        new = self.env[src]
        for d, comps in enumerate(self.layout(src)):
            whole = (sympy.Mul(*comps),)
            if comps != whole and any(e.free_symbols for e in comps):
                new = self.relayout(src, d, whole, new)
        return new

    def padded_dims(self, node: Any) -> list[int]:
        return [d for d, comps in enumerate(self.layout(node)) if any(e.free_symbols for e in comps)]

    def mask(self, src: torch.fx.Node, dims: Sequence[int], fill: str | int | float,
             new: torch.fx.Node | None = None, layout: Layout | None = None) -> torch.fx.Node:
        """``src``'s rewritten node (or ``new``, laid out as ``layout``) with every padding position
        of ``dims`` set to ``fill``."""
        new = self.env[src] if new is None else new
        layout = self.layout(src) if layout is None else layout
        dims = [d for d in sorted(set(dims)) if any(e.free_symbols for e in layout[d])]
        if not self.masked or not dims:
            return new
        val = src.meta["val"]
        valid = None
        for d in dims:
            inside = self._dim_mask(layout[d], val.device)
            shape = [1] * val.dim()
            shape[d] = self.bound(sympy.Mul(*layout[d]))
            inside = self.graph.call_function(aten.view.default, (inside, shape))
            valid = inside if valid is None else self.graph.call_function(aten.logical_and.default, (valid, inside))
        filler = self.graph.call_function(aten.scalar_tensor.default, (_fill_value(fill, val.dtype),),
                                          {"dtype": val.dtype, "device": val.device})
        return self.graph.call_function(aten.where.self, (valid, new, filler))

    def _dim_mask(self, components: tuple[sympy.Expr, ...], device: Any) -> torch.fx.Node:
        """bool [bound of the dim]: the real positions of a dim flattened from ``components``."""
        out, size = None, 1
        for c in components:
            b = self.bound(c)
            positions = self.graph.call_function(aten.arange.start, (0, b), {"dtype": torch.int64, "device": device})
            inside = self.graph.call_function(aten.lt.Tensor, (positions, self.value(c)))
            if out is not None:
                pair = self.graph.call_function(aten.logical_and.default, (
                    self.graph.call_function(aten.view.default, (out, [size, 1])),
                    self.graph.call_function(aten.view.default, (inside, [1, b]))))
                inside = self.graph.call_function(aten.view.default, (pair, [size * b]))
            out, size = inside, size * b
        return out

    # -- arguments -----------------------------------------------------------------------------
    def _map_args(self, node: torch.fx.Node) -> tuple[tuple, dict]:
        op = node.target
        schema = getattr(op, "_schema", None)
        positions = {a.name: i for i, a in enumerate(schema.arguments)} if schema is not None else {}
        types = [str(a.type) for a in schema.arguments] if schema is not None else []

        def convert(x: Any, position: int | None) -> Any:
            if isinstance(x, torch.fx.Node):
                x = self.env[x]
            if isinstance(x, (list, tuple)):
                return type(x)(convert(v, position) for v in x)
            if not isinstance(x, _Size):
                return x
            if not self.masked or not x.expr.free_symbols:
                return self.bound(x.expr)
            if position is not None and position in _SHAPE_ARGS.get(op, ()):
                return self.bound(x.expr)
            if position is not None and position < len(types) and types[position] in _NUMBER_TYPES:
                return self.value(x.expr)
            raise NotBoundable(f"{op} takes the size {x.expr} as argument {position}, an index or count")

        args = tuple(convert(a, i) for i, a in enumerate(node.args))
        kwargs = {k: convert(v, positions.get(k)) for k, v in node.kwargs.items()}
        return args, kwargs

    # -- nodes ---------------------------------------------------------------------------------
    def run(self) -> StaticGraph:
        placeholders = [n for n in self.src.graph.nodes if n.op == "placeholder"]
        for node in placeholders:
            val = node.meta.get("val")
            if isinstance(val, _SYMBOLIC):
                self.env[node] = _Size(val.node.expr)
            else:
                self.env[node] = self._copy(node)
        symbols = sorted(self.bounds, key=str) if self.masked else []
        for s in symbols:
            self.sizes[s] = self.graph.placeholder(f"size_{s}")
            with self._fake_mode:
                self.sizes[s].meta["val"] = torch.empty((), dtype=torch.int64)
        for node in self.src.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                outs = torch.fx.node.map_arg(node.args[0], self._output_value)
                self.graph.output(_without_sizes(outs))
                continue
            if node.op == "get_attr":
                self.env[node] = self._copy(node)
                continue
            if isinstance(node.meta.get("val"), _SYMBOLIC):
                self.env[node] = _Size(node.meta["val"].node.expr)
                continue
            if node.target in _SIZE_ASSERTS:
                continue
            self.env[node] = self._op(node)
        gm = torch.fx.GraphModule(self.src, self.graph)
        return StaticGraph(gm, symbols)

    def _output_value(self, node: torch.fx.Node) -> Any:
        """Outputs are sliced back per dim on the host: real positions first."""
        return self.env[node] if self.is_natural(node) else self.natural_node(node)

    def _copy(self, node: torch.fx.Node) -> torch.fx.Node:
        new = self.graph.node_copy(node, lambda n: self.env[n])
        self._static_meta(node, new)
        return new

    def _static_meta(self, src: torch.fx.Node, new: torch.fx.Node) -> None:
        """``new``'s traced value at the bounds: the lowering's result is checked against it."""
        val = src.meta.get("val")

        def at_bounds(v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                with self._fake_mode:
                    return torch.empty([self.bound(e) for e in size_exprs(v)], dtype=v.dtype, device=v.device)
            if isinstance(v, _SYMBOLIC):
                return None
            return v

        new.meta = dict(src.meta)
        if val is not None:
            new.meta["val"] = torch.utils._pytree.tree_map(at_bounds, val)

    def _op(self, node: torch.fx.Node) -> torch.fx.Node:
        op = node.target
        if node.op != "call_function":
            raise NotBoundable(f"a {node.op} node")
        args, kwargs = self._map_args(node)
        if op is operator.getitem:
            parent = self.layouts.get(node.args[0])
            if isinstance(parent, list) and parent and isinstance(parent[0], list):
                self.layouts[node] = parent[node.args[1]]
            return self._emit(node, op, args, kwargs)
        touched = [a for a in node.all_input_nodes if self.padded_dims(a)] + ([node] if self.padded_dims(node) else [])
        if not self.masked or not touched:
            return self._emit(node, op, args, kwargs)
        rule = _rule_for(op)
        if rule is None:
            raise NotBoundable(f"{op} on a dim of dynamic size")
        if rule not in _LAYOUT_AWARE and not all(self.is_natural(a) for a in node.all_input_nodes):
            raise NotBoundable(f"{op} on dims flattened from several dynamic sizes")
        return rule(self, node, args, kwargs)

    def _emit(self, node: torch.fx.Node, op: Any, args: tuple, kwargs: dict) -> torch.fx.Node:
        new = self.graph.call_function(op, args, kwargs)
        self._static_meta(node, new)
        return new


def _without_sizes(outs: Any) -> Any:
    """Graph outputs with sizes replaced by None (the caller computes them on the host)."""
    return torch.utils._pytree.tree_map(lambda v: None if isinstance(v, _Size) else v, outs)


def _fill_value(fill: str | int | float, dtype: torch.dtype) -> Any:
    if not isinstance(fill, str):
        return fill
    if dtype == torch.bool:
        return {"zero": False, "false": False, "true": True, "one": True, "low": False, "high": True}[fill]
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    low = -math.inf if dtype.is_floating_point else info.min
    high = math.inf if dtype.is_floating_point else info.max
    return {"zero": 0, "false": 0, "one": 1, "true": 1, "low": low, "high": high}[fill]


def _reduced(dims: Any, rank: int) -> set[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return set(range(rank))
    dims = [dims] if isinstance(dims, int) else dims
    return {d % max(rank, 1) for d in dims}


def _dim_arg(node: torch.fx.Node, position: int, name: str, default: Any = None) -> Any:
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


# -- rules: (rewriter, node, mapped args, mapped kwargs) -> new node -----------------------------
# A rule emits the op (masking inputs as needed) and records the output's layout when it is not
# natural; rules in _LAYOUT_AWARE also accept inputs whose dims are flattened from several sizes.
Rule = Callable[[_Rewriter, torch.fx.Node, tuple, dict], torch.fx.Node]


def _row_local(rw: _Rewriter, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.fx.Node:
    return rw._emit(node, node.target, args, kwargs)


def _same_layout(rw: _Rewriter, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.fx.Node:
    """The output laid out as the first input (copies, casts, softmax-like ops)."""
    rw.layouts[node] = rw.layout(node.args[0])
    return _row_local(rw, node, args, kwargs)


def _pointwise(rw: _Rewriter, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.fx.Node:
    """Broadcasting: each output dim laid out as the inputs' dims of its size, which must agree."""
    out = natural(node.meta["val"])
    for a in node.all_input_nodes:
        layout = rw.layout(a)
        for k, comps in enumerate(layout):
            d = len(out) - len(layout) + k
            if size_exprs(a.meta["val"])[k] == 1 and out[d] != (sympy.Integer(1),):
                continue  # broadcast
            if comps != out[d]:
                if not rw.is_natural(a) and out[d] != natural(node.meta["val"])[d]:
                    raise NotBoundable(f"{node.target} on dims laid out as {out[d]} and {comps}")
                if any(e.free_symbols for e in comps):
                    out[d] = comps
    rw.layouts[node] = out
    return _row_local(rw, node, args, kwargs)


def _permute(rw: _Rewriter, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.fx.Node:
    layout = rw.layout(node.args[0])
    rank = len(layout)
    if node.target is aten.permute.default:
        order = [d % rank for d in node.args[1]]
    else:
        order = list(range(rank))
        a, b = (0, 1) if node.target is aten.t.default else (node.args[1] % rank, node.args[2] % rank)
        if rank >= 2:
            order[a], order[b] = order[b], order[a]
    rw.layouts[node] = [layout[d] for d in order]
    return _row_local(rw, node, args, kwargs)


def _view(rw: _Rewriter, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.fx.Node:
    """Views regroup the sizes the source dims are flattened from (squeeze, unsqueeze, view,
    reshape): a dynamic size may be split only into itself over static sizes."""
    one = sympy.Integer(1)
    comps = [c for dim in rw.layout(node.args[0]) for c in dim if c != one]
    out: Layout = []
    for e in size_exprs(node.meta["val"]):
        group: list[sympy.Expr] = []
        while sympy.simplify(sympy.Mul(*group) - e) != 0:
            if not comps:
                raise NotBoundable(f"{node.target} to {size_exprs(node.meta['val'])}: sizes do not regroup")
            c, rest = comps.pop(0), sympy.simplify(e / sympy.Mul(*group))
            if sympy.simplify(c / rest).is_Integer and c != rest:  # c splits into rest x static
                inner = sympy.simplify(c / rest)
                if not rest.free_symbols and c.free_symbols:
                    raise NotBoundable(f"{node.target} splits the dynamic size {c} into {rest} x {inner}")
                group.append(rest)
                comps.insert(0, inner)
            else:
                group.append(c)
        out.append(tuple(group) or (one,))
    if comps:
        raise NotBoundable(f"{node.target} to {size_exprs(node.meta['val'])}: sizes do not regroup")
    rw.layouts[node] = out
    return _row_local(rw, node, args, kwargs)


def _expand(rw: _Rewriter, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.fx.Node:
    src, out = rw.layout(node.args[0]), natural(node.meta["val"])
    for k, comps in enumerate(src):
        d = len(out) - len(src) + k
        if size_exprs(node.args[0].meta["val"])[k] != 1:
            out[d] = comps
    rw.layouts[node] = out
    return _row_local(rw, node, args, kwargs)


def _static_dim(rw: _Rewriter, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.fx.Node:
    position = _DIM_MUST_BE_STATIC[node.target]
    tensors = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
    dim = _dim_arg(node, position, "dim", 0)
    for t in tensors:
        rank = t.meta["val"].dim()
        if rank and dim % rank in rw.padded_dims(t):
            raise NotBoundable(f"{node.target} along a dim of dynamic size")
    return _row_local(rw, node, args, kwargs)


def _slice(rw: _Rewriter, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.fx.Node:
    dim = _dim_arg(node, 1, "dim", 0)
    rank = node.args[0].meta["val"].dim()
    start = _dim_arg(node, 2, "start", 0)
    if dim % rank in rw.padded_dims(node.args[0]) and not (start is None or (isinstance(start, int) and start >= 0)):
        raise NotBoundable(f"{node.target} from a start that depends on a dynamic size")
    return _row_local(rw, node, args, kwargs)


def _pad(rw: _Rewriter, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.fx.Node:
    pads, rank = node.args[1], node.args[0].meta["val"].dim()
    for d in rw.padded_dims(node.args[0]):
        after = rank - 1 - d
        if 2 * after + 1 < len(pads) and pads[2 * after + 1] != 0:
            raise NotBoundable("constant_pad_nd at the end of a dim of dynamic size")
    return _row_local(rw, node, args, kwargs)


def _kept_dims(rw: _Rewriter, node: torch.fx.Node, reduced: set[int], keepdim: bool) -> None:
    layout = rw.layout(node.args[0])
    kept = [(sympy.Integer(1),) if d in reduced else comps for d, comps in enumerate(layout)
            if keepdim or d not in reduced]
    rw.layouts[node] = [kept, kept] if isinstance(node.meta["val"], (list, tuple)) else kept


def _identity_reduction(rw: _Rewriter, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.fx.Node:
    src = node.args[0]
    dim_arg = _dim_arg(node, 1, "dim")
    dims = _reduced(dim_arg, src.meta["val"].dim())
    hit = [d for d in rw.padded_dims(src) if d in dims]
    if node.target in (aten.argmax.default, aten.argmin.default) and dim_arg is None and hit:
        raise NotBoundable(f"{node.target} over all dims: a flat index past a dynamic size")
    if hit:
        args = (rw.mask(src, hit, _IDENTITY_REDUCTIONS[node.target]), *args[1:])
    _kept_dims(rw, node, dims, bool(_dim_arg(node, 2, "keepdim", False)) and dim_arg is not None)
    return rw._emit(node, node.target, args, kwargs)


def _mean(rw: _Rewriter, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.fx.Node:
    src = node.args[0]
    dims = sorted(_reduced(_dim_arg(node, 1, "dim") if node.target is aten.mean.dim else None, src.meta["val"].dim()))
    keepdim = bool(_dim_arg(node, 2, "keepdim", False)) if node.target is aten.mean.dim else False
    _kept_dims(rw, node, set(dims), keepdim)
    hit = [d for d in rw.padded_dims(src) if d in dims]
    if not hit:
        return _row_local(rw, node, args, kwargs)
    dtype = kwargs.get("dtype")
    total = rw.graph.call_function(aten.sum.dim_IntList, (rw.mask(src, hit, "zero"), dims, keepdim),
                                   {"dtype": dtype} if dtype is not None else {})
    count = rw.value(sympy.Mul(*[c for d in dims for c in rw.layout(src)[d]]))
    return rw._emit(node, aten.div.Tensor, (total, count), {})


def _contraction(rw: _Rewriter, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.fx.Node:
    """mm / addmm / bmm / baddbmm: output rows and columns laid out as the operands'; the contracted
    dim masked to 0 in both operands."""
    batched = node.target in (aten.bmm.default, aten.baddbmm.default)
    first = 1 if node.target in (aten.addmm.default, aten.baddbmm.default) else 0
    a, b = node.args[first], node.args[first + 1]
    la, lb = rw.layout(a), list(rw.layout(b))
    k_a, k_b = (2, 1) if batched else (1, 0)
    new_b = rw.env[b]
    for da, db in ((k_a, k_b), (0, 0)) if batched else ((k_a, k_b),):
        if la[da] != lb[db]:  # the same sizes grouped otherwise: b regrouped as a
            if sympy.simplify(sympy.Mul(*la[da]) - sympy.Mul(*lb[db])) != 0:
                raise NotBoundable(f"{node.target} over operands laid out as {la} and {lb}")
            new_b = rw.relayout(b, db, la[da], new_b)
            lb[db] = la[da]
    new_args = list(args)
    new_args[first] = rw.mask(a, [k_a], "zero")
    new_args[first + 1] = rw.mask(b, [k_b], "zero", new=new_b, layout=lb)
    rw.layouts[node] = [la[0], la[1], lb[2]] if batched else [la[0], lb[1]]
    if first and rw.padded_dims(node.args[0]):
        raise NotBoundable(f"{node.target} adds a bias of dynamic size")
    return rw._emit(node, node.target, tuple(new_args), kwargs)


def _mask_all_inputs(fill: str) -> Rule:
    """Ops that sum over the dynamic dims of their inputs (gradient reductions): every tensor
    input's padding set to ``fill`` first."""
    def rule(rw: _Rewriter, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.fx.Node:
        new_args = list(args)
        for i, a in enumerate(node.args):
            if isinstance(a, torch.fx.Node) and rw.padded_dims(a):
                new_args[i] = rw.mask(a, rw.padded_dims(a), fill)
        return rw._emit(node, node.target, tuple(new_args), kwargs)
    return rule


def _softmax(fill_input: str) -> Rule:
    """softmax-like ops along ``dim``: padding along it set to ``fill_input`` in the first input
    (and 0 in a second, the saved output of a backward)."""
    def rule(rw: _Rewriter, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.fx.Node:
        first = node.args[0]
        tensors = [a for a in node.args if isinstance(a, torch.fx.Node)]
        dim = next(a for a in node.args[len(tensors):] if isinstance(a, int)) % max(first.meta["val"].dim(), 1)
        if any(rw.layout(t) != rw.layout(first) for t in tensors):
            raise NotBoundable(f"{node.target} over inputs laid out differently")
        if dim not in rw.padded_dims(first):
            return _same_layout(rw, node, args, kwargs)
        new_args = list(args)
        for i, t in enumerate(tensors):
            new_args[i] = rw.mask(t, [dim], fill_input if i == 0 else "zero")
        return _same_layout(rw, node, tuple(new_args), kwargs)
    return rule


def _nll_loss(rw: _Rewriter, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.fx.Node:
    """Padded samples get the ignored target (and 0 inputs): they add neither loss nor weight."""
    backward = node.target in (aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
    offset = 1 if backward else 0
    source, target = node.args[offset], node.args[offset + 1]
    if any(d != 0 for d in rw.padded_dims(source) + rw.padded_dims(target)):
        raise NotBoundable("nll_loss with a dynamic size past the batch dim")
    ignore_index = args[offset + 4]
    new_args = list(args)
    new_args[offset] = rw.mask(source, [0], "zero")
    new_args[offset + 1] = rw.mask(target, [0], ignore_index)
    if backward:
        new_args[0] = rw.mask(node.args[0], rw.padded_dims(node.args[0]), "zero")
    return rw._emit(node, node.target, tuple(new_args), kwargs)


def _layer_norm(rw: _Rewriter, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.fx.Node:
    backward = node.target is aten.native_layer_norm_backward.default
    source = node.args[1] if backward else node.args[0]
    normalized = len(node.args[2] if backward else node.args[1])
    layout = rw.layout(source)
    rank = len(layout)
    if any(d >= rank - normalized for d in rw.padded_dims(source)):
        raise NotBoundable("layer_norm over a dim of dynamic size")
    if backward:
        rw.layouts[node] = [layout, natural(node.meta["val"][1]) if node.meta["val"][1] is not None else [],
                            natural(node.meta["val"][2]) if node.meta["val"][2] is not None else []]
        return _mask_all_inputs("zero")(rw, node, args, kwargs)
    stats = layout[: rank - normalized] + [(sympy.Integer(1),)] * normalized
    rw.layouts[node] = [layout, stats, stats]
    return _row_local(rw, node, args, kwargs)


def _leading_only(backward: bool) -> Rule:
    """convolution (and its backward): a dynamic batch dim only; the backward's weight gradient sums
    over it."""
    def rule(rw: _Rewriter, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.fx.Node:
        for a in node.all_input_nodes:
            if any(d != 0 for d in rw.padded_dims(a)):
                raise NotBoundable(f"{node.target} with a dynamic size past the batch dim")
        return (_mask_all_inputs("zero") if backward else _row_local)(rw, node, args, kwargs)
    return rule


def _leading_slices(rw: _Rewriter, node: torch.fx.Node) -> int:
    """How many leading dims of ``node.args[0]`` its index list leaves whole (``None``); the
    index tensors must be of static size."""
    indices = list(node.args[1])
    whole = 0
    while whole < len(indices) and indices[whole] is None:
        whole += 1
    if any(isinstance(i, torch.fx.Node) and rw.padded_dims(i) for i in indices):
        raise NotBoundable(f"{node.target} with indices of dynamic size")
    return whole


def _index(rw: _Rewriter, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.fx.Node:
    """``x[:, idx, ...]``: dynamic dims only among the leading whole dims, which stay in front."""
    whole = _leading_slices(rw, node)
    if any(d >= whole for d in rw.padded_dims(node.args[0])):
        raise NotBoundable(f"{node.target} indexing a dim of dynamic size")
    return _row_local(rw, node, args, kwargs)


def _index_put(rw: _Rewriter, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.fx.Node:
    """Writes at static indices of the dims after the leading whole ones (``x[:, idx] += v``) stay
    per row; accumulating writes into a tensor of static size get 0 from padded values."""
    target, values = node.args[0], node.args[2]
    if not rw.padded_dims(target):
        if not _dim_arg(node, 3, "accumulate", False):
            raise NotBoundable(f"{node.target} writing values of dynamic count")
        new_args = list(args)
        new_args[2] = rw.mask(values, rw.padded_dims(values), "zero")
        return rw._emit(node, node.target, tuple(new_args), kwargs)
    whole = _leading_slices(rw, node)
    if any(d >= whole for d in rw.padded_dims(target)):
        raise NotBoundable(f"{node.target} writing along a dim of dynamic size")
    return _row_local(rw, node, args, kwargs)


def _embedding_backward(rw: _Rewriter, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.fx.Node:
    if _dim_arg(node, 4, "scale_grad_by_freq", False):
        raise NotBoundable("embedding_dense_backward with scale_grad_by_freq counts padded ids")
    return _mask_all_inputs("zero")(rw, node, args, kwargs)


_SAME_LAYOUT = {aten.alias.default, aten.clone.default, aten._to_copy.default, aten.detach.default,
                aten.lift_fresh_copy.default, aten.copy.default}
_PERMUTES = {aten.permute.default, aten.transpose.int, aten.t.default}
_RESHAPES = _VIEWS | {aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims}
_CONTRACTIONS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
_RULES: dict[Any, Rule] = {
    **{op: _row_local for op in _LAYOUT}, **{op: _same_layout for op in _SAME_LAYOUT},
    **{op: _permute for op in _PERMUTES}, **{op: _view for op in _RESHAPES}, aten.expand.default: _expand,
    **{op: _static_dim for op in _DIM_MUST_BE_STATIC}, **{op: _identity_reduction for op in _IDENTITY_REDUCTIONS},
    **{op: _mean for op in _MEANS}, **{op: _contraction for op in _CONTRACTIONS},
    aten.slice.Tensor: _slice, aten.constant_pad_nd.default: _pad, aten.dot.default: _mask_all_inputs("zero"),
    aten._softmax.default: _softmax("low"), aten._log_softmax.default: _softmax("low"),
    aten._softmax_backward_data.default: _softmax("zero"), aten._log_softmax_backward_data.default: _softmax("zero"),
    aten.nll_loss_forward.default: _nll_loss, aten.nll_loss_backward.default: _nll_loss,
    aten.nll_loss2d_forward.default: _nll_loss, aten.nll_loss2d_backward.default: _nll_loss,
    aten.native_layer_norm.default: _layer_norm, aten.native_layer_norm_backward.default: _layer_norm,
    aten.convolution.default: _leading_only(False), aten.convolution_backward.default: _leading_only(True),
    aten.embedding_dense_backward.default: _embedding_backward, aten.index_put.default: _index_put,
    aten.index.Tensor: _index, aten._unsafe_index.Tensor: _index,
}
_LAYOUT_AWARE = {_same_layout, _pointwise, _permute, _view, _expand, _identity_reduction, _mean, _contraction,
                 _RULES[aten._softmax.default], _RULES[aten._log_softmax.default],
                 _RULES[aten._softmax_backward_data.default], _RULES[aten._log_softmax_backward_data.default],
                 _layer_norm}


def _rule_for(op: Any) -> Rule | None:
    if isinstance(op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags:
        return None  # random draws over padded shapes would differ from the draws at the true size
    rule = _RULES.get(op)
    if rule is None and isinstance(op, torch._ops.OpOverload) and torch.Tag.pointwise in op.tags:
        return _pointwise
    return rule


def rewrite(gm: torch.fx.GraphModule, bounds: dict[sympy.Symbol, int], masked: bool) -> StaticGraph:
    """The static graph of ``gm`` at ``bounds`` (see the module docstring)."""
    return _Rewriter(gm, bounds, masked).run()
