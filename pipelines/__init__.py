"""Criteo-style data pipelines for torchrec-tpu.

Modules (import them directly; this package imports nothing heavy so the CLI stays fast):

* ``pipelines.schema``        ``DatasetSchema``, ``CRITEO``, ``criteo_schema`` and the Parquet layout
* ``pipelines.text_reader``   ``TextReader`` for headerless TSV / CSV logs, ``BadRowError``, policies
* ``pipelines.convert``       ``convert_to_parquet`` (streaming, chunked, row-accounted)
* ``pipelines.synthetic``     ``SyntheticConfig``, ``generate``, ``default_dataset``
* ``pipelines.arrow_batch``   ``batch_from_arrow``: one Arrow table / record batch -> ``Batch``
* ``pipelines.parquet_reader`` ``ParquetBatchReader``: Parquet files -> sharded ``Batch`` stream
* ``pipelines.cli``           ``torchrec-tpu data convert|generate``
"""
