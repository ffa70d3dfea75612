"""What TorchRec 1.9.2's TPU module expects of TorchTPU, as ``import torch_tpu`` supplies it:
``torch.tpu.ops`` (activation unstacking against an index-by-index reference, errors), the
``pybind_input_preprocessing`` backend served by the import hook (byte-equal to jax-tpu-embedding's
C++ preprocessing; errors), ``torch_tpu._internal.pallas.jax_op`` running TorchRec's own Pallas
kernels (TensorCore kernels in interpret mode; SparseCore ones via their op's CPU kernel),
``torch.accelerator.synchronize`` and ``torch_tpu._internal.sync.synchronize``."""

from __future__ import annotations

# isort: off
import torch_tpu  # TorchTPU's environment (torch.tpu.ops, the preprocessing backend) before TorchRec's TPU module
# isort: on

import importlib
import sys
from itertools import accumulate

import numpy as np
import pytest
import torch
from torchrec.experimental.torch_tpu import SparseCoreInputPreprocessor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore.metadata_backend import SparseCorePreprocessorBackend
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking
from sparsecore.validation import feature_inputs
from tests.torchrec_192.reference import bag_configs, ids_per_sample, kjt, sc_tables
from torch_tpu._internal import import_hook

BATCH = 8


def test_torch_tpu_installs_torchtpus_op_namespace() -> None:
    ops = torch.tpu.ops
    for name in ("sparse_dense_matmul", "sparse_dense_matmul_grad_with_sgd", "sparse_dense_matmul_grad_with_adagrad",
                 "sparse_dense_matmul_grad_with_adam", "sparse_dense_matmul_activation_unstack"):
        assert callable(getattr(ops, name)), name
    assert ops.sparsecores_per_device() == 2  # XLA:CPU has none: TorchRec's default layout


@pytest.mark.parametrize("num_sc", [2, 4])
def test_activation_unstack_equals_sparsecore_major_rows_and_is_differentiable(num_sc: int, monkeypatch) -> None:
    """Row ``sc * F * B/S + f * B/S + j`` of the stack is sample ``sc * B/S + j`` of feature ``f``
    (S from ``TORCH_TPU_SPARSECORES_PER_DEVICE``, as on a device without SparseCores)."""
    monkeypatch.setenv("TORCH_TPU_SPARSECORES_PER_DEVICE", str(num_sc))
    batch, dims, width = 8, [3, 8, 5], 8
    g = torch.Generator().manual_seed(0)
    stacked = torch.randn(batch * len(dims), width, generator=g)
    x = stacked.to("tpu").requires_grad_(True)
    got = torch.tpu.ops.sparse_dense_matmul_activation_unstack(x, [batch] * len(dims), dims)
    per_sc = batch // num_sc
    for f, dim in enumerate(dims):
        expected = torch.stack([stacked[(b // per_sc) * len(dims) * per_sc + f * per_sc + b % per_sc, :dim]
                                for b in range(batch)])
        assert got[f].device.type == "tpu"
        torch.testing.assert_close(got[f].cpu(), expected, rtol=0, atol=0)
    sum(t.sum() * (i + 1) for i, t in enumerate(got)).backward()
    grad = x.grad.cpu()
    for f, dim in enumerate(dims):  # each feature's rows get its weight on its first dim columns, 0 beyond
        rows = [(b // per_sc) * len(dims) * per_sc + f * per_sc + b % per_sc for b in range(batch)]
        assert (grad[rows, :dim] == f + 1).all() and (grad[rows, dim:] == 0).all()


def test_activation_unstack_errors_name_the_bad_value() -> None:
    x = torch.zeros(16, 8, device="tpu")
    unstack = torch.tpu.ops.sparse_dense_matmul_activation_unstack
    with pytest.raises(ValueError, match=r"must be 2-D, got shape \(16,\)"):
        unstack(torch.zeros(16, device="tpu"), [8, 8], [8, 8])
    with pytest.raises(ValueError, match=r"per_feature_batch_sizes \(1\) and per_feature_dims \(2\)"):
        unstack(x, [16], [8, 8])
    with pytest.raises(ValueError, match=r"\[5, 11\] must be equal and divisible by the 2 SparseCores"):
        unstack(x, [5, 11], [8, 8])
    with pytest.raises(ValueError, match=r"does not hold 16 rows of width >= 9"):
        unstack(x, [8, 8], [8, 9])


def test_import_hook_serves_the_preprocessing_module_and_a_real_one_wins(tmp_path, monkeypatch) -> None:
    module = importlib.import_module(import_hook.PREPROCESSING_MODULE)
    assert module.SparseCorePreprocessorBackend is SparseCorePreprocessorBackend
    # an extension found on the path is used instead (the hook serves the name only where no other finder finds it)
    package = tmp_path / "torchrec" / "experimental" / "torch_tpu" / "datasets"
    package.mkdir(parents=True)
    (package / "pybind_input_preprocessing.py").write_text("SparseCorePreprocessorBackend = 'real'\n")
    datasets = importlib.import_module("torchrec.experimental.torch_tpu.datasets")
    monkeypatch.setattr(datasets, "__path__", [str(package), *datasets.__path__])
    monkeypatch.delitem(sys.modules, import_hook.PREPROCESSING_MODULE)
    assert importlib.import_module(import_hook.PREPROCESSING_MODULE).SparseCorePreprocessorBackend == "real"


def test_torchrec_preprocessing_is_jax_tpu_embeddings_bytes() -> None:
    """TorchRec's ``SparseCoreInputPreprocessor`` (through the served backend) builds the buffers
    jax-tpu-embedding's C++ builds for the same tables (one per stack) and batch."""
    jte_interop = pytest.importorskip("sparsecore.jte_interop", exc_type=ImportError)
    configs = bag_configs()
    pre = SparseCoreInputPreprocessor(tables=sc_tables(configs), batch_size=BATCH, num_sc_per_device=4)
    batch = kjt(ids_per_sample(configs, BATCH, seed=3, max_len=4))
    ours = pre(batch)
    tables = [TableSpec(c.name, c.num_embeddings, c.embedding_dim, "mean" if c.pooling.value == "MEAN" else "sum")
              for c in configs]
    features = [FeatureSpec(f, c.name, BATCH) for c in configs for f in c.feature_names]
    plan = plan_stacking(tables, features, SparseCoreTopology("v5p", 1), stack_tables=False)
    theirs = jte_interop.jte_preprocess(feature_inputs(batch, plan.features, plan.tables), plan)[0]
    theirs = theirs.sparse_dense_matmul_input
    for stack in plan.stacks:
        mine = ours.table_tensors[stack.name]
        pointers = np.asarray(theirs.lhs_row_pointers[stack.name]).reshape(-1)
        assert mine.row_pointers.numpy().tobytes() == pointers.tobytes(), stack.name
        region = mine.embedding_ids.numel() // 4
        width = pointers.size // 4
        for k in range(4):  # each SparseCore's used entries (jax-tpu-embedding leaves the rest uninitialised)
            used = slice(k * region, k * region + int(pointers[(k + 1) * width - 1]))
            for name, array in (("embedding_ids", theirs.lhs_embedding_ids), ("sample_ids", theirs.lhs_sample_ids),
                                ("gains", theirs.lhs_gains)):
                got = getattr(mine, name).numpy()[used]
                want = np.asarray(array[stack.name]).reshape(-1)[used]
                assert got.tobytes() == want.tobytes(), (stack.name, name, k)


def test_a_kjts_weights_never_reach_torch_tpu() -> None:
    """Issue 47 asked the fused EBC to warn once when it drops per-sample weights. TorchRec's
    ``SparseCoreInputPreprocessor`` (its code, run unchanged) hands the backend torch_tpu serves
    each feature's ids and offsets only, so nothing of ours sees the weights to warn about: a
    weighted batch preprocesses to the unweighted batch's buffers, gains included."""
    configs = bag_configs()
    pre = SparseCoreInputPreprocessor(tables=sc_tables(configs), batch_size=BATCH, num_sc_per_device=4)
    plain = kjt(ids_per_sample(configs, BATCH, seed=5, max_len=4))
    weights = torch.rand(plain.values().numel(), generator=torch.Generator().manual_seed(0)) + 0.5
    weighted = KeyedJaggedTensor(keys=plain.keys(), values=plain.values(), lengths=plain.lengths(), weights=weights)
    got, want = pre(weighted).table_tensors, pre(plain).table_tensors
    assert sorted(got) == sorted(want)
    for stack, buffers in want.items():
        for name in ("row_pointers", "embedding_ids", "sample_ids", "gains"):  # bytes: unused gains are NaN
            assert getattr(got[stack], name).numpy().tobytes() == getattr(buffers, name).numpy().tobytes(), name


def _metadata(**feature) -> list[dict]:
    f = {"name": "f", "row_offset": 0, "col_offset": 0, "col_shift": 0, "batch_size": 4, "combiner": "sum",
         "max_col_id": 10, **feature}
    return [{"name": "t", "max_ids_per_partition": 8, "max_unique_ids_per_partition": 8,
             "suggested_coo_buffer_size_per_device": 0, "features": [f]}]


def test_preprocessing_backend_errors_name_the_bad_value() -> None:
    backend = SparseCorePreprocessorBackend(_metadata(), 4, 1, 1, 2)
    ids, offsets = torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32)
    assert sorted(backend.preprocess({"t": [ids]}, {"t": [offsets]})["t"]) == [
        "dropped_count", "embedding_ids", "gains", "observed_max_ids", "observed_max_unique_ids", "row_pointers",
        "sample_ids"]
    with pytest.raises(ValueError, match=r"feature 'f': id 12 is outside the table's 10 rows \[0, 10\)"):
        backend.preprocess({"t": [torch.tensor([1, 12, 3], dtype=torch.int32)]}, {"t": [offsets]})
    with pytest.raises(ValueError, match=r"feature 'f': offsets for 2 samples, expected 4 \(batch_size\)"):
        backend.preprocess({"t": [ids]}, {"t": [offsets[:3]]})
    with pytest.raises(ValueError, match=r"feature 'f': indices must be a 1-D int32 tensor, got torch.int64"):
        backend.preprocess({"t": [ids.long()]}, {"t": [offsets]})
    with pytest.raises(ValueError, match=r"need stack 't'; got \['u'\]"):
        backend.preprocess({"u": [ids]}, {"u": [offsets]})
    with pytest.raises(ValueError, match=r"num_sc_per_device=3: no TPU has that many SparseCores per device"):
        SparseCorePreprocessorBackend(_metadata(), 4, 1, 1, 3)
    with pytest.raises(ValueError, match=r"combiner 'max' is not one of"):
        SparseCorePreprocessorBackend(_metadata(combiner="max"), 4, 1, 1, 2)


@pytest.mark.parametrize("limit", [0, -3, 1.5, True])
def test_a_partition_id_limit_that_is_not_a_positive_integer_is_refused_by_name(limit) -> None:
    """Issue 70 item 7: TorchRec's TPU modules hand ``max_ids_per_partition`` from their (mutable)
    table and stack configs straight to ``torch.tpu.ops``; 0 or 1.5 must be refused there in one
    line naming it, as TorchRec's own table checks and the preprocessing backend refuse them."""
    backend = SparseCorePreprocessorBackend(_metadata(), 4, 1, 1, 2)
    ids, offsets = torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32)
    csr = backend.preprocess({"t": [ids]}, {"t": [offsets]})["t"]
    buffers = [csr[k] for k in ("row_pointers", "embedding_ids", "sample_ids", "gains")]
    table = torch.randn(10, 8)
    pattern = rf"max_ids_per_partition must be a positive integer, got {limit!r}"
    with pytest.raises(ValueError, match=rf"torch.tpu.ops.sparse_dense_matmul: {pattern}"):
        torch.tpu.ops.sparse_dense_matmul(*buffers, table, 4, limit, 8)
    with pytest.raises(ValueError, match=rf"torch.tpu.ops.sparse_dense_matmul_grad_with_sgd: {pattern}"):
        torch.tpu.ops.sparse_dense_matmul_grad_with_sgd(*buffers, table, torch.ones(4, 8), 0.1, 4, limit, 8, "t")
    with pytest.raises(ValueError, match=r"max_unique_ids_per_partition must be a positive integer"):
        torch.tpu.ops.sparse_dense_matmul_grad_with_adagrad(*buffers, table, torch.zeros(10, 8), torch.ones(4, 8),
                                                            0.1, 1e-8, 4, 8, limit, "t")
    if isinstance(limit, int) and not isinstance(limit, bool):  # the ops themselves (an int schema)
        with pytest.raises(ValueError, match=rf"tpu::sparse_dense_matmul: {pattern}"):
            torch.ops.tpu.sparse_dense_matmul(*buffers, table, 4, limit, 8)
        from torchrec.experimental.torch_tpu.modules import custom_ops  # TorchRec's op over torch.tpu.ops

        with pytest.raises(ValueError, match=pattern):
            custom_ops.sparse_dense_matmul_sgd_fwd(*buffers, table, torch.tensor(0.1), 4, limit, 8)
    assert torch.tpu.ops.sparse_dense_matmul(*buffers, table, 4, 8, 8).shape == (4, 8)  # a valid limit


def test_torchrecs_tensorcore_pallas_kernels_run_in_interpret_mode_on_the_device(monkeypatch) -> None:
    """``pallas/impl.py`` registers TorchRec's kernels through ``torch_tpu._internal.pallas``: the
    TensorCore ones (column permutation, the v1 lookup) run on the tpu device in Pallas interpret
    mode; the SparseCore pooled lookup, which interpret mode cannot run, runs its op's CPU kernel."""
    from torchrec.experimental.torch_tpu.pallas import impl  # noqa: F401  (registers the kernels)

    dims, order = [16, 32, 16, 8, 16], [0, 2, 4, 1, 3]
    g = torch.Generator().manual_seed(0)
    pooled = torch.randn(10, sum(dims), generator=g)
    offsets = torch.tensor([0, *accumulate(dims)], dtype=torch.int32)
    expected = torch.cat([torch.split(pooled, dims, 1)[i] for i in order], 1)
    torch_tpu.reset_metrics()
    x = pooled.to("tpu").requires_grad_(True)
    out = torch.ops.torchrec.permute_pooled_embs(x, offsets.to("tpu"), torch.tensor(order, dtype=torch.int32).to("tpu"))
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)
    seed = torch.randn(expected.shape, generator=g)
    out.backward(seed.to("tpu"))
    ref = pooled.clone().requires_grad_(True)
    torch.cat([torch.split(ref, dims, 1)[i] for i in order], 1).backward(seed)
    torch.testing.assert_close(x.grad.cpu(), ref.grad, rtol=0, atol=0)
    monkeypatch.setenv("LOOKUP_MODE", "v1_tpu")
    table = torch.randn(64, 16, generator=g)
    ids = torch.tensor([5, 9, 1, 3, 7, 42], dtype=torch.int32)
    rows = torch.ops.torchrec.embedding_lookup(ids.to("tpu"), table.to("tpu"), 16)
    torch.testing.assert_close(rows.cpu(), table[ids.long()], rtol=0, atol=0)
    assert torch_tpu.fallback_counts() == {}, torch_tpu.fallback_counts()
    bag_offsets = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
    bags = torch.ops.torchrec.embedding_pooled_lookup_offset(ids.to("tpu"), bag_offsets.to("tpu"), table.to("tpu"), 16)
    expected_bags = torch.nn.functional.embedding_bag(ids.long(), table, bag_offsets[:-1].long(), mode="sum")
    torch.testing.assert_close(bags.cpu(), expected_bags)
    assert torch_tpu.fallback_counts() == {"embedding_pooled_lookup_offset.default": 1}


def test_accelerator_synchronize_reaches_the_tpu_device() -> None:
    x = torch.ones(4, device="tpu") * 2
    torch.accelerator.synchronize()  # TorchRec's fused modules call it after initialising tables
    torch.accelerator.synchronize("tpu")
    assert x.sum().item() == 8


def test_internal_sync_waits_for_the_device_work_dispatched_so_far() -> None:
    """TorchRec's TPU kernel tests time their kernels between ``sync.synchronize(wait=True)`` calls."""
    from torch_tpu._internal import sync

    x = torch.randn(1024, 1024, device="tpu")
    y = x @ x
    z = y + 1
    sync.synchronize(wait=True)
    assert torch.tpu.current_stream().query()  # the device holds no unfinished op
    sync.synchronize(wait=False)  # returns at once: nothing waits on the host to be flushed
    assert torch.equal(z.cpu(), y.cpu() + 1)
