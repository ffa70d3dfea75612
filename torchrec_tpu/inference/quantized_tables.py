"""Embedding tables stored for inference at ``--table-dtype`` and looked up without an fp32 copy.

int8 / int4 are row-wise quantized exactly as FBGEMM's inference TBE (TorchRec's
``quantize_inference_model``) stores them: FBGEMM's ``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf``
rows, split as TorchRec's ``quantize_state_dict`` splits them into the packed codes (int4: two per
byte, the even column in the low nibble) and a per-row fp16 (scale, bias). fp16 / bf16 tables are a
cast, fp32 the table itself. On the host a DLRM's ``EmbeddingBagCollection`` is replaced by
FBGEMM's inference TBE over them (:func:`host_embedding_bags`), or, for the dtypes it does not
take (bf16), by :class:`QuantizedEmbeddingBags`: it gathers the batch's rows, dequantizes those
only (``code * scale + bias`` in fp32) and sum-pools them per sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_tpu.inference.table_dtypes import CODE_BITS, check_table_dtype

TORCH_FLOATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TBE_DATA_TYPES = {"fp32": "FP32", "fp16": "FP16", "int8": "INT8", "int4": "INT4"}  # TorchRec DataType names
QUANTIZE_ROWS = 1 << 20  # rows quantized at a time: FBGEMM's fp32 temporaries stay this small


@dataclass(frozen=True)
class QuantizedTable:
    """One table at ``dtype``: ``weight`` (float rows, or uint8 packed codes) and, for int8 / int4,
    ``scale_bias`` float16[rows, 2]."""

    dtype: str
    dim: int
    weight: torch.Tensor
    scale_bias: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.weight.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes the table holds (codes and scales)."""
        held = self.weight.numel() * self.weight.element_size()
        if self.scale_bias is not None:
            held += self.scale_bias.numel() * self.scale_bias.element_size()
        return held

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids``, float32[len(ids), dim], dequantized from the gathered rows only."""
        rows = self.weight.index_select(0, ids)
        if self.scale_bias is None:
            return rows.float()
        if self.dtype == "int4":  # two codes per byte, the even column in the low nibble
            rows = torch.stack((rows & 0xF, rows >> 4), dim=-1).flatten(-2)[:, : self.dim]
        scale_bias = self.scale_bias.index_select(0, ids).float()
        return rows.float() * scale_bias[:, :1] + scale_bias[:, 1:]


def quantize_table(weight: torch.Tensor, dtype: str, out: QuantizedTable | None = None) -> QuantizedTable:
    """``weight`` (float[rows, dim], on the CPU) at ``dtype``, quantized ``QUANTIZE_ROWS`` rows at a
    time, into ``out`` (a table of that dtype and shape, e.g. FBGEMM's rows: :func:`empty_host_tables`)
    or new tensors."""
    import fbgemm_gpu  # noqa: F401  registers torch.ops.fbgemm

    rows, dim = (int(n) for n in weight.shape)
    check_table_dtype(dtype, dim)
    weight = weight.detach()
    if out is None:
        out = _empty_table(dtype, rows, dim)
    if dtype in TORCH_FLOATS:
        out.weight.copy_(weight)
        return out
    packed = dim * CODE_BITS[dtype] // 8
    for start in range(0, rows, QUANTIZE_ROWS):
        fused = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(
            weight[start : start + QUANTIZE_ROWS].float().contiguous(), CODE_BITS[dtype])
        out.weight[start : start + fused.shape[0]] = fused[:, :packed]
        out.scale_bias[start : start + fused.shape[0]] = fused[:, packed:].contiguous().view(torch.float16)
    return out


def _empty_table(dtype: str, rows: int, dim: int) -> QuantizedTable:
    if dtype in TORCH_FLOATS:
        return QuantizedTable(dtype, dim, torch.empty(rows, dim, dtype=TORCH_FLOATS[dtype]))
    return QuantizedTable(dtype, dim, torch.empty(rows, dim * CODE_BITS[dtype] // 8, dtype=torch.uint8),
                          torch.empty(rows, 2, dtype=torch.float16))


class QuantizedEmbeddingBags(nn.Module):
    """A sum-pooled ``EmbeddingBagCollection`` over :class:`QuantizedTable` s, one per feature."""

    def __init__(self, tables: dict[str, QuantizedTable]) -> None:
        super().__init__()
        self.layout = tuple((feature, table.dtype, table.dim) for feature, table in tables.items())
        for i, table in enumerate(tables.values()):  # buffers: .to(device) moves the tables
            self.register_buffer(f"weight_{i}", table.weight)
            if table.scale_bias is not None:
                self.register_buffer(f"scale_bias_{i}", table.scale_bias)

    def table(self, i: int) -> QuantizedTable:
        """The ``i``-th feature's table."""
        _, dtype, dim = self.layout[i]
        return QuantizedTable(dtype, dim, getattr(self, f"weight_{i}"), getattr(self, f"scale_bias_{i}", None))

    @property
    def nbytes(self) -> int:
        """Bytes the tables hold."""
        return sum(self.table(i).nbytes for i in range(len(self.layout)))

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        jagged = features.to_dict()
        pooled = []
        for i, (feature, _, _) in enumerate(self.layout):
            table, bags = self.table(i), jagged[feature]
            lengths = bags.lengths()
            samples = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
            out = torch.zeros(lengths.numel(), table.dim, dtype=torch.float32, device=lengths.device)
            pooled.append(out.index_add_(0, samples, table.lookup(bags.values())))
        return KeyedTensor(keys=[feature for feature, _, _ in self.layout],
                           length_per_key=[dim for _, _, dim in self.layout], values=torch.cat(pooled, dim=1))


def host_embedding_bags(tables: dict[str, QuantizedTable]) -> tuple[nn.Module, dict[str, QuantizedTable]]:
    """The module the host looks ``tables`` (one dtype) up with, and the tables as it holds them:
    FBGEMM's inference TBE (:func:`torchrec_quant_ebc`) for the dtypes it takes, the tables then
    views of its rows (no second copy); bf16: :class:`QuantizedEmbeddingBags` over ``tables``."""
    dtypes = {table.dtype for table in tables.values()}
    if not dtypes <= set(TBE_DATA_TYPES) or len(dtypes) != 1:
        return QuantizedEmbeddingBags(tables), tables
    ebc = torchrec_quant_ebc(tables)
    return ebc, _tbe_tables(ebc, {f: (t.dtype, t.rows, t.dim) for f, t in tables.items()})


def held_bytes(module: nn.Module, tables: dict[str, QuantizedTable]) -> int:
    """Bytes the host's lookup ``module`` holds ``tables`` in: FBGEMM's TBE rows (padded to its row
    alignment) where it is one, else the tables' own."""
    tbes = getattr(module, "tbes", None)
    if tbes is None:
        return sum(table.nbytes for table in tables.values())
    return sum(tbe.weights_host.numel() * tbe.weights_host.element_size() for tbe in tbes)


def empty_host_tables(shapes: dict[str, tuple[int, int]], dtype: str
                      ) -> tuple[nn.Module | None, dict[str, QuantizedTable]]:
    """Tables of ``shapes`` (rows, dim by feature) at ``dtype``, uninitialised, as the host will
    hold them: views of the rows of FBGEMM's inference TBE (the module) for the dtypes it takes,
    so quantizing into them (:func:`quantize_table`'s ``out``) makes no second copy; else
    (bf16) plain tensors and no module (:func:`host_embedding_bags` then makes it)."""
    if dtype not in TBE_DATA_TYPES:
        return None, {f: _empty_table(dtype, rows, dim) for f, (rows, dim) in shapes.items()}
    ebc = _quant_ebc({f: (dtype, rows, dim) for f, (rows, dim) in shapes.items()}, None)
    return ebc, _tbe_tables(ebc, {f: (dtype, rows, dim) for f, (rows, dim) in shapes.items()})


def _tbe_tables(ebc: nn.Module, layout: dict[str, tuple[str, int, int]]) -> dict[str, QuantizedTable]:
    """The tables of ``ebc`` (one TBE; ``layout``: dtype, rows, dim by feature, in its order) as
    views of its rows."""
    (tbe,) = ebc.tbes  # one dtype: one TBE, its tables in the order given
    held = {}
    for (feature, (dtype, _, dim)), (codes, scale_shift) in zip(layout.items(), tbe.split_embedding_weights()):
        weight = codes if dtype in CODE_BITS else codes.view(TORCH_FLOATS[dtype])
        held[feature] = QuantizedTable(dtype, dim, weight,
                                       None if scale_shift is None else scale_shift.view(torch.float16))
    return held


def torchrec_quant_ebc(tables: dict[str, QuantizedTable]) -> nn.Module:
    """TorchRec's ``QuantEmbeddingBagCollection`` (FBGEMM's inference TBE) over ``tables`` (by
    feature, tables named ``t_<feature>``): what a TorchRec user serves an exported model's
    tables with. fp32 / fp16 / int8 / int4 (TorchRec's TBE takes no bf16 rows)."""
    weights = {f"t_{feature}": (table.weight.view(torch.uint8),
                                None if table.scale_bias is None else table.scale_bias.view(torch.uint8))
               for feature, table in tables.items()}
    return _quant_ebc({f: (t.dtype, t.rows, t.dim) for f, t in tables.items()}, weights)


def _quant_ebc(layout: dict[str, tuple[str, int, int]], weights: dict | None) -> nn.Module:
    """TorchRec's ``QuantEmbeddingBagCollection`` of ``layout`` (dtype, rows, dim by feature),
    its rows ``weights`` (TorchRec's quantized weights by table name) or, None, zeros."""
    from torchrec import EmbeddingBagConfig
    from torchrec.modules.embedding_configs import DataType
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection

    data_types = {name: getattr(DataType, kind) for name, kind in TBE_DATA_TYPES.items()}
    configs = []
    for feature, (dtype, rows, dim) in layout.items():
        if dtype not in data_types:
            raise ValueError(f"table of {feature!r}: TorchRec's quantized tables take {list(data_types)}, "
                             f"not {dtype}")
        configs.append(EmbeddingBagConfig(name=f"t_{feature}", embedding_dim=dim, num_embeddings=rows,
                                          feature_names=[feature], data_type=data_types[dtype]))
    return QuantEmbeddingBagCollection(configs, is_weighted=False, device=torch.device("cpu"),
                                       table_name_to_quantized_weights=weights, register_tbes=True)
