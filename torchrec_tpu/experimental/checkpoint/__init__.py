"""``torchrec.experimental.torch_tpu.checkpoint``: DCP planners for SparseCore tables."""

from torchrec_tpu.experimental.checkpoint.planners import SparseCoreLoadPlanner, SparseCoreSavePlanner

__all__ = ["SparseCoreLoadPlanner", "SparseCoreSavePlanner"]
