"""A training checkpoint (``torchrec_tpu.train.checkpoint.store`` layout) -> an unsharded DLRM for inference.

The architecture comes from ``meta.json``'s ``model`` (a :class:`~torchrec_tpu.train.model.ModelSpec`,
table sizes included; checkpoints written before it existed: the architecture options of its
``config``, read by name without the training CLI's config class, and the table sizes from the DCP
metadata of the saved tables), so any checkpoint of the training job loads, whatever its data
source, world size or training flags: DCP reassembles the sharded tables into plain CPU tensors.
The files are verified against the checkpoint's manifest, every saved tensor's shape against the
model, and read without running code from them (``torchrec_tpu.train.checkpoint.reader``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import pyarrow as pa
import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipelines.schema import CRITEO, DatasetSchema
from torchrec_tpu.inference.quantized_tables import (
    QuantizedTable,
    empty_host_tables,
    held_bytes,
    host_embedding_bags,
    quantize_table,
)
from torchrec_tpu.inference.scoring import scoring_dlrm
from torchrec_tpu.inference.stacked_tables import StackedTables
from torchrec_tpu.inference.table_dtypes import check_table_dtype
from torchrec_tpu.train.model import ModelSpec, ebc_of, table_weight_key

if TYPE_CHECKING:  # (a model directory's loader imports no training config: torchrec_tpu.inference.export)
    from torchrec_tpu.sharding.zch_collection import ZchCollection


@dataclass
class InferenceModel:
    """The DLRM (eval mode, no loss head), the table sizes its ids are hashed into (``RAW_IDS``:
    read raw, remapped by ``zch``, the frozen managed-collision remap of ``train --zch``) and the
    dtype its tables are held at."""

    dlrm: nn.Module
    table_sizes: tuple[int, ...]
    step: int  # training step the checkpoint was taken at
    table_dtype: str = "fp32"
    tables: dict[str, QuantizedTable] = field(default_factory=dict)  # by feature: the host's tables (the module's)
    zch: "ZchCollection | None" = None
    table_bytes: int = -1  # bytes the embedding tables hold (-1: those of ``tables``)
    scorer: nn.Module | None = None  # what predict runs: dlrm's logits, less work per batch (None: dlrm)
    stacked: StackedTables | None = None  # the tables in one tensor (fp32, one-hot): predict_rows' one gather
    multi_hot: Callable[[KeyedJaggedTensor], KeyedJaggedTensor] | None = None  # train --multi-hot-sizes' expansion

    def __post_init__(self) -> None:
        if self.table_bytes < 0:
            self.table_bytes = sum(table.nbytes for table in self.tables.values())

    def close(self) -> None:
        """Release what the model holds beyond memory (the stack's process group)."""
        getattr(self.dlrm, "close", lambda: None)()

    @torch.inference_mode()
    def predict(self, batch: Batch | torch.Tensor, sparse: KeyedJaggedTensor | None = None) -> torch.Tensor:
        """Click probabilities, float32[B], of a TorchRec ``Batch`` (``predict(batch)``) or of
        dense features and their KJT (``predict(dense, sparse)``)."""
        dense = batch if sparse is not None else batch.dense_features
        sparse = sparse if sparse is not None else batch.sparse_features
        if self.zch is not None:
            sparse, _ = self.zch(sparse, training=False)
        if self.multi_hot is not None:
            sparse = self.multi_hot(sparse)
        return torch.sigmoid((self.scorer or self.dlrm)(dense, sparse).squeeze(-1))

    @torch.inference_mode()
    def predict_rows(self, data: pa.Table | pa.RecordBatch, schema: DatasetSchema) -> torch.Tensor:
        """Click probabilities, float32[B], of Arrow rows in ``schema``'s layout: with ``stacked``
        tables and single-valued categorical columns, their ids gathered from the stack in one
        lookup (:mod:`torchrec_tpu.inference.stacked_tables`), else :meth:`predict` of their
        ``KeyedJaggedTensor``."""
        from pipelines.arrow_batch import dense_from_arrow, sparse_from_arrow

        dense = dense_from_arrow(data, schema)
        rows = None if self.stacked is None else self.stacked.row_numbers(data, schema)
        if rows is None:
            return self.predict(dense, sparse_from_arrow(data, schema, self.table_sizes))
        return torch.sigmoid(self.scorer.towers.stacked(dense, self.stacked.gather(rows)).squeeze(-1))


def load_inference_model(checkpoint_dir: str | Path, schema: DatasetSchema = CRITEO,
                         table_dtype: str = "fp32") -> InferenceModel:
    """Rebuild the trained DLRM on CPU and load its weights from ``checkpoint_dir`` (a checkpoint,
    or a checkpoint root: its latest), its tables at ``table_dtype``
    (:mod:`torchrec_tpu.inference.quantized_tables`; fp32: the stock EmbeddingBagCollection).
    The tables are read one at a time, each quantized before the next is read, once the planner's
    estimate of them at ``table_dtype`` fits this host's memory (ConfigError otherwise). Either
    engine's checkpoints load: both name the tables :func:`~torchrec_tpu.train.model.table_weight_key`."""
    from torchrec_tpu.inference.zch_remap import read_sizes, saved_remap
    from torchrec_tpu.sharding.deferred import DeferredTensor
    from torchrec_tpu.train.checkpoint.reader import load_state
    from torchrec_tpu.train.checkpoint.store import STATE_DIR
    from torchrec_tpu.train.memory_preflight import check_model_fits
    from torchrec_tpu.train.model import build_dlrm

    directory, meta, spec, saved = checkpoint_model_spec(checkpoint_dir, schema)
    state_dir = directory / STATE_DIR
    keys = {f: table_weight_key(f) for f in schema.sparse}
    check_table_dtype(table_dtype, spec.embedding_dim)
    check_model_fits(spec, None, 1, table_dtype)
    train_module = build_dlrm(spec, dense_device=torch.device("cpu"))
    state = train_module.state_dict()  # the towers' tensors are the module's: the load fills them
    for key in keys.values():  # the tables (meta): read when asked, one at a time
        state[key] = DeferredTensor(tuple(state[key].shape), _unread)
    with warnings.catch_warnings():  # DCP's note that it loads in one process: that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        zch = saved_remap(meta, saved, spec, partial(_read_plain, state_dir))
        load_state({"model": state}, state_dir)
        # quantized straight into the rows the host will look them up from (FBGEMM's TBE): no second copy,
        # and no long-lived allocation between one fp32 table read and the next to fragment the heap
        module, tables = empty_host_tables({f: tuple(state[key].shape) for f, key in keys.items()}, table_dtype) \
            if table_dtype != "fp32" else (None, {})
        multi_hot = saved_multi_hot(meta, spec)
        stacked = StackedTables(StackedTables.empty(spec.table_sizes, spec.embedding_dim), spec.table_sizes) \
            if table_dtype == "fp32" and zch is None and multi_hot is None else None  # (each table read into its block)
        if stacked is not None:
            tables = {f: QuantizedTable("fp32", spec.embedding_dim, view) for f, view in zip(keys, stacked.views())}
        tables = {f: _read_table(state, key, table_dtype, tables.get(f)) for f, key in keys.items()}
    dlrm = train_module.model.eval()
    if table_dtype == "fp32":  # the stock EBC, which shares the tables' storage
        ebc_of(train_module).to_empty(device=torch.device("cpu"))
        with torch.no_grad():
            for feature, key in keys.items():
                train_module.get_parameter(key).set_(tables[feature].weight)
    else:
        dlrm.sparse_arch.embedding_bag_collection, tables = (module, tables) if module is not None else \
            host_embedding_bags(tables)
    return InferenceModel(dlrm, read_sizes(spec, zch), int(meta.get("step", 0)), table_dtype, tables, zch,
                          held_bytes(dlrm.sparse_arch.embedding_bag_collection, tables), scoring_dlrm(dlrm), stacked,
                          multi_hot)


def _read_table(state: dict[str, Any], key: str, table_dtype: str, out: QuantizedTable | None) -> QuantizedTable:
    """The table ``key`` of ``state`` read (its fp32 rows) and held at ``table_dtype`` (in ``out``),
    then the heap's freed pages handed back: glibc keeps a freed read as a hole that the next
    table's read, made around longer-lived blocks, does not always fill (int8 at 26 x 40k x 32:
    the load's peak RSS 0.55-0.67x the fp32 tables' bytes without, all of it held after the load)."""
    from xla_cache import host_heap

    table = quantize_table(state.pop(key).value(), table_dtype, out)
    host_heap.release()
    return table


def saved_multi_hot(meta: dict[str, Any], spec: ModelSpec) -> Callable[[KeyedJaggedTensor], KeyedJaggedTensor] | None:
    """The id expansion the checkpoint's training run applied (``train --multi-hot-sizes``, drawn
    from its ``--seed``), which its scores need too; None: it trained on one id per feature."""
    from torchrec_tpu.train.config import per_feature_values
    from torchrec_tpu.train.streams import MultiHotIds

    config = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    sizes = per_feature_values("multi_hot_sizes", config.get("multi_hot_sizes"), len(spec.feature_names))
    if sizes is None:
        return None
    if not isinstance(config.get("seed"), int):
        raise ValueError(f"the checkpoint trained with --multi-hot-sizes {config['multi_hot_sizes']} but its "
                         "meta.json records no --seed, which draws the expansion's offsets")
    return MultiHotIds(sizes, spec.table_sizes, config["seed"])


def _read_plain(state_dir: Path, key: str) -> Any:
    """The plain (non-tensor) value ``key`` of the checkpoint's model state."""
    from torchrec_tpu.train.checkpoint.reader import load_state

    state: dict[str, Any] = {key: b""}
    load_state({"model": state}, state_dir)
    return state[key]


def checkpoint_model_spec(checkpoint_dir: str | Path, schema: DatasetSchema
                          ) -> tuple[Path, dict[str, Any], ModelSpec, set[str]]:
    """(the checkpoint directory, verified; its meta.json; the architecture it holds for
    ``schema``'s features; the keys of its DCP state)."""
    from torchrec_tpu.train.checkpoint.reader import read_state_metadata
    from torchrec_tpu.train.checkpoint.store import STATE_DIR, open_checkpoint

    directory, meta = open_checkpoint(Path(checkpoint_dir))
    saved = read_state_metadata(directory / STATE_DIR).state_dict_metadata
    keys = {f: f"model.{table_weight_key(f)}" for f in schema.sparse}  # DCP state: {"model": DLRMTrain}
    missing = [f for f, key in keys.items() if key not in saved]
    if missing:
        raise ValueError(f"checkpoint {directory} has no embedding table for features {missing}")
    sizes = tuple(int(saved[keys[f]].size[0]) for f in schema.sparse)
    try:
        return directory, meta, saved_model_spec(meta, schema.sparse, sizes, len(schema.dense)), set(saved)
    except ValueError as error:
        raise ValueError(f"checkpoint {directory}: meta.json: {error}") from None


def _unread() -> torch.Tensor:
    raise AssertionError("load_state replaces every DeferredTensor it is given")


def saved_model_spec(meta: dict[str, Any], feature_names: tuple[str, ...], table_sizes: tuple[int, ...],
                     dense_in_features: int) -> ModelSpec:
    """The architecture a checkpoint's ``meta.json`` records, for ``feature_names`` (the data's
    categorical columns); ``table_sizes`` (read from the saved tables) serve checkpoints written
    before meta.json recorded the model."""
    if isinstance(meta.get("model"), dict):
        spec = ModelSpec.from_dict(meta["model"])
        if spec.feature_names != tuple(feature_names):
            raise ValueError(f"the model was trained on features {list(spec.feature_names)}, the data "
                             f"has {list(feature_names)}")
        return spec  # its table sizes: the saved tables are checked against them on load
    return _legacy_model_spec(meta.get("config"), feature_names, table_sizes, dense_in_features)


def _legacy_model_spec(config: Any, feature_names: tuple[str, ...], table_sizes: tuple[int, ...],
                       dense_in_features: int) -> ModelSpec:
    """The architecture of a checkpoint written before meta.json had "model": its training
    config's architecture options, read by the names they had then."""
    if not isinstance(config, dict):
        raise ValueError("it has neither a model spec nor a training config")
    try:
        dcn = config.get("model", "dlrm") == "dlrm_dcn"
        return ModelSpec(
            feature_names=tuple(feature_names), table_sizes=table_sizes,
            embedding_dim=int(config["embedding_dim"]), dense_in_features=dense_in_features,
            dense_layers=tuple(int(x) for x in str(config["dense_arch"]).split(",")),
            over_layers=tuple(int(x) for x in str(config["over_arch"]).split(",")),
            dcn_num_layers=int(config["dcn_num_layers"]) if dcn else 0,
            dcn_low_rank_dim=int(config["dcn_low_rank_dim"]) if dcn else 0,
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"its training config has no valid architecture ({type(error).__name__}: {error})") from None
