"""Quantized inference tables against TorchRec's ``quantize_inference_model`` (FBGEMM's inference TBE)."""

from __future__ import annotations

import copy

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torchrec.inference.modules import quantize_inference_model

from pipelines.parquet_reader import ParquetBatchReader
from tests.inference.quantized_cases import (
    FEATURES,
    TORCH_DTYPES,
    batch_of_two_features,
    ebc_of_two_tables,
    ours,
    torchrec_quantized,
)
from torchrec_tpu.inference.model import load_inference_model
from torchrec_tpu.inference.quantized_tables import quantize_table
from torchrec_tpu.inference.table_dtypes import check_table_dtype


@pytest.mark.parametrize("dtype", ["int8", "int4", "fp16"])
def test_tables_equal_torchrec_quantization_row_for_row(dtype: str) -> None:
    ebc = ebc_of_two_tables()
    theirs = torchrec_quantized(ebc, dtype).tbes[0].split_embedding_weights()
    for i, feature in enumerate(FEATURES):
        ours = quantize_table(ebc.embedding_bags[f"t_{feature}"].weight, dtype)
        codes, scale_shift = theirs[i]
        if dtype == "fp16":
            assert scale_shift is None and ours.scale_bias is None
            assert torch.equal(ours.weight.view(torch.uint8), codes)
        else:
            assert torch.equal(ours.weight, codes)
            assert torch.equal(ours.scale_bias.view(torch.uint8), scale_shift)
        assert ours.nbytes == codes.numel() + (0 if scale_shift is None else scale_shift.numel())


@pytest.mark.parametrize("dtype", ["int8", "int4", "fp16"])
def test_lookup_equals_torchrec_quantized_ebc(dtype: str) -> None:
    ebc, batch = ebc_of_two_tables(), batch_of_two_features()
    expected = torchrec_quantized(ebc, dtype)(batch)
    got = ours(ebc, dtype)(batch)
    assert got.keys() == expected.keys()
    torch.testing.assert_close(got.values(), expected.values().float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_float_lookup_equals_a_cast_table(dtype: str) -> None:
    ebc, batch = ebc_of_two_tables(), batch_of_two_features()
    cast = copy.deepcopy(ebc)
    with torch.no_grad():
        for table in cast.embedding_bags.values():
            table.weight.copy_(table.weight.to(torch.bfloat16 if dtype == "bf16" else torch.float32).float())
    torch.testing.assert_close(ours(ebc, dtype)(batch).values(), cast(batch).values(), rtol=1e-6, atol=1e-6)


def test_dtype_checks_name_the_flag() -> None:
    with pytest.raises(ValueError, match=r"--table-dtype int4 needs an embedding dim divisible by 4, the model's is 6"):
        check_table_dtype("int4", 6)
    with pytest.raises(ValueError, match=r"--table-dtype must be one of .*'int2'"):
        check_table_dtype("int2", 8)


@pytest.mark.parametrize("dtype", ["int8", "int4", "fp16"])
def test_checkpoint_at_a_table_dtype_predicts_as_torchrec_quantized(checkpoint, infer_data, dtype: str) -> None:
    """A trained DLRM loaded at ``dtype`` against TorchRec's ``quantize_inference_model`` of its fp32 DLRM."""
    fp32 = load_inference_model(checkpoint)
    ours = load_inference_model(checkpoint, table_dtype=dtype)
    theirs = quantize_inference_model(copy.deepcopy(fp32.dlrm), per_table_weight_dtype={
        name: TORCH_DTYPES[dtype] for name in fp32.dlrm.sparse_arch.embedding_bag_collection.embedding_bags})
    batch = next(iter(ParquetBatchReader(infer_data, 512, ours.table_sizes)))
    with torch.no_grad():
        expected = torch.sigmoid(theirs(batch.dense_features, batch.sparse_features).squeeze(-1))
    # the host looks the tables up with FBGEMM's inference TBE, which holds them: the same program
    assert torch.equal(ours.predict(batch.dense_features, batch.sparse_features), expected)
    storages = {t.weight.untyped_storage().data_ptr() for t in ours.tables.values()}
    assert len(storages) == 1  # every table a view of the TBE's rows, no second copy
    # dim 8: codes + fp16 scale and bias (int8 12 B, int4 8 B; fp16 16 B), each row padded to FBGEMM's 16 B,
    # and the TBE's few bytes of its own
    assert ours.table_dtype == dtype and 26 * 200 * 16 <= ours.table_bytes < 26 * 200 * 16 + 128
    (tbe,) = ours.dlrm.sparse_arch.embedding_bag_collection.tbes
    assert ours.table_bytes == tbe.weights_host.numel()
    assert fp32.table_bytes == 26 * 200 * 8 * 4


def test_infer_cli_at_int8_prints_the_dtype_and_bytes(checkpoint, infer_data, tmp_path, capsys) -> None:
    from torchrec_tpu.cli import main

    output = tmp_path / "out"
    assert main(["infer", "--data", str(infer_data), "--checkpoint", str(checkpoint), "--output", str(output),
                 "--table-dtype", "int8", "--no-progress"]) == 0
    assert f"  tables          int8, {26 * 200 * (8 + 4):,} bytes held per model copy" in capsys.readouterr().out
    first = sorted(infer_data.glob("*.parquet"))[0]
    batch = next(iter(ParquetBatchReader(first, 500, (200,) * 26)))
    expected = load_inference_model(checkpoint, table_dtype="int8").predict(batch.dense_features,
                                                                            batch.sparse_features)
    got = pq.read_table(output / "part-000000.parquet").column("prediction").to_numpy()
    np.testing.assert_array_equal(got, expected.numpy())
