"""Stock ``DistributedModelParallel`` with ``EmbeddingComputeKernel.UNFUSED_TPU``, column-wise over
two tpu_dist ranks, on ``DLRM_DCN`` (TorchRec's MLPerf DLRM-v2 TPU benchmark path at small
cardinalities) equals the same model trained on CPU over the global batch
(tests/torchrec_192/unfused_dmp_checks.py): every rank's loss per step and the final tables
(each rank's column block) and dense weights."""

from __future__ import annotations

import pytest
import torch

from tests.torchrec_192.unfused_dmp_checks import rank_body, reference
from torch_tpu.distributed.local_launch import launch_local


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dmp_unfused_tpu_column_wise_dlrm_dcn_on_two_ranks_equals_cpu() -> None:
    results = launch_local(rank_body, 2, timeout_s=600)
    assert [status for status, _ in results] == ["ok", "ok"], "\n".join(status for status, _ in results)
    ref_losses, ref_state = reference(2)
    for rank, (_, (losses, state)) in enumerate(results):
        assert losses == pytest.approx([step[rank] for step in ref_losses], rel=1e-5)
        assert state.keys() == ref_state.keys()
        for key, (column, value) in state.items():
            expected = ref_state[key] if column is None else ref_state[key][:, column:column + value.shape[1]]
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {key}")
