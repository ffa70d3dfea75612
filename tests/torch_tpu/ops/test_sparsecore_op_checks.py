"""Bad inputs of ``tpu::sparse_dense_matmul*`` (torch_tpu.ops.sparsecore_checks) raise one ValueError
naming the argument, the value and its limit, on CPU and eagerly on tpu tensors, where they used
to return numbers; padding positions are not read; compiled graphs check values in the debug mode
only; the engine's ``preprocessed()`` entry skips the value checks, never the layout ones.

Buffers: one v5p device (4 SparseCores) from our host preprocessing, a table of 256 rows, batch
32: 64 rows per partition, 8 samples per source SparseCore, 1024 entries per region (by hand)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_tpu
from tests.torch_tpu.ops.sparsecore_case import BATCH, DIM, Case
from torch_tpu.ops.sparsecore_checks import preprocessed

ROWS_PER_PARTITION, SAMPLES_PER_SC, REGION = 64, 8, 1024


@pytest.fixture(scope="module")
def case() -> Case:
    return Case()


def _positions(case: Case) -> tuple[int, int]:
    """(first position partition 0 of SparseCore 0 reads, first padding position of that region)."""
    end = int(case.csr[0][0])
    assert end > 0 and end % 8, "the case needs a non-empty, unaligned first partition"
    return 0, end


def _lookup(case: Case, device: str, **changes: torch.Tensor) -> torch.Tensor:
    names = ("row_pointers", "embedding_ids", "sample_ids", "gains")
    buffers = [changes.get(n, t) for n, t in zip(names, case.csr)]
    table = changes.get("embedding_table", case.table)
    batch = changes.get("device_batch_size", BATCH)
    max_ids = changes.get("max_ids_per_partition", case.limits[1])
    return torch.ops.tpu.sparse_dense_matmul(*(t.to(device) for t in buffers), table.to(device), batch, max_ids,
                                             case.limits[2])


def _with(t: torch.Tensor, position: int, value: int) -> torch.Tensor:
    t = t.clone()
    t[position] = value
    return t


def _bad_inputs(case: Case) -> dict[str, tuple[dict, str]]:
    rp, ids, samples, gains = case.csr
    used, _ = _positions(case)
    return {
        "id == rows per partition": (
            {"embedding_ids": _with(ids, used, 64)},
            r"embedding_ids\[0\] = 64 \(partition 0 of source SparseCore 0\) is outside \[0, 64\)"),
        "negative id": ({"embedding_ids": _with(ids, used, -1)}, r"embedding_ids\[0\] = -1 .* outside \[0, 64\)"),
        "padding id in a partition": ({"embedding_ids": _with(ids, used, 2**31 - 1)},
                                      r"embedding_ids\[0\] = 2147483647 .* outside \[0, 64\)"),
        "float ids": ({"embedding_ids": ids.float()},
                      r"embedding_ids must be a 1-D integer tensor, got dtype .*float32"),
        "int64 table": ({"embedding_table": case.table.long()},
                        r"embedding_table must be a 2-D floating tensor, got dtype .*int64"),
        "sample id == samples per SparseCore": ({"sample_ids": _with(samples, used, 8)},
                                                r"sample_ids\[0\] = 8 .* outside \[0, 8\)"),
        "falling row pointer": ({"row_pointers": _with(rp, 1, int(rp[0]) - 1)},
                                rf"row_pointers\[1\] = {int(rp[0]) - 1} is below row_pointers\[0\] = {int(rp[0])}"),
        "row pointer past the region": ({"row_pointers": _with(rp, 0, REGION + 1)},
                                        r"row_pointers\[0\] = 1025 .* outside \[0, 1024\]"),
        "negative row pointer": ({"row_pointers": _with(rp, 0, -3)}, r"row_pointers\[0\] = -3 .* outside \[0, 1024\]"),
        "short gains": ({"gains": gains[:-8]}, r"gains has 4088 entries, embedding_ids 4096"),
        "batch below the sample ids": ({"device_batch_size": 8}, r"sample_ids\[\d+\] = \d+ .* outside \[0, 2\)"),
        "batch not a multiple of the SparseCores": ({"device_batch_size": 30},
                                                    r"device_batch_size 30 must be a positive multiple of the 4"),
        "row pointers of no SparseCore count": ({"row_pointers": rp[:-1]}, r"row_pointers has 31 entries"),
        "a partition over max_ids_per_partition": (
            {"max_ids_per_partition": 1},
            r"partition \d of source SparseCore \d holds \d+ entries \(row_pointers\[\d+\] = \d+\), more than "
            r"max_ids_per_partition 1"),
    }


CASES = list(_bad_inputs(Case()))


@pytest.mark.parametrize("device", ["cpu", "tpu"])
@pytest.mark.parametrize("name", CASES)
def test_a_bad_lookup_input_raises_naming_it(case: Case, device: str, name: str) -> None:
    changes, message = _bad_inputs(case)[name]
    with pytest.raises(ValueError, match=r"^tpu::sparse_dense_matmul: " + message):
        _lookup(case, device, **changes)


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_padding_positions_are_not_read(case: Case, device: str) -> None:
    _, padding = _positions(case)
    expected = case.bag_forward(case.bag()).detach()
    got = _lookup(case, device, embedding_ids=_with(case.csr[1], padding, -5),
                  sample_ids=_with(case.csr[2], padding, 10**6))
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_fused_updates_check_their_inputs_too(case: Case, device: str) -> None:
    args = [t.to(device) for t in case.csr]
    table, grad, lr = case.table.to(device), case.grad.to(device), torch.tensor(0.1).to(device)
    args[1] = _with(case.csr[1], 0, 300).to(device)
    with pytest.raises(ValueError, match=r"sparse_dense_matmul_grad_with_sgd: embedding_ids\[0\] = 300 .*\[0, 64\)"):
        torch.ops.tpu.sparse_dense_matmul_grad_with_sgd(*args, table, grad, lr, *case.limits)
    good = [t.to(device) for t in case.csr]
    with pytest.raises(ValueError, match=r"activations_grad must be a floating \[device_batch_size, dim\] = \[32, 8\]"):
        torch.ops.tpu.sparse_dense_matmul_grad_with_sgd(*good, table, grad[:16], lr, *case.limits)
    with pytest.raises(ValueError, match=r"accumulator must be a floating tensor of shape \[256, 8\]"):
        torch.ops.tpu.sparse_dense_matmul_grad_with_adagrad(*good, table, torch.zeros(256).to(device), grad, lr,
                                                            torch.tensor(1e-8).to(device), *case.limits)


def test_compiled_lookup_checks_values_in_debug_mode_only(case: Case) -> None:
    def lookup(rp, ids, samples, gains, table):
        return torch.ops.tpu.sparse_dense_matmul(rp, ids, samples, gains, table, BATCH, *case.limits[1:])

    compiled = torch.compile(lookup, backend="tpu", fullgraph=True)
    args = [*case.on("tpu"), case.table.to("tpu")]
    args[1] = _with(case.csr[1], 0, 64).to("tpu")
    assert compiled(*args).shape == (BATCH, DIM)  # strict: undefined, as on a TPU (documented)
    with torch_tpu.eager_mode("debug"), pytest.raises(ValueError, match=r"embedding_ids\[0\] = 64 .*\[0, 64\)"):
        compiled(*args)
    args[1] = case.csr[1].float().to("tpu")  # the layout is checked when the graph is traced, in every mode
    with pytest.raises(Exception, match=r"embedding_ids must be a 1-D integer tensor"):
        torch.compile(lookup, backend="tpu", fullgraph=True)(*args)


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_the_engines_preprocessed_entry_skips_value_checks_only(case: Case, device: str) -> None:
    expected = _lookup(case, device).cpu()
    rp = _with(case.csr[0], 1, int(case.csr[0][0]) - 1)
    with preprocessed():
        # the engine vouches for its own buffers: no host read
        _lookup(case, device, row_pointers=rp)
        with pytest.raises(ValueError, match="embedding_ids must be a 1-D integer tensor"):
            _lookup(case, device, embedding_ids=case.csr[1].float())
    with pytest.raises(ValueError, match="row_pointers"):
        _lookup(case, device, row_pointers=rp)
    np.testing.assert_array_equal(_lookup(case, device).cpu().numpy(), expected.numpy())


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_touched_rows_must_be_those_of_the_buffers(case: Case, device: str) -> None:
    from torch_tpu.ops.sparsecore import touched_rows_ahead

    touched = touched_rows_ahead(*case.csr, stack_rows=case.table.shape[0], device_batch_size=BATCH)
    other = Case(seed=11)
    foreign = touched_rows_ahead(*other.csr, stack_rows=case.table.shape[0], device_batch_size=BATCH, fit=False)
    grad, lr = case.grad.to(device), torch.tensor(0.1).to(device)

    def update(t: torch.Tensor) -> torch.Tensor:
        return torch.ops.tpu.sparse_dense_matmul_grad_with_sgd(*case.on(device), case.table.to(device), grad, lr,
                                                               *case.limits, touched_rows=t.to(device))

    expected = torch.ops.tpu.sparse_dense_matmul_grad_with_sgd(*case.csr, case.table, case.grad,
                                                               torch.tensor(0.1), *case.limits)
    torch.testing.assert_close(update(touched).cpu(), expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"touched_rows\[\d+\] = \d+, but touched_rows_ahead\(\) of these buffers"):
        update(foreign)
    entries = case.csr[1].shape[0]
    with pytest.raises(ValueError, match=r"touched_rows keeps 1 unique rows; these buffers touch \d+"):
        update(touched[:2 * entries + 1])


@pytest.mark.parametrize("mode", ["strict", "debug", "defer_and_fuse"])
def test_every_eager_mode_checks(case: Case, mode: str) -> None:
    with torch_tpu.eager_mode(mode), pytest.raises(ValueError, match=r"embedding_ids\[0\] = -7 .*\[0, 64\)"):
        _lookup(case, "tpu", embedding_ids=_with(case.csr[1], 0, -7)).cpu()
