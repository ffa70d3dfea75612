"""HSTU's sequence tables on the project's sharded EmbeddingCollection (SparseCore engine) equal
stock TorchRec's EmbeddingCollection: the lookups of an HSTU batch on every sharding type, and the
tables after row-wise Adagrad steps (TorchRec's RowWiseAdagrad as the reference)."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingCollection
from torchrec.optim import RowWiseAdagrad as TorchrecRowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore import RowWiseAdagrad
from tests.hstu.batches import batch_kjt
from torchrec_tpu.hstu.config import HSTUConfig
from torchrec_tpu.hstu.model import HSTU, LOOKUP_KEYS, table_configs
from torchrec_tpu.hstu.sharded import sharded_embeddings
from torchrec_tpu.sharding import TableSharding

CONFIG = HSTUConfig(item_rows=37, action_rows=5, dim=8, heads=2, qk_dim=4, v_dim=4, max_seq_len=32)
LR = 0.1


def _stock(seed=0):
    torch.manual_seed(seed)
    return EmbeddingCollection(tables=table_configs(CONFIG), device=torch.device("cpu"))


def _lookups(kjt):
    return KeyedJaggedTensor.from_jt_dict({k: kjt[k] for k in LOOKUP_KEYS})


def _loss(out, step):
    target = torch.randn(CONFIG.dim, generator=torch.Generator().manual_seed(step))
    return sum(((jt.values() - target) ** 2).sum() * (i + 1) for i, (_, jt) in enumerate(sorted(out.items())))


SHARDINGS = {
    "table_wise": "table_wise",
    "row_wise": "row_wise",
    "data_parallel": "data_parallel",
}  # column_wise needs 2 ranks: tests/sharding/test_ec_two_ranks.py checks every kind there


@pytest.mark.parametrize("kind", list(SHARDINGS))
def test_sharded_lookups_and_rowwise_adagrad_equal_stock_torchrec(kind):
    stock = _stock()
    spec = RowWiseAdagrad(LR, initial_accumulator_value=0.0, eps=1e-10)  # TorchRec's starts at 0
    ours = sharded_embeddings(CONFIG, SHARDINGS[kind], optimizer=spec, local_batch=64, ec=_stock())
    opt = TorchrecRowWiseAdagrad(list(stock.parameters()), lr=LR, eps=1e-10)
    for step in range(2):
        kjt = _lookups(batch_kjt([5, 0, 7, 1], [2, 1, 2, 1], CONFIG, seed=step))
        expected, got = stock(kjt), ours(kjt)
        assert set(got) == set(LOOKUP_KEYS)
        for name in LOOKUP_KEYS:
            assert torch.equal(got[name].lengths(), expected[name].lengths())
            torch.testing.assert_close(got[name].values(), expected[name].values(), atol=1e-6, rtol=1e-6)
        opt.zero_grad()
        _loss(expected, step).backward()
        opt.step()
        _loss(got, step).backward()
    weights = ours.unsharded_weights()
    for name, table in stock.embeddings.items():
        torch.testing.assert_close(weights[name], table.weight.detach(), atol=1e-5, rtol=1e-5)


def test_model_over_the_sharded_tables_scores_like_over_stock_ones():
    torch.manual_seed(3)
    plain = HSTU(CONFIG, embeddings=_stock())
    sharded = HSTU(CONFIG, embeddings=sharded_embeddings(CONFIG, ec=_stock()))
    sharded.stack.load_state_dict(plain.stack.state_dict())
    sharded.heads.load_state_dict(plain.heads.state_dict())
    kjt = batch_kjt([3, 6, 0], [1, 2, 1], CONFIG)  # (eval mode: no dropout draws to differ)
    torch.testing.assert_close(sharded.eval()(kjt), plain.eval()(kjt), atol=1e-6, rtol=1e-6)


def test_sharding_must_name_the_hstu_tables():
    with pytest.raises(ValueError, match=r"names tables \['items'\]; expected \['action', 'item'\]"):
        sharded_embeddings(CONFIG, {"items": TableSharding("row_wise")})
