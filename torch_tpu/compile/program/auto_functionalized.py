"""Lower AOTAutograd's ``auto_functionalized`` / ``auto_functionalized_v2`` nodes.

Functionalization turns a call of a custom op that mutates its arguments
(``torch.library.custom_op(..., mutates_args=(...))``, e.g. TorchRec TPU's fused embedding
backward writing its table) into ``auto_functionalized_v2(op, **kwargs, _all_bases=[...])``:
the op run on clones of the bases it writes, returning ``(op outputs..., new bases...)``
(``auto_functionalized``, v1, returns the new mutated arguments instead of bases). Such an op has no
JAX lowering, but its backend-agnostic implementation (the Python function a custom op registers
as its CompositeExplicitAutograd kernel) calls ops that have. :func:`functional_body` traces that
implementation on the node's fake tensors, functionalized, into a graph of those ops, which the
node then runs; nothing here knows any particular op.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch._higher_order_ops.auto_functionalize import get_mutable_args, read_view_information_from_args
from torch._prims_common import clone_preserve_strides
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from torch_tpu.ops import decompositions

AUTO_FUNCTIONALIZED = frozenset({torch.ops.higher_order.auto_functionalized,
                                 torch.ops.higher_order.auto_functionalized_v2})
_BODY = "torch_tpu_functional_body"  # node.meta key: the traced graph, built once per node
_KERNEL = torch._C.DispatchKey.CompositeExplicitAutograd


class NotTraceable(NotImplementedError):
    """An ``auto_functionalized`` node whose mutable op cannot be traced into lowered ops."""


def is_auto_functionalized(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in AUTO_FUNCTIONALIZED


def tensor_arguments(node: torch.fx.Node, kwargs: dict[str, Any]) -> list[Any]:
    """The values among ``kwargs`` (the node's keyword arguments, evaluated) that stand for its
    tensor arguments, in the order :func:`functional_body`'s graph takes them."""
    leaves = pytree.tree_leaves(node.kwargs)
    values = pytree.tree_leaves(kwargs)
    return [v for leaf, v in zip(leaves, values) if isinstance(leaf, torch.fx.Node)]


def functional_body(node: torch.fx.Node) -> torch.fx.GraphModule:
    """The node as a functional graph: inputs its tensor arguments (:func:`tensor_arguments`),
    outputs the node's (the op's outputs, then the new values of the bases / mutated arguments)."""
    if _BODY not in node.meta:
        node.meta[_BODY] = _trace(node)
    return node.meta[_BODY]


def _trace(node: torch.fx.Node) -> torch.fx.GraphModule:
    op = node.args[0]
    if not isinstance(op, torch._ops.OpOverload):
        raise NotTraceable(f"{node.target} of {op}: only custom ops (OpOverloads) are traced")
    if not op.has_kernel_for_dispatch_key(_KERNEL):
        raise NotTraceable(f"{node.target} of {op}: the op has no lowering and no backend-agnostic "
                           "(CompositeExplicitAutograd) implementation to trace")
    leaves, spec = pytree.tree_flatten(dict(node.kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.fx.Node)]
    examples = [leaves[i].meta.get("val") for i in positions]
    if not all(isinstance(e, torch.Tensor) for e in examples):
        raise NotTraceable(f"{node.target} of {op}: a non-tensor graph value (a symbolic size) among its arguments")
    run = _run_v2 if node.target is torch.ops.higher_order.auto_functionalized_v2 else _run_v1

    def body(*tensors: torch.Tensor) -> Any:
        values = list(leaves)
        for i, t in zip(positions, tensors):
            values[i] = t
        return run(op, pytree.tree_unflatten(values, spec))

    return make_fx(torch.func.functionalize(body, remove="mutations"), tracing_mode="fake",
                   decomposition_table=decompositions.compile_table())(*examples)


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else clone_preserve_strides(t) if not t.is_contiguous() else t.clone()


def _call(op: torch._ops.OpOverload, kwargs: dict[str, Any], new_values: list[Any]) -> tuple:
    with torch._C.DisableTorchFunction():  # else make_fx's torch-function mode re-enters the op itself
        out = op._op_dk(_KERNEL, **kwargs)
    return (*out, *new_values) if isinstance(out, tuple) else (out, *new_values)


def _run_v1(op: torch._ops.OpOverload, kwargs: dict[str, Any]) -> tuple:
    """``auto_functionalized``: the op on clones of its mutable arguments, then their new values."""
    kwargs.pop("_only_clone_these_tensors", None)
    names, _ = get_mutable_args(op)
    for name in names:
        value = kwargs[name]
        kwargs[name] = [_clone(t) for t in value] if isinstance(value, list) else _clone(value)
    return _call(op, kwargs, [kwargs[name] for name in names])


def _run_v2(op: torch._ops.OpOverload, kwargs: dict[str, Any]) -> tuple:
    """``auto_functionalized_v2``: the op on views regenerated from clones of ``_all_bases`` (their
    ``_<arg>_size/_stride/_storage_offset``, ``_slice_*`` or ``_alias`` view information), then the
    bases' new values."""
    kwargs.pop("_only_clone_these_bases", None)
    bases = [_clone(b) for b in kwargs.pop("_all_bases", [])]
    names, types = get_mutable_args(op)
    views = read_view_information_from_args(names, types, kwargs, bases)
    for name in names:
        view = views[name]
        if isinstance(view, list):
            kwargs[name] = [None if v is None else v.regenerate_view(bases) for v in view]
        else:
            kwargs[name] = None if view is None else view.regenerate_view(bases)
    return _call(op, kwargs, bases)
