"""Write a Pallas kernel, call it from PyTorch on the tpu device, eager and compiled, with a backward.

    .venv/bin/python examples/pallas/custom_kernel.py

On a TPU the kernel compiles through Mosaic; elsewhere it runs in Pallas interpret mode (same body).
"""

from __future__ import annotations

import torch
from jax.experimental import pallas as pl

import torch_tpu.compile  # noqa: F401  (registers torch.compile(backend="tpu"))
from torch_tpu.ops import pallas as tp
from torch_tpu.runtime._jax import jax, jnp


def _swish_kernel(x_ref, o_ref):
    x = x_ref[...]
    o_ref[...] = x * jax.nn.sigmoid(x)


def _swish_grad_kernel(x_ref, g_ref, o_ref):
    s = jax.nn.sigmoid(x_ref[...])
    o_ref[...] = g_ref[...] * (s + x_ref[...] * s * (1 - s))


def _rows(x) -> pl.BlockSpec:
    block = tp.batch_block(x.shape[0])
    return pl.BlockSpec((block, x.shape[1]), lambda i: (i, 0))


def swish(x: torch.Tensor) -> torch.Tensor:
    """The kernel's JAX entry point: annotations declare the torch schema, values are jax.Arrays."""
    return tp.kernel_call(_swish_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                                   grid=(x.shape[0] // _rows(x).block_shape[0],),
                                   in_specs=[_rows(x)], out_specs=_rows(x))(x)


def swish_backward(x, grad):
    return tp.kernel_call(_swish_grad_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                                   grid=(x.shape[0] // _rows(x).block_shape[0],),
                                   in_specs=[_rows(x), _rows(grad)], out_specs=_rows(x))(x, grad)


swish_op = tp.jax_op("examples::swish", swish, backward=swish_backward)


def main() -> None:
    x = torch.randn(16, 128, device="tpu", requires_grad=True)
    y = swish_op(x)                                    # eager: one jitted program per signature
    y.sum().backward()
    expected = torch.nn.functional.silu(x.detach().cpu())
    print("eager max |err|:", (y.detach().cpu() - expected).abs().max().item())

    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Flatten()).to("tpu")
    step = torch.compile(lambda t: swish_op(model(t)).sum(), backend="tpu")   # traced into one program
    print("compiled loss:", step(x.detach()).item())

    with tp.lowering_for_tpu():                        # what a TPU would run: a Mosaic custom call
        text = jax.jit(swish).trace(jax.ShapeDtypeStruct((16, 128), jnp.float32)).lower(
            lowering_platforms=("tpu",)).as_text()
    print("TPU lowering has the Mosaic call:", "tpu_custom_call" in text)


if __name__ == "__main__":
    main()
