"""A crafted checkpoint cannot run code: not through DCP's ``.metadata``, not through a non-tensor
value inside the DCP data, not through the RNG file; in `train --resume` and in `infer`.

Each payload creates a marker file when unpickled. Every test first shows that stock loading
(plain pickle, ``torch.load(weights_only=False)``, DCP's own reader and planner) runs it, then that
the real CLI refuses the checkpoint with one ``error:`` line and the marker never appears. The
manifest is rewritten over the crafted files (:func:`reseal`), as an attacker would: the safety
must not rest on the checksums.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.faults.checkpoint_helpers import BATCH, Payload, reseal, run_cli, run_copy, train_args, versions  # noqa: F401
from torchrec_tpu.train.checkpoint.reader import read_state_metadata


@pytest.fixture
def crafted(run_copy: tuple[Path, Path]) -> tuple[Path, Path, Path]:
    """(dataset, a copy of the shared checkpoint root, its latest checkpoint directory)."""
    data, root = run_copy
    return data, root, versions(root)[-1]


def _assert_refused(done, marker: Path, *expected: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, done.stderr
    for text in expected:
        assert text in errors[0], errors[0]
    assert "Traceback" not in done.stderr, done.stderr
    assert not marker.exists(), "the payload ran"


def _resume(data: Path, root: Path, tmp_path: Path):
    return run_cli(*train_args(data, tmp_path / "resumed", "--batch-size", str(BATCH), "--max-steps", "6",
                               "--resume", str(root)))


def _craft_metadata(directory: Path, marker: Path) -> None:
    """The genuine DCP metadata with the payload tucked into its planner data."""
    metadata = read_state_metadata(directory / "state")
    metadata.planner_data = {**metadata.planner_data, "extra": Payload(marker)}
    (directory / "state" / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(directory)
    FileSystemReader(str(directory / "state")).read_metadata()  # stock DCP: runs it
    assert marker.exists()
    marker.unlink()


def test_crafted_dcp_metadata_never_runs_in_train_resume(crafted, tmp_path: Path) -> None:
    data, root, latest = crafted
    marker = tmp_path / "pwned"
    _craft_metadata(latest, marker)
    _assert_refused(_resume(data, root, tmp_path), marker, "state/.metadata", "pathlib.Path.touch",
                    "refusing to unpickle")


def test_crafted_dcp_metadata_never_runs_in_infer(crafted, tmp_path: Path) -> None:
    data, root, latest = crafted
    marker = tmp_path / "pwned"
    _craft_metadata(latest, marker)
    done = run_cli("infer", "--data", str(data), "--checkpoint", str(root), "--output",
                   str(tmp_path / "predictions"), "--no-progress")
    _assert_refused(done, marker, "state/.metadata", "pathlib.Path.touch")
    assert not (tmp_path / "predictions").exists()  # refused before any work started


def test_crafted_value_inside_the_dcp_data_never_runs(crafted, tmp_path: Path) -> None:
    """A non-tensor value (DCP stores those as pickles and stock DCP torch.loads them with
    weights_only=False) replaced by the payload, the state re-saved by DCP itself."""
    data, root, latest = crafted
    marker = tmp_path / "pwned"
    dcp_to_torch_save(latest / "state", tmp_path / "genuine.pt")
    state = torch.load(tmp_path / "genuine.pt", weights_only=False)  # our own genuine checkpoint
    step_key = next(k for k in state["optimizer"]["state"])
    state["optimizer"]["state"][step_key]["step"] = Payload(marker)
    for old in (latest / "state").iterdir():
        old.unlink()
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(latest / "state"))
    reseal(latest)
    dcp_to_torch_save(latest / "state", tmp_path / "stock.pt")  # stock DCP planner: runs it
    assert marker.exists()
    marker.unlink()
    _assert_refused(_resume(data, root, tmp_path), marker, "is not plain data", "refusing to load it")


def test_crafted_rng_file_never_runs(crafted, tmp_path: Path) -> None:
    data, root, latest = crafted
    marker = tmp_path / "pwned"
    rng_file = latest / "rng" / "rank-00000.pt"
    torch.save({"torch": Payload(marker)}, rng_file)
    reseal(latest)
    torch.load(rng_file, weights_only=False)  # what the RNG restore used to do: runs it
    assert marker.exists()
    marker.unlink()
    _assert_refused(_resume(data, root, tmp_path), marker, "rng/rank-00000.pt",
                    "is not an RNG state saved by torchrec-tpu")
