"""HSTU (generative recommenders; MLPerf DLRMv4): the STU stack over jagged user histories, its
sequence tables on the sharded SparseCore EmbeddingCollection, and the attention on the tpu device.

``config``: :class:`HSTUConfig` and presets; ``layers``: STU layer and stack; ``attention``: the
tpu op or plain PyTorch; ``model``: :class:`HSTU`; ``sharded``: the tables on SparseCore.
"""

from torchrec_tpu.hstu.config import PRESETS, HSTUConfig, preset
from torchrec_tpu.hstu.layers import HSTUStack, Sequences, STULayer
from torchrec_tpu.hstu.model import FEATURE_KEYS, HSTU, table_configs
from torchrec_tpu.hstu.sharded import sharded_embeddings

__all__ = ["FEATURE_KEYS", "HSTU", "HSTUConfig", "HSTUStack", "PRESETS", "STULayer", "Sequences", "preset",
           "sharded_embeddings", "table_configs"]
