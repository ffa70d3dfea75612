"""Before a model is built: do its embedding tables and their optimizer state fit this host's
memory? A job whose tables cannot fit is refused in one line naming the largest tables, the bytes,
the memory available and what to change, instead of failing minutes later in an allocator
(``RESOURCE_EXHAUSTED: Out of memory allocating ...``) with a run directory left behind.

The estimate is the planner's (:func:`torchrec_tpu.planner.cost_model.row_bytes`: fp32 rows and
the optimizer's slots; for ``infer`` the rows at ``--table-dtype`` and no slots) and, for a
``--zch`` table, its remap's per slot (``ZCH_SLOT_BYTES``: the identity table and the policy's
metadata), the tables split evenly over the ranks; this host holds the shares of its local ranks. Activations, the dense
towers and the data are left out, so a job refused here cannot fit; one that passes may still need
more.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from torchrec_tpu.planner.cost_model import row_bytes
from torchrec_tpu.planner.tables import EmbeddingTable
from torchrec_tpu.train.config import ConfigError
from torchrec_tpu.train.model import ModelSpec
from torchrec_tpu.zch_names import ZCH_SLOT_BYTES

NAMED_TABLES = 3  # the largest tables the refusal names


def available_host_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where the system does not say)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def table_bytes(rows: int, dim: int, optimizer: str | None, data_type: str = "fp32",
                zch_policy: str | None = None) -> int:
    """Bytes of one table of ``rows`` x ``dim`` held at ``data_type`` and its ``optimizer``'s state
    (None: none, an inference table), and with a ``zch_policy`` its managed-collision remap."""
    table = EmbeddingTable("table", 1, dim, optimizer=optimizer or NO_OPTIMIZER, data_type=data_type)
    remap = ZCH_SLOT_BYTES[zch_policy] if zch_policy is not None else 0
    return rows * (row_bytes(table, dim) + remap)  # a row's bytes: any rows


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:,.1f} GB"


DLRM_REMEDY = "lower --num-embeddings or --num-embeddings-per-feature, --embedding-dim, or train on more hosts"
INFER_REMEDY = ("hold the tables at a smaller --table-dtype (int8, int4), or shard them over more hosts (torchrun, "
                "--device tpu)")
NO_OPTIMIZER = "sgd"  # an optimizer without slots: the tables' rows alone


def check_table_memory(names: Sequence[str], rows: Sequence[int], dim: int, optimizer: str | None, world_size: int,
                       local_world_size: int, available: int | None, remedy: str = DLRM_REMEDY,
                       data_type: str = "fp32", zch: Mapping[str, str] | None = None) -> None:
    """ConfigError when the tables ``names`` (``rows`` each, ``dim`` wide at ``data_type``, trained
    by the sparse ``optimizer``; None: not trained; ``zch``: name -> eviction policy of those with a
    remap) with their state need more of this host than ``available`` bytes; the share of this
    host is ``local_world_size`` of ``world_size`` ranks; ``remedy`` ends the line (what to
    change). No check where ``available`` is None."""
    if available is None:
        return
    zch = zch or {}
    sizes = sorted(((table_bytes(r, dim, optimizer, data_type, zch.get(n)), n, r) for n, r in zip(names, rows)),
                   key=lambda t: (-t[0], t[1]))
    total = sum(size for size, _, _ in sizes)
    here = total * local_world_size // world_size
    if here <= available:
        return
    largest = ", ".join(f"{name} {r:,} rows ({_gb(size)})" for size, name, r in sizes[:NAMED_TABLES])
    ranks = f"{local_world_size} of {world_size} ranks on this host" if world_size > 1 else "one rank"
    raise ConfigError(
        f"the embedding tables need {_gb(here)} of this host's memory ({len(sizes)} tables x {dim} {data_type}"
        f"{f' with {optimizer} state' if optimizer else ''}, {_gb(total)} in all, {ranks}; largest: {largest}), "
        f"above the {_gb(available)} it has available; {remedy}")


def check_model_fits(spec: ModelSpec, optimizer: str | None, world_size: int, data_type: str = "fp32",
                     zch: Mapping[str, str] | None = None) -> None:
    """:func:`check_table_memory` of ``spec``'s tables (one per feature; ``zch``: feature ->
    eviction policy of the ``--zch`` ones) for this process: its host's available memory and local
    ranks (torchrun's ``LOCAL_WORLD_SIZE``). ``optimizer`` None: inference's tables, at
    ``data_type`` (``--table-dtype``) without optimizer state."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if world_size > 1 else 1
    check_table_memory(spec.feature_names, spec.table_sizes, spec.embedding_dim, optimizer, world_size,
                       min(local, world_size), available_host_bytes(), DLRM_REMEDY if optimizer else INFER_REMEDY,
                       data_type, zch)
