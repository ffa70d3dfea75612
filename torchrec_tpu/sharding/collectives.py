"""The one collective the input and output dists need: an uneven all_to_all of flat tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def all_to_all(send: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
               group: dist.ProcessGroup | None) -> torch.Tensor:
    """Rank r sends ``send_counts[d]`` consecutive elements of ``send`` to each rank d and returns
    what it receives, ``recv_counts[s]`` elements from each rank s in rank order."""
    if len(send_counts) == 1:
        return send
    out = send.new_empty(int(sum(recv_counts)))
    dist.all_to_all_single(out, send.contiguous(), list(map(int, recv_counts)), list(map(int, send_counts)),
                           group=group)
    return out
