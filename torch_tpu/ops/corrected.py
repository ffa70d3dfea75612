"""Composites of ops whose PyTorch decomposition computes something else than CPU's kernel.

``multilabel_margin_loss_forward``: ``torch._decomp``'s decomposition lets the target positions
after the first ``-1`` count (as class 0), and returns shape ``[1]`` for a 1-D input's unreduced
loss where CPU returns a scalar. PyTorch also installs that decomposition as the op's Python
``Autograd`` kernel, which ``torch.compile`` tracing (the Python dispatcher) runs ahead of any
decomposition table, so the composite here is installed as the ``AutogradPrivateUse1`` Python
kernel as well (a direct registration wins over the ``Autograd`` alias): compiled graphs trace it,
differentiated through its ops (``relu`` where CPU's backward counts ``z > 0``). Eager dispatch runs
it below autograd (the decomposition tier); its backward is aten's formula.
"""

from __future__ import annotations

import torch

from torch_tpu.ops.registry import register_composite

aten = torch.ops.aten
_installed: list[bool] = []


@register_composite(aten.multilabel_margin_loss_forward.default)
def multilabel_margin_loss_forward(input: torch.Tensor, target: torch.Tensor,
                                   reduction: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU's kernel: per sample, the sum over the targets ``j`` before the first ``-1`` and the
    non-target classes ``i`` of ``max(0, 1 - x[y_j] + x[i])``, over the number of classes."""
    torch._check(input.dim() <= 1 and input.numel() != 0 or input.dim() == 2 and input.shape[1] != 0,
                 lambda: f"Expected non-empty vector or matrix with optional 0-dim batch size, but got: "
                         f"{list(input.shape)}")
    torch._check(target.dim() <= 1 and target.numel() == input.numel() if input.dim() <= 1
                 else target.shape == input.shape,
                 lambda: f"inconsistent target size: {list(target.shape)} for input of size: {list(input.shape)}")
    x = input.reshape(-1, input.shape[-1]) if input.dim() else input.reshape(1, 1)
    y = target.reshape(x.shape)
    classes = x.shape[1]
    idx = torch.arange(classes, device=x.device)
    end = torch.amin(torch.where(y == -1, idx, classes), dim=-1, keepdim=True)
    listed = idx < end  # [N, j]: target positions before the first -1
    y_listed = torch.where(listed, y, -1)
    is_target = torch.any(idx == y_listed.unsqueeze(-1), dim=1)  # [N, i]
    x_target = torch.gather(x, 1, torch.where(listed, y, 0))  # [N, j]
    z = torch.relu(1.0 - x_target.unsqueeze(-1) + x.unsqueeze(1))  # [N, j, i]
    z = torch.where(listed.unsqueeze(-1) & ~is_target.unsqueeze(1), z, 0.0)
    loss = z.sum(dim=(1, 2)) / classes  # [N]
    if reduction == 1:  # mean
        loss = loss.mean()
    elif reduction == 2:  # sum
        loss = loss.sum()
    elif input.dim() <= 1:
        loss = loss.reshape(())
    return loss, is_target.to(input.dtype).reshape(target.shape)


def register() -> None:
    """Install the composites as ``AutogradPrivateUse1`` Python kernels (once): what
    ``torch.compile`` tracing of tpu tensors runs in place of PyTorch's ``Autograd`` ones."""
    if _installed:
        return
    aten.multilabel_margin_loss_forward.default.py_impl(torch._C.DispatchKey.AutogradPrivateUse1)(
        multilabel_margin_loss_forward)
    _installed.append(True)
