"""The fused LSTM/GRU cells PyTorch's RNN modules call on every non-CPU device, forward and backward.

``aten::lstm`` / ``gru`` / ``lstm_cell`` / ``gru_cell`` (CompositeImplicitAutograd) call
``_thnn_fused_lstm_cell`` / ``_thnn_fused_gru_cell`` per time step when the input is not on CPU;
PyTorch implements them only for CUDA. Autograd's formulas for them call
``_thnn_fused_lstm_cell_backward_impl`` / ``_thnn_fused_gru_cell_backward`` with the forward's
``workspace``. The workspace layouts follow the CUDA kernels (aten/src/ATen/native/cuda/RNN.cu):
LSTM ``[i, f, g, o]`` (activated gates), GRU ``[r, z, n, hx, hn]`` (``hn``: the hidden new-gate
pre-activation with its bias).
"""

from __future__ import annotations

import torch

from torch_tpu.ops.registry import register_lowering
from torch_tpu.runtime._jax import jax, jnp

aten = torch.ops.aten


def _gates(input_gates, hidden_gates, input_bias, hidden_bias):
    """Input and hidden gate pre-activations with their biases (either bias may be absent)."""
    if input_bias is not None:
        input_gates = input_gates + input_bias
    if hidden_bias is not None:
        hidden_gates = hidden_gates + hidden_bias
    return input_gates, hidden_gates


@register_lowering(aten._thnn_fused_lstm_cell.default)
def fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    ig, hg = _gates(input_gates, hidden_gates, input_bias, hidden_bias)
    i, f, g, o = jnp.split(ig + hg, 4, axis=1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    cy = f * cx + i * g
    hy = o * jnp.tanh(cy)
    return hy, cy, jnp.concatenate([i, f, g, o], axis=1)


@register_lowering(aten._thnn_fused_lstm_cell_backward_impl.default)
def fused_lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    i, f, g, o = jnp.split(workspace, 4, axis=1)
    grad_hy = jnp.zeros_like(cy) if grad_hy is None else grad_hy
    grad_cy = jnp.zeros_like(cy) if grad_cy is None else grad_cy
    tanh_cy = jnp.tanh(cy)
    grad_c = grad_hy * o * (1 - tanh_cy * tanh_cy) + grad_cy
    grad_gates = jnp.concatenate([
        grad_c * g * (1 - i) * i,
        grad_c * cx * (1 - f) * f,
        grad_c * i * (1 - g * g),
        grad_hy * tanh_cy * (1 - o) * o,
    ], axis=1)
    grad_bias = grad_gates.sum(0) if has_bias else None
    return grad_gates, grad_c * f, grad_bias


@register_lowering(aten._thnn_fused_gru_cell.default)
def fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    ig, hg = _gates(input_gates, hidden_gates, input_bias, hidden_bias)
    i_r, i_z, i_n = jnp.split(ig, 3, axis=1)
    h_r, h_z, h_n = jnp.split(hg, 3, axis=1)
    r = jax.nn.sigmoid(i_r + h_r)
    z = jax.nn.sigmoid(i_z + h_z)
    n = jnp.tanh(i_n + r * h_n)
    hy = n + z * (hx - n)
    return hy, jnp.concatenate([r, z, n, hx, h_n], axis=1)


@register_lowering(aten._thnn_fused_gru_cell_backward.default)
def fused_gru_cell_backward(grad_hy, workspace, has_bias):
    r, z, n, hx, h_n = jnp.split(workspace, 5, axis=1)
    grad_z = grad_hy * (hx - n) * (1 - z) * z
    grad_in = grad_hy * (1 - z) * (1 - n * n)
    grad_r = grad_in * h_n * (1 - r) * r
    grad_input_gates = jnp.concatenate([grad_r, grad_z, grad_in], axis=1)
    grad_hidden_gates = jnp.concatenate([grad_r, grad_z, grad_in * r], axis=1)
    if has_bias:
        return grad_input_gates, grad_hidden_gates, grad_hy * z, grad_input_gates.sum(0), grad_hidden_gates.sum(0)
    return grad_input_gates, grad_hidden_gates, grad_hy * z, None, None
