"""What the planner plans: ``EmbeddingTable`` and loaders from files, TorchRec configs and models.

Accepted inputs: YAML/JSON (a list of tables, or ``{"tables": [...]}``), CSV with a header row,
``module:function`` returning an EmbeddingBagCollection, a list of ``EmbeddingBagConfig`` or of
``EmbeddingTable``, and ``sparsecore.specs.TableSpec`` (when that package is importable).
"""

from __future__ import annotations

import csv
import importlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from torchrec_tpu.file_numbers import file_number
from torchrec_tpu.structured_files import brief, read_structured
from torchrec_tpu.zch_names import ZCH_POLICIES
from tpu_facts import COMBINERS, OPTIMIZER_SLOTS
from tpu_facts import MAX_VOCAB as MAX_ROWS

# the dtypes a table's rows are held at (infer / export --table-dtype): bits per element; below 16
# row-wise quantized, each row with an fp16 scale and bias as FBGEMM's inference TBE stores them
DATA_TYPE_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "int8": 8, "int4": 4}
SCALE_BIAS_BYTES = 4
# the dtypes the host holds in FBGEMM's inference TBE, which pads each row to 16 bytes (fp32 stays
# in TorchRec's EmbeddingBagCollection, bf16 in the project's own lookup: unpadded rows)
TBE_ROW_ALIGNMENT, TBE_PADDED_DTYPES = 16, ("fp16", "int8", "int4")


@dataclass(frozen=True)
class EmbeddingTable:
    """One table: ``rows`` x ``dim`` float32, looked up by ``num_features`` features with
    ``pooling_factor`` ids per sample each (mean; 1.0 = single-hot), trained with ``optimizer``,
    its rows held at ``data_type`` (:data:`DATA_TYPE_BITS`; training: fp32); ``zch``: the eviction
    policy of a managed-collision table (raw ids remapped on the host; None: ids taken as rows)."""

    name: str
    rows: int
    dim: int
    pooling_factor: float = 1.0
    optimizer: str = "sgd"
    num_features: int = 1
    combiner: str = "sum"
    max_ids_per_partition: int | None = None  # None: the planner-wide limit
    data_type: str = "fp32"
    zch: str | None = None

    def __post_init__(self) -> None:
        where = f"table {brief(self.name)}"
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"table name must be a non-empty string, got {brief(self.name)}")
        if not isinstance(self.rows, int) or not 1 <= self.rows <= MAX_ROWS:
            raise ValueError(f"{where}: rows must be an int in [1, {MAX_ROWS}], got {brief(self.rows)}")
        if not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"{where}: dim must be a positive int, got {brief(self.dim)}")
        if not (isinstance(self.pooling_factor, (int, float)) and math.isfinite(self.pooling_factor)
                and self.pooling_factor > 0):
            raise ValueError(f"{where}: pooling_factor must be a positive number, got {brief(self.pooling_factor)}")
        if self.optimizer not in OPTIMIZER_SLOTS:
            raise ValueError(f"{where}: optimizer {brief(self.optimizer)} unknown; known: {sorted(OPTIMIZER_SLOTS)}")
        if not isinstance(self.num_features, int) or self.num_features < 1:
            raise ValueError(f"{where}: num_features must be a positive int, got {brief(self.num_features)}")
        if self.data_type not in DATA_TYPE_BITS:
            raise ValueError(f"{where}: data_type must be one of {list(DATA_TYPE_BITS)}, got {brief(self.data_type)}")
        if self.zch is not None and self.zch not in ZCH_POLICIES:
            raise ValueError(f"{where}: zch must be one of {list(ZCH_POLICIES)} or empty, got {brief(self.zch)}")
        if self.combiner not in COMBINERS:
            raise ValueError(f"{where}: combiner must be one of {COMBINERS}, got {brief(self.combiner)}")
        if self.max_ids_per_partition is not None and (
                not isinstance(self.max_ids_per_partition, int) or self.max_ids_per_partition < 1):
            raise ValueError(f"{where}: max_ids_per_partition must be a positive int, "
                             f"got {brief(self.max_ids_per_partition)}")

    @property
    def ids_per_sample(self) -> float:
        return self.pooling_factor * self.num_features


_NUMBER_FIELDS = {"rows": dict(integer=True, positive=True), "dim": dict(integer=True, positive=True),
                  "pooling_factor": dict(positive=True), "num_features": dict(integer=True, positive=True),
                  "max_ids_per_partition": dict(integer=True, positive=True)}
_ALIASES = {"num_embeddings": "rows", "vocab_size": "rows", "embedding_dim": "dim", "pooling": "pooling_factor"}


def table_from_mapping(raw: Any, where: str = "table") -> EmbeddingTable:
    """An ``EmbeddingTable`` from a dict (file row); accepts TorchRec/sparsecore key aliases.
    Errors name ``where``, the table and the key."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected a mapping of table fields (name, rows, dim, ...), "
                         f"got {brief(raw)}")
    data = {_ALIASES.get(k, k): v for k, v in raw.items() if v not in (None, "")}
    known = {f.name for f in fields(EmbeddingTable)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")
    missing = [k for k in ("name", "rows", "dim") if k not in data]
    if missing:
        raise ValueError(f"{where}: missing required keys {missing}")
    where = f"{where} ({brief(data['name'])})"
    typed = {k: file_number(v, f"{where}: {k}", **_NUMBER_FIELDS[k]) if k in _NUMBER_FIELDS else str(v)
             for k, v in data.items()}
    if "optimizer" in typed:
        typed["optimizer"] = typed["optimizer"].lower()
    try:
        return EmbeddingTable(**typed)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def tables_from_configs(configs: Iterable[Any], pooling_factors: Mapping[str, float] | None = None,
                        optimizer: str = "sgd") -> list[EmbeddingTable]:
    """``EmbeddingBagConfig``s (or sparsecore ``TableSpec``s) -> tables. Pooling factors come
    from ``pooling_factors[name]`` (default 1.0) since TorchRec configs do not carry them."""
    pooling_factors = pooling_factors or {}
    out = []
    for cfg in configs:
        if isinstance(cfg, EmbeddingTable):
            out.append(cfg)
            continue
        if hasattr(cfg, "num_embeddings"):  # torchrec EmbeddingBagConfig
            name, table_rows, dim = cfg.name, cfg.num_embeddings, cfg.embedding_dim
            features = max(1, len(getattr(cfg, "feature_names", []) or []))
            combiner = str(getattr(cfg, "pooling", "sum")).split(".")[-1].lower()
            opt = optimizer
        elif hasattr(cfg, "vocab_size"):  # sparsecore.specs.TableSpec
            out.extend(tables_from_sparsecore_specs([cfg], (), pooling_factors))
            continue
        else:
            raise TypeError(f"cannot plan a {type(cfg).__name__}: expected EmbeddingBagConfig, TableSpec or "
                            "EmbeddingTable")
        out.append(EmbeddingTable(name, table_rows, dim, float(pooling_factors.get(name, 1.0)), opt, features,
                                  combiner))
    return out


def tables_from_sparsecore_specs(specs: Iterable[Any], features: Iterable[Any] = (),
                                 pooling_factors: Mapping[str, float] | None = None) -> list[EmbeddingTable]:
    """``sparsecore.specs.TableSpec``s (+ their ``FeatureSpec``s) -> tables. A table's features
    set ``num_features``; a fixed-valency feature's ``max_ids_per_sample`` is its pooling factor
    unless ``pooling_factors`` names the table; the spec's ``max_ids_per_partition`` is kept."""
    pooling_factors = pooling_factors or {}
    by_table: dict[str, list[Any]] = {}
    for f in features:
        by_table.setdefault(f.table, []).append(f)
    out = []
    for spec in specs:
        feats = by_table.get(spec.name, [])
        valencies = [f.max_ids_per_sample for f in feats if f.max_ids_per_sample is not None]
        default_pf = sum(valencies) / len(valencies) if valencies else 1.0
        optimizer = getattr(spec.optimizer, "name", "")
        if optimizer not in OPTIMIZER_SLOTS:
            raise ValueError(f"table {spec.name!r}: sparsecore optimizer {type(spec.optimizer).__name__} has no "
                             f"planner equivalent; known: {sorted(OPTIMIZER_SLOTS)}")
        out.append(EmbeddingTable(spec.name, spec.vocab_size, spec.dim,
                                  float(pooling_factors.get(spec.name, default_pf)), optimizer,
                                  max(1, len(feats)), spec.combiner, spec.max_ids_per_partition))
    return out


def load_tables_file(path: str | Path) -> list[EmbeddingTable]:
    """Tables from a .yaml/.yml/.json/.csv file (one row or entry per table)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tables file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        with path.open(newline="") as f:
            try:
                rows: list[Any] = list(csv.DictReader(f))
            except (csv.Error, UnicodeDecodeError) as error:  # a field over csv's size limit, binary bytes
                raise ValueError(f"{path}: malformed CSV: {error}") from None
    elif suffix in (".yaml", ".yml", ".json"):
        data = read_structured(path)
        rows = data.get("tables") if isinstance(data, dict) else data
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a list of tables or a mapping with a 'tables' list")
    else:
        raise ValueError(f"{path}: unsupported tables file type {suffix!r}; use .yaml, .json or .csv")
    tables = [table_from_mapping(row, f"{path}: entry {i}") for i, row in enumerate(rows)]
    _require_unique_names(tables)
    return tables


def load_tables_from_python(target: str, pooling_factors: Mapping[str, float] | None = None,
                            optimizer: str = "sgd") -> list[EmbeddingTable]:
    """``"package.module:function"``: call it; it returns an EmbeddingBagCollection or a list of
    EmbeddingBagConfig / TableSpec / EmbeddingTable."""
    module_name, _, func_name = target.partition(":")
    if not module_name or not func_name:
        raise ValueError(f"python model target must look like 'package.module:function', got {target!r}")
    func = getattr(importlib.import_module(module_name), func_name, None)
    if not callable(func):
        raise ValueError(f"{target}: {func_name!r} is not a callable in module {module_name!r}")
    result = func()
    configs = result.embedding_bag_configs() if hasattr(result, "embedding_bag_configs") else result
    tables = tables_from_configs(list(configs), pooling_factors, optimizer)
    _require_unique_names(tables)
    return tables


def load_tables(source: str, pooling_factors: Mapping[str, float] | None = None,
                optimizer: str = "sgd") -> list[EmbeddingTable]:
    """A tables file path, or ``module:function`` (see module docstring). ``pooling_factors``
    override per-table pooling for files too."""
    if ":" in source and not Path(source).exists() and Path(source).suffix.lower() not in (".yaml", ".yml", ".json",
                                                                                           ".csv"):
        return load_tables_from_python(source, pooling_factors, optimizer)
    tables = load_tables_file(source)
    unknown = sorted(set(pooling_factors or {}) - {t.name for t in tables})
    if unknown:
        raise ValueError(f"pooling factors given for unknown tables {unknown}")
    return [replace(t, pooling_factor=float(pooling_factors[t.name])) if t.name in (pooling_factors or {}) else t
            for t in tables]


def _require_unique_names(tables: list[EmbeddingTable]) -> None:
    seen: set[str] = set()
    for t in tables:
        if t.name in seen:
            raise ValueError(f"duplicate table name {t.name!r}")
        seen.add(t.name)
