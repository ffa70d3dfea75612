"""Rank body of the multi-rank SparseCore op tests: ``tpu::sparse_dense_matmul*`` with the stacked
table (and slots) a DTensor ``Shard(0)`` over a 1-D "tpu" mesh of the tpu_dist world, each rank
passing its own device's CSR buffers, against one CPU process over the GLOBAL batch: stock TorchRec
EmbeddingBagCollection + torch.optim (SGD, Adagrad, Adam), the xla backend (row-wise Adagrad, FTRL).

Also the shared case builder (:class:`Case`), used in-process by the test file for the math alone.
"""

from __future__ import annotations

import datetime
import math
import traceback
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore import SGD, FeatureSpec, SparseCoreTopology, TableSpec, plan_stacking, preprocess
from sparsecore.stacking import stack_rows
from tests.sparsecore.helpers import random_kjt

VOCAB, DIM, BATCH = 256, 8, 16  # BATCH: samples per device
STEPS = 3


def local_kjt(kjt: KeyedJaggedTensor, start: int, stop: int) -> KeyedJaggedTensor:
    """Samples [start, stop) of a one-feature KJT."""
    offsets = kjt.offsets()
    lo, hi = int(offsets[start]), int(offsets[stop])
    return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values()[lo:hi], lengths=kjt.lengths()[start:stop],
                             weights=kjt.weights()[lo:hi])


class Case:
    """One stacked table "t" (v5p: 4 SparseCores per device) over ``devices`` devices, a global
    batch of ``devices * BATCH`` weighted samples with duplicates, and device ``rank``'s buffers
    built from its own samples (``for_local_devices(1)``)."""

    def __init__(self, devices: int, rank: int, optimizer=SGD(0.1), seed: int = 3) -> None:
        tables = [TableSpec("t", VOCAB, DIM, optimizer=optimizer)]
        features = [FeatureSpec("f", "t", devices * BATCH, weighted=True)]
        self.devices, self.rank = devices, rank
        self.plan = plan_stacking(tables, features, SparseCoreTopology("v5p", devices)).with_table_limits()
        self.stack = self.plan.stacks[0]
        self.kjt = random_kjt(self.plan, seed=seed, max_hot=5, id_range=96)  # duplicates on purpose
        mine = local_kjt(self.kjt, rank * BATCH, (rank + 1) * BATCH)
        csr = preprocess(mine, self.plan.for_local_devices(1)).stacks["t"]
        self.csr = [torch.from_numpy(a) for a in (csr.row_pointers, csr.embedding_ids, csr.sample_ids, csr.gains)]
        self.limits = (BATCH, self.stack.max_ids_per_partition, self.stack.max_unique_ids_per_partition)
        self.weight = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(seed))
        self.grad = torch.randn(devices * BATCH, DIM, generator=torch.Generator().manual_seed(seed + 1))
        self.mine = slice(rank * BATCH, (rank + 1) * BATCH)

    def stacked(self, per_table: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        return stack_rows(self.stack, {"t": per_table}, fill=fill)

    def block(self, per_table: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """This device's Shard(0) block of the stacked ``per_table``."""
        return self.stacked(per_table, fill).chunk(self.devices)[self.rank]

    def ebc(self) -> EmbeddingBagCollection:
        config = EmbeddingBagConfig(num_embeddings=VOCAB, embedding_dim=DIM, name="t", feature_names=["f"],
                                    pooling=PoolingType.SUM)
        ebc = EmbeddingBagCollection(tables=[config], is_weighted=True)
        with torch.no_grad():
            ebc.embedding_bags["t"].weight.copy_(self.weight)
        return ebc

    def torch_steps(self, optimizer_cls, steps: int = STEPS, **kwargs) -> tuple[torch.nn.Parameter, dict]:
        """The EBC's weight and optimizer state after ``steps`` steps of loss sum(out * grad)."""
        ebc = self.ebc()
        opt = optimizer_cls(ebc.parameters(), **kwargs)
        for _ in range(steps):
            opt.zero_grad()
            (ebc(self.kjt)["f"] * self.grad).sum().backward()
            opt.step()
        weight = ebc.embedding_bags["t"].weight
        return weight, opt.state[weight]


# --- the rank body -------------------------------------------------------------------------------------


def rank_body(rank: int, world: int, store: dist.Store, timeout: datetime.timedelta, compiled: bool) -> dict:
    """{check name: "ok" or the traceback}."""
    dist.init_process_group("tpu_dist", store=store, rank=rank, world_size=world, timeout=timeout)
    from torch.distributed.device_mesh import init_device_mesh

    import torch_tpu  # noqa: F401  (the device, the ops) after the group: it joins jax.distributed
    import torch_tpu.distributed as tpu_dist

    mesh = init_device_mesh("tpu", (world,), mesh_dim_names=("tpu",))
    results = {"transport": tpu_dist.active_transport()}
    checks: list[tuple[str, Callable]] = [("buffers", _buffers), ("forward", _forward), ("grad", _grad),
                                          ("sgd", _sgd), ("adagrad", _adagrad), ("adam", _adam),
                                          ("rowwise_adagrad_ftrl", _xla_optimizers), ("errors", _errors)]
    if compiled:
        checks.append(("compiled", _compiled))
    for name, check in checks:
        try:
            check(Case(world, rank), mesh)
            results[name] = "ok"
        except Exception:  # noqa: BLE001 -- reported per check to the parent
            results[name] = traceback.format_exc()
    dist.destroy_process_group()
    return results


def _sharded(local: torch.Tensor, mesh):
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local.to("tpu"), mesh, [Shard(0)], run_check=False)


def _local(value) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Shard

    assert isinstance(value, DTensor) and tuple(value.placements) == (Shard(0),), value
    return value.to_local().cpu()


def _tpu(case: Case) -> list[torch.Tensor]:
    return [t.to("tpu") for t in case.csr]


def _buffers(case: Case, mesh) -> None:
    """This device's buffers equal its block of the buffers of all devices preprocessed at once."""
    every = preprocess(case.kjt, case.plan).stacks["t"]
    for got, whole in zip(case.csr, (every.row_pointers, every.embedding_ids, every.sample_ids, every.gains)):
        np.testing.assert_array_equal(got.numpy(), whole.reshape(case.devices, -1)[case.rank])


def _forward(case: Case, mesh) -> None:
    table = _sharded(case.block(case.weight), mesh)
    out = torch.ops.tpu.sparse_dense_matmul(*_tpu(case), table, *case.limits)
    assert type(out) is not type(table) and out.device.type == "tpu" and out.shape == (BATCH, DIM)
    expected = case.ebc()(case.kjt)["f"].detach()[case.mine]
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)


def _grad(case: Case, mesh) -> None:
    table = _sharded(case.block(case.weight), mesh).requires_grad_(True)
    out = torch.ops.tpu.sparse_dense_matmul(*_tpu(case), table, *case.limits)
    (out * case.grad[case.mine].to("tpu")).sum().backward()
    ebc = case.ebc()
    (ebc(case.kjt)["f"] * case.grad).sum().backward()
    expected = case.block(ebc.embedding_bags["t"].weight.grad)
    torch.testing.assert_close(_local(table.grad), expected, rtol=1e-5, atol=1e-5)


def _fused_steps(case: Case, mesh, optimizer: str, slots: list[torch.Tensor], hypers: Callable[[int], list]) -> list:
    """The local blocks of (table, *slots) after STEPS fused steps; ``hypers(step)`` per step (1-based)."""
    op = getattr(torch.ops.tpu, f"sparse_dense_matmul_grad_with_{optimizer}")
    state = [_sharded(case.block(case.weight), mesh), *(_sharded(s, mesh) for s in slots)]
    grad = case.grad[case.mine].to("tpu")
    for step in range(1, STEPS + 1):
        moved = [h.to("tpu") if isinstance(h, torch.Tensor) else h for h in hypers(step)]
        out = op(*_tpu(case), state[0], *state[1:], grad, *moved, *case.limits)
        state = list(out) if isinstance(out, tuple) else [out]
    return [_local(s) for s in state]


def _sgd(case: Case, mesh) -> None:
    weight, _ = case.torch_steps(torch.optim.SGD, lr=0.1)
    (table,) = _fused_steps(case, mesh, "sgd", [], lambda step: [torch.tensor(0.1)])
    torch.testing.assert_close(table, case.block(weight.detach()), rtol=1e-5, atol=1e-6)


def _adagrad(case: Case, mesh) -> None:
    weight, state = case.torch_steps(torch.optim.Adagrad, lr=0.1, initial_accumulator_value=0.1, eps=1e-10)
    acc = case.block(torch.full((VOCAB, DIM), 0.1), fill=0.1)
    table, new_acc = _fused_steps(case, mesh, "adagrad", [acc],
                                  lambda step: [torch.tensor(0.1), torch.tensor(1e-10)])
    torch.testing.assert_close(table, case.block(weight.detach()), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new_acc, case.block(state["sum"], fill=0.1), rtol=1e-5, atol=1e-6)


def _adam(case: Case, mesh) -> None:
    """The same batch every step: torch's dense Adam leaves untouched rows alone (zero moments), i.e.
    lazy Adam; alpha_t and epsilon_hat from torch's bias corrections (see test_sparsecore_ops)."""
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    weight, state = case.torch_steps(torch.optim.Adam, lr=lr, betas=(b1, b2), eps=eps)
    zeros = case.block(torch.zeros(VOCAB, DIM))

    def hypers(t: int) -> list:
        c2 = math.sqrt(1 - b2**t)
        return [torch.tensor(lr * c2 / (1 - b1**t), dtype=torch.float32), b1, b2, eps * c2]

    table, m, v = _fused_steps(case, mesh, "adam", [zeros, zeros.clone()], hypers)
    torch.testing.assert_close(table, case.block(weight.detach()), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m, case.block(state["exp_avg"]), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(v, case.block(state["exp_avg_sq"]), rtol=1e-5, atol=1e-9)


def _xla_optimizers(case: Case, mesh) -> None:
    """Row-wise Adagrad and FTRL against the xla backend over the global batch (one process, all
    devices' buffers)."""
    from sparsecore import FTRL, RowWiseAdagrad
    from sparsecore.backends.xla import XlaBackend
    from sparsecore.validation import feature_inputs

    runs = {
        "rowwise_adagrad": (RowWiseAdagrad(0.1, initial_accumulator_value=0.1, eps=1e-8),
                            [torch.full((VOCAB,), 0.1)], [torch.tensor(0.1), torch.tensor(1e-8)]),
        "ftrl": (FTRL(0.1, learning_rate_power=-0.5, l1_regularization_strength=0.01,
                      l2_regularization_strength=0.001, beta=0.0),
                 [torch.full((VOCAB, DIM), 0.1), torch.zeros(VOCAB, DIM)], [torch.tensor(0.1), -0.5, 0.01, 0.001, 0.0]),
    }
    for name, (spec, slots, hypers) in runs.items():
        spec_case = Case(case.devices, case.rank, optimizer=spec)
        backend = XlaBackend(spec_case.plan, weights={"t": spec_case.weight})
        for _ in range(STEPS):
            _, ctx = backend.forward(feature_inputs(spec_case.kjt, spec_case.plan.features, spec_case.plan.tables))
            backend.backward(ctx, {"f": spec_case.grad})
        fills = list(spec.slot_initial_values().values())
        blocks = [spec_case.block(s, fill=f) for s, f in zip(slots, fills)]
        table, *new_slots = _fused_steps(spec_case, mesh, name, blocks, lambda step, hypers=hypers: hypers)
        torch.testing.assert_close(table, spec_case.block(backend.table_weights()["t"]), rtol=1e-5, atol=1e-6,
                                   msg=name)
        expected = backend.optimizer_slots()["t"]
        for got, slot, fill in zip(new_slots, spec.slot_names, fills):
            torch.testing.assert_close(got, spec_case.block(expected[slot], fill=fill), rtol=1e-5, atol=1e-6,
                                       msg=f"{name} {slot}")


def _errors(case: Case, mesh) -> None:
    from torch.distributed.tensor import DTensor, Replicate

    replicated = DTensor.from_local(case.stacked(case.weight).to("tpu"), mesh, [Replicate()], run_check=False)
    try:
        torch.ops.tpu.sparse_dense_matmul(*_tpu(case), replicated, *case.limits)
    except ValueError as error:
        assert "Replicate" in str(error) and "Shard(0)" in str(error), error
    else:
        raise AssertionError("a Replicate table was accepted")
    table = _sharded(case.block(case.weight), mesh)
    try:
        torch.ops.tpu.sparse_dense_matmul_grad_with_adagrad(
            *_tpu(case), table, case.block(case.weight).to("tpu"), case.grad[case.mine].to("tpu"),
            torch.tensor(0.1).to("tpu"), torch.tensor(1e-8).to("tpu"), *case.limits)
    except TypeError as error:
        assert "accumulator must be a DTensor" in str(error), error
    else:
        raise AssertionError("a plain accumulator beside a DTensor table was accepted")


def _compiled(case: Case, mesh) -> None:
    """torch.compile(backend="tpu") around the op equals eager; Dynamo graph-breaks at the op (its
    collectives run eagerly), the arithmetic around it compiles."""
    import torch._dynamo

    limits = case.limits

    def lookup(rp, ids, samples, gains, table, scale):
        out = torch.ops.tpu.sparse_dense_matmul(rp, ids, samples, gains, table, *limits)
        return out * scale + 1.0

    def sgd(rp, ids, samples, gains, table, grad, lr):
        return torch.ops.tpu.sparse_dense_matmul_grad_with_sgd(rp, ids, samples, gains, table, grad * 2.0, lr,
                                                               *limits)

    table = _sharded(case.block(case.weight), mesh)
    scale = torch.tensor(0.5).to("tpu")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = lookup(*_tpu(case), table, scale)
    got = torch.compile(lookup, backend="tpu")(*_tpu(case), table, scale)
    torch.testing.assert_close(got.cpu(), eager.cpu(), rtol=0, atol=0)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) >= 1, dict(torch._dynamo.utils.counters)
    grads = []
    for fn in (lookup, torch.compile(lookup, backend="tpu")):  # backward through the graph break
        leaf = _sharded(case.block(case.weight), mesh).requires_grad_(True)
        (fn(*_tpu(case), leaf, scale) * case.grad[case.mine].to("tpu")).sum().backward()
        grads.append(_local(leaf.grad))
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    args = (*_tpu(case), table, case.grad[case.mine].to("tpu"), torch.tensor(0.1).to("tpu"))
    eager_sgd = _local(sgd(*args))
    torch.testing.assert_close(_local(torch.compile(sgd, backend="tpu")(*args)), eager_sgd, rtol=0, atol=0)
