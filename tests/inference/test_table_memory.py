"""The planner's memory estimate at ``--table-dtype`` and the memory preflight of ``infer``/``export``."""

from __future__ import annotations

import pytest
import torch

from torchrec_tpu.inference.model import load_inference_model
from torchrec_tpu.inference.quantized_tables import quantize_table
from torchrec_tpu.planner.tables import EmbeddingTable
from torchrec_tpu.train import memory_preflight
from torchrec_tpu.train.config import ConfigError
from torchrec_tpu.train.memory_preflight import table_bytes

ROWS, DIM = 1000, 36
# a row's bytes by hand: 4 / 2 bytes an element; int8 a byte a code, int4 two codes a byte, each with an fp16
# scale and bias (4 bytes)
BY_HAND = {"fp32": 4 * DIM, "fp16": 2 * DIM, "bf16": 2 * DIM, "int8": DIM + 4, "int4": DIM // 2 + 4}


@pytest.mark.parametrize("dtype", sorted(BY_HAND))
def test_the_estimate_is_what_fbgemm_stores(dtype: str) -> None:
    assert table_bytes(ROWS, DIM, None, dtype) == ROWS * BY_HAND[dtype]
    assert table_bytes(ROWS, DIM, None, dtype) == quantize_table(torch.randn(ROWS, DIM), dtype).nbytes


def test_training_state_still_counts_fp32_rows_and_slots() -> None:
    assert table_bytes(ROWS, DIM, "rowwise_adagrad") == ROWS * (4 * DIM + 4)


def test_an_unknown_data_type_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"table 't': data_type must be one of \['fp32', 'fp16', 'bf16', 'int8', "
                                         r"'int4'\], got 'int2'"):
        EmbeddingTable("t", 10, 8, data_type="int2")


def test_infer_preflight_takes_the_table_dtype(checkpoint, monkeypatch) -> None:
    tables = 26 * 200  # the checkpoint's rows, 8 wide
    fp32, int8 = tables * 8 * 4, tables * (8 + 4)
    monkeypatch.setattr(memory_preflight, "available_host_bytes", lambda: (fp32 + int8) // 2)
    with pytest.raises(ConfigError, match=r"\(26 tables x 8 fp32, .* above the .* available; hold the tables at a "
                                          r"smaller --table-dtype \(int8, int4\)"):
        load_inference_model(checkpoint, table_dtype="fp32")
    assert load_inference_model(checkpoint, table_dtype="int8").table_bytes == int8
