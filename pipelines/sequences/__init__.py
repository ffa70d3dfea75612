"""Sequence data for generative recommenders (HSTU): events from MovieLens, Yambda or a synthetic
generator (``sources``, ``synthetic``), written as per-window sequence Parquet (``layout``) and
read back as KeyedJaggedTensor batches (``reader``)."""

from pipelines.sequences.events import Events
from pipelines.sequences.layout import SequenceMeta, read_meta, window_path, write_sequences
from pipelines.sequences.sources import read_movielens, read_yambda
from pipelines.sequences.synthetic import synthetic_events

__all__ = ["Events", "SequenceMeta", "read_meta", "read_movielens", "read_yambda", "synthetic_events",
           "window_path", "write_sequences"]
