"""``torchrec-tpu export`` / ``load_model`` / ``infer --model``: a self-contained model directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from pipelines.parquet_reader import ParquetBatchReader
from tests.inference.quantized_cases import FEATURES, batch_of_two_features, ebc_of_two_tables, torchrec_quantized
from torchrec_tpu.cli import main
from torchrec_tpu.inference.export import load_model
from torchrec_tpu.inference.export_files import TABLES, TOWERS
from torchrec_tpu.inference.job import EXPORTED, InferenceConfig, run_inference
from torchrec_tpu.inference.model import load_inference_model
from torchrec_tpu.inference.quantized_tables import quantize_table, torchrec_quant_ebc
from torchrec_tpu.train.checkpoint.manifest import MANIFEST_FILE, manifest_of

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def exported(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("export") / "m"
    assert main(["export", "--checkpoint", str(checkpoint), "--table-dtype", "int8", "-o", str(model)]) == 0
    return model


def _first_file(infer_data: Path) -> Path:
    return sorted(infer_data.glob("*.parquet"))[0]


def test_export_loads_in_a_fresh_process_with_no_checkpoint_or_training_config(
        exported, checkpoint, infer_data, tmp_path) -> None:
    """The artefact alone (moved away from the checkpoint) predicts as the checkpoint at int8."""
    moved = tmp_path / "moved"
    exported.rename(moved)
    try:
        script = (
            "import sys, numpy as np; from pipelines.parquet_reader import ParquetBatchReader; "
            "from torchrec_tpu.inference.export import load_model; m = load_model(sys.argv[1]); "
            "b = next(iter(ParquetBatchReader(sys.argv[2], 500, m.table_sizes))); "
            "np.save(sys.argv[3], m.predict(b).numpy()); "
            "print(m.table_dtype, 'torchrec_tpu.train.config' in sys.modules)"
        )
        result = subprocess.run([sys.executable, "-c", script, str(moved), str(_first_file(infer_data)),
                                 str(tmp_path / "p.npy")], capture_output=True, text=True, cwd=tmp_path,
                                timeout=600, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    finally:
        moved.rename(exported)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-2:] == ["int8", "False"]
    batch = next(iter(ParquetBatchReader(_first_file(infer_data), 500, (200,) * 26)))
    expected = load_inference_model(checkpoint, table_dtype="int8").predict(batch)
    np.testing.assert_array_equal(np.load(tmp_path / "p.npy"), expected.numpy())


def test_infer_model_writes_the_checkpoints_int8_predictions(exported, checkpoint, infer_data, tmp_path,
                                                              capsys) -> None:
    data = _first_file(infer_data)
    assert main(["infer", "--data", str(data), "--model", str(exported), "--output", str(tmp_path / "m"),
                 "--no-progress"]) == 0
    assert f"  tables          int8, {26 * 200 * (8 + 4):,} bytes held per model copy" in capsys.readouterr().out
    run_inference(InferenceConfig(data=str(data), checkpoint=str(checkpoint), output=str(tmp_path / "c"),
                                  table_dtype="int8", progress=False))
    for part in sorted((tmp_path / "c").glob("part-*.parquet")):
        np.testing.assert_array_equal(pq.read_table(tmp_path / "m" / part.name).column("prediction").to_numpy(),
                                      pq.read_table(part).column("prediction").to_numpy())
    with pytest.raises(ValueError, match="--table-dtype int4: only for a DLRM checkpoint"):
        InferenceConfig(data=str(data), checkpoint=str(exported), output="o", model=EXPORTED, table_dtype="int4")


def _tampered(exported: Path, target: Path) -> Path:
    target.mkdir()
    for path in exported.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return target


def test_a_changed_file_is_refused_by_name(exported, infer_data, tmp_path, capsys) -> None:
    model = _tampered(exported, tmp_path / "m")
    raw = bytearray((model / TABLES).read_bytes())
    raw[-100] ^= 1
    (model / TABLES).write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=rf"exported model {model}: {TABLES} is corrupt \(its sha256 differs"):
        load_model(model)
    rc = main(["infer", "--data", str(_first_file(infer_data)), "--model", str(model), "--output",
               str(tmp_path / "out"), "--no-progress"])
    assert rc == 2 and f"{TABLES} is corrupt" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before the output is claimed


def test_a_pickle_in_the_towers_is_refused_even_with_a_matching_manifest(exported, tmp_path) -> None:
    """A crafted program archive (example inputs a pickle that runs code), manifest rewritten to
    match: refused, and the pickle never runs."""
    model = _tampered(exported, tmp_path / "m")
    planted = tmp_path / "ran"
    with zipfile.ZipFile(exported / TOWERS) as source, zipfile.ZipFile(model / TOWERS, "w") as target:
        for item in source.infolist():
            data = source.read(item)
            if "/data/sample_inputs/" in item.filename:
                data = _code_running_pickle(planted)
            target.writestr(item, data)
    (model / MANIFEST_FILE).write_text(json.dumps(manifest_of(model)))
    with pytest.raises(ValueError, match=rf"{TOWERS}: .*sample_inputs.* holds pickled objects"):
        load_model(model)
    assert not planted.exists()


def _code_running_pickle(planted: Path) -> bytes:
    import io

    class Payload:
        def __reduce__(self):
            return (Path.touch, (planted,))

    buffer = io.BytesIO()
    torch.save(Payload(), buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("dtype", ["int8", "int4", "fp16", "fp32"])
def test_exported_tables_load_into_torchrecs_quantized_ebc(dtype: str) -> None:
    """A TorchRec user serves our tables with FBGEMM's TBE: the same pooled embeddings as TorchRec's
    own quantization of the float tables (fp32: as the float EBC)."""
    ebc, batch = ebc_of_two_tables(), batch_of_two_features()
    tables = {f: quantize_table(ebc.embedding_bags[f"t_{f}"].weight, dtype) for f in FEATURES}
    got = torchrec_quant_ebc(tables)(batch).values()
    expected = ebc(batch).values().detach() if dtype == "fp32" else torchrec_quantized(ebc, dtype)(batch).values()
    assert torch.equal(got, expected)
