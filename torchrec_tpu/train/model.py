"""Model factory: stock TorchRec DLRM / DLRM_DCN with one embedding table per sparse feature.

The embedding tables are built on the meta device; the torchrec engine's
``DistributedModelParallel`` (:mod:`torchrec_tpu.train.sharding`) materialises them sharded. The dense towers are built on
``dense_device``; the sparsecore engine builds them on the CPU and moves them
(:mod:`torchrec_tpu.train.dense_placement`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain


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


def table_configs(spec: ModelSpec) -> list[EmbeddingBagConfig]:
    """One sum-pooled table per feature, named ``t_<feature>``."""
    if len(spec.table_sizes) != len(spec.feature_names):
        raise ValueError(
            f"{len(spec.table_sizes)} table sizes for {len(spec.feature_names)} features"
        )
    return [
        EmbeddingBagConfig(
            name=f"t_{feature}",
            embedding_dim=spec.embedding_dim,
            num_embeddings=rows,
            feature_names=[feature],
        )
        for feature, rows in zip(spec.feature_names, spec.table_sizes)
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
