"""A training checkpoint (``torchrec_tpu.train.checkpoint`` layout) -> an unsharded DLRM for inference.

The architecture comes from ``meta.json`` (the training config) and the table sizes from the DCP
metadata of the saved tables, so any checkpoint of the training job loads, whatever its data
source and world size: DCP reassembles the sharded tables into plain CPU tensors. The files are
verified against the checkpoint's manifest and read without running code from them
(``torchrec_tpu.train.checkpoint_reader``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipelines.schema import CRITEO, DatasetSchema

# DCP key of feature f's table: {"model": DLRMTrain.state_dict()} with DLRMTrain.model = DLRM.
_TABLE_KEY = "model.model.sparse_arch.embedding_bag_collection.embedding_bags.t_{}.weight"


@dataclass
class InferenceModel:
    """The DLRM (eval mode, no loss head) and the table sizes its ids are hashed into."""

    dlrm: nn.Module
    table_sizes: tuple[int, ...]
    step: int  # training step the checkpoint was taken at

    @torch.no_grad()
    def predict(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Click probabilities, float32[B]."""
        return torch.sigmoid(self.dlrm(dense, sparse).squeeze(-1))


def load_inference_model(checkpoint_dir: str | Path, schema: DatasetSchema = CRITEO) -> InferenceModel:
    """Rebuild the trained DLRM on CPU and load its weights from ``checkpoint_dir`` (a checkpoint,
    or a checkpoint root: its latest). Either engine's checkpoints load: both name the tables
    ``...embedding_bag_collection.embedding_bags.<table>.weight``."""
    from torchrec_tpu.train.checkpoint import STATE_DIR, open_checkpoint
    from torchrec_tpu.train.checkpoint_reader import load_state, read_state_metadata
    from torchrec_tpu.train.config import TrainConfig
    from torchrec_tpu.train.job import model_spec
    from torchrec_tpu.train.model import build_dlrm

    directory, meta = open_checkpoint(Path(checkpoint_dir))
    state_dir = directory / STATE_DIR
    saved = read_state_metadata(state_dir).state_dict_metadata
    missing = [f for f in schema.sparse if _TABLE_KEY.format(f) not in saved]
    if missing:
        raise ValueError(f"checkpoint {directory} has no embedding table for features {missing}")
    sizes = tuple(int(saved[_TABLE_KEY.format(f)].size[0]) for f in schema.sparse)
    spec = model_spec(TrainConfig(**meta["config"]), schema.sparse, sizes, len(schema.dense))
    train_module = build_dlrm(spec, dense_device=torch.device("cpu"))
    # The tables were built on the meta device; give them storage, which the load then fills.
    train_module.model.sparse_arch.embedding_bag_collection.to_empty(device=torch.device("cpu"))
    state = {"model": train_module.state_dict()}
    load_state(state, state_dir)
    train_module.load_state_dict(state["model"])
    return InferenceModel(train_module.model.eval(), sizes, int(meta.get("step", 0)))
