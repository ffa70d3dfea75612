"""Batch inference over Parquet with a trained checkpoint (``torchrec-tpu infer``)."""
