"""The decomposition tier: ops without a lowering run as PyTorch's own decompositions on tpu tensors.

Between "lowered" and "CPU fallback": an op with no JAX lowering but a decomposition in
``torch._decomp`` (the full ``decomposition_table`` and the core-ATen table), a
CompositeImplicitAutograd kernel (``op.decompose()``), a CompositeExplicitAutograd kernel (the
backend-agnostic kernel every C++ backend runs, e.g. ``rand_like``) or a registered composite
(``register_composite``: torch_tpu's own composites of ops PyTorch gives only device kernels, e.g.
the Transformer fast path) runs that decomposition on the tpu tensors, below autograd: every op it
calls is dispatched again (lowered, decomposed in turn, or falling back), and the op is counted as
decomposed.

Safety rules (:func:`decomposition`):
* view ops never decompose (eager dispatch aliases them); in-place and out= ops decompose through
  their functional sibling (``torch_tpu.eager`` writes the result with torch's casting and
  resizing rules), never through a decomposition of the mutating overload itself;
* :data:`_NOT_DECOMPOSED` lists ops whose decomposition is not what the op does on CPU;
* an op re-entered while its own decomposition runs (directly or through other decompositions)
  falls back instead of recursing, and a decomposition that raises falls back for that call
  (``torch_tpu.eager.handlers.decomposed_handler`` runs them).

:func:`compile_table` is the same table for ``torch.compile(backend="tpu")``'s AOTAutograd.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torch_tpu.ops.registry import composites, get_composite, get_lowering

aten = torch.ops.aten
Decomposition = Callable[..., Any]

# Ops whose PyTorch decomposition computes something else than CPU: eager falls back to the CPU
# kernel, compiled graphs holding them fail as unlowered (listed in docs/architecture/torch_tpu_device.md).
# (multilabel_margin_loss_forward's was: torch_tpu.ops.corrected has CPU's composite.)
_DIFFERS_FROM_CPU: frozenset[Any] = frozenset()
# Ops never decomposed: eager dispatch has dedicated handlers for them (devices, aliasing).
_NOT_DECOMPOSED: frozenset[Any] = frozenset({
    aten._to_copy.default,  # dedicated handler (devices)
    aten.lift_fresh.default,
    aten.detach.default,
}) | _DIFFERS_FROM_CPU

# Collectives keep their own path (the CPU fallback over the process group): their backend-agnostic
# kernels register in-flight work by the output's storage, which ``wait_tensor`` cannot find again
# on a tpu tensor, so the result would be read before the collective wrote it.
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor"})

_EXPLICIT = torch._C.DispatchKey.CompositeExplicitAutograd
_table: dict[Any, Decomposition] | None = None


def _build() -> dict[Any, Decomposition]:
    from torch._decomp import core_aten_decompositions, decomposition_table

    table: dict[Any, Decomposition] = dict(decomposition_table)
    table.update(core_aten_decompositions().items())
    return table


def _mutates(op: Any) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)


def is_composite(op: Any) -> bool:
    """A non-mutating CompositeImplicitAutograd op (``reshape``, ``linear``, ``lstm_cell`` ...),
    reached when another kernel calls it below autograd. Its own composite (``op.decompose``) is
    what CPU runs, views and copies alike (``reshape`` of a non-contiguous tensor copies although
    its schema says it aliases), so it runs ahead of the view and decomposition-table handlers."""
    return (isinstance(op, torch._ops.OpOverload) and get_composite(op) is None and not _mutates(op)
            and op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd))


def decomposition(op: Any) -> Decomposition | None:
    """The decomposition eager dispatch uses for ``op`` (``None``: the op falls back to CPU)."""
    global _table
    if _table is None:
        _table = _build()
    if (op in _NOT_DECOMPOSED or not isinstance(op, torch._ops.OpOverload) or _mutates(op)
            or op.namespace in COLLECTIVE_NAMESPACES):
        return None
    composite = get_composite(op)
    if composite is not None:
        return composite
    if is_composite(op):
        return op.decompose
    fn = _table.get(op)
    if fn is None and op.has_kernel_for_dispatch_key(_EXPLICIT):
        # A backend-agnostic kernel (rand_like, new_zeros ...): what every C++ backend runs.
        return lambda *args, **kwargs: op._op_dk(_EXPLICIT, *args, **kwargs)
    return fn


def compile_table(graph: torch.fx.Graph | None = None) -> dict[Any, Decomposition]:
    """AOTAutograd's decompositions for ``torch.compile(backend="tpu")``: the core-ATen table, and for
    functional ops without a lowering the rest of ``torch._decomp``'s ATen-level table
    (``slice_scatter`` ...) and the registered composites (lowered ops stay whole in graphs). The
    custom ops (``torch.library.custom_op`` ...) that ``graph`` (Dynamo's) calls decompose as eager
    decomposes them: into their backend-agnostic kernel, e.g. ``torch_nn::_linear_cross_entropy_*``."""
    from torch._decomp import core_aten_decompositions, decomposition_table

    table = dict(core_aten_decompositions().items())
    # detach stays whole (lowered: an identity): decomposed it becomes alias_copy -> alias, a view,
    # and torch.ops.higher_order.scan then rejects the autograd body (the saved detached
    # activation "might be aliasing the input or the output")
    table.pop(torch.ops.aten.detach.default, None)
    aten_level = {op: fn for op, fn in decomposition_table.items()
                  if not fn.__module__.startswith("torch._refs")}  # refs emit prims, which have no lowerings
    table.update({op: fn for op, fn in {**aten_level, **composites()}.items()
                  if isinstance(op, torch._ops.OpOverload) and not _mutates(op) and get_lowering(op) is None})
    for op in _DIFFERS_FROM_CPU:
        table.pop(op, None)
    for op in _custom_ops(graph) if graph is not None else ():
        fn = decomposition(op)
        if fn is not None and get_lowering(op) is None:
            table.setdefault(op, _functionalized(fn))
    return table


def _functionalized(fn: Decomposition) -> Decomposition:
    """``fn`` with its in-place ops and views made functional: AOTAutograd runs a decomposition below
    its functionalization, and a custom op's kernel may write into views (the chunked
    linear-cross-entropy kernel accumulates into slices)."""
    def functional(*args: Any, **kwargs: Any) -> Any:
        from torch._functorch._aot_autograd.functional_utils import from_fun, to_fun
        from torch._subclasses.functional_tensor import FunctionalTensorMode
        from torch.utils import _pytree as pytree

        with FunctionalTensorMode():
            args, kwargs = pytree.tree_map_only(torch.Tensor, to_fun, (args, kwargs))
            out = fn(*args, **kwargs)
        return pytree.tree_map_only(torch.Tensor, from_fun, out)

    return functional


def _custom_ops(graph: torch.fx.Graph) -> set[Any]:
    """The ops outside ATen and prims that ``graph`` calls."""
    return {node.target for node in graph.nodes if node.op == "call_function"
            and isinstance(node.target, torch._ops.OpOverload) and node.target.namespace not in ("aten", "prims")}
