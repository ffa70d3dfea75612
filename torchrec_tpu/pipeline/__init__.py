"""Train pipeline: batches are read, moved and input-dist'ed ahead of the step that uses them."""

from torchrec_tpu.pipeline.prefetch import PrefetchedBatches

__all__ = ["PrefetchedBatches"]
