"""The FDO stats of a training run: per stacked table, the most ids and unique ids one partition
got in a step, and the limits in effect. ``train --fdo`` writes them (a JSON file and the
checkpoint's ``meta.json``); ``plan --fdo-stats``, a resume and ``infer`` read them back.

The JSON form (docs/ID_LIMITS.md)::

    {"format": "torchrec-tpu fdo stats", "version": 1, "steps": 40,
     "stacks": {"<stack>": {"tables": ["t_C1", ...],
                            "max_ids_per_partition": 231, "max_unique_ids_per_partition": 198,
                            "limits": [231, 198]}}}

``max_*`` are the observed maxima over every step recorded (all ranks); ``limits`` (ids, unique
ids) are the stack's partition limits after the last tuning: never below the observed maxima
once a boundary has raised them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT, VERSION = "torchrec-tpu fdo stats", 1


class FdoStatsError(ValueError):
    """A stats file or record that is not FDO stats; the message names the source, the field and the value."""


@dataclass(frozen=True)
class StackRecord:
    """One stack: its tables (row order), observed maxima and its (ids, unique ids) limits."""

    tables: tuple[str, ...]
    max_ids: int
    max_unique_ids: int
    limits: tuple[int, int]

    def observed(self, max_ids: int, max_unique_ids: int) -> StackRecord:
        """This record with a step's maxima merged in (element-wise max)."""
        return StackRecord(self.tables, max(self.max_ids, max_ids), max(self.max_unique_ids, max_unique_ids),
                           self.limits)

    @property
    def exceeded(self) -> bool:
        return self.max_ids > self.limits[0] or self.max_unique_ids > self.limits[1]

    def raised(self) -> StackRecord:
        """Limits raised to the observed maxima where these exceed them (never lowered)."""
        return StackRecord(self.tables, self.max_ids, self.max_unique_ids,
                           (max(self.limits[0], self.max_ids), max(self.limits[1], self.max_unique_ids)))


@dataclass(frozen=True)
class FdoStats:
    """Every stack's record and the steps they cover."""

    steps: int = 0
    stacks: dict[str, StackRecord] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "steps": self.steps,
                "stacks": {name: {"tables": list(r.tables), "max_ids_per_partition": r.max_ids,
                                  "max_unique_ids_per_partition": r.max_unique_ids, "limits": list(r.limits)}
                           for name, r in self.stacks.items()}}

    def write(self, path: Path) -> None:
        """Written whole or not at all (a temporary file renamed)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        partial.replace(path)

    def table_limits(self) -> dict[str, int]:
        """Per table, the ids limit of its stack (a bound on any one table's share of it)."""
        return {table: r.limits[0] for r in self.stacks.values() for table in r.tables}

    def table_shares(self) -> dict[str, tuple[int, int]]:
        """Per table, an equal share of its stack's (ids, unique ids) limits: the shares of a stack
        sum to at least its limits, as a build stacks tables (``StackingPlan.with_table_limits``)."""
        return {table: (-(-r.limits[0] // len(r.tables)), -(-r.limits[1] // len(r.tables)))
                for r in self.stacks.values() for table in r.tables}

    @classmethod
    def from_json(cls, data: Any, source: str) -> FdoStats:
        """Checked: FdoStatsError naming ``source`` and the first bad field."""
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise FdoStatsError(f"{source}: not FDO stats (no \"format\": {FORMAT!r}; train --fdo writes them)")
        if data.get("version") != VERSION:
            raise FdoStatsError(f"{source}: FDO stats version {data.get('version')!r}; this version reads {VERSION}")
        steps = _count(data.get("steps"), f"{source}: \"steps\"", minimum=0)
        stacks = data.get("stacks")
        if not isinstance(stacks, Mapping) or not stacks:
            raise FdoStatsError(f"{source}: \"stacks\" must be a non-empty object of stack records, got {stacks!r:.80}")
        return cls(steps, {str(name): _record(value, f"{source}: stack {name!r}") for name, value in stacks.items()})


def read_stats(path: Path, what: str) -> FdoStats:
    """The stats in ``path``; ``what`` names where the path came from (``--fdo-stats``) in errors."""
    source = f"{what} {path}"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FdoStatsError(f"{source}: no such file") from None
    except OSError as error:
        raise FdoStatsError(f"{source}: cannot be read ({error.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise FdoStatsError(f"{source}: not JSON ({error.msg} at line {error.lineno})") from None
    return FdoStats.from_json(data, source)


def _record(value: Any, where: str) -> StackRecord:
    if not isinstance(value, Mapping):
        raise FdoStatsError(f"{where}: must be an object, got {value!r:.80}")
    tables = value.get("tables")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, str) and t for t in tables):
        raise FdoStatsError(f"{where}: \"tables\" must be a non-empty list of table names, got {tables!r:.80}")
    limits = value.get("limits")
    if not isinstance(limits, list) or len(limits) != 2:
        raise FdoStatsError(f"{where}: \"limits\" must be [ids, unique ids], got {limits!r:.80}")
    return StackRecord(tuple(tables), _count(value.get("max_ids_per_partition"), f"{where}: max_ids_per_partition"),
                       _count(value.get("max_unique_ids_per_partition"), f"{where}: max_unique_ids_per_partition"),
                       (_count(limits[0], f"{where}: limits[0]", 1), _count(limits[1], f"{where}: limits[1]", 1)))


def _count(value: Any, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise FdoStatsError(f"{where} must be an integer >= {minimum}, got {value!r:.80}")
    return value
