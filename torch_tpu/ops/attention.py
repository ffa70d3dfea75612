"""The PrivateUse1 attention ops (``aten._scaled_dot_product_fused_attention_overrideable`` and its
backward) as composites of lowered ops (decomposition tier).

PyTorch declares them for third-party devices and gives them no kernel. These follow
``scaled_dot_product_attention``'s math (scores ``scale * q @ k^T`` plus the bias, a causal mask
aligned top-left, softmax, ``@ v``) and the shapes of torch's meta kernels: the logsumexp of the
scores is float32 ``[batch, heads, seq_q]`` (batch 1 for 3-d inputs); the cumulative sequence
lengths and the debug mask are None; the philox seed and offset are zero (no dropout).
"""

from __future__ import annotations

import math

import torch

from torch_tpu.ops.registry import register_composite

aten = torch.ops.aten


def _scores(query, key, attn_bias, is_causal, scale):
    """float32 ``scale * q @ k^T`` with the bias (a bool bias keeps the True positions) and the causal mask."""
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    scores = (query.float() @ key.float().transpose(-2, -1)) * scale
    if attn_bias is not None:
        if attn_bias.dtype == torch.bool:
            scores = scores.masked_fill(~attn_bias, float("-inf"))
        else:
            scores = scores + attn_bias.float()
    if is_causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores, scale


def _check_no_dropout(dropout_p: float) -> None:
    if dropout_p:
        raise NotImplementedError(
            "tpu: _scaled_dot_product_fused_attention_overrideable supports dropout_p=0 only "
            "(scaled_dot_product_attention with dropout takes the math path)"
        )


@register_composite(aten._scaled_dot_product_fused_attention_overrideable.default)
def fused_attention(query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False,
                    return_debug_mask=False, *, scale=None):
    """Forward: ``(out, logsumexp, None, None, seq_q, seq_k, seed, offset, None)``."""
    _check_no_dropout(dropout_p)
    scores, _ = _scores(query, key, attn_bias, is_causal, scale)
    logsumexp = torch.logsumexp(scores, dim=-1)
    out = (torch.exp(scores - logsumexp.unsqueeze(-1)) @ value.float()).to(query.dtype)
    if query.dim() == 3:
        logsumexp = logsumexp.unsqueeze(0)
    zero = torch.zeros((), dtype=torch.long, device=query.device)
    return out, logsumexp, None, None, query.size(-2), key.size(-2), zero, zero.clone(), None


@register_composite(aten._scaled_dot_product_fused_attention_overrideable_backward.default)
def fused_attention_backward(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp,
                             cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed,
                             philox_offset, *, scale=None):
    """Backward: gradients of query, key, value and a floating bias (None where not asked for)."""
    _check_no_dropout(dropout_p)
    scores, scale = _scores(query, key, attn_bias, is_causal, scale)
    probs = torch.exp(scores - logsumexp.reshape(scores.shape[:-1]).unsqueeze(-1))
    grad_out = grad_out.float()
    grad_probs = grad_out @ value.float().transpose(-2, -1)
    grad_scores = probs * (grad_probs - (grad_out * out.float()).sum(-1, keepdim=True))
    grads = (
        (grad_scores @ key.float()) * scale,
        (grad_scores.transpose(-2, -1) @ query.float()) * scale,
        probs.transpose(-2, -1) @ grad_out,
        grad_scores.sum_to_size(attn_bias.shape)
        if attn_bias is not None and attn_bias.is_floating_point() else None,
    )
    like = (query, key, value, attn_bias)
    return tuple(g.to(ref.dtype) if g is not None and wanted else None
                 for g, ref, wanted in zip(grads, like, grad_input_mask))
