"""Criteo-style data pipelines for torchrec-tpu.

Modules (import them directly; this package imports nothing heavy so the CLI stays fast):

* ``pipelines.schema``        ``DatasetSchema``, ``CRITEO``, ``criteo_schema`` and the Parquet layout
* ``pipelines.text_reader``   ``TextReader`` for headerless TSV / CSV logs, ``BadRowError``, policies
* ``pipelines.convert``       ``convert_to_parquet`` (streaming, chunked, row-accounted)
* ``pipelines.synthetic``     ``SyntheticConfig``, ``generate``, ``default_dataset``
* ``pipelines.arrow_batch``   ``batch_from_arrow``: one Arrow table / record batch -> ``Batch``
* ``pipelines.parquet_reader`` ``ParquetBatchReader``: Parquet files -> sharded ``Batch`` stream
* ``pipelines.streams``       ``prefetched`` (background-thread iterator), ``batches_from_row`` (seek)
* ``pipelines.bad_values``    ``--bad-values`` policies (error / skip / clamp) and their counts
* ``pipelines.npy_criteo``    TorchRec's preprocessed Criteo (``day_<d>_*.npy``) as ``Batch`` streams
* ``pipelines.parquet_writer`` chunked Parquet output, each file renamed into place when complete
* ``pipelines.dataset_dir``   atomic dataset directories (temporary dir + rename, ``_COMPLETE.json``)
* ``pipelines.text_parsing``  vectorised TSV / CSV field parsing
* ``pipelines.ray_data``      Ray Data reader (``streaming_split``) yielding ``Batch``
* ``pipelines.ray_session``   a local Ray instance and its watchdog
* ``pipelines.sample_data``   the vendored Criteo sample rows (package data)
* ``pipelines.cli``           ``torchrec-tpu data convert|generate``
"""
