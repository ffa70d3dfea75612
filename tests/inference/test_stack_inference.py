"""``infer --device tpu``: the checkpoint as the trainer lays it out (SparseCore tables, towers on
tpu, one program per batch) against the eager CPU reference path."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from torchrec_tpu.inference.job import InferenceConfig, run_inference


def _predictions(output: Path) -> np.ndarray:
    return np.concatenate([pq.read_table(p).column("prediction").to_numpy()
                           for p in sorted(output.glob("part-*.parquet"))])


@pytest.mark.slow
def test_stack_predictions_equal_the_cpu_path_at_fp32(checkpoint, infer_data, tmp_path, caplog) -> None:
    data = sorted(infer_data.glob("*.parquet"))[0]
    common = dict(data=str(data), checkpoint=str(checkpoint), batch_size=512, progress=False)
    with caplog.at_level(logging.INFO, logger="torchrec_tpu.inference.job"):
        stack = run_inference(InferenceConfig(output=str(tmp_path / "tpu"), device="tpu", **common))
    assert "infer: the model on the stack: tables on the SparseCore ops, towers on the tpu device" in caplog.text
    run_inference(InferenceConfig(output=str(tmp_path / "cpu"), device="cpu", **common))
    assert stack.table_bytes == 26 * 200 * 8 * 4
    np.testing.assert_allclose(_predictions(tmp_path / "tpu"), _predictions(tmp_path / "cpu"), rtol=0, atol=1e-6)


def test_auto_takes_the_cpu_path_without_a_tpu_and_says_why(checkpoint, infer_data, tmp_path, caplog) -> None:
    data = sorted(infer_data.glob("*.parquet"))[0]
    with caplog.at_level(logging.INFO, logger="torchrec_tpu.inference.job"):
        run_inference(InferenceConfig(data=str(data), checkpoint=str(checkpoint), output=str(tmp_path / "o"),
                                      table_dtype="int8", progress=False))
    assert ("infer: the model on eager torch on the host CPU (--device auto: a DLRM checkpoint at int8, "
            "--concurrency 1, which the stack does not serve)") in caplog.text


def test_tpu_refuses_what_the_sparsecore_ops_do_not_serve(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"--device tpu serves a DLRM or HSTU checkpoint at --table-dtype fp32 in one "
                                         r"process \(--concurrency 1\): .*got a DLRM checkpoint at int4"):
        InferenceConfig(data="d", checkpoint="c", output="o", device="tpu", table_dtype="int4")
