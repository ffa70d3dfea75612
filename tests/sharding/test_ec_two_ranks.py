"""Two ranks over tpu_dist (loopback processes, uneven per-rank batches): every sharding type of
the EmbeddingCollection trains exactly like stock TorchRec's on the global batch."""

import pytest
import torch

from torch_tpu.distributed import launch_local

from .ec_rank_checks import EC_LAYOUTS, RANK_SAMPLES, train_sharded_ec
from .ec_reference import train_reference_ec
from .reference import assert_tables_close, random_kjt

STEPS = 3


def check_against_torchrec(results: list[dict], layout: str) -> None:
    optimizer, _ = EC_LAYOUTS[layout]
    expected_outputs, expected_weights = train_reference_ec(optimizer, [RANK_SAMPLES[-1]] * STEPS)
    for rank, by_layout in enumerate(results):
        outputs, weights, _ = by_layout[layout]
        for step, out in enumerate(outputs):
            global_kjt = random_kjt(RANK_SAMPLES[-1], step)
            for name, values in out.items():
                offsets = global_kjt[name].offsets()
                first, last = offsets[RANK_SAMPLES[rank]], offsets[RANK_SAMPLES[rank + 1]]
                torch.testing.assert_close(values, expected_outputs[step][name][first:last], atol=1e-5, rtol=1e-5)
        assert_tables_close(weights, expected_weights)
    # every rank reassembles the same tables and slots
    slots0, slots1 = results[0][layout][2], results[1][layout][2]
    assert slots0.keys() == slots1.keys()
    for table in slots0:
        for slot in slots0[table]:
            assert torch.equal(slots0[table][slot], slots1[table][slot])


@pytest.fixture(scope="module")
def fbgemm_results():
    return launch_local(train_sharded_ec, 2, list(EC_LAYOUTS), STEPS, "fbgemm", timeout_s=120)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(EC_LAYOUTS))
def test_two_ranks_equal_stock_torchrec(fbgemm_results, layout):
    check_against_torchrec(fbgemm_results, layout)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_on_the_xla_backend_equal_stock_torchrec():
    results = launch_local(train_sharded_ec, 2, list(EC_LAYOUTS), STEPS, "xla", timeout_s=600)
    for layout in EC_LAYOUTS:
        check_against_torchrec(results, layout)
