"""TorchTPU's jagged-tensor helpers (``torch.tpu.ops.align_jagged_to_multiple`` /
``strip_jagged_padding``).

A ``torch.jagged`` nested tensor is a flat values buffer ``[total_tokens, ...]`` plus offsets.
Padding the buffer's token count to a multiple of 128 once, at the input, lets every layer after it
run on one tile-aligned shape (TPU's MXU works in 128-row tiles; on XLA:CPU the padding only makes
the shapes, and so the compiled programs, fewer). The offsets stay as they were, so the padded
rows lie past ``offsets[-1]`` and belong to no sequence; ``strip_jagged_padding`` slices them off
again. Both work on any device and under ``torch.compile``.
"""

from __future__ import annotations

import torch
from torch.nested._internal import nested_tensor as _njt

__all__ = ["align_jagged_to_multiple", "strip_jagged_padding"]


def _check_jagged(name: str, nt: torch.Tensor) -> None:
    if not (isinstance(nt, torch.Tensor) and nt.is_nested and nt.layout == torch.jagged):
        layout = getattr(nt, "layout", type(nt).__name__)
        raise TypeError(f"torch.tpu.ops.{name}: nt must be a torch.jagged nested tensor, got {layout}")


def align_jagged_to_multiple(
    nt: torch.Tensor,
    multiple: int = 128,
    padding_value: float | int | bool = 0.0,
) -> torch.Tensor:
    """``nt`` with its values buffer padded with ``padding_value`` rows to a multiple of
    ``multiple`` tokens (``nt`` itself when already aligned). The offsets are shared, unchanged."""
    _check_jagged("align_jagged_to_multiple", nt)
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"torch.tpu.ops.align_jagged_to_multiple: multiple must be a positive integer, "
                         f"got {multiple!r}")
    values = nt.values()
    remainder = values.size(0) % multiple
    if remainder == 0:
        return nt
    padding = values.new_full((multiple - remainder, *values.shape[1:]), padding_value)
    return _njt.nested_view_from_values_offsets(torch.cat([values, padding]), nt.offsets())


def strip_jagged_padding(
    nt: torch.Tensor,
    valid_tokens: int | None = None,
) -> torch.Tensor:
    """``nt`` with its values buffer cut to its valid tokens (a view; ``nt`` itself when there is
    no padding). ``valid_tokens`` is the count when the host knows it; without it the count is
    ``offsets[-1]``, read from the device (one wait for the device)."""
    _check_jagged("strip_jagged_padding", nt)
    offsets = nt.offsets()
    if valid_tokens is None:
        valid_tokens = int(offsets[-1].item()) if offsets.numel() > 0 else 0
    size = nt.values().size(0)
    integer = isinstance(valid_tokens, (int, torch.SymInt)) and not isinstance(valid_tokens, bool)
    if not integer or not 0 <= valid_tokens <= size:
        raise ValueError(f"torch.tpu.ops.strip_jagged_padding: valid_tokens must be an integer in [0, {size}] "
                         f"(the values buffer's rows), got {valid_tokens!r}")
    if size == valid_tokens:
        return nt
    return _njt.nested_view_from_values_offsets(nt.values()[:valid_tokens], offsets)
