"""TorchRec 1.9.2's own TPU module, unchanged, refuses bad ids, configs and KJTs with one clear
error (``torch_tpu`` checks them where TorchRec hands them over, before TorchRec narrows ids to
int32): ids never wrap (2^32 + 3 is not id 3), non-integral ids are not truncated, and each error
names the feature or table and the bad value."""

from __future__ import annotations

# isort: off
import torch_tpu  # noqa: F401  TorchTPU's environment before TorchRec's TPU module
# isort: on

import math

import pytest
import torch
from torchrec.experimental.torch_tpu import (
    SparseCoreEmbeddingConfig,
    SparseCoreFusedEmbeddingBagCollection,
    SparseCoreFusedEmbeddingCollection,
    SparseCoreInputPreprocessor,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

BATCH = 2
ROWS = 100


def _tables(*extra: dict, **config) -> list[SparseCoreEmbeddingConfig]:
    base = {"name": "t", "num_embeddings": ROWS, "embedding_dim": 8, "feature_names": ["f"], **config}
    return [SparseCoreEmbeddingConfig(config=EmbeddingBagConfig(**c)) for c in (base, *extra)]


def _preprocess(values: list, lengths: list[int] | None = None, keys: tuple[str, ...] = ("f",),
                dtype: torch.dtype = torch.int64) -> object:
    pre = SparseCoreInputPreprocessor(tables=_tables(), batch_size=BATCH)
    lengths = lengths if lengths is not None else [len(values)] + [0] * (BATCH * len(keys) - 1)
    return pre(KeyedJaggedTensor(keys=list(keys), values=torch.tensor(values, dtype=dtype),
                                 lengths=torch.tensor(lengths)))


def test_in_range_ids_still_preprocess() -> None:
    out = _preprocess([3, 99])
    assert out.table_tensors["t"].embedding_ids.numel() > 0


@pytest.mark.parametrize("bad", [2**32 + 3, -2**63, 2**63 - 1, ROWS, -1])
def test_ids_outside_the_table_are_refused_in_their_int64_form(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"feature 'f' \(table 't'\): id {bad} is outside the table's {ROWS} rows "
                                         rf"\[0, {ROWS}\) \(position 1"):
        _preprocess([3, bad])


@pytest.mark.parametrize("bad", [1.5, math.nan, math.inf, -0.5])
def test_non_integral_ids_are_refused_not_truncated(bad: float) -> None:
    with pytest.raises(ValueError, match=rf"feature 'f' \(table 't'\): id {bad!r} is not an integer \(position 1.*"
                                         rf"the table's {ROWS} rows"):
        _preprocess([3.0, bad], dtype=torch.float32)
    _preprocess([3.0, 7.0], dtype=torch.float32)  # integral floats are ids


def test_kjt_layout_errors_name_the_feature_and_the_count() -> None:
    with pytest.raises(ValueError, match=r"the KJT has no feature 'f'; its features are \['g'\]"):
        _preprocess([1], keys=("g",))
    with pytest.raises(ValueError, match=r"feature 'f': lengths for 3 samples, expected 2 \(the batch size\)"):
        _preprocess([1, 2], lengths=[1, 1, 0])
    with pytest.raises(ValueError, match=r"feature 'f': sample 1 has length -1"):
        _preprocess([1, 2], lengths=[3, -1])
    with pytest.raises(ValueError, match=r"feature 'f': lengths sum to 2 \(2 over all features \['f'\]\) but the KJT "
                                         r"has 3 values"):
        _preprocess([1, 2, 3], lengths=[1, 1])


def test_sequence_tables_refuse_more_ids_than_their_slots() -> None:
    tables = [SparseCoreEmbeddingConfig(config=EmbeddingConfig(name="s", num_embeddings=ROWS, embedding_dim=8,
                                                               feature_names=["h"]), max_seq_len=2)]
    pre = SparseCoreInputPreprocessor(tables=tables, batch_size=BATCH)
    with pytest.raises(ValueError, match=r"feature 'h' \(table 's'\): 5 ids, more than batch_size 2 x max_seq_len 2"):
        pre(KeyedJaggedTensor(keys=["h"], values=torch.arange(5), lengths=torch.tensor([3, 2])))


@pytest.mark.parametrize("field, value", [("embedding_dim", -4), ("embedding_dim", 0), ("embedding_dim", 2.5)])
def test_table_sizes_are_checked_by_the_preprocessor_and_the_fused_modules(field: str, value: int) -> None:
    message = rf"table 't': {field} must be a positive integer, got {value}"
    with pytest.raises(ValueError, match=message):
        SparseCoreInputPreprocessor(tables=_tables(**{field: value}), batch_size=BATCH)
    with pytest.raises(ValueError, match=message):
        SparseCoreFusedEmbeddingBagCollection(tables=_tables(**{field: value}), optimizer_type=torch.optim.SGD,
                                              optimizer_kwargs={"lr": 0.1}, batch_size=BATCH)


@pytest.mark.parametrize("field", ["max_ids_per_partition", "max_unique_ids_per_partition"])
@pytest.mark.parametrize("value", [0, -1, 1.5])
def test_partition_limits_must_be_positive_integers(field: str, value: float) -> None:
    tables = _tables()
    setattr(tables[0], field, value)
    with pytest.raises(ValueError, match=rf"table 't': {field} must be a positive integer, got {value}"):
        SparseCoreInputPreprocessor(tables=tables, batch_size=BATCH)


def test_duplicate_tables_and_shared_features_are_refused() -> None:
    with pytest.raises(ValueError, match=r"duplicate table name 't'"):
        SparseCoreInputPreprocessor(tables=_tables({"name": "t", "num_embeddings": 10, "embedding_dim": 8,
                                                    "feature_names": ["g"]}), batch_size=BATCH)
    with pytest.raises(ValueError, match=r"feature 'f' is listed by tables 't' and 'u'"):
        SparseCoreInputPreprocessor(tables=_tables({"name": "u", "num_embeddings": 10, "embedding_dim": 8,
                                                    "feature_names": ["f"]}), batch_size=BATCH)
    seq = [SparseCoreEmbeddingConfig(config=EmbeddingConfig(name=n, num_embeddings=10, embedding_dim=8,
                                                            feature_names=["h"]), max_seq_len=2) for n in "ab"]
    with pytest.raises(ValueError, match=r"feature 'h' is listed by tables 'a' and 'b'"):
        SparseCoreFusedEmbeddingCollection(tables=seq, optimizer_type=torch.optim.SGD, optimizer_kwargs={"lr": 0.1},
                                           batch_size=BATCH)


def test_auto_stacking_and_explicit_stacking_check_the_tables_first() -> None:
    from torchrec.experimental.torch_tpu import auto_stack_tables, stack_tables

    with pytest.raises(ValueError, match=r"table 't': embedding_dim must be a positive integer, got -4"):
        SparseCoreInputPreprocessor(tables=_tables(embedding_dim=-4), batch_size=BATCH, auto_stack=True)
    with pytest.raises(ValueError, match=r"table 't': embedding_dim must be a positive integer, got -4"):
        auto_stack_tables(_tables(embedding_dim=-4), global_device_count=1, num_sc_per_device=2, batch_size=BATCH)
    with pytest.raises(ValueError, match=r"duplicate table name 't'"):
        stack_tables(_tables({"name": "t", "num_embeddings": 10, "embedding_dim": 8, "feature_names": ["g"]}),
                     ["t"])
