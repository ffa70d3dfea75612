"""Synthetic Criteo-like click logs in the Parquet layout of ``pipelines.schema``.

Generative model (per row; every draw is vectorized over a row group and seeded by
``(seed, row group index)``, so the same config gives byte-identical files):

* Categorical feature k with table size N_k: the popularity rank r is drawn from a bounded Zipf
  law ``P(r) = (r + 1)^-s / H(N_k, s)`` (``zipf_exponent`` s); the stored id is
  ``(a_k * r + b_k) mod N_k`` with ``gcd(a_k, N_k) = 1``, a bijection, so ids lie in
  ``[0, N_k)`` and the most popular ids are scattered over the table. A value is missing (null)
  with the feature's missing rate. A multi-hot feature holds ``1 + Poisson(mean - 1)`` ids (at most
  ``multi_hot_max_length``), each drawn as above; a missing one is an empty list.
* Dense feature j: ``x = max(floor(exp(N(log(1 + m_j), dense_sigma))) - 1, 0)``, a heavy-tailed count with
  median about m_j (Criteo-like medians), missing with the column's missing rate.
* Label: ``Bernoulli(sigmoid(z))`` with
  ``z = intercept + dense_weight * sum_j std(log1p(x_j)) + sum_k effect_k[id_k]`` over the
  ``signal_dense`` and ``signal_sparse`` features, where ``std`` standardises the reader's
  transform and ``effect_k`` is a hidden N(0, effect_scale^2) value per id (a multi-hot bag uses the
  mean over its ids); missing features contribute 0. The intercept is calibrated so that about
  ``base_click_rate`` of the rows are clicks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa

from pipelines.dataset_dir import staged_dataset
from pipelines.parquet_writer import ParquetShardWriter
from pipelines.progress import progress_bar
from pipelines.schema import CRITEO, DatasetSchema, criteo_schema
from tpu_facts import knobs

GENERATOR_VERSION = 1

# MLPerf DLRM-DCNv2 (Criteo 1TB) table sizes, C1..C26.
MLPERF_DCNV2_CARDINALITIES: tuple[int, ...] = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
    11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)
# Approximate missing-value rates of Criteo Kaggle (I1..I13, then C1..C26).
CRITEO_DENSE_MISSING_RATES: tuple[float, ...] = (
    0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0005, 0.04, 0.45, 0.04, 0.77, 0.22,
)
CRITEO_SPARSE_MISSING_RATES: tuple[float, ...] = (
    0.0, 0.0, 0.03, 0.03, 0.0, 0.12, 0.0, 0.0, 0.0, 0.0, 0.0, 0.03, 0.0, 0.0, 0.0, 0.03, 0.0,
    0.0, 0.44, 0.44, 0.03, 0.76, 0.0, 0.03, 0.44, 0.44,
)
# Approximate medians of the raw Criteo Kaggle dense counts, I1..I13.
CRITEO_DENSE_MEDIANS: tuple[float, ...] = (1, 3, 7, 4, 2800, 33, 3, 7, 37, 1, 1, 0, 4)


@dataclass(frozen=True)
class SyntheticConfig:
    """Everything that determines a synthetic dataset (its cache key hashes all of it)."""

    num_rows: int = 1_000_000
    seed: int = 0
    cardinalities: tuple[int, ...] = MLPERF_DCNV2_CARDINALITIES
    max_cardinality: int = 100_000  # each table size is min(cardinality, max_cardinality)
    zipf_exponent: float = 1.05
    dense_missing_rates: tuple[float, ...] = CRITEO_DENSE_MISSING_RATES
    sparse_missing_rates: tuple[float, ...] = CRITEO_SPARSE_MISSING_RATES
    dense_medians: tuple[float, ...] = CRITEO_DENSE_MEDIANS
    dense_sigma: float = 1.2
    multi_hot: tuple[str, ...] = ()
    multi_hot_mean_length: float = 3.0
    multi_hot_max_length: int = 8
    multi_hot_sizes: tuple[int, ...] = ()  # MLPerf DLRM-DCNv2: exactly k ids per row (k > 1: multi-hot)
    # drifting vocabularies: every id moves up by vocabulary_drift * table size over the dataset's rows,
    # so new ids appear and old ones fade (each keeps its own hidden effect); 0: a fixed vocabulary
    vocabulary_drift: float = 0.0
    signal_dense: tuple[str, ...] = ("I2", "I5", "I7")
    signal_sparse: tuple[str, ...] = ("C2", "C6", "C9", "C14")
    dense_weight: float = 0.4
    effect_scale: float = 1.0
    base_click_rate: float = 0.25
    rows_per_file: int = 1 << 18
    row_group_size: int = 1 << 16

    def __post_init__(self) -> None:
        schema = self.schema  # validates the multi-hot names
        lengths = {
            "cardinalities": (self.cardinalities, len(schema.sparse)),
            "sparse_missing_rates": (self.sparse_missing_rates, len(schema.sparse)),
            "dense_missing_rates": (self.dense_missing_rates, len(schema.dense)),
            "dense_medians": (self.dense_medians, len(schema.dense)),
        }
        for name, (values, expected) in lengths.items():
            if len(values) != expected:
                raise ValueError(f"{name} needs {expected} values, got {len(values)}")
        rates = (*self.dense_missing_rates, *self.sparse_missing_rates)
        if any(not 0.0 <= rate < 1.0 for rate in rates):
            raise ValueError(f"missing rates must lie in [0, 1), got {rates}")
        if self.num_rows < 0 or min(self.cardinalities) <= 0 or self.max_cardinality <= 0:
            raise ValueError("num_rows must be >= 0 and cardinalities, max_cardinality > 0")
        if self.zipf_exponent < 0:
            raise ValueError(f"zipf_exponent must be >= 0, got {self.zipf_exponent}")
        if not 0.0 <= self.vocabulary_drift <= 1000.0:
            raise ValueError(f"vocabulary_drift must lie in [0, 1000], got {self.vocabulary_drift}")
        if not 0.0 < self.base_click_rate < 1.0:
            raise ValueError(f"base_click_rate must lie in (0, 1), got {self.base_click_rate}")
        if self.multi_hot_sizes and (len(self.multi_hot_sizes) != len(schema.sparse)
                                     or min(self.multi_hot_sizes) < 1):
            raise ValueError(f"multi_hot_sizes needs {len(schema.sparse)} sizes >= 1, got {self.multi_hot_sizes}")
        if self.multi_hot and not 1 <= self.multi_hot_mean_length <= self.multi_hot_max_length:
            raise ValueError("need 1 <= multi_hot_mean_length <= multi_hot_max_length")
        for names, allowed in ((self.signal_dense, schema.dense), (self.signal_sparse, schema.sparse)):
            unknown = [name for name in names if name not in allowed]
            if unknown:
                raise ValueError(f"signal features {unknown} are not among the columns {allowed}")

    @property
    def schema(self) -> DatasetSchema:
        fixed = {name for name, k in zip(CRITEO.sparse, self.multi_hot_sizes) if k > 1}
        return criteo_schema(frozenset(self.multi_hot) | fixed)

    @property
    def table_sizes(self) -> tuple[int, ...]:
        """Per-categorical table size: ids are generated in ``[0, size)`` (drifting: ``[0, size *
        (1 + vocabulary_drift))``, ``size`` of them live at any row)."""
        return tuple(min(c, self.max_cardinality) for c in self.cardinalities)

    def cache_key(self) -> str:
        """A digest of the config and the generator version."""
        fields = dataclasses.asdict(self)
        for name in ("multi_hot_sizes", "vocabulary_drift"):  # keep the keys of datasets made before them
            if not fields[name]:
                del fields[name]
        payload = json.dumps([GENERATOR_VERSION, fields], sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


class _Feature:
    """Id sampler and hidden per-id effects of one categorical feature."""

    def __init__(self, size: int, exponent: float, rng: np.random.Generator, signal: bool, drift: float = 0.0) -> None:
        self.size = size
        self.drift = int(math.ceil(drift * size))  # how far the ids move over the dataset
        weights = np.arange(1, size + 1, dtype=np.float64) ** -exponent
        self.cdf = np.cumsum(weights)
        self.cdf /= self.cdf[-1]
        self.stride = int(rng.integers(1, size + 1))
        while math.gcd(self.stride, size) != 1:
            self.stride += 1
        self.shift = int(rng.integers(0, size))
        self.effects = rng.normal(0.0, 1.0, size + self.drift) if signal else None

    def sample(self, rng: np.random.Generator, count: int, progress: np.ndarray | float = 0.0) -> np.ndarray:
        """``count`` ids; ``progress``: where in the dataset each falls (0 first row, 1 past the last)."""
        ranks = np.minimum(np.searchsorted(self.cdf, rng.random(count), side="right"), self.size - 1)
        ids = (ranks * self.stride + self.shift) % self.size
        return ids + np.floor(np.asarray(progress) * self.drift).astype(np.int64) if self.drift else ids


class SyntheticGenerator:
    """Generates the row groups of a :class:`SyntheticConfig` as Arrow record batches."""

    def __init__(self, config: SyntheticConfig) -> None:
        self.config = config
        self.schema = config.schema
        self.arrow_schema = self.schema.arrow_schema()
        setup = np.random.default_rng(np.random.SeedSequence([config.seed, 0]))
        self.features = [
            _Feature(size, config.zipf_exponent, setup, name in config.signal_sparse, config.vocabulary_drift)
            for name, size in zip(self.schema.sparse, config.table_sizes)
        ]
        # Log-space location of each dense column; the standardised transform uses the same.
        self.dense_mu = np.log1p(np.asarray(config.dense_medians, dtype=np.float64))
        self.intercept = self._calibrated_intercept()

    def _calibrated_intercept(self) -> float:
        """Intercept giving about ``base_click_rate`` clicks, by the probit approximation
        ``E[sigmoid(a + X)] ~ sigmoid(a / sqrt(1 + pi var(X) / 8))`` for the signal X."""
        config, schema = self.config, self.schema
        variance = sum(
            config.dense_weight**2 * (1.0 - config.dense_missing_rates[schema.dense.index(name)])
            for name in config.signal_dense
        ) + sum(
            config.effect_scale**2 * (1.0 - config.sparse_missing_rates[schema.sparse.index(name)])
            for name in config.signal_sparse
        )
        base_logit = math.log(config.base_click_rate / (1.0 - config.base_click_rate))
        return base_logit * math.sqrt(1.0 + math.pi * variance / 8.0)

    @property
    def num_row_groups(self) -> int:
        return -(-self.config.num_rows // self.config.row_group_size)

    def row_groups(self) -> Iterator[pa.RecordBatch]:
        for index in range(self.num_row_groups):
            start = index * self.config.row_group_size
            yield self.row_group(index, min(self.config.row_group_size, self.config.num_rows - start))

    def row_group(self, index: int, rows: int) -> pa.RecordBatch:
        rng = np.random.default_rng(np.random.SeedSequence([self.config.seed, 1, index]))
        logit = np.full(rows, self.intercept)
        dense_columns = [self._dense(rng, j, rows, logit) for j in range(len(self.schema.dense))]
        progress = (index * self.config.row_group_size + np.arange(rows)) / max(self.config.num_rows, 1)
        sparse_columns = [self._sparse(rng, k, rows, logit, progress) for k in range(len(self.schema.sparse))]
        labels = (rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int8)
        return pa.RecordBatch.from_arrays(
            [pa.array(labels), *dense_columns, *sparse_columns], schema=self.arrow_schema
        )

    def _dense(self, rng: np.random.Generator, j: int, rows: int, logit: np.ndarray) -> pa.Array:
        config, name = self.config, self.schema.dense[j]
        log_values = rng.normal(self.dense_mu[j], config.dense_sigma, rows)
        values = np.maximum(np.floor(np.exp(log_values)).astype(np.int64) - 1, 0)
        missing = rng.random(rows) < config.dense_missing_rates[j]
        if name in config.signal_dense:
            standardised = (np.log1p(values) - self.dense_mu[j]) / config.dense_sigma
            logit += np.where(missing, 0.0, config.dense_weight * standardised)
        return pa.array(values, mask=missing)

    def _sparse(self, rng: np.random.Generator, k: int, rows: int, logit: np.ndarray,
                progress: np.ndarray) -> pa.Array:
        config, feature, name = self.config, self.features[k], self.schema.sparse[k]
        missing = rng.random(rows) < config.sparse_missing_rates[k]
        if not self.schema.is_multi_hot(name):
            ids = feature.sample(rng, rows, progress)
            if feature.effects is not None:
                logit += np.where(missing, 0.0, config.effect_scale * feature.effects[ids])
            return pa.array(ids, mask=missing)
        fixed = config.multi_hot_sizes[k] if config.multi_hot_sizes else 1
        if fixed > 1:
            lengths = np.where(missing, 0, fixed)
        else:
            lengths = 1 + rng.poisson(config.multi_hot_mean_length - 1.0, rows)
            lengths = np.where(missing, 0, np.minimum(lengths, config.multi_hot_max_length))
        ids = feature.sample(rng, int(lengths.sum()), np.repeat(progress, lengths))
        if feature.effects is not None:
            bag_sums = np.bincount(
                np.repeat(np.arange(rows), lengths), weights=feature.effects[ids], minlength=rows
            )
            logit += config.effect_scale * bag_sums / np.maximum(lengths, 1)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids, type=pa.int64()))


def generate(config: SyntheticConfig, output_dir: str | Path, progress: bool = True) -> list[Path]:
    """Writes the dataset of ``config`` as Parquet files under ``output_dir`` (absent or empty),
    published atomically (:mod:`pipelines.dataset_dir`)."""
    generator = SyntheticGenerator(config)
    with staged_dataset(output_dir) as staged, ParquetShardWriter(
        staged.path, generator.arrow_schema, config.rows_per_file, config.row_group_size
    ) as writer:
        for batch in progress_bar(
            generator.row_groups(),
            total=generator.num_row_groups,
            unit="row group",
            desc="generate",
            enabled=progress,
        ):
            writer.write(batch)
    return staged.files


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$TORCHREC_TPU_CACHE``, else ``~/.cache/torchrec_tpu``."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(knobs.DATA_CACHE.value() or Path.home() / ".cache" / "torchrec_tpu")


def default_dataset(
    cache_dir: str | Path | None = None,
    config: SyntheticConfig = SyntheticConfig(),
    progress: bool = True,
) -> Path:
    """The directory of the synthetic dataset of ``config``, generated on first use.

    The directory is named by the config's cache key, so a config change generates a new
    dataset; it is generated in a temporary directory and renamed into place, so a killed run
    leaves nothing that a later call would take for a finished dataset.
    """
    root = cache_root(cache_dir) / "synthetic"
    target = root / f"criteo-{config.cache_key()}"
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        generate(config, staging, progress=progress)
        # The "_" prefix keeps the provenance file out of pyarrow datasets of the directory.
        (staging / "_config.json").write_text(json.dumps(dataclasses.asdict(config), indent=1))
        os.rename(staging, target)
    except OSError:
        if not target.is_dir():  # another process finishing first is fine; anything else is not
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
