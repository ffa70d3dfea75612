"""The nn.Transformer eval fast path on tpu, as composites of lowered ops (decomposition tier).

In eval without grad, ``nn.MultiheadAttention`` calls ``aten._native_multi_head_attention`` and
``nn.TransformerEncoderLayer`` calls ``aten._transformer_encoder_layer_fwd``, ops PyTorch gives
only CPU/CUDA kernels. Their composites here follow the CPU kernels
(aten/src/ATen/native/transformers/{attention,transformer}.cpp): the same projections, scaling,
masked softmax (a nonzero mask entry masks; fully masked rows give zeros), residuals and norms.

``nn.TransformerEncoder`` with ``enable_nested_tensor`` and a padding mask turns its input into a
nested tensor (``_nested_tensor_from_mask``), runs the layers on it and pads the result with zeros
(``to_padded_tensor``). A nested tensor cannot hold a tpu buffer, so the tpu composite of
``_nested_tensor_from_mask`` returns a :class:`PaddedNested`: the padded values with the mask of
valid positions. The layer composite attends only to valid keys and zeroes padded positions, so
``to_padded_tensor`` gives what CPU's nested path gives.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from torch_tpu.ops.registry import register_composite
from torch_tpu.runtime.tensor import TpuTensor, make_alias, share_storage

aten = torch.ops.aten


class PaddedNested(TpuTensor):
    """A batch of left-aligned variable-length sequences on tpu: padded values (zero where
    ``valid`` is False) and ``valid`` ([batch, seq] bool). Only the Transformer fast-path
    composites accept it."""

    valid: torch.Tensor

    @property
    def is_nested(self) -> bool:  # type: ignore[override]
        return True


def _padded_nested(values: TpuTensor, valid: torch.Tensor) -> PaddedNested:
    dense = values * valid.unsqueeze(-1).to(values.dtype)
    out = torch.Tensor._make_wrapper_subclass(PaddedNested, dense.shape, dtype=dense.dtype, device=dense.device)
    share_storage(out, dense)
    out.valid = valid
    return out


def _plain(t: PaddedNested) -> TpuTensor:
    return make_alias(t.storage_box, t.shape, t.stride(), t.storage_offset(), t.dtype)


@register_composite(aten._nested_tensor_from_mask.default)
def nested_tensor_from_mask(t, mask, mask_check=True):
    if t.dim() != 3 or mask.dim() != 2 or tuple(mask.shape) != tuple(t.shape[:2]):
        raise RuntimeError(
            f"_nested_tensor_from_mask: expected a [batch, seq, dim] tensor and a [batch, seq] mask, "
            f"got {list(t.shape)} and {list(mask.shape)}"
        )
    if mask_check and not nested_tensor_from_mask_left_aligned(t, mask):
        raise RuntimeError("Mask must be left aligned without gaps")
    return _padded_nested(t, mask.bool())


@register_composite(aten._nested_tensor_from_mask_left_aligned.default)
def nested_tensor_from_mask_left_aligned(t, mask):
    """Whether every row of ``mask`` is some Trues followed only by Falses (one host read)."""
    m = mask.bool()
    return bool((m[:, 1:] <= m[:, :-1]).all()) if m.shape[-1] > 1 else True


@register_composite(aten.to_padded_tensor.default)
def to_padded_tensor(self, padding, output_size=None):
    if type(self) is not PaddedNested:
        raise RuntimeError(f"to_padded_tensor: expected a nested tensor, got a dense tpu tensor {list(self.shape)}")
    out = torch.where(self.valid.unsqueeze(-1), _plain(self), padding)
    if output_size is not None:
        pads = []
        for have, want in zip(reversed(out.shape), reversed(list(output_size))):
            pads += [0, want - have]
        out = F.pad(out, pads, value=padding)
    return out


def _masked_softmax(scores, mask, mask_type):
    """Softmax over the last dim with ``mask`` (nonzero: masked) laid out as ``mask_type`` says:
    0 [L, S], 1 [B, S] (key padding), 2 [B, H, L, S]."""
    if mask is None:
        return torch.softmax(scores, -1)
    mask = mask.bool() if mask.dtype == torch.bool else mask != 0
    if mask_type == 1:
        mask = mask[:, None, None, :]
    return torch._safe_softmax(scores.masked_fill(mask, float("-inf")), -1)


@register_composite(aten._native_multi_head_attention.default)
def native_multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight,
                                proj_bias, mask=None, need_weights=True, average_attn_weights=True, mask_type=None):
    batch, length, _ = query.shape
    head_dim = embed_dim // num_head
    if query is key and key is value:
        q, k, v = F.linear(query, qkv_weight, qkv_bias).chunk(3, -1)
    else:
        w_q, w_k, w_v = qkv_weight.chunk(3)
        b_q, b_k, b_v = qkv_bias.chunk(3)
        q, k, v = F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)

    def heads(x):
        return x.reshape(batch, -1, num_head, head_dim).transpose(1, 2)

    q, k, v = heads(q) / math.sqrt(head_dim), heads(k), heads(v)
    weights = _masked_softmax(q @ k.transpose(-2, -1), mask, mask_type)
    context = (weights @ v).transpose(1, 2).reshape(batch, length, embed_dim)
    out = F.linear(context, proj_weight, proj_bias)
    if need_weights and average_attn_weights:
        weights = weights.sum(1) / num_head
    return out, weights


@register_composite(aten._transformer_encoder_layer_fwd.default)
def transformer_encoder_layer_fwd(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
                                  use_gelu, norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2,
                                  norm_bias_2, ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2, mask=None,
                                  mask_type=None):
    valid = src.valid if type(src) is PaddedNested else None
    x = _plain(src) if valid is not None else src
    if valid is not None:  # the nested layout: attend to valid keys only
        mask, mask_type = ~valid, 1
    residual = x

    def norm1(y):
        return F.layer_norm(y, (embed_dim,), norm_weight_1, norm_bias_1, eps)

    def norm2(y):
        return F.layer_norm(y, (embed_dim,), norm_weight_2, norm_bias_2, eps)

    h = norm1(x) if norm_first else x
    h = native_multi_head_attention(h, h, h, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
                                    mask, False, True, mask_type)[0]
    h = h + residual
    if not norm_first:
        h = norm1(h)
    residual = h
    if norm_first:
        h = norm2(h)
    h = F.linear(h, ffn_weight_1, ffn_bias_1)
    h = F.gelu(h) if use_gelu else F.relu(h)
    h = F.linear(h, ffn_weight_2, ffn_bias_2) + residual
    if not norm_first:
        h = norm2(h)
    return _padded_nested(h, valid) if valid is not None else h
