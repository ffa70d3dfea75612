"""The dtypes ``infer`` / ``export`` hold embedding tables at (``--table-dtype``), torch-free."""

from __future__ import annotations

FLOAT_DTYPES = ("fp32", "fp16", "bf16")
CODE_BITS = {"int8": 8, "int4": 4}  # row-wise quantized: bits per code
TABLE_DTYPES = (*FLOAT_DTYPES, *CODE_BITS)


def check_table_dtype(dtype: str, dim: int) -> None:
    """ValueError naming ``--table-dtype`` when ``dtype`` is unknown or cannot hold ``dim``-wide rows."""
    if dtype not in TABLE_DTYPES:
        raise ValueError(f"--table-dtype must be one of {list(TABLE_DTYPES)}, got {dtype!r}")
    if dtype == "int4" and dim % 4:
        # FBGEMM keeps a row's fp16 scale and bias 2-byte aligned: packed codes of an even byte count
        raise ValueError(f"--table-dtype int4 needs an embedding dim divisible by 4, the model's is {dim}")
