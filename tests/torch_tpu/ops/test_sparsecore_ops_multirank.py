"""``tpu::sparse_dense_matmul*`` with the table sharded ``Shard(0)`` over D devices
(torch_tpu.ops.sparsecore_dtensor): the per-device math in one process (the private sharded ops
summed over devices equal TorchRec's EmbeddingBagCollection on the global batch), then real
tpu_dist worlds of 2 and 4 ranks, one spawned job each running every check
(tests/torch_tpu/ops/sparsecore_multirank_checks.py)."""

from __future__ import annotations

import pytest
import torch

import torch_tpu  # noqa: F401  (registers the device and the ops)
from tests.torch_tpu.ops.sparsecore_multirank_checks import BATCH, Case, rank_body
from torch_tpu.distributed.local_launch import launch_local

CHECKS = ("buffers", "forward", "grad", "sgd", "adagrad", "adam", "rowwise_adagrad_ftrl", "errors")


@pytest.mark.parametrize("devices", [2, 4])
def test_sharded_ops_summed_over_devices_equal_the_ebc_on_the_global_batch(devices: int) -> None:
    cases = [Case(devices, rank) for rank in range(devices)]
    gathered = [torch.cat(parts) for parts in zip(*(c.csr for c in cases))]  # what the all_gather gives
    c0 = cases[0]
    limits = (devices * BATCH, *c0.limits[1:])
    ebc = c0.ebc()
    expected = ebc(c0.kjt)["f"]
    (expected * c0.grad).sum().backward()
    partial = [torch.ops.tpu.sparse_dense_matmul(*gathered, c.block(c.weight), *limits, devices=devices,
                                                 device_index=c.rank) for c in cases]
    torch.testing.assert_close(sum(partial), expected.detach(), rtol=1e-5, atol=1e-5)
    grads = [torch.ops.tpu.sparse_dense_matmul_grad(*gathered, c.block(c.weight), c0.grad, *limits,
                                                    devices=devices, device_index=c.rank) for c in cases]
    torch.testing.assert_close(torch.cat(grads), c0.stacked(ebc.embedding_bags["t"].weight.grad), rtol=1e-5,
                               atol=1e-5)


def test_buffer_sizes_name_the_layout() -> None:
    from sparsecore import csr_math

    assert csr_math.sparsecores_per_device(4 * 8, devices=2) == 4  # v5p, 2 devices: S regions of max(8, 8)
    assert csr_math.sparsecores_per_device(4 * 16, devices=4) == 4
    with pytest.raises(ValueError, match=r"row_pointers has 40 entries; one of 2 devices"):
        csr_math.sparsecores_per_device(40, devices=2)


def _run(world: int, compiled: bool) -> None:
    ranks = launch_local(rank_body, world, compiled, timeout_s=240)
    failed = [f"rank {rank} of {world}, {check}:\n{got[check]}" for rank, got in enumerate(ranks)
              for check in ((*CHECKS, "compiled") if compiled else CHECKS) if got[check] != "ok"]
    assert not failed, "\n".join(failed)
    assert {got["transport"] for got in ranks} == {"xla"}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_forward_grad_fused_updates_and_compiled() -> None:
    _run(2, compiled=True)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_four_ranks_forward_grad_and_fused_updates() -> None:
    _run(4, compiled=False)


def test_every_op_has_its_dtensor_rule() -> None:
    from torch.distributed.tensor import DTensor  # the rules register once this module is imported

    from torch_tpu.ops.sparsecore import NAMESPACE, SCHEMAS

    for name in SCHEMAS:
        entry = torch._library.simple_registry.singleton.find(f"{NAMESPACE}::{name}")
        assert entry.torch_dispatch_rules.find(DTensor) is not None, name
