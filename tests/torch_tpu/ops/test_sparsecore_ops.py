"""``tpu::sparse_dense_matmul*`` (torch_tpu.ops.sparsecore): CSR buffers from our own host
preprocessing; the lookup against torch.nn.EmbeddingBag and the xla backend, the fused updates
against torch.optim and the xla backend, on CPU, eagerly on tpu tensors and in
torch.compile(backend="tpu") graphs; fake kernels; the TPU lowering's SparseCore custom calls."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import torch_tpu  # noqa: F401  (registers the device and the ops)
from sparsecore import SGD as SGDSpec
from sparsecore import Adagrad
from tests.torch_tpu.ops.sparsecore_case import BATCH, DIM, VOCAB, Case


@pytest.fixture(scope="module")
def case() -> Case:
    return Case()


def test_schemas_are_torchtpus() -> None:
    schema = str(torch.ops.tpu.sparse_dense_matmul.default._schema)
    assert schema == ("tpu::sparse_dense_matmul(Tensor row_pointers, Tensor embedding_ids, Tensor sample_ids, "
                      "Tensor gains, Tensor embedding_table, int device_batch_size, int max_ids_per_partition, "
                      "int max_unique_ids_per_partition, Tensor? touched_rows=None, Tensor? output_rows=None, "
                      "int num_minibatches=1, int devices=1, int device_index=0) -> Tensor")
    adam = torch.ops.tpu.sparse_dense_matmul_grad_with_adam.default._schema
    assert [a.name for a in adam.arguments][5:] == [
        "momentum", "velocity", "activations_grad", "alpha_t", "beta_1", "beta_2", "epsilon", "device_batch_size",
        "max_ids_per_partition", "max_unique_ids_per_partition", "computation_name", "touched_rows", "grad_rows",
        "num_minibatches", "devices", "device_index"]
    assert len(adam.returns) == 3
    # ours, optional: every TorchTPU call binds the same way (one pass, one device, the whole table)
    assert [(a.has_default_value(), a.default_value) for a in adam.arguments[-5:]] == [
        (True, None), (True, None), (True, 1), (True, 1), (True, 0)]


def test_lookup_on_cpu_equals_embedding_bag_and_the_xla_backend(case: Case) -> None:
    from sparsecore.backends.xla import XlaBackend

    out = torch.ops.tpu.sparse_dense_matmul(*case.csr, case.table, *case.limits)
    torch.testing.assert_close(out, case.bag_forward(case.bag()).detach(), rtol=1e-5, atol=1e-5)
    backend = XlaBackend(case.plan, weights={"t": case.weight})
    xla = np.asarray(backend.stack_activations(case.stack, case.raw_csr))
    tpu = torch.ops.tpu.sparse_dense_matmul(*case.on("tpu"), case.table.to("tpu"), *case.limits).cpu().numpy()
    np.testing.assert_array_equal(tpu, xla)  # the jnp formulation sums as the xla backend does


def test_lookup_eager_and_compiled_on_tpu(case: Case) -> None:
    expected = torch.ops.tpu.sparse_dense_matmul(*case.csr, case.table, *case.limits)

    def lookup(rp, ids, samples, gains, table):
        return torch.ops.tpu.sparse_dense_matmul(rp, ids, samples, gains, table, device_batch_size=BATCH,
                                                 max_ids_per_partition=case.limits[1],
                                                 max_unique_ids_per_partition=case.limits[2])

    args = [*case.on("tpu"), case.table.to("tpu")]
    eager = lookup(*args)
    assert eager.device.type == "tpu"
    compiled = torch.compile(lookup, backend="tpu", fullgraph=True)(*args)
    torch.testing.assert_close(eager.cpu(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled.cpu(), eager.cpu(), rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_lookup_backward_trains_with_a_torch_optimizer(case: Case, device: str) -> None:
    table = case.table.clone().to(device).requires_grad_(True)
    opt = torch.optim.SGD([table], lr=0.1)
    out = torch.ops.tpu.sparse_dense_matmul(*case.on(device), table, *case.limits)
    (out * case.grad.to(device)).sum().backward()
    opt.step()
    bag, _ = case.torch_step(torch.optim.SGD, lr=0.1)
    torch.testing.assert_close(case.logical(table.detach()), bag.weight.detach(), rtol=1e-5, atol=1e-6)


def test_fused_sgd_equals_torch_sgd_on_cpu_tpu_and_compiled(case: Case) -> None:
    bag, _ = case.torch_step(torch.optim.SGD, lr=0.1)
    lr = torch.tensor(0.1)

    def step(rp, ids, samples, gains, table, grad, lr):
        return torch.ops.tpu.sparse_dense_matmul_grad_with_sgd(
            rp, ids, samples, gains, table, grad, lr, device_batch_size=BATCH,
            max_ids_per_partition=case.limits[1], max_unique_ids_per_partition=case.limits[2],
            computation_name="sgd_t")

    for device in ("cpu", "tpu"):
        args = [*case.on(device), case.table.to(device), case.grad.to(device), lr.to(device)]
        for fn in (step, torch.compile(step, backend="tpu", fullgraph=True)) if device == "tpu" else (step,):
            new = fn(*args)
            torch.testing.assert_close(case.logical(new), bag.weight.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_fused_adagrad_equals_torch_adagrad(case: Case, device: str) -> None:
    bag, opt = case.torch_step(torch.optim.Adagrad, lr=0.1, initial_accumulator_value=0.1, eps=1e-10)
    acc = case.stacked(torch.full((VOCAB, DIM), 0.1), fill=0.1)
    new, new_acc = torch.ops.tpu.sparse_dense_matmul_grad_with_adagrad(
        *case.on(device), case.table.to(device), acc.to(device), case.grad.to(device),
        torch.tensor(0.1).to(device), torch.tensor(1e-10).to(device), *case.limits)
    torch.testing.assert_close(case.logical(new), bag.weight.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(case.logical(new_acc), opt.state[bag.weight]["sum"], rtol=1e-6, atol=1e-6)


def test_fused_sgd_and_adagrad_equal_the_xla_backend() -> None:
    from sparsecore.backends.xla import XlaBackend
    from sparsecore.validation import feature_inputs

    for spec in (SGDSpec(0.1), Adagrad(0.1, initial_accumulator_value=0.1, eps=1e-6)):
        c = Case(spec, seed=5)
        backend = XlaBackend(c.plan, weights={"t": c.weight})
        _, ctx = backend.forward(feature_inputs(c.kjt, c.plan.features, c.plan.tables))
        backend.backward(ctx, {"f": c.grad})
        hypers = [torch.tensor(0.1)]
        slots = []
        if isinstance(spec, Adagrad):
            slots, hypers = [c.stacked(torch.full((VOCAB, DIM), 0.1), fill=0.1)], [*hypers, torch.tensor(1e-6)]
        op = getattr(torch.ops.tpu, f"sparse_dense_matmul_grad_with_{spec.name}")
        out = op(*c.on("tpu"), c.table.to("tpu"), *[s.to("tpu") for s in slots], c.grad.to("tpu"),
                 *[h.to("tpu") for h in hypers], *c.limits)
        new = out[0] if isinstance(out, tuple) else out
        torch.testing.assert_close(c.logical(new), backend.table_weights()["t"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_fused_adam_equals_torch_adam_over_two_steps(case: Case, device: str) -> None:
    """Torch's dense Adam leaves untouched rows alone while their moments are zero, so with the same
    batch twice it is lazy Adam: alpha_t and epsilon_hat from torch's bias corrections (in double)."""
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    bag, opt = case.torch_step(torch.optim.Adam, steps=2, lr=lr, betas=(b1, b2), eps=eps)
    zeros = torch.zeros_like(case.table)
    table, m, v = case.table.to(device), zeros.to(device), zeros.clone().to(device)
    for t in (1, 2):
        c2 = math.sqrt(1 - b2**t)
        alpha_t = torch.tensor(lr * c2 / (1 - b1**t), dtype=torch.float32).to(device)
        table, m, v = torch.ops.tpu.sparse_dense_matmul_grad_with_adam(
            *case.on(device), table, m, v, case.grad.to(device), alpha_t, b1, b2, eps * c2, *case.limits)
    state = opt.state[bag.weight]
    torch.testing.assert_close(case.logical(table), bag.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(case.logical(m), state["exp_avg"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(case.logical(v), state["exp_avg_sq"], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_an_eager_update_gives_the_same_bits_on_every_call(case: Case, optimizer: str) -> None:
    """A resumed training run repeats the uninterrupted run's updates bit for bit only if an eager
    op's first call computes exactly as its later ones (the per-op jit once ran the first call op by
    op and later ones as one program, where XLA contracts multiply-adds into FMAs)."""
    op = getattr(torch.ops.tpu, f"sparse_dense_matmul_grad_with_{optimizer}")
    slots = [torch.full_like(case.table, 0.1)] if optimizer == "adagrad" else []
    hypers = [torch.tensor(0.1)] + ([torch.tensor(1e-8)] if optimizer == "adagrad" else [])
    calls = []
    for _ in range(3):
        outs = op(*case.on("tpu"), case.table.to("tpu"), *[s.to("tpu") for s in slots], case.grad.to("tpu"),
                  *[h.to("tpu") for h in hypers], *case.limits)
        calls.append([t.cpu() for t in ([outs] if isinstance(outs, torch.Tensor) else outs)])
    for later in calls[1:]:
        for first, again in zip(calls[0], later):
            assert torch.equal(first, again)


def test_our_further_optimizers_agree_between_cpu_and_tpu(case: Case) -> None:
    acc_row = torch.full((case.table.shape[0],), 0.1)
    acc, lin = torch.full_like(case.table, 0.1), torch.zeros_like(case.table)
    calls = {
        "rowwise_adagrad": ([acc_row], [torch.tensor(0.1), torch.tensor(1e-8)]),
        "ftrl": ([acc, lin], [torch.tensor(0.1), -0.5, 0.01, 0.001, 0.0]),
    }
    for name, (slots, hypers) in calls.items():
        op = getattr(torch.ops.tpu, f"sparse_dense_matmul_grad_with_{name}")
        outs = {}
        for device in ("cpu", "tpu"):
            moved = [h.to(device) if isinstance(h, torch.Tensor) else h for h in hypers]
            outs[device] = op(*case.on(device), case.table.to(device), *[s.to(device) for s in slots],
                              case.grad.to(device), *moved, *case.limits)
        for cpu, tpu in zip(outs["cpu"], outs["tpu"]):
            torch.testing.assert_close(tpu.cpu(), cpu, rtol=1e-5, atol=1e-6)
        untouched = ~torch.isin(torch.arange(case.table.shape[0]), case.phys_rows())
        assert torch.equal(outs["cpu"][0][untouched], case.table[untouched]), name



def test_fake_kernels_give_the_shapes(case: Case) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    row_velocity = case.table[:, 0].contiguous()
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(t) for t in (*case.csr, case.table)]
        grad = mode.from_tensor(case.grad)
        out = torch.ops.tpu.sparse_dense_matmul(*args, *case.limits)
        assert out.shape == (BATCH, DIM) and out.dtype == torch.float32
        lr = mode.from_tensor(torch.tensor(0.1))
        table, m, v = torch.ops.tpu.sparse_dense_matmul_grad_with_adam(
            *args, mode.from_tensor(case.table), mode.from_tensor(row_velocity), grad, lr,
            0.9, 0.999, 1e-8, *case.limits)
        assert table.shape == case.table.shape and m.shape == case.table.shape and v.shape == (case.table.shape[0],)


def test_tpu_lowering_emits_the_sparsecore_custom_calls(case: Case, monkeypatch) -> None:
    import jax

    from torch_tpu.ops import sparsecore as ops
    from torch_tpu.ops.registry import get_lowering

    monkeypatch.setattr(ops, "_on_tpu_platform", lambda: True)
    arrays = [jax.ShapeDtypeStruct(tuple(t.shape), np.dtype(str(t.dtype).removeprefix("torch."))) for t in
              (*case.csr, case.table)]
    grad = jax.ShapeDtypeStruct((BATCH, DIM), np.float32)
    scalar = jax.ShapeDtypeStruct((), np.float32)
    lookup = get_lowering(torch.ops.tpu.sparse_dense_matmul.default).fn
    text = jax.jit(lambda *a: lookup(*a, *case.limits)).trace(*arrays).lower(lowering_platforms=("tpu",)).as_text()
    assert "SparseDenseMatmulOp" in text
    for name, slots, hypers in (("sgd", 0, [scalar]), ("adagrad", 1, [scalar, scalar]),
                                ("adam", 2, [scalar, 0.9, 0.999, 1e-8])):
        fn = get_lowering(getattr(torch.ops.tpu, f"sparse_dense_matmul_grad_with_{name}").default).fn
        tensors = [*arrays, *[arrays[4]] * slots, grad, *[h for h in hypers if not isinstance(h, float)]]
        floats = [h for h in hypers if isinstance(h, float)]

        def call(*a, fn=fn, n=len(tensors), floats=floats):
            return fn(*a[:n], *floats, *case.limits, f"{name}_t")

        text = jax.jit(call).trace(*tensors).lower(lowering_platforms=("tpu",)).as_text()
        assert "SparseDenseMatmulGradOpWithOptimizerUpdate" in text, name
        assert f"{name}_t" in text


@pytest.mark.parametrize("pad_rows", [0, 1 << 21])
def test_fused_update_dedup_paths_agree_exactly(case: Case, pad_rows: int, monkeypatch) -> None:
    """The fused update deduplicates touched rows with one sort of row * entries + position keys
    (int32 where they fit, else int64: ``pad_rows`` grows the table past int32 keys) or, without
    64-bit keys, jnp.unique: all three give the same bits, equal to the dense-gradient rule."""
    import jax
    import jax.numpy as jnp

    from sparsecore import csr_math
    from sparsecore.optimizer_rules import rule_named

    csr = [jnp.asarray(t.numpy()) for t in case.csr]
    table = jnp.concatenate([jnp.asarray(case.table.numpy()), jnp.ones((pad_rows, DIM), jnp.float32)])
    acc = jnp.full(table.shape, 0.1, jnp.float32)
    grad, hypers = jnp.asarray(case.grad.numpy()), [jnp.float32(0.1), jnp.float32(1e-6)]
    entries = csr[1].shape[0]
    assert ((table.shape[0] + 1) * entries >= 2**31) == bool(pad_rows)
    fused = csr_math.fused_update("adagrad", *csr, table, [acc], grad, hypers)
    dense_grad, touched = csr_math.table_grad(*csr, table, grad)
    new_table, (new_acc,) = rule_named("adagrad").update(table, (acc,), dense_grad, hypers, DIM)
    reference = [jnp.where(touched[:, None], new, old) for new, old in ((new_table, table), (new_acc, acc))]
    monkeypatch.setattr(csr_math, "_touched_rows", lambda phys, vocab: None)  # the jnp.unique path
    unique_path = csr_math.fused_update("adagrad", *csr, table, [acc], grad, hypers)
    for a, b, c in zip(fused, unique_path, reference):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    assert jax.config.jax_enable_x64  # (torch_tpu turns it on: the int64 keys exist)


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_touched_rows_computed_ahead_give_the_same_bits(case: Case, device: str) -> None:
    """``touched_rows`` (the deduplication done on the host ahead of the step, its unique rows cut
    to a bucket) changes nothing in the results of the lookup and a fused update; one of the wrong
    size is refused."""
    from torch_tpu.ops.sparsecore import touched_rows_ahead

    touched = touched_rows_ahead(*case.csr, case.table.shape[0], BATCH)
    entries = case.csr[1].shape[0]
    assert touched is not None and touched.dtype == torch.int32 and 2 * entries < touched.shape[0] < 3 * entries
    import jax.numpy as jnp

    from sparsecore import csr_math

    phys = csr_math.decode(*(jnp.asarray(t.numpy()) for t in case.csr), case.table.shape[0], BATCH)[0]
    in_program = np.asarray(csr_math.touched_rows(phys, case.table.shape[0]))  # numpy on the host == jnp
    np.testing.assert_array_equal(touched.numpy(), csr_math.fit_touched(in_program, entries))
    csr, table = case.on(device), case.table.to(device)
    torch.testing.assert_close(  # the lookup reads each row once
        torch.ops.tpu.sparse_dense_matmul(*csr, table, *case.limits, touched_rows=touched.to(device)).cpu(),
        torch.ops.tpu.sparse_dense_matmul(*csr, table, *case.limits).cpu(), rtol=0, atol=0)
    acc = case.stacked(torch.full((VOCAB, DIM), 0.1), fill=0.1)
    args = (*csr, table, acc.to(device), case.grad.to(device), torch.tensor(0.1).to(device),
            torch.tensor(1e-6).to(device), *case.limits)
    plain = torch.ops.tpu.sparse_dense_matmul_grad_with_adagrad(*args)
    ahead = torch.ops.tpu.sparse_dense_matmul_grad_with_adagrad(*args, touched_rows=touched.to(device))
    for a, b in zip(plain, ahead):
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="touched_rows must be"):
        torch.ops.tpu.sparse_dense_matmul_grad_with_adagrad(*args, touched_rows=touched[:2 * entries].to(device))


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_grad_rows_read_the_gradient_where_it_lies(case: Case, device: str) -> None:
    """``grad_rows``: the fused op reads activation row r's gradient from row grad_rows[r] of a larger
    matrix (rows interleaved with other rows), with the bits of the call on the gathered gradient;
    a row outside that matrix is refused."""
    rng = np.random.default_rng(3)
    grad_rows = torch.from_numpy(rng.permutation(3 * BATCH)[:BATCH].astype(np.int32))
    whole = torch.from_numpy(rng.normal(size=(3 * BATCH, DIM)).astype(np.float32))
    whole[grad_rows.long()] = case.grad
    csr, table = case.on(device), case.table.to(device)
    acc = case.stacked(torch.full((VOCAB, DIM), 0.1), fill=0.1)
    hypers = (torch.tensor(0.1).to(device), torch.tensor(1e-6).to(device), *case.limits)
    plain = torch.ops.tpu.sparse_dense_matmul_grad_with_adagrad(*csr, table, acc.to(device), case.grad.to(device),
                                                                *hypers)
    read = torch.ops.tpu.sparse_dense_matmul_grad_with_adagrad(*csr, table, acc.to(device), whole.to(device), *hypers,
                                                               grad_rows=grad_rows.to(device))
    for a, b in zip(plain, read):
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0)
    assert not torch.equal(plain[0].cpu(), table.cpu())  # (the update moved rows)
    bad = grad_rows.clone()
    bad[5] = 3 * BATCH
    with pytest.raises(ValueError, match=rf"grad_rows\[5\] = {3 * BATCH} is outside \[0, {3 * BATCH}\)"):
        torch.ops.tpu.sparse_dense_matmul_grad_with_adagrad(*csr, table, acc.to(device), whole.to(device), *hypers,
                                                            grad_rows=bad.to(device))
    with pytest.raises(ValueError, match=r"grad_rows must be an integer \[device_batch_size\]"):
        torch.ops.tpu.sparse_dense_matmul_grad_with_adagrad(*csr, table, acc.to(device), whole.to(device), *hypers,
                                                            grad_rows=grad_rows[1:].to(device))


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_output_rows_place_the_activations_and_read_their_gradient_back(case: Case, device: str) -> None:
    """``output_rows``: the lookup returns activation row r as row output_rows[r] (the bits of the
    plain lookup, permuted), its table gradient is the plain one's for the permuted gradient, and
    a non-permutation is refused."""
    perm = torch.from_numpy(np.random.default_rng(4).permutation(BATCH).astype(np.int32))
    csr = case.on(device)
    plain = torch.ops.tpu.sparse_dense_matmul(*csr, case.table.to(device), *case.limits).cpu()
    table = case.table.to(device).detach().requires_grad_()
    placed = torch.ops.tpu.sparse_dense_matmul(*csr, table, *case.limits, output_rows=perm.to(device))
    expected = torch.empty_like(plain)
    expected[perm.long()] = plain
    torch.testing.assert_close(placed.cpu(), expected, rtol=0, atol=0)
    assert not torch.equal(expected, plain)
    grad = torch.empty_like(case.grad)
    grad[perm.long()] = case.grad  # activation row r's gradient, at output row perm[r]
    (placed * grad.to(device)).sum().backward()
    reference = torch.ops.tpu.sparse_dense_matmul_grad(*csr, case.table.to(device), case.grad.to(device),
                                                       *case.limits)
    torch.testing.assert_close(table.grad.cpu(), reference.cpu(), rtol=0, atol=0)
    twice = perm.clone()
    twice[1] = twice[0]
    with pytest.raises(ValueError, match=r"output_rows must be a permutation of 0..\d+ \(one output row per "):
        torch.ops.tpu.sparse_dense_matmul(*csr, case.table.to(device), *case.limits, output_rows=twice.to(device))


def test_compile_cache_key_covers_the_ops_math() -> None:
    """A stored step or graph program holding these ops is keyed by their math's source too (the
    lowering in torch_tpu calls into sparsecore.csr_math)."""
    from pathlib import Path

    from sparsecore import csr_math
    from torch_tpu.compile.program.graph import lowering_files

    assert Path(csr_math.__file__).resolve() in {p.resolve() for p in lowering_files()}
