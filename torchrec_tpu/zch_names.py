"""The managed-collision (ZCH) eviction policies by name: a leaf, so ``train --help`` and the
config read the vocabulary without importing TorchRec (``torchrec_tpu.sharding.zch`` maps each
name to TorchRec's policy class)."""

ZCH_POLICIES = ("lfu", "lru", "distance_lfu")

# host bytes of a remap's slot: its raw id in the sorted identity table and the slot it maps to
# (int64 each), and the policy's per-slot metadata (int64: LFU's counts, LRU's last access, both)
ZCH_SLOT_BYTES = dict(zip(ZCH_POLICIES, (8 + 8 + 8, 8 + 8 + 8, 8 + 8 + 16)))
