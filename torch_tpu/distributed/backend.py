"""Registration of the ``tpu_dist`` c10d backend (idempotent; no torch_tpu core import needed)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from torch_tpu.distributed.process_group import BACKEND_NAME, ProcessGroupTPU
from torch_tpu.distributed.transport import GlooTransport


def _create_process_group(opts: Any, _backend_options: Any) -> ProcessGroupTPU:
    transport = GlooTransport(opts.store, opts.group_rank, opts.group_size, opts.timeout)
    return ProcessGroupTPU(transport, opts.timeout, global_ranks=opts.global_ranks_in_group)


def register_backend() -> None:
    """Make ``init_process_group("tpu_dist")`` available for tpu and cpu tensors."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, _create_process_group, extended_api=True, devices=["tpu", "cpu"]
    )
