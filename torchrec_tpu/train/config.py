"""Training configuration: nested frozen groups, exposed as flat CLI flags and YAML keys.

:class:`TrainConfig` holds six groups (``model``, ``data``, ``engine``, ``optim``, ``checkpoint``,
``loop``); every field of a group is one option, a flag (``embedding_dim`` -> ``--embedding-dim``)
and a YAML key (either spelling), named as before the grouping (``--model``, ``--engine`` and
``--data`` are the ``kind`` / ``source`` fields of their groups). Precedence: built-in defaults <
``--config file.yaml`` < explicit flags; :meth:`TrainConfig.from_options` builds a config from
option names (flags, YAML, a checkpoint's ``meta.json``). All validation lives in
:meth:`TrainConfig.validate`, so a bad value gives the same clear error whichever way it arrived.
No heavy imports here: ``--help`` must stay fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, get_args

from pipelines.bad_value_policies import POLICIES as BAD_VALUE_POLICIES
from sparsecore.backends import XLA, BackendName
from torchrec_tpu.cli_help import NOTES, refusals
from torchrec_tpu.structured_files import brief, read_structured
from torchrec_tpu.suggest import close_match, did_you_mean
from torchrec_tpu.train.dlrm_main_flags import add_dlrm_main_flags, per_rank_options
from torchrec_tpu.train.engine_kinds import ENGINES
from torchrec_tpu.train.model_kinds import MODEL_KINDS, TASK_KINDS, TASKS, ModelKind, model_kind
from torchrec_tpu.train.optimizers import DENSE_OPTIMIZERS, SPARSE_OPTIMIZERS
from torchrec_tpu.train.spellings import conflicting_spellings, record_spellings
from torchrec_tpu.zch_names import ZCH_POLICIES

_log = logging.getLogger(__name__)

# The option vocabularies that are defined here (the others come from their registries above).
Model = str  # a name of torchrec_tpu.train.model_kinds.MODEL_KINDS
HSTU_MODELS = tuple(m.name for m in MODEL_KINDS.values() if m.sequences)  # the models of sequence datasets
Precision = Literal["fp32", "bf16"]  # --precision: the towers' matmuls (engines.precision)
Stu = Literal["auto", "paper", "dlrmv3", "legacy"]  # --stu: HSTU's STU layer (torchrec_tpu.hstu.layers)
DenseDevice = Literal["auto", "cpu", "tpu"]
DenseParallel = Literal["ddp", "fsdp2"]
MLPerfDivision = Literal["closed", "open"]  # --mllog-division (MLCommons' submission divisions)
MLPerfStatus = Literal["onprem", "cloud", "research"]  # --mllog-status (mlperf_logging's submission statuses)
# sparsecore.backends' names, and auto: the CLI's choice, resolved to one of them at start (engines.step_layout)
SparseBackend = Literal["auto", BackendName]
MODELS, PRECISIONS, DENSE_DEVICES, DENSE_PARALLELS, SPARSE_BACKENDS = (
    tuple(MODEL_KINDS), get_args(Precision), get_args(DenseDevice), get_args(DenseParallel), get_args(SparseBackend))
STUS = get_args(Stu)
RANDOM_NEGATIVES = 128  # --random-negatives: the paper's MovieLens configs (num_negatives, local sampler)
MLPERF_DIVISIONS, MLPERF_STATUSES = get_args(MLPerfDivision), get_args(MLPerfStatus)
# --id-overflow: sparsecore.limits' policies, and auto (minibatch where the backend runs it, else error)
ID_OVERFLOW_POLICIES = ("auto", "minibatch", "error", "drop")


class ConfigError(ValueError):
    """A training option has a bad value; the message names the option, the value and the limit."""


def _opt(default: Any, text: str, *, flag: str | None = None, choices: tuple[str, ...] | None = None,
         metavar: str | None = None, aliases: tuple[str, ...] = ()) -> Any:
    """A group field that is one option, explained once in ``text``: its first sentence is the
    ``--help`` line, the whole text the option's row in docs/TRAINING_OPTIONS.md; ``flag``: its
    option name when not the field's."""
    extra = {k: v for k, v in (("flag", flag), ("choices", choices), ("metavar", metavar)) if v is not None}
    return field(default=default, metadata={"help": first_sentence(text), "details": text, "aliases": aliases,
                                            **extra})


def first_sentence(text: str) -> str:
    """``text`` up to its first ". " outside parentheses (so "(e.g. ...)" does not end it), else all of it."""
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "." and depth == 0 and text[i + 1:i + 2] == " ":
            return text[:i]
    return text


@dataclass(frozen=True)
class Shorthand:
    """A flag (and YAML key) of TorchRec's dlrm_main / MLPerf DLRM setting several of our options:
    ``targets`` to its value, ``implies`` where no flag or key sets them (an option given beats it,
    whatever the order)."""

    targets: tuple[str, ...]
    kind: type
    help: str
    implies: Mapping[str, Any] = field(default_factory=dict)


SHORTHANDS: dict[str, Shorthand] = {
    "learning_rate": Shorthand(
        ("sparse_lr", "dense_lr"), float,
        "sets --sparse-lr and --dense-lr, and SGD for both optimizers unless --adagrad or --sparse-optimizer / "
        "--dense-optimizer say otherwise (TorchRec dlrm_main's --learning_rate: SGD without --adagrad); "
        "--sparse-lr/--dense-lr given too override it (default: their own defaults)",
        implies={"sparse_optimizer": "sgd", "dense_optimizer": "sgd"}),
}


class _Group:
    """A config group: it checks its own options when built (:meth:`validate`)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad option of this group, its value and the limit."""


@dataclass(frozen=True)
class ModelConfig(_Group):
    """The architecture: DLRM kind, tables, towers."""

    kind: Model = _opt("dlrm", "model: torchrec DLRM or DLRM_DCN; HSTU (the 2024 paper's); MLPerf's DLRMv4. Each "
                               "model has its defaults where neither a flag nor --config sets the option (hstu: "
                               "--batch-size 128, --dense-lr 0.003, --epochs 2; dlrmv4: --precision bf16) "
                               "and refuses the options it does not read (torchrec_tpu/train/model_kinds.py).",
                       flag="model", choices=MODELS)
    num_embeddings: int = _opt(
        100_000, "rows per embedding table, at most; ids are hashed modulo the table size. Synthetic tables with "
                 "fewer ids are smaller.")
    num_embeddings_per_feature: str | None = _opt(
        None, "rows of each feature's table, comma-separated (default: --num-embeddings for each). One value per "
              "categorical feature, as TorchRec dlrm_main's flag; ids are hashed modulo each.",
        metavar="N,N,...")
    embedding_dim: int = _opt(16, "embedding dimension of every table")
    dense_arch: str = _opt("64,16", "dense MLP layer sizes; the last must equal --embedding-dim", metavar="SIZES")
    over_arch: str = _opt("64,32,1", "over-arch MLP layer sizes; the last must be 1", metavar="SIZES")
    dcn_num_layers: int = _opt(3, "DCN cross layers (dlrm_dcn only)")
    dcn_low_rank_dim: int = _opt(16, "DCN low rank (dlrm_dcn only)")
    stu: Stu = _opt("auto", "HSTU's STU layer: paper (the 2024 paper's code) or dlrmv3 (MLPerf DLRMv4's). Only "
                            "for --model hstu (--model dlrmv4 has MLPerf's, dlrmv3). auto: paper; legacy: this "
                            "project's first layer, to resume a checkpoint written before the variants. "
                            "docs/HSTU.md compares them.", choices=STUS)
    task: str = _opt("ranking", "what the model learns: ranking (candidates' AUC, NE) or retrieval (--model hstu). "
                                "retrieval is the HSTU paper's next-item task: sampled softmax, then HR@K, NDCG@K "
                                "and MRR over all items (docs/HSTU.md); its defaults are --batch-size 128, --dense-lr "
                                "0.001, --epochs 2, and it refuses the options it does not read.", choices=TASKS)
    random_negatives: int = _opt(RANDOM_NEGATIVES, "--task retrieval: sampled softmax negatives from all items. "
                                                   "Drawn uniformly (the paper's MovieLens configs: 128).", metavar="N")
    in_batch_negatives: int = _opt(0, "--task retrieval: sampled softmax negatives from the batch's items. Drawn "
                                      "uniformly from its distinct items (the paper's in-batch sampler).", metavar="N")

    @property
    def dense_layers(self) -> list[int]:
        return _layer_sizes("dense_arch", self.dense_arch)

    @property
    def over_layers(self) -> list[int]:
        return _layer_sizes("over_arch", self.over_arch)

    def validate(self) -> None:
        _check_group(self, at_least_1=("num_embeddings", "embedding_dim", "dcn_num_layers", "dcn_low_rank_dim"))
        if self.num_embeddings_per_feature is not None:
            _positive_ints("num_embeddings_per_feature", self.num_embeddings_per_feature)
        _check_group(self, at_least_0=("random_negatives", "in_batch_negatives"))
        if model_kind(self.kind, self.task) is None and self.kind in MODEL_KINDS:
            raise ConfigError(task_refusal(self.kind, self.task))
        if self.task == "retrieval" and self.random_negatives + self.in_batch_negatives < 1:
            raise ConfigError(f"--random-negatives {self.random_negatives} and --in-batch-negatives "
                              f"{self.in_batch_negatives}: the sampled softmax needs at least one negative")
        if self.kind in HSTU_MODELS:  # DLRM's shape rules: HSTU refuses these options by name instead
            return
        if (self.random_negatives, self.in_batch_negatives) != (RANDOM_NEGATIVES, 0):
            raise ConfigError("--random-negatives/--in-batch-negatives are for --task retrieval (--model hstu)")
        if self.stu != "auto":
            raise ConfigError(f"--stu {self.stu}: --model {self.kind} has no STU layer (--stu is for hstu)")
        if self.dense_layers[-1] != self.embedding_dim:
            raise ConfigError(f"--dense-arch={self.dense_arch!r} must end in --embedding-dim ({self.embedding_dim}): "
                              "the dense output is interacted with the embeddings")
        if self.over_layers[-1] != 1:
            raise ConfigError(f"--over-arch={self.over_arch!r} must end in 1 (one logit)")


@dataclass(frozen=True)
class DataConfig(_Group):
    """Where the rows come from and how they are batched."""

    source: str = _opt(
        "synthetic", "'synthetic', 'sample' (200 real Criteo rows) or a directory of Parquet files. 'synthetic' is "
                     "generated into --cache-dir on first run; 'sample' is converted on the fly.",
        flag="data", metavar="SOURCE")
    cache_dir: str | None = _opt(None, "where synthetic data is generated (default: $TORCHREC_TPU_CACHE, else "
                                       "~/.cache/torchrec_tpu)")
    bad_values: str = _opt(
        "error", "rows with a label outside [0, 1] or an infinite dense value: error, skip or clamp. A NaN label "
                 "is bad too, and so is a dense value beyond float32 (NaN dense values are missing, read as 0): "
                 "error names file, row and column; skip drops the rows (counted); clamp clamps the values "
                 "(labels to [0, 1], dense to +-3.4e38; a NaN label's row is skipped).",
        choices=BAD_VALUE_POLICIES)
    eval_files: int = _opt(
        1, "hold out the last N Parquet files (or days) for evaluation; from 2 on, validation + test. From 2 on "
           "they are halved, as TorchRec's DLRM: the test AUC comes at the end.")
    in_memory_binary_criteo_path: str | None = _opt(
        None, "TorchRec's preprocessed Criteo .npy days to train on (default: use --data). A directory of "
              "day_<d>_{dense,sparse,labels}.npy (torchrec/datasets/scripts/npy_preproc_criteo.py), read instead "
              "of --data; the last --eval-files days are held out.",
        metavar="DIR")
    mmap_mode: bool = _opt(
        False, "with --in-memory-binary-criteo-path: memory-map the .npy files instead of loading them")
    multi_hot_sizes: str | None = _opt(
        None, "MLPerf DLRM-DCNv2 multi-hot: ids per feature, comma-separated (default: one-hot). Each feature's id "
              "is expanded into this many ids (one value per feature, or one for all): the id itself, then fixed "
              "random offsets of it.",
        metavar="K,K,...")
    batch_size: int = _opt(
        512, "GLOBAL training batch size, split over the ranks. Summed over all ranks: each rank trains on "
             "batch-size / world-size rows per step.")
    eval_batch_size: int = _opt(2048, "GLOBAL evaluation batch size (split over the ranks)")
    shuffle_batches: bool = _opt(
        False, "shuffle the training batches' order, anew each epoch (TorchRec's --shuffle-batches). Seeded by "
               "--seed and the epoch.")
    limit_train_batches: int = _opt(0, "train on at most N batches per epoch (0: all)")
    limit_val_batches: int = _opt(0, "evaluate on at most N held-out batches (0: all)")

    def validate(self) -> None:
        _check_group(self, at_least_1=("batch_size", "eval_batch_size", "eval_files"),
                     at_least_0=("limit_train_batches", "limit_val_batches"))
        if self.multi_hot_sizes is not None:
            _positive_ints("multi_hot_sizes", self.multi_hot_sizes)
        if self.mmap_mode and self.in_memory_binary_criteo_path is None:
            raise ConfigError("--mmap-mode needs --in-memory-binary-criteo-path")
        if self.in_memory_binary_criteo_path is not None and self.bad_values != "error":
            raise ConfigError(f"--bad-values={self.bad_values!r} does not apply to --in-memory-binary-criteo-path "
                              "(TorchRec's preprocessed values are used as stored)")


@dataclass(frozen=True)
class EngineConfig(_Group):
    """Which embedding engine, how it is sharded, where the dense part runs."""

    kind: str = _opt(
        "sparsecore", "embedding engine: sparsecore (ours) or torchrec (the reference). "
                      + "; ".join(f"{e.name}: {e.help}" for e in ENGINES.values()) + ".",
        flag="engine", choices=tuple(ENGINES))
    plan: str | None = _opt(
        None, "a `torchrec-tpu plan` JSON, or 'auto' (default: whole tables balanced over the ranks). sparsecore "
              "engine only: the plan's devices are the ranks, one device per rank; 'auto' plans the tables for "
              "this world now.",
        metavar="PATH|auto")
    dense_device: DenseDevice = _opt(
        "auto", "where the dense towers run: tpu (one compiled step program), cpu, or auto. The towers are the "
                "MLPs, interaction and DCN; --engine sparsecore only. tpu: with ddp each step is ONE compiled "
                "program per rank: embedding lookup, towers, dense optimizer and the fused embedding update "
                "(several ranks: one SPMD program, over tpu_dist's XLA transport; without it, or with fsdp2, "
                "the towers run eagerly). Its first step traces and compiles. auto: tpu where the step compiles "
                "into one program and the tpu device is a TPU, or, on XLA:CPU in one process, where that program "
                "runs the whole training step faster than the towers in CPU eager torch beside the embedding "
                "lookup and update (both timed once on this host for this model and stored), else cpu "
                "(docs/architecture/training_step.md). With --model hstu: its STU stack and heads.",
        choices=DENSE_DEVICES)
    sparse_backend: SparseBackend = _opt(
        "auto", "the sparsecore engine's embedding backend (sparsecore.backends), or auto. The rank's local backend, "
                "--engine sparsecore only. ops: TorchTPU's tpu:: SparseCore ops on tpu tables (where the step is one "
                "program, it calls them itself: lookup, towers and fused update in one program; in an eager step each "
                "update writes only the batch's rows, in place), each batch's CSR buffers cut to a bucket of its "
                "largest partition (eight sizes per power of two); xla: one lookup and one update program a step for "
                "all stacks (the same results as ops), run beside the step, updating the tables in place (e.g. "
                "row-wise Adagrad on tables whose dim is not a multiple of 8, which ops refuses); fbgemm: FBGEMM's "
                "table-batched embedding CPU kernels, beside the step (SGD, Adagrad, and row-wise Adagrad on dims that "
                "are multiples of 4; no Adam or FTRL); tpu: jax-tpu-embedding's SparseCore kernels, which only a TPU "
                "host (libtpu) runs. auto: ops where the step is one program and the optimizer runs inside it (not "
                "Adam, whose update takes a host value per step), else xla (the eager step runs the xla backend's "
                "programs beside it).",
        choices=SPARSE_BACKENDS)
    id_overflow: str = _opt(
        "auto", "what a batch whose ids overflow a SparseCore partition's limits does: minibatch, error or drop. "
                "--engine sparsecore only (docs/ID_LIMITS.md). minibatch: split into passes that each fit, as "
                "jax-tpu-embedding minibatches, with the results of one pass and 0 ids dropped; error: stop the "
                "job naming the partition; drop: keep each partition's first ids up to its limits, as the "
                "SparseCores do. auto: minibatch (error on the ops backend where a rank drives several devices).",
        choices=ID_OVERFLOW_POLICIES)
    max_ids_per_partition: int | None = _opt(
        None, "every table's SparseCore id limits per partition and step (default: 256, or --plan's). The most ids "
              "and unique ids one SparseCore sends another in a step, --engine sparsecore only (docs/ID_LIMITS.md). "
              "A larger batch per SparseCore needs a larger limit; each partition's buffer grows with it.",
        metavar="N")
    fdo: bool = _opt(
        False, "tune the SparseCore id limits from what training sees (FDO). Every step records each stacked "
               "table's most ids and unique ids per partition (the MAX over ranks); each checkpoint and epoch "
               "raises the limits they exceeded, and the checkpoint's meta.json and <log-dir>/fdo_stats.json keep "
               "them (plan --fdo-stats reads that file; a resume with --fdo and infer use the checkpoint's). "
               "--engine sparsecore on --sparse-backend xla (auto picks it; docs/ID_LIMITS.md).")
    dense_parallel: DenseParallel = _opt(
        "ddp", "how the dense towers sync over ranks: ddp (replicated) or fsdp2 (sharded). --engine sparsecore "
               "only; fsdp2 shards each tower (FSDP2 fully_shard), for large towers.",
        choices=DENSE_PARALLELS)
    num_threads: int = _opt(
        1, "CPU threads per process for torch/FBGEMM kernels (0: one per CPU the rank may use). Never more than "
           "those CPUs; 1 keeps small models fast on a busy machine, where spinning threads compete for cores.")
    bind_cpus: bool = _opt(
        True, "with several ranks on one host, bind each rank to its own block of CPUs. Several ranks on one "
              "host (torchrun) then do not compete with their thread pools (torch, XLA:CPU).")
    print_sharding_plan: bool = _opt(
        False, "print where each embedding table went once the model is sharded. Sharding type, ranks, rows and "
               "columns of each shard (TorchRec dlrm_main's --print_sharding_plan).")
    collective_timeout: float = _opt(
        300.0, "seconds a collective waits for the other ranks before every rank fails. All process groups; it "
               "ends a run that waits on a stalled or dead rank.",
        metavar="SECONDS")
    zch: str | None = _opt(
        None, "comma-separated features whose tables remap raw ids by managed collisions, or all (default: none). "
              "Each item is NAME[:POLICY[:INTERVAL]], as TorchRec's MCH modules: the ids are read as raw int64 values "
              "(no modulo); each table keeps its ids in a sorted identity table and every INTERVAL batches evicts "
              "by POLICY (default --zch-policy, --zch-eviction-interval), resetting the evicted rows and their "
              "optimizer state; an id not in the table goes to its last row (row-wise over several ranks: each "
              "shard remaps the ids routed to it, id mod ranks). --engine sparsecore.",
        metavar="TABLES")
    zch_policy: str = _opt("lfu", "eviction policy of the --zch tables that name none: TorchRec's LFU, LRU or "
                                  "distance-LFU", choices=ZCH_POLICIES)
    zch_eviction_interval: int = _opt(100, "batches between evictions of the --zch tables that name none")

    def validate(self) -> None:
        _check_group(self, at_least_0=("num_threads",), at_least_1=("zch_eviction_interval",),
                     positive=("collective_timeout",))
        if self.max_ids_per_partition is not None:
            _require("max_ids_per_partition", self.max_ids_per_partition, lambda v: v >= 1, "must be >= 1")
        kind = ENGINES[self.kind]
        if self.zch is not None and not kind.manages_collisions:
            raise ConfigError(f"--zch={self.zch!r} needs --engine {_engines_that('manages_collisions')} (the "
                              f"{kind.name} engine takes ids modulo its tables)")
        if self.zch is not None:
            self.zch_tables(None)
        if self.fdo and self.sparse_backend not in ("auto", XLA):
            raise ConfigError(f"--fdo needs --sparse-backend {XLA} or auto, not {self.sparse_backend!r}: the "
                              f"{self.sparse_backend} backend keeps the id limits it was built with")
        for name, default in (("id_overflow", "auto"), ("max_ids_per_partition", None), ("fdo", False)):
            if not kind.places_dense and getattr(self, name) != default:
                raise ConfigError(f"{_as_flag(name)}={getattr(self, name)!r} needs --engine "
                                  f"{_engines_that('places_dense')} (the {kind.name} engine has no SparseCore "
                                  "partitions)")
        for name, default in (("dense_device", "auto"), ("dense_parallel", "ddp"), ("sparse_backend", "auto")):
            if not kind.places_dense and getattr(self, name) not in (default, "cpu"):
                raise ConfigError(f"{_as_flag(name)}={getattr(self, name)!r} needs --engine "
                                  f"{_engines_that('places_dense')} (the {kind.name} engine keeps its dense part "
                                  "on cpu in DDP and has no sparse backend choice)")
        if self.plan is not None and not kind.reads_plan:
            raise ConfigError(f"--plan={self.plan!r} needs --engine {_engines_that('reads_plan')} (the "
                              f"{kind.name} engine plans with its own planner)")


    def zch_tables(self, features: tuple[str, ...] | None) -> dict[str, tuple[str, int]]:
        """``--zch`` as feature -> (policy, eviction interval), over ``features`` (the data's
        categorical features; None: names unchecked, 'all' unexpanded)."""
        tables: dict[str, tuple[str, int]] = {}
        for item in (self.zch or "").split(","):
            name, *rest = item.strip().split(":")
            if not name or len(rest) > 2:
                raise ConfigError(f"--zch={self.zch!r}: {item!r} is not NAME[:POLICY[:INTERVAL]]")
            policy = rest[0] if rest else self.zch_policy
            if policy not in ZCH_POLICIES:
                raise ConfigError(f"--zch={self.zch!r}: policy {policy!r} of {name!r} is not one of {ZCH_POLICIES}")
            interval = rest[1] if len(rest) > 1 else str(self.zch_eviction_interval)
            if not interval.isdigit() or int(interval) < 1:
                raise ConfigError(f"--zch={self.zch!r}: eviction interval {interval!r} of {name!r} must be an "
                                  "integer >= 1")
            names = [name] if features is None or name != "all" else list(features)
            if features is not None and name != "all" and name not in features:
                raise ConfigError(f"--zch={self.zch!r}: {name!r} is not a categorical feature of the data "
                                  f"({', '.join(features)}){did_you_mean(name, features)}")
            tables.update({n: (policy, int(interval)) for n in names})
        return tables


@dataclass(frozen=True)
class OptimConfig(_Group):
    """The fused embedding optimizer, the dense one, the learning-rate schedule, the towers' precision."""

    sparse_optimizer: str = _opt("adagrad", "fused embedding optimizer (runs inside backward)",
                                 choices=tuple(SPARSE_OPTIMIZERS))
    sparse_lr: float = _opt(0.05, "embedding learning rate")
    dense_optimizer: str = _opt("adagrad", "optimizer of the MLPs", choices=tuple(DENSE_OPTIMIZERS))
    dense_lr: float = _opt(0.05, "dense learning rate")
    lr_warmup_steps: int = _opt(
        0, "linear learning-rate warm-up over the first N steps (0: none). Both optimizers, as TorchRec "
           "dlrm_main / MLPerf DLRM.")
    lr_decay_start: int = _opt(0, "step where the quadratic learning-rate decay starts")
    lr_decay_steps: int = _opt(0, "steps of the quadratic decay to 1e-7 (0: no decay)")
    precision: Precision = _opt(
        "fp32", "the dense towers' matmuls: fp32, or bf16 as TPUs train (fp32 parameters). bf16 is autocast on "
                "the towers' device, both engines; parameters, optimizer state and accumulation stay fp32.",
        choices=PRECISIONS)

    def rates_text(self) -> str:
        """The learning rates and their optimizers, as a divergence stop names them."""
        return (f"--sparse-lr {self.sparse_lr:g} ({self.sparse_optimizer}), --dense-lr {self.dense_lr:g} "
                f"({self.dense_optimizer})")

    def validate(self) -> None:
        _check_group(self, at_least_0=("lr_warmup_steps", "lr_decay_start", "lr_decay_steps"),
                     positive=("sparse_lr", "dense_lr"))
        if self.lr_decay_steps and self.lr_decay_start < self.lr_warmup_steps:
            raise ConfigError(f"--lr-decay-start={self.lr_decay_start} must be >= --lr-warmup-steps="
                              f"{self.lr_warmup_steps} (the warm-up ends before the decay starts)")


@dataclass(frozen=True)
class CheckpointConfig(_Group):
    """Where checkpoints go, how often, how many stay, what to resume."""

    checkpoint_dir: str | None = _opt(None, "checkpoint root: versioned checkpoints and a 'latest' link "
                                            "(default: <log-dir>/checkpoint)")
    checkpoint_every: int = _opt(0, "also checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = _opt(
        2, "checkpoints of this run kept in the checkpoint root (older ones deleted). Other runs' checkpoints "
           "never are.")
    overwrite_checkpoints: bool = _opt(
        False, "start a new run in a checkpoint root that holds another run's checkpoints. Refused otherwise; "
               "with it, 'latest' moves to this run's and theirs stay.")
    resume: str | None = _opt(
        None, "checkpoint (or checkpoint root) to resume from (default: start from scratch). A root resumes its "
              "latest intact checkpoint: model, optimizer state, RNG, step and data position (in rows: "
              "--batch-size may change); tables, dims, optimizers, data and world size must match it.")

    def validate(self) -> None:
        _check_group(self, at_least_1=("keep_checkpoints",), at_least_0=("checkpoint_every",))


@dataclass(frozen=True)
class LoopConfig(_Group):
    """How long to train, what to log and evaluate, the seed."""

    epochs: int = _opt(1, "passes over the training split")
    max_steps: int = _opt(0, "stop after this many steps (0: run all epochs)")
    seed: int = _opt(0, "random seed (model init)")
    log_dir: str | None = _opt(None, "TensorBoard log directory (default: runs/<UTC timestamp>)")
    log_every: int = _opt(20, "log training scalars every N steps")
    eval_every: int = _opt(0, "also evaluate every N steps (0: only at the end)", aliases=("--validation-freq",))
    target_auc: float = _opt(
        0.0, "stop at the first --eval-every evaluation reaching this AUC (0: no target). MLPerf DLRM-DCNv2's "
             "target is 0.80275.")
    progress: bool = _opt(True, "show a tqdm progress bar")
    mllog: str | None = _opt(
        None, "write MLPerf's compliance log (mlperf-logging's mllog) to FILE, rank 0 (default: none). It holds "
              "the submission info, hyperparameters, init/run start and stop (status success when --target-auc is "
              "reached, else aborted), epoch, block and evaluation events with the AUC; check it with `python -m "
              "mlperf_logging.compliance_checker` (docs/MLPERF.md).",
        metavar="FILE")
    mllog_org: str = _opt("torchrec-tpu", "--mllog's submission_org")
    mllog_division: MLPerfDivision = _opt("closed", "--mllog's submission_division", choices=MLPERF_DIVISIONS)
    mllog_platform: str | None = _opt(
        None, "--mllog's submission_platform (default: '<ranks>x<machine> (<engine> engine)')", metavar="TEXT")
    mllog_status: MLPerfStatus = _opt("research", "--mllog's submission_status", choices=MLPERF_STATUSES)

    def resolved_log_dir(self) -> Path:
        if self.log_dir:
            return Path(self.log_dir)
        return Path("runs") / datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")

    def validate(self) -> None:
        _check_group(self, at_least_1=("epochs", "log_every"), at_least_0=("max_steps", "eval_every", "seed"))
        _require("target_auc", self.target_auc, lambda v: 0 <= v < 1, "must be in [0, 1)")
        if not self.mllog_org.strip() or (self.mllog_platform is not None and not self.mllog_platform.strip()):
            raise ConfigError("--mllog-org and --mllog-platform must not be empty (MLPerf's checker refuses an "
                              "empty submission_org or submission_platform)")


@dataclass(frozen=True)
class TrainConfig:
    """All options of ``torchrec-tpu train``; the defaults are the README's main command."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_options(cls, **options: Any) -> "TrainConfig":
        """The config of these options (by option name: flags and YAML keys with underscores), the
        rest at their model's defaults (:attr:`ModelKind.defaults <torchrec_tpu.train.model_kinds.ModelKind>`),
        else at the options' own; TypeError names an unknown option."""
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            hints = "".join(did_you_mean(name, OPTIONS) for name in unknown)
            raise TypeError(f"unknown training options {unknown}{hints}")
        model = model_kind(options.get("model", ModelConfig().kind), options.get("task", ModelConfig().task))
        options = {**(model.defaults if model is not None else {}), **options}
        groups: dict[str, dict[str, Any]] = {f.name: {} for f in dataclasses.fields(cls)}
        for name, value in options.items():
            group, f = OPTIONS[name]
            groups[group][f.name] = value
        return cls(**{f.name: f.default_factory(**groups[f.name]) for f in dataclasses.fields(cls)})

    @property
    def kind(self) -> ModelKind:
        """The registry's entry of ``--model`` and ``--task`` (:func:`~torchrec_tpu.train.model_kinds.model_kind`)."""
        kind = model_kind(self.model.kind, self.model.task)
        assert kind is not None, "ModelConfig.validate refuses a model without the task"
        return kind

    def option(self, name: str) -> Any:
        """The value of option ``name`` (``"batch_size"``, ``"engine"``, ...)."""
        group, f = OPTIONS[name]
        return getattr(getattr(self, group), f.name)

    def to_dict(self) -> dict[str, Any]:
        """Every option by name: what :meth:`from_options` takes back (a checkpoint's "config")."""
        return {name: self.option(name) for name in OPTIONS}

    def with_options(self, **options: Any) -> "TrainConfig":
        """This config with the given options (by option name: ``resume``, ``data``, ...) changed."""
        return TrainConfig.from_options(**{**self.to_dict(), **options})

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad option, its value and the limit: each group
        checks its own options when built; these are the checks across groups."""
        kind = ENGINES[self.engine.kind]
        if self.loop.mllog is not None and MODEL_KINDS[self.model.kind].mlperf_benchmark is None:
            benchmarks = ", ".join(f"{m.mlperf_benchmark} (--model {m.name})" for m in MODEL_KINDS.values()
                                   if m.mlperf_benchmark)
            raise ConfigError(f"--mllog={self.loop.mllog!r} writes an MLPerf benchmark's log, and --model "
                              f"{self.model.kind} has none: {benchmarks}")
        # dlrmv4's --eval-every 0: MLPerf's evaluation grid (torchrec_tpu.hstu.dlrmv4_recipe)
        if self.loop.target_auc and not self.loop.eval_every and self.model.kind != "dlrmv4":
            raise ConfigError(f"--target-auc={self.loop.target_auc} needs --eval-every N: the target is checked "
                              "at each of those evaluations")
        # dlrmv4's tables are TorchRec's (DMP over FBGEMM), whose fused rate ramps with the dense rate
        schedules = kind.schedules_sparse_lr or self.model.kind == "dlrmv4"
        if (self.optim.lr_warmup_steps or self.optim.lr_decay_steps) and not schedules:
            raise ConfigError(f"--lr-warmup-steps/--lr-decay-steps need --engine "
                              f"{_engines_that('schedules_sparse_lr')}: the {kind.name} engine's fused embedding "
                              "optimizer has a fixed learning rate")

    def per_feature(self, name: str, count: int) -> tuple[int, ...] | None:
        """``--num-embeddings-per-feature`` or ``--multi-hot-sizes`` (``name``) for ``count``
        features: one value per feature (a single value for all is allowed for multi-hot sizes),
        or None when not given."""
        return per_feature_values(name, self.option(name), count)


def per_feature_values(name: str, text: str | None, count: int) -> tuple[int, ...] | None:
    """:meth:`TrainConfig.per_feature` of option ``name``'s value ``text``."""
    if text is None:
        return None
    values = _positive_ints(name, text)
    if len(values) == 1 and name == "multi_hot_sizes":
        values = values * count
    if len(values) != count:
        raise ConfigError(f"{_as_flag(name)}={text!r} has {len(values)} values; the data has "
                          f"{count} categorical features")
    return tuple(values)


def _group_options() -> dict[str, tuple[str, dataclasses.Field]]:
    out: dict[str, tuple[str, dataclasses.Field]] = {}
    for group in dataclasses.fields(TrainConfig):
        for f in dataclasses.fields(group.default_factory):  # type: ignore[arg-type]
            out[f.metadata.get("flag", f.name)] = (group.name, f)
    return out


# Every option's name (flag and YAML key, with underscores) -> (its group, its field), grouped order.
OPTIONS: dict[str, tuple[str, dataclasses.Field]] = _group_options()


def check_batch_split(data: DataConfig, world_size: int) -> None:
    """ConfigError naming the flag, its value, the world size and the nearest valid sizes when
    ``--batch-size`` or ``--eval-batch-size`` (global, split evenly over the ranks) is not a
    multiple of ``world_size``."""
    for name in ("batch_size", "eval_batch_size"):
        value = getattr(data, name)
        if value % world_size:
            lower = value // world_size * world_size
            nearest = " and ".join(str(v) for v in (lower, lower + world_size) if v > 0)
            raise ConfigError(f"{_as_flag(name)}={value} does not split over {world_size} ranks (each takes an equal "
                              f"share of the global batch); nearest valid: {nearest}")


def _engines_that(trait: str) -> str:
    """The ``--engine`` values whose :class:`~torchrec_tpu.train.engine_kinds.EngineKind` has ``trait``."""
    return "|".join(e.name for e in ENGINES.values() if getattr(e, trait))


def _as_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_group(group: Any, at_least_1: tuple[str, ...] = (), at_least_0: tuple[str, ...] = (),
                 positive: tuple[str, ...] = ()) -> None:
    """A group's bounds by field name, then every field with ``choices`` in them; ConfigError names
    the option (its flag), the value and the limit."""
    for name in at_least_1:
        _require(name, getattr(group, name), lambda v: v >= 1, "must be >= 1")
    for name in at_least_0:
        _require(name, getattr(group, name), lambda v: v >= 0, "must be >= 0")
    for name in positive:
        _require(name, getattr(group, name), lambda v: 0 < v < math.inf, "must be > 0 and finite")
    for f in dataclasses.fields(group):
        choices = f.metadata.get("choices")
        value = getattr(group, f.name)
        if choices and value not in choices:
            raise ConfigError(f"{_as_flag(f.metadata.get('flag', f.name))}={value!r} is not one of {list(choices)}")


def _require(name: str, value: Any, ok: Any, limit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ConfigError(f"{_as_flag(name)}={value!r} {limit}")


def _positive_ints(name: str, text: str) -> list[int]:
    try:
        values = [int(part) for part in str(text).split(",")]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ConfigError(f"{_as_flag(name)}={text!r} must be comma-separated positive integers")
    return values


def _layer_sizes(name: str, text: str) -> list[int]:
    try:
        sizes = [int(part) for part in str(text).split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(s < 1 for s in sizes):
        raise ConfigError(
            f"{_as_flag(name)}={text!r} must be comma-separated positive layer sizes, e.g. 64,16"
        )
    return sizes


_FIELD_TYPES = {"int": int, "float": float, "str": str, "str | None": str, "int | None": int}
_METAVARS = {"int": "N", "float": "X", "str": "TEXT", "str | None": "PATH", "int | None": "N"}


def add_config_arguments(parser: argparse.ArgumentParser, defaults: TrainConfig | None = None,
                         skip: frozenset[str] = frozenset()) -> None:
    """One flag per option (in an argument group per config group), plus ``--config`` and TorchRec
    dlrm_main's flags (:mod:`~torchrec_tpu.train.dlrm_main_flags`). Unset
    flags stay absent; ``defaults`` (TrainConfig's own if None) is what the help text quotes;
    options in ``skip`` get no flag (a YAML file may still set them)."""
    parser.add_argument(
        "--config", metavar="FILE.yaml", default=None,
        help="YAML file whose keys mirror these flags; explicit flags override it (default: none)",
    )
    defaults = defaults or TrainConfig()
    kept = {group for name, (group, _) in OPTIONS.items() if name not in skip}
    sections = {g.name: parser.add_argument_group(f"{g.name} options", g.default_factory.__doc__)  # type: ignore
                for g in dataclasses.fields(TrainConfig) if g.name in kept}
    for name, (group, f) in OPTIONS.items():
        if name in skip:
            continue
        section = sections[group]
        default = defaults.option(name)
        help_text = f.metadata["help"]
        if "(default:" not in help_text:  # fields whose default is None say what None means
            help_text = f"{help_text} (default: {default})"
        flags = (_as_flag(name), *f.metadata.get("aliases", ()))
        if f.type == "bool":
            section.add_argument(
                *flags, dest=name, action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS, help=help_text,
            )
            continue
        choices = f.metadata.get("choices")
        metavar = f.metadata.get("metavar") or (None if choices else _METAVARS[str(f.type)])
        section.add_argument(
            *flags, dest=name, type=str if choices else _FIELD_TYPES[str(f.type)],
            default=argparse.SUPPRESS, choices=choices, metavar=metavar, help=help_text,
        )
    for name, shorthand in SHORTHANDS.items():
        sections[OPTIONS[shorthand.targets[0]][0]].add_argument(
            _as_flag(name), dest=name, type=shorthand.kind, default=argparse.SUPPRESS,
            metavar=_METAVARS[shorthand.kind.__name__], help=shorthand.help)
    add_dlrm_main_flags(parser)
    record_spellings(parser, {*OPTIONS, *SHORTHANDS})


def config_from_args(args: argparse.Namespace, world_size: int = 1, notes: list[str] | None = None) -> TrainConfig:
    """Defaults, overlaid by the YAML file (if any), overlaid by the flags given explicitly (a
    per-rank dlrm_main size times ``world_size``); ConfigError for refused flags and for an option
    given twice, under two spellings, with different values. Notes on flags taken as given go to
    ``notes`` (None: logged here, in one line: :func:`log_notes`)."""
    refused = refusals(args) or conflicting_spellings(args)
    if refused:
        raise ConfigError(refused)
    layers = [read_yaml_options(Path(args.config))] if getattr(args, "config", None) else []
    flags = {k: v for k, v in vars(args).items() if k in OPTIONS or k in SHORTHANDS}
    per_rank, per_rank_notes = per_rank_options(args, world_size)
    for name, value in per_rank.items():
        if name in flags and flags[name] != value:
            raise ConfigError(f"{_as_flag(name)} {flags[name]} (global) and dlrm_main's per-rank size x {world_size} "
                              f"rank(s) = {value} disagree; give one")
    layers.append({**flags, **per_rank})
    said = [*getattr(args, NOTES, []), *per_rank_notes]
    values = resolve_layers(layers, said)
    check_model_reads(values.get("model", ModelConfig().kind), [name for layer in layers for name in layer],
                      values.get("task", ModelConfig().task))
    config = TrainConfig.from_options(**values)
    if notes is None:
        log_notes(said)
    else:
        notes += said
    return config


def task_refusal(model: str, task: str) -> str:
    """The error line of ``--task task`` with a ``--model model`` that has no such task."""
    others = [m for (m, t) in TASK_KINDS if t == task]
    return f"--task {task} does not apply to --model {model} (it is built for --model {', '.join(others)})"


def check_model_reads(model: str, given: list[str], task: str = "ranking") -> None:
    """ConfigError naming the options of ``given`` (option and shorthand names set by a flag or the
    YAML file) that ``--model model`` (at ``--task task``) does not read (:attr:`ModelKind.reads
    <torchrec_tpu.train.model_kinds.ModelKind>`)."""
    if model not in MODEL_KINDS:
        return  # an unknown model: ModelConfig names it
    kind = model_kind(model, task)
    if kind is None:
        raise ConfigError(task_refusal(model, task))
    # a shorthand is named as given where the model does not read one of the options it sets
    refused = list(dict.fromkeys(name for name in given if kind.refused(
        list(SHORTHANDS[name].targets) if name in SHORTHANDS else [name])))
    if refused:
        flags = ", ".join(_as_flag(name) for name in refused)
        at = "" if task == "ranking" else f" --task {task}"
        raise ConfigError(f"{flags} {'does' if len(refused) == 1 else 'do'} not apply to --model {model}{at}")


def log_notes(notes: list[str]) -> None:
    """The notes on a run's options, in one line (none: nothing)."""
    if notes:
        _log.info("note: %s", "; ".join(notes))


def resolve_layers(layers: list[dict[str, Any]], notes: list[str] | None = None) -> dict[str, Any]:
    """The options of ``layers`` (option and shorthand names -> values), each overriding the ones
    before it; within a layer an option beats a shorthand setting it, and a shorthand's implied
    options apply where no layer sets them (HSTU's optimizers are its own: none implied there),
    said in ``notes``."""
    values: dict[str, Any] = {}
    implied: dict[str, Any] = {}
    for layer in layers:
        for name, shorthand in SHORTHANDS.items():
            if name in layer:  # (its targets' own limit, named as given: > 0 and finite)
                _require(name, layer[name], lambda v: 0 < v < math.inf, "must be > 0 and finite")
                values.update(dict.fromkeys(shorthand.targets, layer[name]))
                implied.update(shorthand.implies)
        values.update({k: v for k, v in layer.items() if k not in SHORTHANDS})
    if values.get("model") not in HSTU_MODELS:
        chosen = {k: v for k, v in implied.items() if k not in values}
        if chosen and notes is not None:
            notes.append("--learning-rate without --adagrad trains " + ", ".join(
                f"{_as_flag(k)} {v}" for k, v in chosen.items()) + ", as TorchRec dlrm_main (--adagrad for Adagrad)")
        values.update(chosen)
    return values


def load_yaml(path: Path) -> dict[str, Any]:
    """The options a YAML file of option -> value sets (keys may use dashes or underscores;
    shorthands resolved as :func:`resolve_layers` does)."""
    return resolve_layers([read_yaml_options(path)])


def read_yaml_options(path: Path) -> dict[str, Any]:
    """The YAML file's keys as option and shorthand names -> values; ConfigError naming the file
    for a bad file, key or value, and naming both keys when two spellings of one option
    (``embedding_dim``, ``embedding-dim``) give it different values."""
    if not path.is_file():
        raise ConfigError(f"--config={str(path)!r}: no such file")
    try:
        raw = read_structured(path) or {}
    except ValueError as error:
        raise ConfigError(f"--config={str(path)!r}: {error}") from None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"--config={str(path)!r} must hold a mapping of option: value")
    types = {name: str(f.type) for name, (_, f) in OPTIONS.items()}
    types.update({name: shorthand.kind.__name__ for name, shorthand in SHORTHANDS.items()})
    aliases = {alias[2:].replace("-", "_"): name for name, (_, f) in OPTIONS.items()
               for alias in f.metadata.get("aliases", ())}
    values: dict[str, Any] = {}
    keys: dict[str, Any] = {}  # option -> the key that set it
    for key, value in raw.items():
        name = aliases.get(str(key).replace("-", "_"), str(key).replace("-", "_"))
        if name not in types:
            known = sorted(n.replace("_", "-") for n in types)
            hint = close_match(str(key), known)
            raise ConfigError(f"--config={str(path)!r}: unknown option {brief(key)}" + (
                f" (did you mean {hint}?)" if hint else "; known: " + ", ".join(known)))
        value = _coerce(name, types[name], value, path)
        if name in values and values[name] != value:
            raise ConfigError(f"--config={str(path)!r}: {key}: {brief(value)} and {keys[name]}: {brief(values[name])} "
                              f"set the same option ({_as_flag(name)}) to different values; give it once")
        values[name], keys[name] = value, key
    return values


def _coerce(name: str, kind: str, value: Any, path: Path) -> Any:
    """YAML gives ints for floats (``lr: 1``) and lists for layer sizes; normalise those."""
    if name in ("dense_arch", "over_arch", "num_embeddings_per_feature", "multi_hot_sizes") \
            and isinstance(value, list):
        return ",".join(str(v) for v in value)
    if kind == "float" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    expected = {"int": int, "float": float, "bool": bool, "str": str}.get(kind)
    wrong_type = expected is not None and not isinstance(value, expected)
    if wrong_type or (expected is int and isinstance(value, bool)):
        raise ConfigError(
            f"--config={str(path)!r}: {name.replace('_', '-')}={brief(value)} must be {kind}"
        )
    return value
