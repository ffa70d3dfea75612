"""Interaction logs as one table of events: who (``user``), what (``item``), how (``action``, a
small integer code), when (``timestamp``, integer) and each task's label, as read from a source."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Events:
    """Parallel int64 arrays ``user``, ``item``, ``action``, ``timestamp`` and one float32 array
    per task in ``labels`` (any order); ``action_rows``: the action codes' vocabulary size."""

    user: np.ndarray
    item: np.ndarray
    action: np.ndarray
    timestamp: np.ndarray
    labels: Mapping[str, np.ndarray]
    action_rows: int
    source: str

    def __post_init__(self) -> None:
        n = self.user.shape[0]
        arrays = {"item": self.item, "action": self.action, "timestamp": self.timestamp, **self.labels}
        for name, array in arrays.items():
            if array.shape != (n,):
                raise ValueError(f"{self.source} events: column {name!r} has shape {array.shape}, expected ({n},)")
        if not self.labels:
            raise ValueError(f"{self.source} events: no label column (name at least one task)")
        for name in ("user", "item", "action"):
            array = getattr(self, name)
            if n and array.min() < 0:
                raise ValueError(f"{self.source} events: negative {name} id {int(array.min())}")
        if n and self.action.max() >= self.action_rows:
            raise ValueError(f"{self.source} events: action code {int(self.action.max())} outside "
                             f"[0, {self.action_rows})")

    def __len__(self) -> int:
        return int(self.user.shape[0])
