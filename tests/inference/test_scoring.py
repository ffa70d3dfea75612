"""The host's scoring forward (:mod:`torchrec_tpu.inference.scoring`) against TorchRec's own DLRM forward."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_tpu.inference.scoring import PooledDLRM, scoring_dlrm

FEATURES = ("a", "b", "c")
DIM, DENSE, BATCH = 8, 5, 64


def _ebc(order: tuple[str, ...] = FEATURES) -> EmbeddingBagCollection:
    return EmbeddingBagCollection([EmbeddingBagConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=50 + i,
                                                      feature_names=[f]) for i, f in enumerate(order)])


def _batch(generator: torch.Generator) -> tuple[torch.Tensor, KeyedJaggedTensor]:
    lengths = torch.randint(0, 4, (len(FEATURES) * BATCH,), generator=generator)
    ids = torch.randint(0, 50, (int(lengths.sum()),), generator=generator)
    return torch.randn(BATCH, DENSE, generator=generator), KeyedJaggedTensor(list(FEATURES), ids, lengths=lengths)


@pytest.mark.parametrize("model", ["dlrm", "dlrm_dcn"])
def test_scoring_forward_equals_torchrec_bit_for_bit(model: str) -> None:
    torch.manual_seed(0)
    if model == "dlrm":
        dlrm = DLRM(_ebc(), DENSE, [16, DIM], [16, 1])
    else:
        dlrm = DLRM_DCN(_ebc(), DENSE, [16, DIM], [16, 1], dcn_num_layers=2, dcn_low_rank_dim=4)
    dlrm.eval()
    generator = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for _ in range(3):
            dense, sparse = _batch(generator)
            assert torch.equal(scoring_dlrm(dlrm)(dense, sparse), dlrm(dense, sparse))


def test_tables_in_another_feature_order_are_refused() -> None:
    dlrm = DLRM(_ebc(), DENSE, [16, DIM], [16, 1]).eval()
    scorer = scoring_dlrm(dlrm)
    assert isinstance(scorer, PooledDLRM)
    scorer.tables = _ebc(tuple(reversed(FEATURES)))  # would pool c's rows where the towers take a's
    with pytest.raises(ValueError, match=r"the tables pool features \['c', 'b', 'a'\], the towers take"):
        scorer(*_batch(torch.Generator().manual_seed(2)))
