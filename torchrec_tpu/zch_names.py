"""The managed-collision (ZCH) eviction policies by name: a leaf, so ``train --help`` and the
config read the vocabulary without importing TorchRec (``torchrec_tpu.sharding.zch`` maps each
name to TorchRec's policy class)."""

ZCH_POLICIES = ("lfu", "lru", "distance_lfu")
