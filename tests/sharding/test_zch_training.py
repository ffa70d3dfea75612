"""Training with managed collisions on one rank against stock TorchRec's
``ManagedCollisionEmbeddingBagCollection``: the same raw-id stream, policy and loss give the
same outputs and tables after several steps with evictions, and a state dict resumes exactly.

The reference runs the stock MC-EBC's own collection and EBC in the order TorchRec's sharded
MC-EBC does (remap, reset the evicted rows: weights to the table's ``init_fn``, optimizer state
to zero, then look up); the unsharded stock module leaves evicted rows as they are."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import ManagedCollisionCollection, MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore import SGD, Adagrad
from sparsecore.specs import Initializer
from torchrec_tpu.sharding import ShardedSparseCoreEBC, TableSharding
from torchrec_tpu.sharding.zch import ZchSpec

from .reference import CONFIGS, FEATURES, reference_ebc, targets

BATCH, STEPS, RESET = 16, 8, 0.05  # RESET: the managed tables' initializer (a constant), what eviction writes
MANAGED = {"t_user": ZchSpec("lfu", 2), "t_item": ZchSpec("distance_lfu", 1), "t_small": ZchSpec("lru", 1)}
OPTIMIZERS = {"sgd": (SGD(0.3), lambda p: torch.optim.SGD(p, lr=0.3)),
              "adagrad": (Adagrad(0.2, initial_accumulator_value=0.0, eps=1e-10),
                          lambda p: torch.optim.Adagrad(p, lr=0.2, initial_accumulator_value=0.0, eps=1e-10))}


def raw_kjt(step: int) -> KeyedJaggedTensor:
    """Raw 64-bit ids drifting upward (``small``: a few, below its rows)."""
    rng = np.random.default_rng(step)
    lengths = rng.integers(0, 4, size=(len(FEATURES), BATCH))
    parts = []
    for i, feature in enumerate(FEATURES):
        n = int(lengths[i].sum())
        if feature == "small":
            parts.append(rng.integers(0, 9, size=n))
        else:
            parts.append((np.floor(np.exp(rng.uniform(0, 4, size=n))).astype(np.int64) + 3 * step) * 0x9E3779B97F4A7C1)
    return KeyedJaggedTensor(keys=FEATURES, values=torch.from_numpy(np.concatenate(parts)),
                             lengths=torch.from_numpy(lengths.reshape(-1)))


def _ours(optimizer: str) -> ShardedSparseCoreEBC:
    ebc = reference_ebc()
    tables, features = ShardedSparseCoreEBC.specs_of(ebc, BATCH, OPTIMIZERS[optimizer][0])
    tables = [dataclasses.replace(t, initializer=Initializer("constant", value=RESET)) if t.name in MANAGED else t
              for t in tables]
    plan = {c.name: TableSharding("table_wise", (0,)) for c in CONFIGS}
    sharded = ShardedSparseCoreEBC.from_torchrec(ebc, BATCH, plan, OPTIMIZERS[optimizer][0], specs=(tables, features),
                                                 backend="fbgemm")  # (no compiles: a fast test)
    sharded.manage_collisions(MANAGED)
    return sharded


def torchrec_mc_ebc(specs: dict[str, ZchSpec]) -> ManagedCollisionEmbeddingBagCollection:
    """Stock TorchRec's MC-EBC over the reference tables, an MCH module of ``specs`` per table."""
    ebc = reference_ebc()
    mcc = ManagedCollisionCollection(
        {c.name: MCHManagedCollisionModule(zch_size=c.num_embeddings, device=torch.device("cpu"),
                                           eviction_policy=specs[c.name].eviction_policy(),
                                           eviction_interval=specs[c.name].eviction_interval) for c in CONFIGS},
        ebc.embedding_bag_configs())
    return ManagedCollisionEmbeddingBagCollection(ebc, mcc)


def _reference(optimizer: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], int]:
    """Each step's pooled outputs, the final tables and the rows evicted, of the stock MC-EBC."""
    mc_ebc = torchrec_mc_ebc(MANAGED)
    ebc = mc_ebc._embedding_module
    params = {name: bag.weight for name, bag in ebc.embedding_bags.items()}
    opt = OPTIMIZERS[optimizer][1](list(params.values()))
    outputs, evicted_rows = [], 0
    for step in range(STEPS):
        remapped = mc_ebc._managed_collision_collection(raw_kjt(step))
        for table, rows in mc_ebc._managed_collision_collection.evict().items():
            if rows is not None and rows.numel():
                evicted_rows += rows.numel()
                with torch.no_grad():
                    params[table][rows] = RESET  # the table's init_fn (a constant here)
                for state in opt.state[params[table]].values():
                    if state.dim() == 2:
                        state[rows] = 0.0  # fbgemm's reset_embedding_weight_momentum
        out = mc_ebc._embedding_module(remapped).values()
        outputs.append(out.detach().clone())
        opt.zero_grad()
        (0.5 * ((out - targets(BATCH, step)) ** 2).sum()).backward()
        opt.step()
    return outputs, {name: p.detach().clone() for name, p in params.items()}, evicted_rows


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_trains_like_torchrecs_managed_collision_ebc(optimizer):
    expected_outputs, expected_tables, evicted = _reference(optimizer)
    assert evicted > 20  # the drift evicted rows that trained before
    ebc = _ours(optimizer)
    for step in range(STEPS):
        pooled = ebc(raw_kjt(step))
        torch.testing.assert_close(pooled.values(), expected_outputs[step], atol=1e-5, rtol=1e-5)
        (0.5 * ((pooled.values() - targets(BATCH, step)) ** 2).sum()).backward()
    for name, weight in ebc.unsharded_weights().items():
        torch.testing.assert_close(weight, expected_tables[name], atol=1e-5, rtol=1e-5)


def test_state_dict_resumes_the_remap_exactly():
    straight = _ours("adagrad")
    for step in range(STEPS):
        (straight(raw_kjt(step)).values() ** 2).sum().backward()
    first = _ours("adagrad")
    for step in range(3):
        (first(raw_kjt(step)).values() ** 2).sum().backward()
    first.prefetch(raw_kjt(3))  # remapped ahead (a prefetch thread), never trained: not in the state
    resumed = _ours("adagrad")
    resumed.load_state_dict(first.state_dict())
    for step in range(3, STEPS):
        (resumed(raw_kjt(step)).values() ** 2).sum().backward()
    for name, weight in resumed.unsharded_weights().items():
        assert torch.equal(weight, straight.unsharded_weights()[name]), name
    assert resumed.state_dict()["zch_state"] == straight.state_dict()["zch_state"]


def test_evaluation_remaps_frozen():
    ebc = _ours("sgd")
    for step in range(3):
        (ebc(raw_kjt(step)).values() ** 2).sum().backward()
    before = ebc.state_dict()["zch_state"]
    ebc.eval()
    with torch.no_grad():
        ebc(raw_kjt(7))
    assert ebc.state_dict()["zch_state"] == before


def test_from_torchrec_takes_an_mc_ebc_with_its_policies_and_state():
    """A TorchRec MC-EBC that already remapped some batches converts with its policies and remap
    state; both then remap the rest of the stream alike."""
    specs = {"t_user": ZchSpec("lru", 2, decay_exponent=2.0), "t_item": ZchSpec("lfu", 1, threshold="average"),
             "t_small": ZchSpec("distance_lfu", 3, threshold="dynamic", threshold_skew_multiplier=2.0)}
    mc_ebc = torchrec_mc_ebc(specs)
    ebc, mcc = mc_ebc._embedding_module, mc_ebc._managed_collision_collection
    for step in range(3):  # three batches: every table evicted at the third
        mcc(raw_kjt(step))
    plan = {c.name: TableSharding("table_wise", (0,)) for c in CONFIGS}
    ours = ShardedSparseCoreEBC.from_torchrec(mc_ebc, BATCH, plan, SGD(0.1), backend="fbgemm")
    assert ours.zch.specs == specs
    for step in range(3, 7):
        kjt = raw_kjt(step)
        expected = mcc(kjt).to_dict()
        remapped, _ = ours.zch.collection(kjt)
        for key, jt in remapped.to_dict().items():
            torch.testing.assert_close(jt.values(), expected[key].values(), rtol=0, atol=0)
    for name, bag in ebc.embedding_bags.items():
        assert torch.equal(ours.unsharded_weights()[name], bag.weight.detach())


def test_from_torchrec_refuses_a_hashing_mch_module():
    ebc = reference_ebc()
    mcc = ManagedCollisionCollection(
        {c.name: MCHManagedCollisionModule(zch_size=c.num_embeddings, device=torch.device("cpu"),
                                           eviction_policy=ZchSpec().eviction_policy(), eviction_interval=1,
                                           input_hash_func=lambda ids, size: ids % size, name=c.name)
         for c in CONFIGS}, ebc.embedding_bag_configs())
    plan = {c.name: TableSharding("table_wise", (0,)) for c in CONFIGS}
    with pytest.raises(ValueError, match="zch of t_user: an input_hash_func is not supported"):
        ShardedSparseCoreEBC.from_torchrec(ManagedCollisionEmbeddingBagCollection(ebc, mcc), BATCH, plan, SGD(0.1),
                                           backend="fbgemm")


@pytest.mark.parametrize("backend_name", ["xla", "ops"])
@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
def test_a_backend_writes_reset_rows_where_they_are_as_a_whole_reload_does(optimizer, backend_name):
    """The xla and ops backends' row write (their stacked arrays, row slots included) against the
    generic reset: every table and slot read back, then reloaded with the rows replaced."""
    from sparsecore.backends.base import Backend

    from .reference import OPTIMIZERS as SPARSE

    plan = {c.name: TableSharding("table_wise", (0,)) for c in CONFIGS}
    rows, fresh = torch.tensor([3, 0, 17]), torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    tables = []
    for write in (None, Backend.reset_rows):
        ebc = ShardedSparseCoreEBC.from_torchrec(reference_ebc(), BATCH, plan, SPARSE[optimizer][0],
                                                 backend=backend_name)
        backend = ebc.local_backend
        values = {slot: 0.25 for slot in SPARSE[optimizer][0].slot_names}
        buffers = _buffers(backend)
        (write or type(backend).reset_rows)(backend, "t_item", rows, fresh, values)
        if write is None:  # written in place: a copy of the stacks at every eviction took seconds
            assert _buffers(backend) == buffers
        tables.append((backend.table_weights(), backend.optimizer_slots()))
    assert type(ebc.local_backend).reset_rows is not Backend.reset_rows
    (weights, slots), (want_weights, want_slots) = tables
    assert torch.equal(weights["t_item"][rows], fresh)
    for name in weights:
        assert torch.equal(weights[name], want_weights[name]), name
        for slot in slots[name]:
            assert torch.equal(slots[name][slot], want_slots[name][slot]), (name, slot)


def _buffers(backend) -> list[int]:
    """Where the xla or ops backend's stacked tables and slots live."""
    if state := getattr(backend, "state", None):  # ops: tpu tensors sharing their jax arrays
        import torch_tpu

        arrays = [torch_tpu.to_jax(t) for t in state.buffers()]
    else:
        arrays = [*backend._tables.values(), *(a for slots in backend._slots.values() for a in slots.values())]
    return [a.unsafe_buffer_pointer() for a in arrays]
