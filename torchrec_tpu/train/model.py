"""Model factory: stock TorchRec DLRM / DLRM_DCN with one embedding table per sparse feature.

The embedding tables are built on the meta device; the torchrec engine's
``DistributedModelParallel`` (:mod:`torchrec_tpu.train.engines.torchrec_engine`) materialises them sharded.
The dense towers are built on ``dense_device``; the sparsecore engine builds them on the CPU and
moves them (:mod:`torchrec_tpu.train.engines.dense_placement`). :data:`EBC_PATH` and :func:`table_name`
are the one definition of where the tables live in the model and what they are called, which
both engines' checkpoints and the inference loader rely on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain

# Where DLRMTrain keeps its EmbeddingBagCollection (parameter names start with it).
EBC_PATH = "model.sparse_arch.embedding_bag_collection"


def ebc_of(train_model: nn.Module) -> nn.Module:
    """The EmbeddingBagCollection (or its sharded replacement) of a ``DLRMTrain``."""
    return train_model.get_submodule(EBC_PATH)


def table_name(feature: str) -> str:
    """The name of ``feature``'s embedding table: ``t_<feature>``."""
    return f"t_{feature}"


def table_weight_key(feature: str) -> str:
    """``DLRMTrain.state_dict()`` key of ``feature``'s table (either engine)."""
    return f"{EBC_PATH}.embedding_bags.{table_name(feature)}.weight"


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a DLRM: what :func:`build_dlrm` needs, independent of the CLI config."""

    feature_names: tuple[str, ...]
    table_sizes: tuple[int, ...]  # rows of each feature's table, in feature_names order
    embedding_dim: int
    dense_in_features: int
    dense_layers: tuple[int, ...]
    over_layers: tuple[int, ...]
    dcn_num_layers: int = 0  # 0: plain DLRM (dot interaction); > 0: DLRM_DCN
    dcn_low_rank_dim: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (a checkpoint's ``meta.json`` "model")."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> "ModelSpec":
        """The inverse of :meth:`to_dict`; ValueError naming what is missing or malformed."""
        try:
            return cls(feature_names=tuple(str(f) for f in saved["feature_names"]),
                       table_sizes=tuple(int(r) for r in saved["table_sizes"]),
                       embedding_dim=int(saved["embedding_dim"]),
                       dense_in_features=int(saved["dense_in_features"]),
                       dense_layers=tuple(int(x) for x in saved["dense_layers"]),
                       over_layers=tuple(int(x) for x in saved["over_layers"]),
                       dcn_num_layers=int(saved.get("dcn_num_layers", 0)),
                       dcn_low_rank_dim=int(saved.get("dcn_low_rank_dim", 0)))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not a model spec ({type(error).__name__}: {error})") from None


def table_configs(spec: ModelSpec) -> list[EmbeddingBagConfig]:
    """One sum-pooled table per feature, named :func:`table_name`."""
    if len(spec.table_sizes) != len(spec.feature_names):
        raise ValueError(
            f"{len(spec.table_sizes)} table sizes for {len(spec.feature_names)} features"
        )
    return [
        EmbeddingBagConfig(
            name=table_name(feature),
            embedding_dim=spec.embedding_dim,
            num_embeddings=table_rows,
            feature_names=[feature],
        )
        for feature, table_rows in zip(spec.feature_names, spec.table_sizes)
    ]


def build_dlrm(spec: ModelSpec, dense_device: torch.device) -> DLRMTrain:
    """An unsharded DLRMTrain (BCE-with-logits loss head) with meta-device embedding tables."""
    ebc = EmbeddingBagCollection(tables=table_configs(spec), device=torch.device("meta"))
    common = dict(
        embedding_bag_collection=ebc,
        dense_in_features=spec.dense_in_features,
        dense_arch_layer_sizes=list(spec.dense_layers),
        over_arch_layer_sizes=list(spec.over_layers),
        dense_device=dense_device,
    )
    if spec.dcn_num_layers:
        dlrm: DLRM = DLRM_DCN(
            **common, dcn_num_layers=spec.dcn_num_layers, dcn_low_rank_dim=spec.dcn_low_rank_dim
        )
    else:
        dlrm = DLRM(**common)
    return DLRMTrain(dlrm)
