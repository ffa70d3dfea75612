"""A training checkpoint -> the DLRM as the trainer lays it out, for ``infer --device tpu``.

The tables in :class:`~torchrec_tpu.sharding.ShardedSparseCoreEBC` on the ``tpu::`` SparseCore
ops, sharded over the ranks of the process group as ``--plan`` says (default: whole tables balanced
over the ranks; each rank holds only its shards), the towers on the tpu device, and a batch scored
by the trainer's own evaluation forward
(:class:`~torchrec_tpu.train.engines.dense_step.CompiledDenseEval`): on one rank lookup and towers
ONE compiled program, run on chunks of ``--batch-size`` rows (the last zero-padded); on several,
the EBC's input and output dists as in training, every rank's batch zero-padded to ``--batch-size``
rows. The tables stay fp32 (the SparseCore ops take fp32 tables); a ``train --fdo`` checkpoint's
tuned id limits are theirs.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipelines.schema import CRITEO, DatasetSchema
from torchrec_tpu.inference.model import InferenceModel, checkpoint_model_spec, saved_multi_hot
from torchrec_tpu.train.metrics import EvalForward
from torchrec_tpu.train.model import ModelSpec


class StackDLRM(nn.Module):
    """``(dense, KJT) -> logits float32[B, 1]`` through the trainer's evaluation forward."""

    def __init__(self, model: nn.Module, forward: EvalForward, resources: ExitStack, rows: int = 0) -> None:
        super().__init__()
        self.model, self.forward_of, self.resources = model, forward, resources
        self.rows = rows  # > 0: every batch zero-padded to this many rows (the ranks' dists meet one shape)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        from torchrec_tpu.train.metrics import padded

        rows = dense.shape[0]
        batch = padded(Batch(dense, sparse, torch.zeros(rows)), self.rows)
        return self.forward_of(self.model, batch)[:rows].reshape(-1, 1)

    def close(self) -> None:
        """Leave the process group this model joined."""
        self.resources.close()


def load_stack_model(checkpoint_dir: str | Path, batch_size: int, schema: DatasetSchema = CRITEO,
                     plan: str | None = None) -> InferenceModel:
    """The model of ``checkpoint_dir`` (a checkpoint or a checkpoint root) sharded on the
    SparseCore ops over the default process group's ranks as ``plan`` says (``--plan``), towers
    on tpu, each rank scoring ``batch_size`` rows a forward; joins (or makes) the default process
    group until :meth:`InferenceModel.close`. Its ``table_bytes``: those of this rank's shards."""
    from torchrec_tpu.inference.zch_remap import SAVED_KEY
    from torchrec_tpu.train.config import EngineConfig, OptimConfig
    from torchrec_tpu.train.distributed import process_group
    from torchrec_tpu.train.engines.dense_step import eval_forward
    from torchrec_tpu.train.engines.sparsecore_engine import build_sparsecore_model, unwrap_dense
    from torchrec_tpu.train.engines.step_layout import resolve_sparsecore_layout
    from torchrec_tpu.train.memory_preflight import check_model_fits

    directory, meta, spec, saved = checkpoint_model_spec(checkpoint_dir, schema)
    if any(key.startswith(f"model.{SAVED_KEY}") for key in saved):  # (one rank's, or each rank's of several)
        raise ValueError(f"--device tpu: checkpoint {directory} remaps its ids (train --zch), which this path "
                         "does not apply; --device cpu serves it")
    resources = ExitStack()
    try:
        env = resources.enter_context(process_group(device_tensors=True))
        check_model_fits(spec, None, env.world_size)  # fp32 tables, this host's ranks' shares
        # sgd: tables without optimizer slots (nothing is trained)
        options, optim = EngineConfig(dense_device="tpu", plan=plan), OptimConfig(sparse_optimizer="sgd")
        global_batch = batch_size * env.world_size
        layout = resolve_sparsecore_layout(options, optim, spec, env.world_size, global_batch)
        # the towers are not trained: no DDP around them (each rank loads the same ones)
        model = unwrap_dense(build_sparsecore_model(spec, env, layout, optim, options, global_batch, seed=0,
                                                    table_limits=checkpoint_limits(meta, directory)))
        _load(directory, model, spec)
        model.eval()
        dlrm = StackDLRM(model, eval_forward(model, layout), resources, batch_size if env.world_size > 1 else 0)
    except BaseException:
        resources.close()
        raise
    return InferenceModel(dlrm, spec.table_sizes, int(meta.get("step", 0)), "fp32", table_bytes=_held_bytes(model),
                          multi_hot=saved_multi_hot(meta, spec))


def checkpoint_limits(meta: dict, directory: Path) -> dict[str, tuple[int, int]] | None:
    """The id limits a ``train --fdo`` checkpoint tuned, as each table's share of its stack's
    (None: the checkpoint recorded none)."""
    from sparsecore.fdo_stats import FdoStats

    if "fdo" not in meta:
        return None
    return FdoStats.from_json(meta["fdo"], f"checkpoint {directory}: meta.json's \"fdo\"").table_shares()


def _held_bytes(model: nn.Module) -> int:
    """Bytes of the embedding tables this rank holds (its shards' rows, not the whole tables)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    from torchrec_tpu.sharding.deferred import deferred_tables
    from torchrec_tpu.train.model import EBC_PATH

    with deferred_tables():
        state = model.state_dict()
    held = 0
    for key, value in state.items():
        if key.startswith(EBC_PATH) and key.endswith(".weight"):
            shards = [s.tensor for s in value.local_shards()] if isinstance(value, ShardedTensor) else [value]
            held += sum(t.numel() * t.element_size() for t in shards)  # (a DeferredTensor's: its shape's, unread)
    return held


def _load(directory: Path, model: nn.Module, spec: ModelSpec) -> None:
    """The checkpoint's tables (read one at a time) and towers into the sharded ``model``; state
    the checkpoint keeps elsewhere or not at all (the sparse optimizer's, which either engine
    keeps in its own place; the sparsecore EBC's zero-element anchor) keeps its fresh value."""
    from torchrec_tpu.sharding.deferred import DeferredTensor, deferred_tables
    from torchrec_tpu.train.checkpoint.reader import load_state, read_state_metadata
    from torchrec_tpu.train.checkpoint.store import STATE_DIR
    from torchrec_tpu.train.model import build_dlrm

    saved = read_state_metadata(directory / STATE_DIR).state_dict_metadata
    with deferred_tables():
        state = model.state_dict()
    asked = {k: v for k, v in state.items() if f"model.{k}" in saved}
    # the rest (an anchor, sgd's step count) keep their fresh values, read before the load replaces them
    state = {k: v.value() if isinstance(v, DeferredTensor) else v for k, v in state.items() if k not in asked}
    missing = [k for k in build_dlrm(spec, torch.device("cpu")).state_dict() if k not in asked]
    if missing:
        raise ValueError(f"checkpoint {directory} has no tensors {missing[:3]} of the model")
    load_state({"model": asked}, directory / STATE_DIR)
    model.load_state_dict({**state, **asked})
