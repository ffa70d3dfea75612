"""Named ``record_function`` ranges for the phases of a training step, attached by hooks.

The model is not edited: forward hooks open and close a range around the modules of each phase,
a DDP comm hook wraps the gradient all-reduce, and :class:`PhasedParquetReader` labels the reader.
``dense_bwd`` is the whole ``loss.backward()``: the fused embedding update runs inside it (FBGEMM
applies the sparse optimizer in backward), so there is no separate sparse-backward range; it and
``optimizer`` are opened by the eager step itself (:func:`torchrec_tpu.train.loop.train_step`).
"""


import contextlib
from typing import Iterator

import pyarrow as pa
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torchrec.datasets.utils import Batch

from pipelines.parquet_reader import ParquetBatchReader
from torchrec_tpu.train.loop import COLLECTIVES, DENSE_BWD, OPTIMIZER

DATA, PREPROCESS, SPARSE_LOOKUP = "data", "preprocess", "sparse_lookup"
DENSE_FWD, TRAIN_STEP = "dense_fwd", "train_step"
# TRAIN_STEP: the whole step function train runs (one compiled program by default, whose parts
# then show no ranges of their own); the eager step's parts show as the others
PHASES = (DATA, PREPROCESS, TRAIN_STEP, SPARSE_LOOKUP, DENSE_FWD, DENSE_BWD, OPTIMIZER, COLLECTIVES)

_DENSE_PARTS = ("dense_arch", "inter_arch", "over_arch")
# HSTU's (torchrec_tpu.hstu.model.HSTU) top-level modules, by their full names
_HSTU_SPARSE, _HSTU_DENSE = ("embeddings",), ("stack", "heads")


class PhasedParquetReader(ParquetBatchReader):
    """The Parquet reader with ``data`` (row-group decode) and ``preprocess`` (Arrow -> Batch)
    ranges. Construct it with ``prefetch_row_groups=0``: torch.profiler records only threads it
    was enabled on, so a prefetch thread's reads would be missing from the trace."""

    def _tables(self, start: int) -> Iterator[pa.Table]:
        tables = super()._tables(start)
        while True:
            with record_function(DATA):
                table = next(tables, None)
            if table is None:
                return
            yield table

    def _batch(self, rows: pa.Table) -> Batch:
        with record_function(PREPROCESS):
            return super()._batch(rows)


def _range_hooks(module: nn.Module, name: str) -> list:
    open_ranges: list[record_function] = []

    def enter(*_: object) -> None:
        open_ranges.append(record_function(name).__enter__())

    def leave(*_: object) -> None:
        open_ranges.pop().__exit__(None, None, None)

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]


def _collective_modules(model: nn.Module) -> Iterator[nn.Module]:
    """TorchRec's sharded modules keep their input/output all-to-alls in these lists (created on
    the first forward)."""
    for module in model.modules():
        for attribute in ("_input_dists", "_output_dists"):
            dists = getattr(module, attribute, None)
            if isinstance(dists, (list, nn.ModuleList)):
                yield from (d for d in dists if isinstance(d, nn.Module))


def _traced_allreduce(process_group: dist.ProcessGroup, bucket: dist.GradBucket):
    with record_function(COLLECTIVES):
        return default_hooks.allreduce_hook(process_group, bucket)


@contextlib.contextmanager
def phase_ranges(model: nn.Module) -> Iterator[None]:
    """Attach the forward phase ranges (and the all-reduce range of DDP parts) for the body.

    The DDP comm hook cannot be removed again, so it stays (it only adds a range).
    """
    handles = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "sparse_arch" or name in _HSTU_SPARSE:
            handles += _range_hooks(module, SPARSE_LOOKUP)
        elif leaf in _DENSE_PARTS or name in _HSTU_DENSE:
            handles += _range_hooks(module, DENSE_FWD)
        elif isinstance(module, DistributedDataParallel) and not getattr(module, "_tpu_traced", False):
            module.register_comm_hook(dist.group.WORLD, _traced_allreduce)
            module._tpu_traced = True
    for module in _collective_modules(model):
        handles += _range_hooks(module, COLLECTIVES)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
