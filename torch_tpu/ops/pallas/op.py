"""JAX functions (typically calling Pallas kernels) as torch operators on the tpu device.

:func:`jax_op` turns a JAX function into a ``torch.library`` custom operator:

* its schema comes from the function's annotations (``torch.Tensor`` parameters receive
  ``jax.Array`` values; ``int``/``float``/``bool``/``str`` parameters are passed unchanged);
* its fake (meta) kernel is ``jax.eval_shape`` of the function, so shapes are never written twice;
* its tpu kernel is the function itself, registered in the op-lowering registry: eager dispatch runs
  it as one jitted program per signature and ``torch.compile(backend="tpu")`` traces it into the
  graph's single XLA program (no graph break);
* an optional ``backward`` JAX function becomes a second operator wired in with
  ``torch.library.register_autograd``.

CPU tensors are refused with an error naming the operator: a kernel runs where its data lives.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torch_tpu.ops.registry import register_lowering
from torch_tpu.runtime._jax import jax
from torch_tpu.runtime.dtypes import to_jax_dtype, to_torch_dtype

_STATIC_TYPES = (int, float, bool, str)


def _tensor_params(signature: inspect.Signature) -> list[str]:
    names = []
    for name, param in signature.parameters.items():
        if param.annotation is torch.Tensor:
            names.append(name)
        elif param.annotation not in _STATIC_TYPES:
            raise TypeError(
                f"jax_op parameter {name!r} is annotated {param.annotation!r}; use torch.Tensor for arrays "
                f"or one of {[t.__name__ for t in _STATIC_TYPES]} for static arguments"
            )
    if not names:
        raise TypeError("jax_op needs at least one torch.Tensor parameter")
    return names


def _check_on_tpu(op_name: str, bound: inspect.BoundArguments, tensor_names: Sequence[str]) -> None:
    for name in tensor_names:
        value = bound.arguments[name]
        if value.device.type != "tpu":
            raise RuntimeError(
                f"{op_name}: argument {name!r} is on {value.device}; this kernel runs on the tpu device "
                f"(move it with .to('tpu'))"
            )


def _abstract(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return jax.ShapeDtypeStruct(tuple(value.shape), to_jax_dtype(value.dtype))
    return value


def _fake_outputs(fn: Callable[..., Any], bound: inspect.BoundArguments, device: torch.device) -> Any:
    tensors = {k: v for k, v in bound.arguments.items() if isinstance(v, torch.Tensor)}
    statics = {k: v for k, v in bound.arguments.items() if k not in tensors}
    shapes = jax.eval_shape(lambda **arrays: fn(**arrays, **statics), **{k: _abstract(v) for k, v in tensors.items()})
    return jax.tree.map(
        lambda s: torch.empty(s.shape, dtype=to_torch_dtype(s.dtype), device=device), shapes
    )


def _with_signature(fn: Callable[..., Any], signature: inspect.Signature, name: str) -> Callable[..., Any]:
    fn.__signature__ = signature  # custom_op infers the schema from it
    fn.__name__ = fn.__qualname__ = name.split("::")[-1]
    return fn


def jax_op(
    name: str,
    fn: Callable[..., Any],
    *,
    backward: Callable[..., Any] | None = None,
    differentiable: Sequence[str] | None = None,
) -> Callable[..., Any]:
    """Register ``fn`` (a JAX function) as the torch operator ``name`` ("namespace::op") and return it.

    ``fn``'s annotations give the schema; it returns one ``jax.Array`` (or a tuple of them).
    ``backward(*inputs, grad) -> tuple`` (JAX, same parameters as ``fn`` plus the output gradient)
    returns one gradient per name in ``differentiable`` (default: every ``torch.Tensor``
    parameter), in order; without it the op is not differentiable."""
    signature = inspect.signature(fn, eval_str=True)
    tensor_names = _tensor_params(signature)
    returns = signature.return_annotation
    if returns is inspect.Signature.empty:
        raise TypeError(f"jax_op {name}: annotate the return type (torch.Tensor or tuple[torch.Tensor, ...])")

    def run_elsewhere(*args: Any, **kwargs: Any) -> Any:
        # Reached only by tensors that are not TpuTensors (tpu tensors dispatch to the lowering).
        bound = signature.bind(*args, **kwargs)
        _check_on_tpu(name, bound, tensor_names)
        raise RuntimeError(f"{name}: no kernel for these inputs")

    op = torch.library.custom_op(name, mutates_args=())(_with_signature(run_elsewhere, signature, name))

    @op.register_fake
    def _(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return _fake_outputs(fn, bound, bound.arguments[tensor_names[0]].device)

    register_lowering(_overload(name))(fn)
    if backward is not None:
        wrt = list(tensor_names if differentiable is None else differentiable)
        unknown = [n for n in wrt if n not in tensor_names]
        if unknown:
            raise ValueError(f"jax_op {name}: differentiable names {unknown} are not tensor parameters {tensor_names}")
        _register_backward(name, op, signature, wrt, backward)
    return op


def _overload(name: str) -> torch._ops.OpOverload:
    namespace, op_name = name.split("::")
    return getattr(getattr(torch.ops, namespace), op_name).default


def _register_backward(
    name: str,
    op: Any,
    signature: inspect.Signature,
    wrt: list[str],
    backward: Callable[..., Any],
) -> None:
    grad = inspect.Parameter("grad", inspect.Parameter.KEYWORD_ONLY, annotation=torch.Tensor)
    params = [p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in signature.parameters.values()]
    backward_signature = inspect.Signature(
        [*params, grad.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)],
        return_annotation=tuple[(torch.Tensor,) * len(wrt)] if len(wrt) > 1 else torch.Tensor,
    )

    def backward_fn(*args: Any, **kwargs: Any) -> Any:
        bound = backward_signature.bind(*args, **kwargs)
        values = dict(bound.arguments)
        grad_out = values.pop("grad")
        grads = backward(*values.values(), grad_out)
        grads = tuple(grads) if isinstance(grads, (tuple, list)) else (grads,)
        if len(grads) != len(wrt):
            raise ValueError(f"{name} backward returned {len(grads)} gradients for {wrt}")
        return grads if len(grads) > 1 else grads[0]

    backward_name = f"{name}_backward"
    backward_op = jax_op(backward_name, _with_signature(backward_fn, backward_signature, backward_name))
    names = list(signature.parameters)
    tensor_positions = [i for i, p in enumerate(signature.parameters.values()) if p.annotation is torch.Tensor]

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.statics = [None if i in tensor_positions else x for i, x in enumerate(inputs)]
        ctx.save_for_backward(*(inputs[i] for i in tensor_positions))

    def autograd_backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        inputs = list(ctx.statics)
        for i, saved in zip(tensor_positions, ctx.saved_tensors):
            inputs[i] = saved
        grads = backward_op(*inputs, grad_out.contiguous())
        by_name = dict(zip(wrt, grads if isinstance(grads, tuple) else (grads,)))
        return tuple(by_name.get(n) for n in names)

    op.register_autograd(autograd_backward, setup_context=setup_context)
