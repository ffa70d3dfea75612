"""A checkpoint whose tensors disagree with its own meta.json (ranks that trained with different
flags wrote one, or it was assembled by hand) is refused by `train --resume` and by `infer`, with
an error naming the tensor; stock DCP would load it, or fail deep inside."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.faults.checkpoint_helpers import BATCH, reseal, run_cli, run_copy, train_args, versions  # noqa: F401
from tests.faults.helpers import assert_clean_error
from torchrec_tpu.train.model import table_weight_key

KEY = table_weight_key("C3")  # the third table
TABLE = f"model.{KEY}"  # its name in the DCP state


def _shrink_a_table(checkpoint: Path, scratch: Path) -> list[int]:
    """Rewrite ``checkpoint``'s state with table C3 (and its optimizer state) cut to half its
    rows, leaving meta.json as it is; the manifest is resealed. Returns the new table shape."""
    dcp_to_torch_save(checkpoint / "state", scratch / "state.pt")
    state = torch.load(scratch / "state.pt", weights_only=True)
    state["model"][KEY] = state["model"][KEY][: state["model"][KEY].shape[0] // 2].clone()
    for path in (checkpoint / "state").iterdir():
        path.unlink()
    dcp.save(state, checkpoint_id=str(checkpoint / "state"))
    reseal(checkpoint)
    return list(state["model"][KEY].shape)


@pytest.mark.slow  # a resume and an `infer` (Ray) of a real run (~2 min on 2 busy cores)
def test_resume_and_infer_refuse_a_tensor_meta_json_disagrees_with(run_copy, tmp_path: Path) -> None:
    data, root = run_copy
    latest = versions(root)[-1]
    shape = _shrink_a_table(latest, tmp_path)
    rows = json.loads((latest / "meta.json").read_text())["model"]["table_sizes"][2]
    assert shape[0] != rows
    resumed = run_cli(*train_args(data, tmp_path / "resumed", "--batch-size", str(BATCH), "--max-steps", "6",
                                  "--resume", str(latest)))
    assert_clean_error(resumed.returncode, resumed.stderr, f"checkpoint {latest}", f"tensor {TABLE!r} is {shape}",
                       f"needs [{rows}, ")
    inferred = run_cli("infer", "--data", str(data), "--checkpoint", str(latest), "--output",
                       str(tmp_path / "out"), "--no-progress")
    assert_clean_error(inferred.returncode, inferred.stderr, f"tensor {TABLE!r} is {shape}", f"needs [{rows}, ")
    assert not list(tmp_path.glob("out/*.parquet"))
