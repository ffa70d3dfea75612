"""TorchRec 1.9.2's own ``SparseCoreFused{EmbeddingBag,Embedding}Collection`` and
``SparseCoreInputPreprocessor``, unchanged, on the tpu device (``import torch_tpu``): forward and
three fused training steps, eager and compiled, equal stock TorchRec on CPU with TorchRec TPU's optimizer semantics
(tests/torchrec_192/reference.py), tables and optimizer slots included; the fused optimizer's
learning-rate path; the stacking and sharding functions against MOD sharding by hand."""

from __future__ import annotations

# isort: off
import torch_tpu  # TorchTPU's environment (torch.tpu.ops, the preprocessing backend) before TorchRec's TPU module
# isort: on

import pytest
import torch
from torchrec.experimental.torch_tpu import (
    KeyedSparseCorePreprocessedInput,
    SparseCoreEmbeddingConfig,
    SparseCoreFusedEmbeddingBagCollection,
    SparseCoreFusedEmbeddingCollection,
    SparseCoreInputPreprocessor,
    SparseCorePreprocessedInput,
    StackedSparseCoreEmbeddingConfig,
    auto_stack_tables,
    prepare_tables_for_stacking,
    stack_and_shard_tables,
    stack_tables,
    unshard_and_unstack_tables,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from tests.torchrec_192.reference import (
    NUM_SC,
    OPTIMIZERS,
    StockReference,
    bag_configs,
    ids_per_sample,
    kjt,
    load_logical_tables,
    logical_tables,
    sc_tables,
    seq_configs,
    touched_rows,
)

BATCH = 8
MAX_SEQ_LEN = 3
# the module's slot dicts and the reference's state for them
SLOTS = {"adagrad": [("accumulators", lambda ref, w: ref.optimizer.state[w]["sum"])],
         "adam": [("momentums", lambda ref, w: ref.optimizer.state[ref.name_of[id(w)]][0]),
                  ("velocities", lambda ref, w: ref.optimizer.state[ref.name_of[id(w)]][1])]}


class Pair:
    """TorchRec's fused module on tpu and the stock CPU module + reference optimizer it must equal."""

    def __init__(self, kind: str, optimizer: str, compiled: bool = False) -> None:
        self.configs = bag_configs() if kind == "ebc" else seq_configs()
        stack = {"ta": "s", "tc": "s"} if kind == "ebc" else {}
        self.tables = sc_tables(self.configs, stack, None if kind == "ebc" else MAX_SEQ_LEN)
        optimizer_type, kwargs = OPTIMIZERS[optimizer]
        cls = SparseCoreFusedEmbeddingBagCollection if kind == "ebc" else SparseCoreFusedEmbeddingCollection
        self.fused = cls(tables=self.tables, optimizer_type=optimizer_type, optimizer_kwargs=kwargs,
                         batch_size=BATCH, num_sc_per_device=NUM_SC)
        torch.manual_seed(0)
        stock = EmbeddingBagCollection(tables=self.configs) if kind == "ebc" else EmbeddingCollection(
            tables=self.configs)
        self.ref = StockReference(stock, optimizer)
        self.ref.name_of = {id(w): n for n, w in self.ref.weights.items()}
        load_logical_tables(self.fused, {n: w.detach() for n, w in self.ref.weights.items()})
        self.preprocessor = SparseCoreInputPreprocessor(tables=self.tables, batch_size=BATCH,
                                                        num_sc_per_device=NUM_SC)
        self.optimizer = optimizer
        self.forward = torch.compile(self.fused, backend="tpu", fullgraph=True) if compiled else self.fused

    def step(self, step: int) -> None:
        ids = ids_per_sample(self.configs, BATCH, seed=step, max_len=MAX_SEQ_LEN)
        batch = self.preprocessor(kjt(ids))
        assert isinstance(batch, KeyedSparseCorePreprocessedInput)
        assert all(isinstance(t, SparseCorePreprocessedInput) for t in batch.table_tensors.values())
        got = self.forward(batch.to("tpu"))
        expected = self.ref.stock(kjt(ids))
        grads = torch.Generator().manual_seed(100 + step)
        # per feature: a JaggedTensor's values (EmbeddingCollection) or a pooled [batch, dim] tensor
        # (KeyedTensor; TorchRec TPU orders its keys by stack)
        if isinstance(expected, dict):
            got, expected = {k: v.values() for k, v in got.items()}, {k: v.values() for k, v in expected.items()}
        else:
            got, expected = got.to_dict(), expected.to_dict()
        assert sorted(got) == sorted(expected)
        loss, stock_loss = 0, 0
        for key, value in expected.items():
            assert got[key].device.type == "tpu"
            torch.testing.assert_close(got[key].cpu(), value.detach(), rtol=1e-5, atol=1e-6, msg=key)
            w = torch.randn(value.shape, generator=grads)
            loss = loss + (got[key] * w.to("tpu")).sum()
            stock_loss = stock_loss + (value * w).sum()
        loss.backward()  # the fused update runs here
        self.ref.step(stock_loss, touched_rows(ids, self.configs))

    def check_tables(self) -> None:
        got = logical_tables(self.fused)
        for name, weight in self.ref.weights.items():
            torch.testing.assert_close(got[name], weight.detach(), rtol=1e-5, atol=1e-6, msg=name)
        for slot_dict, expected_of in SLOTS.get(self.optimizer, []):
            slots = logical_tables(self.fused, getattr(self.fused, slot_dict))
            for name, weight in self.ref.weights.items():
                torch.testing.assert_close(slots[name], expected_of(self.ref, weight), rtol=1e-5, atol=1e-7,
                                           msg=f"{slot_dict} {name}")
        assert all(w.grad is None for w in self.fused.table_weights.values())  # updated in backward


def test_one_fused_sgd_step_equals_torchrec_and_runs_on_the_device() -> None:
    pair = Pair("ebc", "sgd")
    torch_tpu.reset_metrics()
    pair.step(0)
    pair.check_tables()
    assert torch_tpu.fallback_counts() == {}, torch_tpu.fallback_counts()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ebc", "ec"])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_three_fused_steps_equal_stock_torchrec_with_torchrec_tpus_optimizer(kind: str, optimizer: str) -> None:
    pair = Pair(kind, optimizer)
    for step in range(3):
        pair.step(step)
        pair.check_tables()


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_three_compiled_fused_ebc_steps_equal_stock_torchrec(optimizer: str) -> None:
    """The EBC under torch.compile(backend="tpu", fullgraph=True): its backward graph holds the
    fused update as AOTAutograd's ``auto_functionalized_v2`` of TorchRec's mutating custom op."""
    pair = Pair("ebc", optimizer, compiled=True)
    for step in range(3):
        pair.step(step)
        pair.check_tables()


def test_adam_is_torchrec_tpus_raw_lr_without_bias_correction() -> None:
    """The first Adam step moves a touched row by lr * (1 - b1) g / (sqrt(1 - b2) |g| + eps): with
    b2 = 0.999 that is ~3.16 lr, where torch.optim.Adam moves it by ~lr."""
    config = bag_configs()[1:2]
    tables = sc_tables(config)
    fused = SparseCoreFusedEmbeddingBagCollection(tables=tables, optimizer_type=torch.optim.Adam,
                                                  optimizer_kwargs={"lr": 0.01}, batch_size=BATCH)
    load_logical_tables(fused, {"tb": torch.zeros(40, 16)})
    ids = {"fb": [torch.tensor([3])] + [torch.zeros(0, dtype=torch.long)] * (BATCH - 1)}
    out = fused(SparseCoreInputPreprocessor(tables=tables, batch_size=BATCH)(kjt(ids)).to("tpu"))
    out.values().sum().backward()  # gradient 1 on row 3 (one id, MEAN over one)
    moved = logical_tables(fused)["tb"]
    torch.testing.assert_close(moved[3], torch.full((16,), -0.01 * 0.1 / (0.001 ** 0.5 + 1e-10)))
    assert moved[:3].abs().sum() == 0 and moved[4:].abs().sum() == 0


def test_fused_optimizer_lr_reaches_the_update() -> None:
    pair = Pair("ebc", "sgd")
    assert pair.fused.get_initial_lr() == pytest.approx(0.1)
    pair.fused.set_learning_rate(0.05)
    for group in pair.ref.optimizer.param_groups:
        group["lr"] = 0.05
    assert all(float(v) == pytest.approx(0.05) for v in pair.fused.learning_rates.values())
    pair.step(0)
    pair.check_tables()
    assert pair.fused.fused_optimizer is not None


def test_stacking_functions_lay_tables_out_mod_sharded() -> None:
    """``prepare_tables_for_stacking`` / ``stack_tables`` / ``auto_stack_tables`` group the tables;
    ``stack_and_shard_tables`` and ``unshard_and_unstack_tables`` invert each other on the device
    layout; TorchRec's checkpoint utils put logical row r of a table on SparseCore r % N."""
    tables = sc_tables(bag_configs())
    stack_tables(tables, ["ta", "tc"])
    configs = prepare_tables_for_stacking(tables, global_device_count=1, num_sc_per_device=NUM_SC)
    assert all(isinstance(c, StackedSparseCoreEmbeddingConfig) for c in configs)
    assert sorted(sorted(t.name for t in c.tables) for c in configs) == [["ta", "tc"], ["tb"]]
    auto = sc_tables(bag_configs())
    auto_stack_tables(auto, global_device_count=1, num_sc_per_device=NUM_SC, batch_size=BATCH)
    grouped = prepare_tables_for_stacking(auto, global_device_count=1, num_sc_per_device=NUM_SC)
    assert sorted(sorted(t.name for t in c.tables) for c in grouped) == [["ta", "tc"], ["tb"]]  # equal dims stack
    g = torch.Generator().manual_seed(0)
    weights = {c.name: torch.randn(c.num_embeddings, c.embedding_dim, generator=g) for c in bag_configs()}
    stacked = stack_and_shard_tables(weights, configs, global_device_count=1, num_sc_per_device=NUM_SC)
    back = unshard_and_unstack_tables(stacked, configs, global_device_count=1, num_sc_per_device=NUM_SC)
    for name, w in weights.items():
        torch.testing.assert_close(back[name], w)
    fused = SparseCoreFusedEmbeddingBagCollection(tables=sc_tables([bag_configs()[1]]),
                                                  optimizer_type=torch.optim.SGD, optimizer_kwargs={"lr": 0.1},
                                                  batch_size=BATCH)
    load_logical_tables(fused, {"tb": weights["tb"]})
    physical = fused.table_weights["tb"].detach().cpu()
    shard_rows = physical.shape[0] // NUM_SC
    for row in (0, 1, 7, 39):
        torch.testing.assert_close(physical[(row % NUM_SC) * shard_rows + row // NUM_SC], weights["tb"][row])


def test_config_and_module_errors() -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        SparseCoreInputPreprocessor(tables=sc_tables(seq_configs()), batch_size=BATCH)
    with pytest.raises(ValueError, match=r"batch_size \(7\) must be divisible by num_sc_per_device \(2\)"):
        SparseCoreFusedEmbeddingBagCollection(tables=sc_tables(bag_configs()), optimizer_type=torch.optim.SGD,
                                              optimizer_kwargs={}, batch_size=7)
    assert isinstance(sc_tables(bag_configs())[0], SparseCoreEmbeddingConfig)
