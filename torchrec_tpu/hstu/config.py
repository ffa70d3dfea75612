"""HSTU's architecture (:class:`HSTUConfig`) and its presets.

``hstu``: the 2024 paper's STU layer; fits this box and trains in minutes. (MLPerf's DLRMv4, with
DLRMv3's STU layer, is its own model: :mod:`torchrec_tpu.hstu.dlrmv4`.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping

from torchrec_tpu.hstu.attention import ATTENTION_KERNELS
from torchrec_tpu.hstu.layers import STU_VARIANTS


@dataclass(frozen=True)
class HSTUConfig:
    """Tables, STU stack and heads. ``max_seq_len`` bounds history + candidates (the ``paper``
    layer's N); longer histories keep their latest events. ``tasks`` name the heads' outputs (one
    logit each). ``stu``: the layer variant (:mod:`~torchrec_tpu.hstu.layers`); ``dropout``: its
    dropout rate (the paper code's ``linear_dropout_rate``, DLRMv3's ``output_dropout_ratio``)."""

    item_rows: int
    action_rows: int
    dim: int = 64
    layers: int = 2
    heads: int = 2
    qk_dim: int = 32
    v_dim: int = 32
    max_seq_len: int = 256
    time_buckets: int = 128
    tasks: tuple[str, ...] = ("positive",)
    head_hidden: int = 64
    kernel: str = "xla"
    stu: str = "paper"
    dropout: float = 0.2

    def __post_init__(self) -> None:
        for name in ("item_rows", "action_rows", "dim", "layers", "heads", "qk_dim", "v_dim", "max_seq_len",
                     "time_buckets", "head_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"HSTUConfig.{name}={value!r}: it must be a positive integer")
        if not self.tasks:
            raise ValueError("HSTUConfig.tasks is empty: name at least one task")
        if self.stu not in STU_VARIANTS:
            raise ValueError(f"HSTUConfig.stu={self.stu!r}; expected one of {list(STU_VARIANTS)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"HSTUConfig.dropout={self.dropout!r}: it must lie in [0, 1)")
        if self.kernel not in ATTENTION_KERNELS:
            raise ValueError(f"HSTUConfig.kernel={self.kernel!r}; expected one of {list(ATTENTION_KERNELS)}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (a checkpoint's model record)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> "HSTUConfig":
        """The inverse of :meth:`to_dict`; ValueError naming what is missing or malformed. A record
        written before the STU variants (no ``stu``) is the ``legacy`` layer's, without dropout."""
        if "max_history" in saved:  # the record of train --task retrieval's encoder (RetrievalConfig)
            raise ValueError("a checkpoint of --task retrieval, not of an HSTU ranking model: resume it with "
                             "--task retrieval")
        try:
            values = dict(saved)
            values["tasks"] = tuple(str(t) for t in values.get("tasks", ("positive",)))
            if "stu" not in values:
                values.update(stu="legacy", dropout=0.0)
            return cls(**values)
        except TypeError as error:
            raise ValueError(f"not an HSTU config ({error})") from None


PRESETS: dict[str, dict[str, Any]] = {
    "hstu": {"stu": "paper", "dropout": 0.2},  # the paper's MovieLens configs: linear_dropout_rate 0.2
}


def preset(name: str, item_rows: int, action_rows: int, **overrides: Any) -> HSTUConfig:
    """The preset ``name`` for a dataset of ``item_rows`` items and ``action_rows`` action codes."""
    if name not in PRESETS:
        raise ValueError(f"unknown HSTU preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(HSTUConfig(item_rows=item_rows, action_rows=action_rows, **PRESETS[name]), **overrides)
