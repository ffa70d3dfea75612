"""Translate a core-ATen FX graph into one pure JAX function through the shared op registry.

Every ``call_function`` node must be an aten ``OpOverload`` with a lowering in
``torch_tpu.ops.registry`` (or ``operator.getitem`` on a multi-output node), or a higher-order op
lowered here: ``torch.ops.higher_order.scan`` becomes one ``jax.lax.scan`` (an XLA while loop whose
body is the combine graph, translated once: the program does not grow with the sequence length;
AOTAutograd's backward of a scan is a reversed scan, lowered the same way), or AOTAutograd's
``auto_functionalized(_v2)`` of a mutating custom op, which runs the graph of the op's own
implementation (:mod:`torch_tpu.compile.program.auto_functionalized`). The exception is
``aten.copy_`` into a graph input: AOTAutograd keeps a backward's in-place updates of its inputs
(a fused optimizer writing its table) as such copies; the function returns each updated input's
new value after the graph's outputs (:func:`mutated_inputs` names them). Random lowerings draw
their keys from one key-data argument appended after the graph inputs, so the traced function is
pure and exportable.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from torch_tpu.compile.program.auto_functionalized import (
    NotTraceable,
    functional_body,
    is_auto_functionalized,
    tensor_arguments,
)
from torch_tpu.ops.registry import Lowering, get_lowering
from torch_tpu.runtime._jax import jax
from torch_tpu.runtime.dtypes import to_jax_dtype
from torch_tpu.runtime.tensor import TpuTensor, cpu_to_jax, to_jax


def _traced_shape(node: torch.fx.Node) -> tuple[int, ...] | None:
    """The node's output shape as the graph was traced, when every size is a number (a data-dependent
    size that tracing equated with a number, e.g. a mask's count with the rows of ``values``, counts)."""
    shape = getattr(node.meta.get("val"), "shape", None)
    if shape is None:
        return None
    sizes = [s if isinstance(s, int) else s.node.maybe_as_int() for s in shape]
    return None if any(s is None for s in sizes) else tuple(sizes)


def _has_mask(node: torch.fx.Node) -> bool:
    indices = node.args[1] if len(node.args) > 1 else ()
    return any(getattr(getattr(i, "meta", {}).get("val"), "dtype", None) in (torch.bool, torch.uint8)
               for i in indices if isinstance(i, torch.fx.Node))


def _index_in_graph(node: torch.fx.Node, value_of: Callable[[torch.fx.Node], Any], self: Any, indices: list) -> Any:
    from torch_tpu.ops.lowerings.indexing import index_traced_as

    return index_traced_as(self, indices, _traced_shape(node))


def _index_refused(node: torch.fx.Node) -> str | None:
    return "output shape depends on values" if _has_mask(node) and _traced_shape(node) is None else None


def _polygamma_refused(node: torch.fx.Node) -> str | None:
    return f"order n={node.args[0]}: only n <= 1 is lowered" if node.args[0] > 1 else None


def _swaps_last_two(node: Any, rank: int) -> bool:
    """Whether ``node`` is a transpose of a ``rank``-D tensor swapping its last two dims."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or len(_traced_shape(node) or ()) != rank:
        return False
    if node.target is torch.ops.aten.t.default:
        return rank == 2
    if node.target is torch.ops.aten.permute.default:
        return [d % rank for d in node.args[1]] == [*range(rank - 2), rank - 1, rank - 2]
    if node.target is torch.ops.aten.transpose.int:
        return {node.args[1] % rank, node.args[2] % rank} == {rank - 2, rank - 1}
    return False


def _unswapped(node: torch.fx.Node, rank: int) -> tuple[torch.fx.Node, bool]:
    """The tensor a chain of last-two-dim swaps starts from, and whether the chain transposes it."""
    transposed = False
    while _swaps_last_two(node, rank):
        node, transposed = node.args[0], not transposed
    return node, transposed


def _product_in_graph(rank: int, product: Callable[..., Any], first: int = 0) -> Callable[..., Any]:
    """A graph lowering of a product whose operands (args ``first`` and ``first + 1``) go to
    ``product`` as the tensors their transposes start from, with transpose flags."""
    def lowering(node: torch.fx.Node, value_of: Callable[[torch.fx.Node], Any], *args: Any, **kwargs: Any) -> Any:
        (a, trans_a), (b, trans_b) = (_unswapped(node.args[first + i], rank) for i in (0, 1))
        return product(*args[:first], value_of(a), value_of(b), trans_a, trans_b, **kwargs)

    return lowering


def _linalg(name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        from torch_tpu.ops.lowerings import linalg

        return getattr(linalg, name)(*args, **kwargs)

    return call


# Ops lowered in graphs for some of their nodes only: (why this node is not, or None; its lowering by
# the node and the values of the graph's nodes, or None for the registry's). aten.index.Tensor: a
# boolean mask's output shape depends on values, unless the graph traced it to static sizes
# (node.meta["val"]), which the lowering then takes. aten.bmm/mm/addmm: an operand transposed in its
# last two dims goes to the product as a transpose flag, not a transposed copy (DLRM's interaction
# and its gradients: the [B, 64, 27] copy took a tenth of their time on XLA:CPU at the anchor's
# batch; a linear layer's weight.t() would be copied before the GEMM kernel every step).
_BY_NODE: dict[Any, tuple[Callable[[torch.fx.Node], str | None], Callable[..., Any] | None]] = {
    torch.ops.aten.index.Tensor: (_index_refused, _index_in_graph),
    torch.ops.aten.polygamma.default: (_polygamma_refused, None),
    torch.ops.aten.bmm.default: (lambda node: None, _product_in_graph(3, _linalg("bmm_transposed"))),
    torch.ops.aten.mm.default: (lambda node: None, _product_in_graph(2, _linalg("mm_transposed"))),
    torch.ops.aten.addmm.default: (lambda node: None, _product_in_graph(2, _linalg("addmm_transposed"), first=1)),
}


class UnloweredOpError(NotImplementedError):
    """A graph uses ops the registry cannot lower."""


class LoweringShapeError(RuntimeError):
    """A lowering's result disagrees with the shape/dtype PyTorch's meta kernel gave the graph."""


def check_against_meta(node: torch.fx.Node, value: Any) -> None:
    """Raise :class:`LoweringShapeError` when ``value`` (a node's traced JAX result) differs in
    shape or dtype from the fake tensor(s) the graph was traced with (``node.meta["val"]``)."""
    expected = node.meta.get("val")
    if expected is None:
        return
    got = jax.tree_util.tree_leaves(value)
    want = [e for e in torch.utils._pytree.tree_leaves(expected) if isinstance(e, torch.Tensor)]
    arrays = [g for g in got if hasattr(g, "shape") and hasattr(g, "dtype")]
    if len(arrays) != len(want):
        return  # optional outputs (None) flatten differently; nothing to compare one to one
    for i, (g, e) in enumerate(zip(arrays, want)):
        if any(not isinstance(s, int) for s in e.shape):
            continue  # symbolic size: checked once specialized
        if tuple(g.shape) != tuple(e.shape) or to_jax_dtype(e.dtype) != g.dtype:
            raise LoweringShapeError(
                f"torch.compile(backend='tpu'): the lowering of {node.target} returned output {i} as "
                f"{g.dtype}{list(g.shape)}, but PyTorch's meta kernel gives {e.dtype}{list(e.shape)}; "
                "a lowering must follow the meta kernel (fix it in the torch_tpu registry)"
            )


# collectives are lowered by the SPMD program that runs the graph (``to_jax_function(collectives=)``)
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd"})


def is_collective(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and node.target.namespace in COLLECTIVE_NAMESPACES)


def _is_input_update(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target is torch.ops.aten.copy_.default
            and isinstance(node.args[0], torch.fx.Node) and node.args[0].op == "placeholder")


def mutated_inputs(gm: torch.fx.GraphModule) -> list[int]:
    """Positions (among the graph inputs) of the inputs the graph updates in place, in the order
    their new values follow the outputs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    updated = [node.args[0] for node in gm.graph.nodes if _is_input_update(node)]
    if len(set(updated)) != len(updated):
        raise UnloweredOpError("torch.compile(backend='tpu'): a graph copies into the same input twice")
    return [placeholders.index(p) for p in updated]


def _scan(combine: Callable[..., tuple], init: list, xs: list, additional_inputs: tuple) -> list:
    """``torch.ops.higher_order.scan`` (``xs`` already scanned along dim 0, forward): one
    ``lax.scan`` whose body runs ``combine(*carry, *x_slices, *additional_inputs)`` -> next carry
    and this step's outputs; returns the final carry then the stacked outputs."""
    num_carry = len(init)

    def step(carry: tuple, x: tuple) -> tuple[tuple, tuple]:
        out = combine(*carry, *x, *additional_inputs)
        return tuple(out[:num_carry]), tuple(out[num_carry:])

    carry, ys = jax.lax.scan(step, tuple(init), tuple(xs))
    return [*carry, *ys]


_HIGHER_ORDER: dict[Any, Callable[..., Any]] = {torch.ops.higher_order.scan: _scan}


def _subgraphs(gm: torch.fx.GraphModule, node: torch.fx.Node) -> list[torch.fx.GraphModule]:
    """The graph modules a higher-order op node takes (its ``get_attr`` arguments)."""
    return [operator.attrgetter(a.target)(gm) for a in node.args
            if isinstance(a, torch.fx.Node) and a.op == "get_attr"]


def graph_lowerings(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, Lowering]:
    """The lowering of every op node, raising one error that names all unlowered ops (those in the
    bodies of higher-order ops too)."""
    found: dict[torch.fx.Node, Lowering] = {}
    missing: set[str] = set()
    _collect_lowerings(gm, found, missing)
    if missing:
        raise UnloweredOpError(
            "torch.compile(backend='tpu'): no JAX lowering for " + ", ".join(sorted(missing))
            + " (add it to the torch_tpu registry)"
        )
    return found


def _collect_lowerings(gm: torch.fx.GraphModule, found: dict[torch.fx.Node, Lowering], missing: set[str]) -> None:
    for node in gm.graph.nodes:
        if (node.op != "call_function" or node.target is operator.getitem or _is_input_update(node)
                or is_collective(node)):  # (lowered by the SPMD program that runs the graph)
            continue
        if node.target in _HIGHER_ORDER:
            for sub in _subgraphs(gm, node):
                _collect_body_lowerings(sub, str(node.target), missing)
            continue
        if is_auto_functionalized(node):
            try:
                body = functional_body(node)
            except NotTraceable as e:
                missing.add(f"{node.target} ({e})")
                continue
            _collect_body_lowerings(body, f"{node.target} of {node.args[0]}", missing)
            continue
        lowering = get_lowering(node.target) if isinstance(node.target, torch._ops.OpOverload) else None
        if lowering is None:
            missing.add(str(node.target))
            continue
        if not lowering.static_shape:
            missing.add(f"{node.target} (output shape depends on values)")
            continue
        refused = _BY_NODE[node.target][0](node) if node.target in _BY_NODE else None
        if refused:
            missing.add(f"{node.target} ({refused})")
            continue
        found[node] = lowering


def _collect_body_lowerings(body: torch.fx.GraphModule, owner: str, missing: set[str]) -> None:
    """The unlowered ops of a graph run inside the node ``owner`` names; a body gets no random key."""
    inner: dict[torch.fx.Node, Lowering] = {}
    _collect_lowerings(body, inner, missing)
    if any(lowering.needs_key for lowering in inner.values()):
        missing.add(f"random ops inside {owner}")


def needs_random_key(gm: torch.fx.GraphModule) -> bool:
    return any(lowering.needs_key for lowering in graph_lowerings(gm).values())


def to_jax_function(gm: torch.fx.GraphModule,
                    collectives: Callable[[torch.fx.Node], Callable[[Any], Any]] | None = None,
                    ) -> Callable[..., tuple]:
    """``fn(*graph_inputs[, key_data]) -> (*outputs, *new values of the mutated inputs)`` over JAX
    arrays, for ``jax.jit``. ``collectives(node)`` lowers each collective node to ``fn(input)``
    (an SPMD program's, e.g. inside ``shard_map``); without it a graph may hold none."""
    lowerings = graph_lowerings(gm)
    collective_nodes = [node for node in gm.graph.nodes if is_collective(node)]
    if collective_nodes and collectives is None:
        raise UnloweredOpError(f"{collective_nodes[0].target}: a collective in a graph compiled as a one-device "
                               "program (split the graph at its collectives, or compile it as an SPMD program)")
    lowered_collectives = {node: collectives(node) for node in collective_nodes} if collectives else {}
    constants = {
        node: _constant(gm, node.target) for node in gm.graph.nodes if node.op == "get_attr"
    }  # a higher-order op's body: its JAX function
    random_nodes = [node for node, lowering in lowerings.items() if lowering.needs_key]
    bodies = {node: to_jax_function(functional_body(node)) for node in gm.graph.nodes if is_auto_functionalized(node)}
    nodes = list(gm.graph.nodes)

    def run(*inputs: Any) -> tuple:
        env: dict[torch.fx.Node, Any] = dict(constants)
        args_iter = iter(inputs)
        keys = {}
        if random_nodes:
            key_data = inputs[-1]
            split = jax.random.split(jax.random.wrap_key_data(key_data), len(random_nodes))
            keys = {node: split[i] for i, node in enumerate(random_nodes)}
        result: tuple = ()
        updates: list[Any] = []
        for node in nodes:
            if node.op == "placeholder":
                env[node] = next(args_iter)
            elif node.op == "call_function":
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                if node.target is operator.getitem:
                    env[node] = operator.getitem(*args)
                    continue
                if node in lowered_collectives:
                    env[node] = lowered_collectives[node](args[0])
                    continue
                if _is_input_update(node):
                    dst, src = args[0], args[1]
                    env[node] = jax.numpy.broadcast_to(src, dst.shape).astype(dst.dtype)
                    updates.append(env[node])
                    continue
                if node in bodies:
                    env[node] = bodies[node](*tensor_arguments(node, kwargs))
                    check_against_meta(node, env[node])
                    continue
                if node.target in _HIGHER_ORDER:
                    env[node] = _HIGHER_ORDER[node.target](*args, **kwargs)
                    check_against_meta(node, env[node])
                    continue
                lowering = lowerings[node]
                if lowering.needs_key:
                    kwargs = {**kwargs, "key": keys[node]}
                if _BY_NODE.get(node.target, (None, None))[1] is not None:
                    env[node] = _BY_NODE[node.target][1](node, env.__getitem__, *args, **kwargs)
                else:
                    env[node] = lowering.fn(*args, **kwargs)
                if lowering.writes:
                    env[node] = _without_writes(node, lowering, env[node])
                check_against_meta(node, env[node])
            elif node.op == "output":
                out = torch.fx.node.map_arg(node.args[0], env.__getitem__)
                result = tuple(out) if isinstance(out, (list, tuple)) else (out,)
        return (*result, *updates)

    return run


def _without_writes(node: torch.fx.Node, lowering: Lowering, out: tuple) -> Any:
    """The op's own outputs; a graph cannot express an update of an input in place."""
    n = lowering.num_outputs
    written = [name for name, v in zip(lowering.writes, out[n:]) if v is not None]
    if written:
        raise UnloweredOpError(
            f"torch.compile(backend='tpu'): {node.target} updates its inputs {written} in place; "
            "graphs must use its functional variant (AOTAutograd's functionalization emits one)"
        )
    return out[0] if n == 1 else tuple(out[:n])


def _constant(gm: torch.fx.GraphModule, target: str) -> Any:
    value = operator.attrgetter(target)(gm)
    if isinstance(value, torch.fx.GraphModule):  # the body of a higher-order op
        return to_jax_function(value)
    if not isinstance(value, torch.Tensor):
        raise UnloweredOpError(f"graph attribute {target!r} is a {type(value).__name__}, not a tensor")
    return _tensor_to_jax(value)


def _tensor_to_jax(t: torch.Tensor) -> jax.Array:
    return to_jax(t) if type(t) is TpuTensor else cpu_to_jax(t)
