"""Batch inference: output schema, predictions vs the training model, resume after SIGKILL."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipelines.bad_values import BadValueLog
from pipelines.parquet_reader import ParquetBatchReader
from tests.inference.conftest import INFER_DATA
from torchrec_tpu.inference.job import InferenceConfig, run_inference
from torchrec_tpu.inference.model import load_inference_model
from torchrec_tpu.inference.units import MANIFEST
from torchrec_tpu.train.checkpoint.dirs import write_manifest
from torchrec_tpu.train.model import ModelSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_UNITS = INFER_DATA.num_rows // INFER_DATA.row_group_size


def _config(data: Path, checkpoint: Path, output: Path, **extra) -> InferenceConfig:
    return InferenceConfig(data=str(data), checkpoint=str(checkpoint), output=str(output),
                           progress=False, **extra)


def _predictions_by_row(output: Path) -> pa.Table:
    parts = sorted(output.glob("part-*.parquet"))
    return pa.concat_tables([pq.read_table(p) for p in parts]).sort_by("row_id")


def test_checkpoint_loads_table_sizes_from_the_saved_tables(checkpoint: Path) -> None:
    model = load_inference_model(checkpoint)
    assert model.table_sizes == (200,) * 26
    assert model.step == 3 * 2048 // 256 - 2048 // 256  # 2 train files of 2048 rows, batch 256


def _rewritten(checkpoint: Path, target: Path, meta: dict) -> Path:
    """A copy of ``checkpoint`` whose meta.json is ``meta`` (manifest rewritten to match)."""
    shutil.copytree(checkpoint, target)
    (target / "meta.json").write_text(json.dumps(meta))
    write_manifest(target)
    return target


def test_meta_holds_the_model_spec_and_both_formats_load(checkpoint: Path, infer_data: Path,
                                                         tmp_path: Path) -> None:
    meta = json.loads((checkpoint / "meta.json").read_text())
    spec = ModelSpec.from_dict(meta["model"])
    assert (spec.embedding_dim, spec.dense_layers, spec.over_layers) == (8, (16, 8), (16, 1))
    assert spec.table_sizes == (200,) * 26 and spec.feature_names == tuple(f"C{i}" for i in range(1, 27))
    renamed = {("renamed_" + k if k not in ("model", "engine") else k): v for k, v in meta["config"].items()}
    spec_only = _rewritten(checkpoint, tmp_path / "spec_only", {**meta, "config": renamed})
    old_config = {k: meta["config"][k] for k in ("model", "embedding_dim", "dense_arch", "over_arch",
                                                 "dcn_num_layers", "dcn_low_rank_dim")}
    old_format = {k: v for k, v in meta.items() if k != "model"}  # written before meta.json had "model"
    legacy = _rewritten(checkpoint, tmp_path / "legacy", {**old_format, "config": {**old_config, "new_flag": 1}})
    reader_batch = next(iter(ParquetBatchReader(infer_data, 512, (200,) * 26)))
    expected = load_inference_model(checkpoint).predict(reader_batch.dense_features, reader_batch.sparse_features)
    for variant in (spec_only, legacy):
        got = load_inference_model(variant).predict(reader_batch.dense_features, reader_batch.sparse_features)
        assert torch.equal(got, expected), variant


def test_output_schema_and_predictions(ray_session, checkpoint, infer_data, reference_predictions,
                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    output = tmp_path / "out"
    summary = run_inference(_config(infer_data, checkpoint, output, key_columns=("label", "C1"),
                                    concurrency=2, batch_size=1000))
    assert (summary.rows, summary.rows_total) == (INFER_DATA.num_rows, INFER_DATA.num_rows)
    assert (summary.parts_written, summary.parts_skipped) == (NUM_UNITS, 0)
    table = _predictions_by_row(output)
    assert table.schema == pa.schema([("label", pa.int8()), ("C1", pa.int64()),
                                      ("row_id", pa.int64()), ("prediction", pa.float32())])
    np.testing.assert_array_equal(table.column("row_id").to_numpy(), np.arange(INFER_DATA.num_rows))
    source = pq.read_table(infer_data, columns=["label", "C1"])  # key columns travel with their row
    assert table.column("label").to_pylist() == source.column("label").to_pylist()
    assert table.column("C1").to_pylist() == source.column("C1").to_pylist()
    np.testing.assert_allclose(table.column("prediction").to_numpy(), reference_predictions,
                               rtol=1e-5, atol=1e-6)
    def no_ray(**_kwargs):
        raise AssertionError("a rerun with nothing left to do must not start Ray")

    monkeypatch.setattr("pipelines.ray_data.local_ray", no_ray)
    again = run_inference(_config(infer_data, checkpoint, output, key_columns=("label", "C1")))
    assert (again.rows, again.parts_written, again.parts_skipped) == (0, 0, NUM_UNITS)


def _kill_job(process: subprocess.Popen) -> None:
    """SIGKILL the job; its Ray watchdog (pipelines.ray_session) then ends the Ray processes it
    had started and removes their directory. Any still alive after 30 s are killed here."""
    children = psutil.Process(process.pid).children(recursive=True)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    _, alive = psutil.wait_procs(children, timeout=30)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.mark.slow  # ~60 s on the shared 2-core box: two Ray starts and a killed job
@pytest.mark.multiprocess
def test_killed_job_resumes_with_every_row_exactly_once(
    ray_session, checkpoint, infer_data, reference_predictions, tmp_path: Path
) -> None:
    output = tmp_path / "out"
    command = [sys.executable, "-m", "torchrec_tpu.inference.cli", "--data", str(infer_data),
               "--checkpoint", str(checkpoint), "--output", str(output), "--no-progress",
               "--batch-size", "250", "--num-cpus", "1"]
    job = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not list(output.glob("part-*.parquet")) and time.monotonic() < deadline:
            assert job.poll() is None, "the job ended before writing any part"
            time.sleep(0.02)
    finally:
        _kill_job(job)
    done_before = len(list(output.glob("part-*.parquet")))
    assert 0 < done_before < NUM_UNITS, f"kill landed outside the run: {done_before} parts"

    summary = run_inference(_config(infer_data, checkpoint, output))
    assert summary.parts_skipped == done_before
    assert summary.parts_written == NUM_UNITS - done_before
    table = _predictions_by_row(output)
    np.testing.assert_array_equal(table.column("row_id").to_numpy(), np.arange(INFER_DATA.num_rows))
    np.testing.assert_allclose(table.column("prediction").to_numpy(), reference_predictions,
                               rtol=1e-5, atol=1e-6)
    assert not list(output.glob(".tmp-*"))


def test_output_dir_of_another_job_is_refused(checkpoint, infer_data, tmp_path: Path) -> None:
    output = tmp_path / "out"
    output.mkdir()
    (output / MANIFEST).write_text('{"checkpoint": "elsewhere", "units": []}')
    with pytest.raises(ValueError, match="output of another job"):
        run_inference(_config(infer_data, checkpoint, output))


def test_missing_key_column_is_named(checkpoint, infer_data, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\['user_id'\]"):
        run_inference(_config(infer_data, checkpoint, tmp_path / "o", key_columns=("user_id",)))
    with pytest.raises(ValueError, match="collide"):
        _config(infer_data, checkpoint, tmp_path / "o", key_columns=("prediction",))


def test_labels_travel_and_score_the_output_and_a_rerun_stays_light(
    ray_session, checkpoint, infer_data, reference_predictions, tmp_path: Path, capsys, monkeypatch
) -> None:
    """By default the input's label column is written next to each prediction and the summary
    holds the output's offline AUC (checked against torchmetrics on the reference predictions);
    not on a terminal (--concurrency 1: in this process, no Ray), a line when the predictor starts
    and when the model is loaded, then progress lines
    (every $TORCHREC_TPU_PROGRESS_SECONDS, here 0: as often as the driver looks); a rerun with
    nothing to do imports neither Ray nor torch and says there was nothing to score."""
    from torchmetrics.functional.classification import binary_auroc

    from torchrec_tpu.cli import main

    monkeypatch.setenv("TORCHREC_TPU_PROGRESS_SECONDS", "0")
    output = tmp_path / "out"
    argv = ["infer", "--data", str(infer_data), "--checkpoint", str(checkpoint), "--output", str(output),
            "--batch-size", "1000"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == ("infer: the model on eager torch on the host CPU (--device auto: no TPU is attached, and on "
                        "XLA:CPU eager torch is faster)")
    assert lines[1].startswith("infer: in this process (--concurrency 1, no Ray); loading the model from ")
    assert re.fullmatch(rf"infer: model loaded in [0-9.]+ s; predicting {INFER_DATA.num_rows:,} rows in "
                        rf"{NUM_UNITS} part\(s\)", lines[2])
    progress = [line for line in lines if re.fullmatch(r"infer: [0-9,]+/[0-9,]+ rows \(\d+%\)  [0-9,]+ rows/s  "
                                                       r"ETA (\?|\d+s|\d+m\d\ds)", line)]
    done = [int(line.split()[1].split("/")[0].replace(",", "")) for line in progress]
    assert len(progress) >= NUM_UNITS and done == sorted(done)  # at least one per part, never backwards
    assert progress[-1].startswith(f"infer: {INFER_DATA.num_rows:,}/{INFER_DATA.num_rows:,} rows (100%)")
    table = _predictions_by_row(output)
    assert table.column_names == ["row_id", "label", "prediction"]
    labels = pq.read_table(infer_data, columns=["label"]).column("label").to_numpy()
    np.testing.assert_array_equal(table.column("label").to_numpy(), labels)
    expected = float(binary_auroc(torch.from_numpy(reference_predictions), torch.from_numpy(labels).int()))
    auc_line = next(line for line in out.splitlines() if line.startswith("  AUC"))
    assert auc_line.startswith(f"  AUC             {expected:.4f} (offline")
    assert f"{INFER_DATA.num_rows:,} rows" in auc_line

    script = ("import sys; from torchrec_tpu.cli import main; rc = main(sys.argv[1:]); "
              "print(rc, sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    rerun = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, cwd=REPO_ROOT,
                           timeout=300)
    assert rerun.stdout.splitlines()[-1] == "0 []", rerun.stdout + rerun.stderr
    assert f"0 written, {NUM_UNITS} already done" in rerun.stdout and auc_line in rerun.stdout
    assert f"  throughput      nothing to score: all {NUM_UNITS} part(s) were already in the output" in rerun.stdout
    assert "rows/s" not in rerun.stdout


def test_no_label_leaves_it_out(ray_session, checkpoint, infer_data, tmp_path: Path) -> None:
    summary = run_inference(_config(infer_data, checkpoint, tmp_path / "o", with_label=False, row_id_column=None))
    assert summary.auc is None and "AUC" not in summary.format()
    assert pq.read_schema(tmp_path / "o" / "part-000000.parquet").names == ["prediction"]


def _wait_for_free_cpus(timeout: float = 60) -> None:
    import ray

    deadline = time.monotonic() + timeout
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, f"Ray CPUs still held: {ray.available_resources()}"
        time.sleep(0.2)


def _bad_labels(infer_data: Path, target: Path) -> Path:
    """The first 500 input rows with labels 7 (row 3) and -1 (row 10), written without checksums
    as another tool would; returns its directory."""
    table = pq.read_table(sorted(infer_data.glob("*.parquet"))[0]).slice(0, 500)
    labels = table.column("label").to_numpy().astype(np.int8)
    labels[3], labels[10] = 7, -1
    table = table.set_column(table.schema.get_field_index("label"), "label", pa.array(labels))
    target.mkdir()
    pq.write_table(table, target / "part-00000.parquet")
    return target


def test_bad_labels_follow_trains_policy(ray_session, checkpoint, infer_data, tmp_path: Path) -> None:
    """``infer`` used to score labels 7 and -1 silently; it now applies train's label check (same
    code, same flags, same words): error names the file, row and value as train's reader does, skip
    drops the rows, clamp clamps them; --no-label reads no label and refuses nothing."""
    from pipelines.bad_values import BadValueError
    from torchrec_tpu.inference.job import Predictor
    from torchrec_tpu.inference.units import plan_units

    data = _bad_labels(infer_data, tmp_path / "data")
    with pytest.raises(BadValueError) as train_error:
        list(ParquetBatchReader(data, 100, (400,) * 26))
    assert "row 3, column label: 7.0 is not a label in [0, 1]" in str(train_error.value)
    with pytest.raises(BadValueError) as infer_error:
        run_inference(_config(data, checkpoint, tmp_path / "o"))
    assert str(infer_error.value) == str(train_error.value)
    _wait_for_free_cpus()  # the failed job's actors are gone though its traceback is still referenced

    unit = plan_units(data, ["label"])[0]
    table = pq.read_table(data / "part-00000.parquet")
    for policy, rows, label_3, label_10 in (("skip", 498, None, None), ("clamp", 500, 1, 0)):
        config = _config(data, checkpoint, tmp_path / policy, bad_values=policy)
        log = BadValueLog()
        out = Predictor(config, 1, with_label=True)._output(unit, table, log)
        assert out.num_rows == rows
        by_row = dict(zip(out.column("row_id").to_pylist(), out.column("label").to_pylist()))
        assert by_row.get(3) == label_3 and by_row.get(10) == label_10
        assert (log.counts().skipped, log.counts().clamped) == ((2, 0) if policy == "skip" else (0, 2))
    unlabelled = Predictor(_config(data, checkpoint, tmp_path / "n", with_label=False), 1, with_label=False)
    assert unlabelled._output(unit, table.drop_columns(["label"]), BadValueLog()).num_rows == 500


def test_rank_auc_matches_torchmetrics_with_ties() -> None:
    from torchmetrics.functional.classification import binary_auroc

    from torchrec_tpu.inference.job import rank_auc

    rng = np.random.default_rng(0)
    scores = rng.integers(0, 20, 500).astype(np.float32) / 20  # many ties
    labels = rng.random(500) < scores
    assert rank_auc(labels, scores) == pytest.approx(
        float(binary_auroc(torch.from_numpy(scores), torch.from_numpy(labels).int())), abs=1e-6)


def test_infer_says_which_rows_it_scores_and_warns_on_training_rows(
    ray_session, checkpoint, train_data, tmp_path: Path, capsys
) -> None:
    """The checkpoint records its split (files by footer hash, rows of each); infer over the training
    directory warns once that 4,096 of its 6,144 rows were trained on; over a renamed copy of the
    held-out file it does not; a checkpoint without the record says it could not check."""
    files = sorted(train_data.glob("*.parquet"))
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert [(e["name"], e["rows"]) for e in meta["data_split"]["train"]] == [(f.name, [0, 2048]) for f in files[:2]]
    assert [(e["name"], e["rows"]) for e in meta["data_split"]["held_out"]] == [(files[2].name, [0, 2048])]

    summary = run_inference(_config(train_data, checkpoint, tmp_path / "all"))
    err = capsys.readouterr().err
    # (the prefix names the first job this test session configured logging for)
    warnings = [line.partition(": warning: ")[2] for line in err.splitlines() if "checkpoint trained on" in line]
    assert warnings == [f"4,096 of the 6,144 input rows are rows the checkpoint "
                        f"trained on ({files[0].name} rows 0-2,047, {files[1].name} rows 0-2,047): an AUC over "
                        "them is not a held-out score; point --data at the run's held-out files for one"]
    scored = next(line for line in summary.format().splitlines() if line.startswith("  scored rows"))
    assert scored == (f"  scored rows     6,144 rows (row_id 0-6,143) of 3 files ({files[0].name}, {files[1].name}, "
                      f"{files[2].name}); 4,096 of them in the checkpoint's training split")

    held_out = tmp_path / "held_out"
    held_out.mkdir()
    shutil.copy(files[2], held_out / "renamed.parquet")
    summary = run_inference(_config(held_out, checkpoint, tmp_path / "held"))
    assert "trained on" not in capsys.readouterr().err
    assert "2,048 rows (row_id 0-2,047) of 1 file (renamed.parquet); none in the checkpoint's training split" \
        in summary.format()

    old = _rewritten(checkpoint, tmp_path / "old", {k: v for k, v in meta.items() if k != "data_split"})
    summary = run_inference(_config(train_data, old, tmp_path / "old_out"))
    assert "trained on" not in capsys.readouterr().err
    assert "the checkpoint does not record its training split (not checked)" in summary.format()
