"""Checks of what TorchRec 1.9's ``torchrec.experimental.torch_tpu`` hands the project, in the
shared words of :mod:`sparsecore.input_checks`: its table configs (``SparseCoreEmbeddingConfig``,
before it stacks them) and the KJT its ``SparseCoreInputPreprocessor`` is called with (before it
narrows the ids to int32 and splits the KJT by feature). ``torch_tpu`` runs them around TorchRec's
functions (``torch_tpu._internal.import_hook``); TorchRec's code is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore.input_checks import check_table_names, checked_ids, jagged_batch, positive_int


def check_sparsecore_tables(tables: Sequence[Any]) -> None:
    """ValueError naming the table and the value for a non-positive or non-integer size or
    limit of TorchRec TPU table configs ``tables``, a repeated table name or a feature in two
    tables."""
    for table in tables:
        where = f"table {table.name!r}"
        positive_int(table.num_embeddings, f"{where}: num_embeddings")
        positive_int(table.embedding_dim, f"{where}: embedding_dim")
        positive_int(table.max_ids_per_partition, f"{where}: max_ids_per_partition")
        positive_int(table.max_unique_ids_per_partition, f"{where}: max_unique_ids_per_partition")
        if table.max_seq_len is not None:
            positive_int(table.max_seq_len, f"{where}: max_seq_len")
    check_table_names((table.name, list(table.feature_names)) for table in tables)


def check_preprocessor_input(kjt: KeyedJaggedTensor, tables: Sequence[Any], batch_size: int) -> None:
    """ValueError naming the feature for a KJT that ``SparseCoreInputPreprocessor(tables,
    batch_size)`` would misread: a feature missing, lengths for another number of samples, a
    negative length, lengths and values that disagree, an id outside its table's rows or not an
    integer (checked in the KJT's own dtype, before TorchRec narrows it), more ids than a sequence
    table's ``batch_size x max_seq_len`` slots."""
    table_of = {name: table for table in tables for name in table.feature_names}
    batch = jagged_batch(kjt, list(table_of), dict.fromkeys(table_of, batch_size), other_keys=True)
    for name, table in table_of.items():
        values = batch.feature(name)[0]
        checked_ids(values, table.num_embeddings, f"feature {name!r} (table {table.name!r})")
        if isinstance(table.config, EmbeddingConfig) and table.max_seq_len is not None:
            slots = batch_size * table.max_seq_len
            if values.size > slots:
                raise ValueError(f"feature {name!r} (table {table.name!r}): {values.size} ids, more than batch_size "
                                 f"{batch_size} x max_seq_len {table.max_seq_len} = {slots}")
