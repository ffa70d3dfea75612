"""Tables and batches the quantized-table tests share: two tables of 37 rows, TorchRec's quantization of them."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.inference.modules import quantize_inference_model
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_tpu.inference.quantized_tables import QuantizedEmbeddingBags, quantize_table

TORCH_DTYPES = {"int8": torch.qint8, "int4": torch.quint4x2, "fp16": torch.float16}
FEATURES = ("a", "b")
ROWS, DIM = 37, 16


class _Holder(nn.Module):
    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, features: KeyedJaggedTensor):
        return self.ebc(features)


def ebc_of_two_tables(dim: int = DIM) -> EmbeddingBagCollection:
    torch.manual_seed(5)
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=f"t_{f}", embedding_dim=dim, num_embeddings=ROWS,
                                                            feature_names=[f]) for f in FEATURES])
    with torch.no_grad():
        for i, table in enumerate(ebc.embedding_bags.values()):
            table.weight.normal_(0, 0.3 * (i + 1))
            table.weight[3] = 0.25  # a constant row: FBGEMM's zero-range scale
            table.weight[4, 0] = 1e4  # one outlier: a coarse scale
    return ebc


def torchrec_quantized(ebc: EmbeddingBagCollection, dtype: str) -> nn.Module:
    dtypes = {f"t_{f}": TORCH_DTYPES[dtype] for f in FEATURES}
    return quantize_inference_model(_Holder(copy.deepcopy(ebc)), per_table_weight_dtype=dtypes).ebc


def ours(ebc: EmbeddingBagCollection, dtype: str) -> QuantizedEmbeddingBags:
    return QuantizedEmbeddingBags({f: quantize_table(ebc.embedding_bags[f"t_{f}"].weight, dtype) for f in FEATURES})


def batch_of_two_features() -> KeyedJaggedTensor:
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 4, (2 * 9,), generator=generator)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=generator)
    return KeyedJaggedTensor.from_lengths_sync(list(FEATURES), values, lengths)
