"""HSTU (generative recommenders; MLPerf DLRMv4): the STU stack over jagged user histories, its
sequence tables on the sharded SparseCore EmbeddingCollection, and the attention on the tpu device.

``config``: :class:`HSTUConfig` and presets; ``layers``: the STU layers (paper, dlrmv3, legacy) and
stack; ``attention``: the tpu op or plain PyTorch; ``model``: :class:`HSTU`; ``sharded``: the tables on SparseCore;
``retrieval``, ``retrieval_model``, ``retrieval_job``: the paper's retrieval task (splits, sampled
softmax, the encoder, ``train --task retrieval``); ``retrieval_metrics``: HR@K, NDCG@K and MRR over all items.
"""

from torchrec_tpu.hstu.config import PRESETS, HSTUConfig, preset
from torchrec_tpu.hstu.layers import STU_VARIANTS, DLRMv3STU, HSTUStack, LegacySTU, PaperSTU, Sequences
from torchrec_tpu.hstu.model import FEATURE_KEYS, HSTU, table_configs
from torchrec_tpu.hstu.sharded import sharded_embeddings

__all__ = ["FEATURE_KEYS", "HSTU", "STU_VARIANTS", "DLRMv3STU", "HSTUConfig", "HSTUStack", "LegacySTU", "PRESETS",
           "PaperSTU", "Sequences", "preset", "sharded_embeddings", "table_configs"]
