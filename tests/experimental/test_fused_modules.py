"""torchrec_tpu.experimental's fused SparseCore EBC / EC against stock TorchRec on CPU + torch.optim:
forward and three training steps (the optimizer fused into ``loss.backward()``), eagerly on tpu
tensors and inside torch.compile(backend="tpu"); state_dict, the fused optimizer, errors; two
tpu_dist ranks with DTensor tables."""

from __future__ import annotations

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore.stacking import unstack_rows
from torchrec_tpu.experimental import (
    SparseCoreEmbeddingConfig,
    SparseCoreFusedEmbeddingBagCollection,
    SparseCoreFusedEmbeddingCollection,
    SparseCoreInputPreprocessor,
)

BATCH = 8
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1, "eps": 1e-10}),
    "adam": (torch.optim.Adam, {"lr": 0.05, "betas": (0.9, 0.99), "eps": 1e-8}),
}
# torch's slot names for ours
TORCH_STATE = {"accumulators": "sum", "momentums": "exp_avg", "velocities": "exp_avg_sq"}


def _bag_tables() -> list[SparseCoreEmbeddingConfig]:
    """Two tables stacked into "s" (one of them with two features) and a MEAN table of another dim."""
    return [
        SparseCoreEmbeddingConfig(EmbeddingBagConfig(name="ta", num_embeddings=100, embedding_dim=8,
                                                     feature_names=["fa", "fa2"]), stack_table_name="s"),
        SparseCoreEmbeddingConfig(EmbeddingBagConfig(name="tb", num_embeddings=40, embedding_dim=16,
                                                     feature_names=["fb"], pooling=PoolingType.MEAN)),
        SparseCoreEmbeddingConfig(EmbeddingBagConfig(name="tc", num_embeddings=60, embedding_dim=8,
                                                     feature_names=["fc"]), stack_table_name="s"),
    ]


def _seq_tables() -> list[SparseCoreEmbeddingConfig]:
    return [
        SparseCoreEmbeddingConfig(EmbeddingConfig(name="sa", num_embeddings=80, embedding_dim=8,
                                                  feature_names=["ha", "ha2"]), max_seq_len=3),
        SparseCoreEmbeddingConfig(EmbeddingConfig(name="sb", num_embeddings=30, embedding_dim=8,
                                                  feature_names=["hb"]), max_seq_len=3),
    ]


def _kjt(tables: list[SparseCoreEmbeddingConfig], seed: int) -> KeyedJaggedTensor:
    """Random ids with repeats (within and across samples), up to each table's max_seq_len."""
    g = torch.Generator().manual_seed(seed)
    keys, lengths, values = [], [], []
    for t in tables:
        for f in t.feature_names:
            keys.append(f)
            n = torch.randint(0, (t.max_seq_len or 4) + 1, (BATCH,), generator=g)
            lengths.append(n)
            values.append(torch.randint(0, min(t.num_embeddings, 20), (int(n.sum()),), generator=g))
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


class Pair:
    """A fused module and the stock TorchRec module + torch optimizer it must equal."""

    def __init__(self, kind: str, optimizer: str, tables: list[SparseCoreEmbeddingConfig] | None = None) -> None:
        self.tables = tables or (_bag_tables() if kind == "ebc" else _seq_tables())
        optimizer_type, kwargs = OPTIMIZERS[optimizer]
        fused_cls = SparseCoreFusedEmbeddingBagCollection if kind == "ebc" else SparseCoreFusedEmbeddingCollection
        self.fused = fused_cls(self.tables, optimizer_type, kwargs, batch_size=BATCH)
        configs = [t.config for t in self.tables]
        torch.manual_seed(0)
        self.stock = EmbeddingBagCollection(tables=configs) if kind == "ebc" else EmbeddingCollection(tables=configs)
        self.stock_weights = self.stock.embedding_bags if kind == "ebc" else self.stock.embeddings
        self.fused.set_unstacked_table_weights({n: m.weight for n, m in self.stock_weights.items()})
        self.optimizer = optimizer_type(self.stock.parameters(), **kwargs)
        self.preprocessor = SparseCoreInputPreprocessor(self.tables, batch_size=BATCH)
        self.lazy = optimizer == "adam"  # SparseCore Adam is lazy: the same batch each step equals torch's

    def step(self, step: int, forward=None) -> None:
        """One step of both; their outputs must agree."""
        kjt = _kjt(self.tables, seed=0 if self.lazy else step)
        grads = torch.Generator().manual_seed(100 + step)
        expected = self.stock(kjt)
        got = (self.fused if forward is None else forward)(self.preprocessor(kjt).to("tpu"))
        if isinstance(expected, dict):
            assert list(got) == list(expected)
            weights = {k: torch.randn(v.values().shape, generator=grads) for k, v in expected.items()}
            for k, jt in expected.items():
                assert got[k].values().device.type == "tpu"
                torch.testing.assert_close(got[k].values().cpu(), jt.values().detach(), rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(got[k].lengths().cpu(), jt.lengths())
            loss = sum((got[k].values() * w.to("tpu")).sum() for k, w in weights.items())
            stock_loss = sum((jt.values() * weights[k]).sum() for k, jt in expected.items())
        else:
            assert got.keys() == expected.keys() and got.length_per_key() == expected.length_per_key()
            torch.testing.assert_close(got.values().cpu(), expected.values().detach(), rtol=1e-5, atol=1e-6)
            w = torch.randn(expected.values().shape, generator=grads)
            loss, stock_loss = (got.values() * w.to("tpu")).sum(), (expected.values() * w).sum()
        loss.backward()
        self.optimizer.zero_grad()
        stock_loss.backward()
        self.optimizer.step()

    def check_tables(self) -> None:
        got = self.fused.get_unstacked_table_weights()
        for name, module in self.stock_weights.items():
            torch.testing.assert_close(got[name], module.weight.detach(), rtol=1e-5, atol=1e-6)
        for dict_name, torch_name in TORCH_STATE.items():
            for stack_name, slot in getattr(self.fused, dict_name).items():
                unstacked = unstack_rows(self.preprocessor.plan.stack(stack_name), slot.detach().cpu())
                for name, value in unstacked.items():
                    state = self.optimizer.state[self.stock_weights[name].weight][torch_name]
                    torch.testing.assert_close(value, state, rtol=1e-5, atol=1e-7)
        # the tables never get a .grad: the update ran in backward
        assert all(w.grad is None for w in self.fused.table_weights.values())


def _train(pair: Pair, forward=None) -> None:
    for step in range(3):
        pair.step(step, forward)
        pair.check_tables()


def test_one_fused_sgd_step_of_one_table_equals_torchrec() -> None:
    """The default run's smoke test (the tpu device compiles each op on first use: ~10 s cold)."""
    pair = Pair("ebc", "sgd", tables=_bag_tables()[1:2])
    pair.step(0)
    pair.check_tables()


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_ebc_trains_like_torchrec_ebc_and_torch_optim_eagerly_on_tpu(optimizer: str) -> None:
    _train(Pair("ebc", optimizer))


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_ebc_trains_like_torchrec_ebc_compiled(optimizer: str) -> None:
    """SGD and Adagrad compile into one graph with the fused update in the backward graph; Adam's
    lookups stay outside the graph (its step count lives on the host)."""
    pair = Pair("ebc", optimizer)
    _train(pair, torch.compile(pair.fused, backend="tpu", fullgraph=optimizer != "adam"))


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_ec_trains_like_torchrec_ec_and_torch_optim_eagerly_on_tpu(optimizer: str) -> None:
    _train(Pair("ec", optimizer))


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_ec_trains_like_torchrec_ec_compiled(optimizer: str) -> None:
    pair = Pair("ec", optimizer)
    _train(pair, torch.compile(pair.fused, backend="tpu"))


def test_state_dict_is_torchrec_tpus_and_round_trips() -> None:
    pair = Pair("ebc", "adagrad")
    fused = pair.fused
    assert sorted(fused.state_dict()) == [
        "accumulators.s", "accumulators.tb", "embedding_bags.s.weight", "embedding_bags.tb.weight",
        "learning_rates.s", "learning_rates.tb"]
    assert [c.stack_name for c in fused.stacked_configs] == ["s", "tb"]
    stacked = fused.state_dict()["embedding_bags.s.weight"]
    assert stacked.device.type == "tpu" and tuple(stacked.shape) == (pair.preprocessor.plan.stack("s").vocab_size, 8)
    logical = unstack_rows(pair.preprocessor.plan.stack("s"), stacked.cpu())
    for name in ("ta", "tc"):
        torch.testing.assert_close(logical[name], pair.stock_weights[name].weight.detach())
    assert fused.unstacked_state_dict().keys() == {"ta", "tb", "tc"}
    fresh = SparseCoreFusedEmbeddingBagCollection(_bag_tables(), torch.optim.Adagrad, {"lr": 0.1}, batch_size=BATCH)
    fresh.load_state_dict(fused.state_dict())
    for name, value in fresh.get_unstacked_table_weights().items():
        torch.testing.assert_close(value, pair.stock_weights[name].weight.detach())
    state = fused.fused_optimizer.state_dict()["state"]
    assert sorted(state) == ["s.weight", "tb.weight"] and list(state["tb.weight"]) == ["tb.weight.accumulator"]


def test_fused_optimizer_carries_lr_schedules_to_the_tables() -> None:
    fused = SparseCoreFusedEmbeddingBagCollection(_bag_tables(), torch.optim.SGD, {"learning_rate": 0.1},
                                                  batch_size=BATCH)
    assert fused.optimizer_kwargs() == {"lr": 0.1} and fused.get_initial_lr() == 0.1
    optimizer = fused.fused_optimizer
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad()
    assert [float(v) for v in fused.learning_rates.values()] == pytest.approx([0.05, 0.05])
    fused.set_learning_rate(0.2)
    assert fused.current_lr == 0.2 and float(fused.learning_rates["tb"]) == pytest.approx(0.2)


def test_errors_name_the_bad_value() -> None:
    tables = _bag_tables()
    with pytest.raises(ValueError, match=r"optimizer_type .*RMSprop.* supported: \['torch.optim.SGD'"):
        SparseCoreFusedEmbeddingBagCollection(tables, torch.optim.RMSprop, {}, batch_size=BATCH)
    with pytest.raises(ValueError, match=r"\['momentum'\] are not supported by the fused SGD update; it takes"):
        SparseCoreFusedEmbeddingBagCollection(tables, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, batch_size=BATCH)
    with pytest.raises(ValueError, match=r"global_device_count=2 needs torch.distributed initialized with that many "
                                         r"ranks \(one tpu device each\); the world size is 1"):
        SparseCoreFusedEmbeddingBagCollection(tables, torch.optim.SGD, {}, batch_size=BATCH, global_device_count=2)
    with pytest.raises(ValueError, match=r"tables \['ta', 'tb', 'tc'\] wrap EmbeddingBagConfig"):
        SparseCoreFusedEmbeddingCollection(tables, batch_size=BATCH)
    with pytest.raises(ValueError, match=r"tables \['sa', 'sb'\] wrap EmbeddingConfig"):
        SparseCoreFusedEmbeddingBagCollection(_seq_tables(), torch.optim.SGD, {}, batch_size=BATCH)
    with pytest.raises(ValueError, match=r"batch_size must be a positive multiple of num_sc_per_device=2.* 7"):
        SparseCoreFusedEmbeddingBagCollection(tables, torch.optim.SGD, {}, batch_size=7)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_two_ranks_with_dtensor_tables_equal_torchrec_and_their_checkpoint_loads_on_one(optimizer: str,
                                                                                        tmp_path) -> None:
    """Two tpu_dist ranks train DTensor tables like TorchRec on the global batch and save them
    (SparseCoreSavePlanner); one process loads that checkpoint into a one-device module (re-sharded
    from 4 SparseCores to 2) and unsharded into a CPU TorchRec EBC."""
    import torch.distributed.checkpoint as dcp

    from tests.experimental.fused_multirank_checks import BATCH as RANK_BATCH
    from tests.experimental.fused_multirank_checks import rank_body, table_configs
    from torch_tpu.distributed.local_launch import launch_local
    from torchrec_tpu.experimental import SparseCoreLoadPlanner

    results = launch_local(rank_body, 2, optimizer, str(tmp_path), timeout_s=500)
    assert [r for r, _ in results] == ["ok", "ok"], "\n".join(r for r, _ in results)
    trained = results[0][1]
    optimizer_type, kwargs = OPTIMIZERS[optimizer]
    one = SparseCoreFusedEmbeddingBagCollection([SparseCoreEmbeddingConfig(c) for c in table_configs()],
                                                optimizer_type, kwargs, batch_size=RANK_BATCH)
    planner = SparseCoreLoadPlanner(num_sc_per_device=2)
    dcp.load(one.state_dict(), checkpoint_id=str(tmp_path), planner=planner)
    assert planner.cross_topology
    for name, value in one.get_unstacked_table_weights().items():
        torch.testing.assert_close(value, trained[name], rtol=0, atol=0)
    cpu = EmbeddingBagCollection(tables=table_configs(), device=torch.device("cpu"))
    dcp.load(cpu.state_dict(), checkpoint_id=str(tmp_path),
             planner=SparseCoreLoadPlanner(num_sc_per_device=2, unshard_for_cpu=True))
    for name, bag in cpu.embedding_bags.items():
        torch.testing.assert_close(bag.weight.detach(), trained[name], rtol=0, atol=0)
