"""A matrix product with transpose flags that runs a CPU kernel on XLA:CPU and XLA's dot elsewhere,
differentiable: the shared frame of :mod:`~torch_tpu.ops.batched_matmul` and
:mod:`~torch_tpu.ops.host_gemm`. The platform is chosen at lowering (``jax.lax.platform_dependent``),
so one traced program serves a CPU and a TPU."""

from __future__ import annotations

import functools
from typing import Callable

from torch_tpu.runtime._jax import jax

Product = Callable[..., jax.Array]  # (a, b, trans_a, trans_b) -> op(a) @ op(b)


def differentiable_product(kernel: Product, dot: Product, product: Product) -> Product:
    """``op(a) @ op(b)`` through ``kernel`` on the CPU platform and ``dot`` on others. With
    C = op(A) op(B): d op(A) = dC op(B)^T and d op(B) = op(A)^T dC, computed by ``product`` (which
    picks the kernel again) with the flags flipped, the cotangent and gradients in the operands' dtype."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
    def call(a, b, trans_a: bool, trans_b: bool) -> jax.Array:
        return jax.lax.platform_dependent(a, b, cpu=functools.partial(kernel, trans_a=trans_a, trans_b=trans_b),
                                          default=functools.partial(dot, trans_a=trans_a, trans_b=trans_b))

    def forward(a, b, trans_a: bool, trans_b: bool):
        return call(a, b, trans_a, trans_b), (a, b)

    def backward(trans_a: bool, trans_b: bool, residuals, grad):
        a, b = residuals
        grad = grad.astype(a.dtype)
        grad_a = product(b, grad, trans_b, True) if trans_a else product(grad, b, False, not trans_b)
        grad_b = product(grad, a, True, trans_a) if trans_b else product(a, grad, not trans_a, False)
        return grad_a.astype(a.dtype), grad_b.astype(b.dtype)

    call.defvjp(forward, backward)
    return call
