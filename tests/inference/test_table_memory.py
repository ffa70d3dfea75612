"""The planner's memory estimate at ``--table-dtype`` and the memory preflight of ``infer``/``export``."""

from __future__ import annotations

import pytest
import torch

from torchrec_tpu.inference.model import load_inference_model
from torchrec_tpu.inference.quantized_tables import empty_host_tables, quantize_table
from torchrec_tpu.planner.tables import EmbeddingTable
from torchrec_tpu.train import memory_preflight
from torchrec_tpu.train.config import ConfigError
from torchrec_tpu.train.memory_preflight import table_bytes

ROWS, DIM = 1000, 36
# a row's bytes by hand: 4 / 2 bytes an element; int8 a byte a code, int4 two codes a byte, each with an fp16
# scale and bias (4 bytes); in FBGEMM's inference TBE (fp16, int8, int4) padded to 16 bytes
BY_HAND = {"fp32": 4 * DIM, "bf16": 2 * DIM, "fp16": 80, "int8": 48, "int4": 32}  # 72, 40, 22 padded


@pytest.mark.parametrize("dtype", sorted(BY_HAND))
def test_the_estimate_is_what_the_host_holds(dtype: str) -> None:
    estimate = table_bytes(ROWS, DIM, None, dtype)
    assert estimate == ROWS * BY_HAND[dtype]
    module, tables = empty_host_tables({"t": (ROWS, DIM)}, dtype)
    if module is None:  # bf16: the project's own lookup over the tables
        assert estimate == quantize_table(torch.randn(ROWS, DIM), dtype).nbytes
    else:  # FBGEMM's TBE: its rows, and a few bytes of its own
        (tbe,) = module.tbes
        assert estimate <= tbe.weights_host.numel() < estimate + 128


def test_training_state_still_counts_fp32_rows_and_slots() -> None:
    assert table_bytes(ROWS, DIM, "rowwise_adagrad") == ROWS * (4 * DIM + 4)


def test_an_unknown_data_type_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"table 't': data_type must be one of \['fp32', 'fp16', 'bf16', 'int8', "
                                         r"'int4'\], got 'int2'"):
        EmbeddingTable("t", 10, 8, data_type="int2")


def test_infer_preflight_takes_the_table_dtype(checkpoint, monkeypatch) -> None:
    tables = 26 * 200  # the checkpoint's rows, 8 wide
    fp32, int8 = tables * 8 * 4, tables * 16  # int8: 8 codes, scale and bias, padded to 16 B
    monkeypatch.setattr(memory_preflight, "available_host_bytes", lambda: (fp32 + int8) // 2)
    with pytest.raises(ConfigError, match=r"\(26 tables x 8 fp32, .* above the .* available; hold the tables at a "
                                          r"smaller --table-dtype \(int8, int4\)"):
        load_inference_model(checkpoint, table_dtype="fp32")
    assert int8 <= load_inference_model(checkpoint, table_dtype="int8").table_bytes < int8 + 128


@pytest.mark.slow
def test_int8_load_holds_no_fp32_copy_of_the_tables(train_data, tmp_path) -> None:
    """Peak RSS growth of loading 26 tables of 40,000 x 32 at int8 in a fresh process (the bench's
    line): the TBE's rows (0.375x the fp32 bytes) and one table's fp32 read at a time, far below a
    whole fp32 copy (1x; a run before reached 1.17x, when each quantized table was a tensor of its
    own allocated between one fp32 read and the next). 0.545x in every run since each read's freed
    pages go back to the system (0.55-0.67x before: glibc kept 0.15-0.2x of freed reads as heap holes)."""
    import json
    import subprocess
    import sys

    from tests.train.conftest import REPO_ROOT
    from torchrec_tpu.train.config import TrainConfig
    from torchrec_tpu.train.job import run_job

    checkpoint = run_job(TrainConfig.from_options(
        engine="torchrec", data=str(train_data), num_embeddings=40_000, embedding_dim=32, dense_arch="16,32",
        over_arch="16,1", batch_size=256, max_steps=1, log_dir=str(tmp_path / "logs"), progress=False,
    )).checkpoint_dir
    done = subprocess.run([sys.executable, "bench/bench_inference.py", "--rss-child", str(checkpoint)],
                          capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rss = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))  # (then quiet_box's)
    fp32 = 26 * 40_000 * 32 * 4
    held = 26 * table_bytes(40_000, 32, None, "int8")  # 48 B a row: 32 codes, scale and bias, padded
    assert held <= rss["held"] < held + 128
    assert rss["growth"] < 0.6 * fp32, f"peak RSS grew {rss['growth'] / fp32:.2f}x the fp32 tables' bytes"
