"""Convolution lowerings (1-D/2-D/3-D, groups, dilation, transposed) through ``lax.conv_general_dilated``.

``aten.convolution`` receives batched NC... inputs and symmetric integer padding (the ``conv*d``
composites batch unbatched inputs and turn ``padding="same"`` into explicit padding). A transposed
convolution is the gradient of a convolution: the input dilated by ``stride``, padded by
``dilation * (k - 1) - padding`` (plus ``output_padding`` at the end), convolved with the
spatially flipped kernel whose in/out channels are swapped per group.
The backward is the VJP of the forward lowering.
"""

from __future__ import annotations

import torch

from torch_tpu.ops.lowerings._common import promoted, upcast
from torch_tpu.ops.registry import register_lowering
from torch_tpu.runtime._jax import jax, jnp

aten = torch.ops.aten
_SPATIAL = "DHW"


def _dimension_numbers(spatial: int) -> tuple[str, str, str]:
    s = _SPATIAL[-spatial:] if spatial <= 3 else None
    if s is None:
        raise ValueError(f"convolution supports 1 to 3 spatial dims, got {spatial}")
    return "NC" + s, "OI" + s, "NC" + s


def _transposed_kernel(weight: jax.Array, groups: int) -> jax.Array:
    """[C_in, C_out/g, k...] -> [C_out, C_in/g, k...] flipped spatially."""
    c_in, c_out_g, *k = weight.shape
    w = weight.reshape(groups, c_in // groups, c_out_g, *k).swapaxes(1, 2)
    w = w.reshape(groups * c_out_g, c_in // groups, *k)
    return jnp.flip(w, axis=tuple(range(2, w.ndim)))


def _conv(input, weight, stride, padding, dilation, transposed, output_padding, groups):
    """The convolution without bias, in float32 for bfloat16/float16 operands (as torch accumulates)."""
    accumulate = upcast(input).dtype
    spatial = input.ndim - 2
    numbers = _dimension_numbers(spatial)

    def expand(v):
        return list(v) * spatial if len(v) == 1 else list(v)

    stride, padding, dilation = expand(stride), expand(padding), expand(dilation)
    if not transposed:
        return jax.lax.conv_general_dilated(
            input, weight, window_strides=stride, padding=[(p, p) for p in padding],
            rhs_dilation=dilation, feature_group_count=groups, dimension_numbers=numbers,
            preferred_element_type=accumulate,  # precision: the device's (torch.tpu.precision)
        )
    output_padding = expand(output_padding)
    kernel = weight.shape[2:]
    pads = [(d * (k - 1) - p, d * (k - 1) - p + op) for k, p, d, op in zip(kernel, padding, dilation, output_padding)]
    return jax.lax.conv_general_dilated(
        input, _transposed_kernel(weight, groups), window_strides=[1] * spatial, padding=pads,
        lhs_dilation=stride, rhs_dilation=dilation, feature_group_count=groups, dimension_numbers=numbers,
        preferred_element_type=accumulate,
    )


@register_lowering(aten.convolution.default)
def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    if bias is None:
        input, weight = promoted(input, weight)
    else:
        input, weight, bias = promoted(input, weight, bias)
    out = _conv(input, weight, stride, padding, dilation, transposed, output_padding, groups)
    if bias is not None:
        out = out + upcast(bias).reshape((1, -1) + (1,) * (out.ndim - 2))
    return out.astype(input.dtype)


@register_lowering(aten.convolution_backward.default)
def convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                         output_padding, groups, output_mask):
    def forward(x, w):
        return _conv(x, w, stride, padding, dilation, transposed, output_padding, groups)

    out, vjp = jax.vjp(forward, input, weight)
    grad_input, grad_weight = vjp(grad_output.astype(out.dtype))
    grad_bias = None
    if output_mask[2]:
        axes = (0,) + tuple(range(2, grad_output.ndim))
        grad_bias = jnp.sum(upcast(grad_output), axis=axes).astype(grad_output.dtype)
    return (grad_input.astype(input.dtype) if output_mask[0] else None,
            grad_weight.astype(weight.dtype) if output_mask[1] else None, grad_bias)
