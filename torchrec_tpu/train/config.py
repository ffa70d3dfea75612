"""Training configuration: one dataclass, exposed as CLI flags and as optional YAML keys.

Every field of :class:`TrainConfig` is a flag (``embedding_dim`` -> ``--embedding-dim``) and a
YAML key (either spelling). Precedence: built-in defaults < ``--config file.yaml`` < explicit
flags. All validation lives in :meth:`TrainConfig.validate`, so a bad value gives the same clear
error whichever way it arrived. No heavy imports here: ``--help`` must stay fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

MODELS = ("dlrm", "dlrm_dcn")
ENGINES = ("torchrec", "sparsecore")
SPARSE_OPTIMIZERS = ("adagrad", "rowwise_adagrad", "sgd")
DENSE_OPTIMIZERS = ("adagrad", "adam")
DENSE_DEVICES = ("cpu", "tpu")
DENSE_PARALLELS = ("ddp", "fsdp2")
BAD_VALUE_POLICIES = ("error", "skip", "clamp")  # pipelines.bad_values.POLICIES (not imported: fast --help)


class ConfigError(ValueError):
    """A training option has a bad value; the message names the option, the value and the limit."""


def _flag(help_text: str, **extra: Any) -> dict[str, Any]:
    return {"help": help_text, **extra}


# Flags of TorchRec's dlrm_main / MLPerf DLRM that set one or more of our options (also YAML keys).
SHORTHANDS: dict[str, tuple[tuple[str, ...], type, str]] = {
    "learning_rate": (("sparse_lr", "dense_lr"), float,
                      "sets --sparse-lr and --dense-lr (TorchRec's --learning-rate); a later "
                      "--sparse-lr/--dense-lr overrides it (default: their own defaults)"),
}


@dataclass
class TrainConfig:
    """All options of ``torchrec-tpu train``; the defaults are the README's main command."""

    model: str = field(
        default="dlrm", metadata=_flag("model: stock torchrec DLRM or DLRM_DCN", choices=MODELS)
    )
    engine: str = field(
        default="sparsecore",
        metadata=_flag(
            "embedding engine: the sparsecore sharded EBC (sharded as --plan says, dense part in DDP "
            "or FSDP2, see --dense-parallel), or stock TorchRec DMP on FBGEMM (the reference)",
            choices=ENGINES,
        ),
    )
    plan: str | None = field(
        default=None,
        metadata=_flag(
            "sparsecore engine: a plan JSON from `torchrec-tpu plan` (one device per rank), or "
            "'auto' to plan the tables for this world now (default: whole tables balanced over "
            "the ranks)", metavar="PATH|auto",
        ),
    )
    dense_device: str = field(
        default="cpu",
        metadata=_flag(
            "where the dense towers (MLPs, interaction, DCN) run, --engine sparsecore only; tpu "
            "runs them with the dense optimizer as one compiled program per step (one rank; several "
            "ranks run eagerly). cpu is the default: with the tpu device backed by XLA:CPU (no TPU), "
            "tpu measured 0.70-1.20x cpu on the default towers and 0.96-1.09x at the anchor config "
            "(26 x 100k x 64, 512-wide towers, batch 2048) (bench/bench_dense_device.py); its first "
            "step traces and compiles (3-7 s), a second run loads both from the persistent compile "
            "cache (1.0-1.8 s, bench/bench_first_step.py); choose tpu on a real TPU", choices=DENSE_DEVICES,
        ),
    )
    dense_parallel: str = field(
        default="ddp",
        metadata=_flag(
            "how the dense towers are synced over ranks, --engine sparsecore only: replicated "
            "(DDP) or sharded per tower (FSDP2 fully_shard, for large towers)", choices=DENSE_PARALLELS,
        ),
    )
    data: str = field(
        default="synthetic",
        metadata=_flag(
            "'synthetic' (generated into --cache-dir on first run), 'sample' (the real 200-row "
            "Criteo sample, converted on the fly) or a directory of Parquet files",
            metavar="SOURCE",
        ),
    )
    cache_dir: str | None = field(
        default=None, metadata=_flag("where synthetic data is generated (default: $TORCHREC_TPU_CACHE, else "
                                  "~/.cache/torchrec_tpu)")
    )
    bad_values: str = field(
        default="error",
        metadata=_flag(
            "rows whose label is outside [0, 1] (or NaN) or whose dense value is infinite or beyond "
            "float32 (NaN dense values are missing, read as 0): error naming file, row and column; "
            "skip them (counted); or clamp the values (labels to [0, 1], dense to +-3.4e38; a NaN "
            "label's row is skipped)", choices=BAD_VALUE_POLICIES,
        ),
    )
    eval_files: int = field(
        default=1, metadata=_flag("held-out evaluation split: the last N Parquet files")
    )
    num_embeddings: int = field(
        default=100_000,
        metadata=_flag(
            "rows per embedding table, at most (synthetic tables with fewer ids are smaller); "
            "ids are hashed modulo the table size"
        ),
    )
    num_embeddings_per_feature: str | None = field(
        default=None,
        metadata=_flag("rows of each categorical feature's table, comma-separated, one per feature "
                       "(TorchRec dlrm_main's flag; ids are hashed modulo each) (default: "
                       "--num-embeddings for every table)", metavar="N,N,..."),
    )
    in_memory_binary_criteo_path: str | None = field(
        default=None,
        metadata=_flag("train on TorchRec's preprocessed Criteo instead of --data: a directory of "
                       "day_<d>_{dense,sparse,labels}.npy (torchrec/datasets/scripts/"
                       "npy_preproc_criteo.py); the last --eval-files days are held out "
                       "(default: use --data)", metavar="DIR"),
    )
    mmap_mode: bool = field(
        default=False,
        metadata=_flag("with --in-memory-binary-criteo-path: memory-map the npy files instead of "
                       "loading them into memory"),
    )
    multi_hot_sizes: str | None = field(
        default=None,
        metadata=_flag("MLPerf DLRM-DCNv2 multi-hot: expand each feature's id into this many ids "
                       "(comma-separated, one per feature, or one for all; the first is the id "
                       "itself, the others fixed random offsets of it) (default: one-hot as read)",
                       metavar="K,K,..."),
    )
    embedding_dim: int = field(default=16, metadata=_flag("embedding dimension of every table"))
    dense_arch: str = field(
        default="64,16",
        metadata=_flag("dense MLP layer sizes; the last must equal --embedding-dim", metavar="SIZES"),
    )
    over_arch: str = field(
        default="64,32,1",
        metadata=_flag("over-arch MLP layer sizes; the last must be 1", metavar="SIZES"),
    )
    dcn_num_layers: int = field(default=3, metadata=_flag("DCN cross layers (dlrm_dcn only)"))
    dcn_low_rank_dim: int = field(default=16, metadata=_flag("DCN low rank (dlrm_dcn only)"))
    batch_size: int = field(
        default=512, metadata=_flag("GLOBAL training batch size: summed over all ranks, each rank "
                                    "trains on batch-size / world-size rows per step")
    )
    eval_batch_size: int = field(
        default=2048, metadata=_flag("GLOBAL evaluation batch size (split over the ranks)")
    )
    shuffle_batches: bool = field(
        default=False,
        metadata=_flag("shuffle the order of the training batches, anew each epoch (seeded by --seed "
                       "and the epoch; TorchRec's --shuffle-batches)"),
    )
    limit_train_batches: int = field(
        default=0, metadata=_flag("train on at most N batches per epoch (0: all)")
    )
    limit_val_batches: int = field(
        default=0, metadata=_flag("evaluate on at most N held-out batches (0: all)")
    )
    epochs: int = field(default=1, metadata=_flag("passes over the training split"))
    max_steps: int = field(
        default=0, metadata=_flag("stop after this many steps (0: run all epochs)")
    )
    sparse_optimizer: str = field(
        default="adagrad",
        metadata=_flag("fused embedding optimizer (runs inside backward)", choices=SPARSE_OPTIMIZERS),
    )
    sparse_lr: float = field(default=0.05, metadata=_flag("embedding learning rate"))
    dense_optimizer: str = field(
        default="adagrad", metadata=_flag("optimizer of the MLPs", choices=DENSE_OPTIMIZERS)
    )
    dense_lr: float = field(default=0.05, metadata=_flag("dense learning rate"))
    lr_warmup_steps: int = field(
        default=0, metadata=_flag("linear learning-rate warm-up over the first N steps (both "
                                  "optimizers, as TorchRec dlrm_main / MLPerf DLRM; 0: none)")
    )
    lr_decay_start: int = field(
        default=0, metadata=_flag("step where the quadratic learning-rate decay starts")
    )
    lr_decay_steps: int = field(
        default=0, metadata=_flag("steps of the quadratic decay to 1e-7 (0: no decay)")
    )
    seed: int = field(default=0, metadata=_flag("random seed (model init)"))
    num_threads: int = field(
        default=1,
        metadata=_flag(
            "CPU threads per process for torch/FBGEMM kernels (0: torch's default, one per core); "
            "1 keeps small models fast on a busy machine, where spinning threads compete for cores"
        ),
    )
    log_dir: str | None = field(
        default=None, metadata=_flag("TensorBoard log directory (default: runs/<UTC timestamp>)")
    )
    checkpoint_dir: str | None = field(
        default=None,
        metadata=_flag("checkpoint root: versioned checkpoints and a 'latest' link "
                       "(default: <log-dir>/checkpoint)"),
    )
    checkpoint_every: int = field(
        default=0, metadata=_flag("also checkpoint every N steps (0: only at the end)")
    )
    keep_checkpoints: int = field(
        default=2, metadata=_flag("checkpoints kept in the checkpoint root (older ones are deleted)")
    )
    resume: str | None = field(
        default=None,
        metadata=_flag("checkpoint to resume from (a checkpoint root: its latest intact one): model, "
                       "optimizer state, RNG, step and data position (in rows: --batch-size may "
                       "change); tables, dims, optimizers, data and world size must match it "
                       "(default: start from scratch)"),
    )
    log_every: int = field(default=20, metadata=_flag("log training scalars every N steps"))
    eval_every: int = field(
        default=0, metadata=_flag("also evaluate every N steps (0: only at the end)",
                                  aliases=("--validation-freq",)),
    )
    progress: bool = field(default=True, metadata=_flag("show a tqdm progress bar"))
    collective_timeout: float = field(
        default=300.0,
        metadata=_flag("seconds a collective may wait for the other ranks before every rank fails "
                       "(a stalled or dead rank), all process groups", metavar="SECONDS"),
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad option, its value and the limit."""
        for name in ("num_embeddings", "embedding_dim", "batch_size", "eval_batch_size", "epochs",
                     "eval_files", "log_every", "dcn_num_layers", "dcn_low_rank_dim",
                     "keep_checkpoints"):
            _require(name, getattr(self, name), lambda v: v >= 1, "must be >= 1")
        for name in ("max_steps", "eval_every", "checkpoint_every", "num_threads", "lr_warmup_steps",
                     "lr_decay_start", "lr_decay_steps", "limit_train_batches", "limit_val_batches"):
            _require(name, getattr(self, name), lambda v: v >= 0, "must be >= 0")
        for name in ("sparse_lr", "dense_lr", "collective_timeout"):
            _require(name, getattr(self, name), lambda v: v > 0, "must be > 0")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ConfigError(
                    f"{_as_flag(f.name)}={getattr(self, f.name)!r} is not one of {list(choices)}"
                )
        for name, default in (("dense_device", "cpu"), ("dense_parallel", "ddp")):
            if self.engine != "sparsecore" and getattr(self, name) != default:
                raise ConfigError(f"{_as_flag(name)}={getattr(self, name)!r} needs --engine sparsecore "
                                  f"(the torchrec engine keeps its dense part on cpu in DDP)")
        dense, over = self.dense_layers, self.over_layers
        if dense[-1] != self.embedding_dim:
            raise ConfigError(
                f"--dense-arch={self.dense_arch!r} must end in --embedding-dim "
                f"({self.embedding_dim}): the dense output is interacted with the embeddings"
            )
        if over[-1] != 1:
            raise ConfigError(f"--over-arch={self.over_arch!r} must end in 1 (one logit)")
        if self.plan is not None and self.engine != "sparsecore":
            raise ConfigError(f"--plan={self.plan!r} needs --engine sparsecore (the torchrec engine "
                              "plans with TorchRec's own planner)")
        for name in ("num_embeddings_per_feature", "multi_hot_sizes"):
            if getattr(self, name) is not None:
                _positive_ints(name, getattr(self, name))
        if self.mmap_mode and self.in_memory_binary_criteo_path is None:
            raise ConfigError("--mmap-mode needs --in-memory-binary-criteo-path")
        if self.in_memory_binary_criteo_path is not None and self.bad_values != "error":
            raise ConfigError(f"--bad-values={self.bad_values!r} does not apply to "
                              "--in-memory-binary-criteo-path (TorchRec's preprocessed values are used as stored)")
        if self.lr_decay_steps and self.lr_decay_start < self.lr_warmup_steps:
            raise ConfigError(f"--lr-decay-start={self.lr_decay_start} must be >= --lr-warmup-steps="
                              f"{self.lr_warmup_steps} (the warm-up ends before the decay starts)")
        if (self.lr_warmup_steps or self.lr_decay_steps) and self.engine != "torchrec":
            raise ConfigError("--lr-warmup-steps/--lr-decay-steps need --engine torchrec: the sparsecore "
                              "engine's fused embedding optimizer has a fixed learning rate")

    def per_feature(self, name: str, count: int) -> tuple[int, ...] | None:
        """``--num-embeddings-per-feature`` or ``--multi-hot-sizes`` (``name``) for ``count``
        features: one value per feature (a single value for all is allowed for multi-hot sizes),
        or None when not given."""
        text = getattr(self, name)
        if text is None:
            return None
        values = _positive_ints(name, text)
        if len(values) == 1 and name == "multi_hot_sizes":
            values = values * count
        if len(values) != count:
            raise ConfigError(f"{_as_flag(name)}={text!r} has {len(values)} values; the data has "
                              f"{count} categorical features")
        return tuple(values)

    @property
    def dense_layers(self) -> list[int]:
        return _layer_sizes("dense_arch", self.dense_arch)

    @property
    def over_layers(self) -> list[int]:
        return _layer_sizes("over_arch", self.over_arch)

    def resolved_log_dir(self) -> Path:
        if self.log_dir:
            return Path(self.log_dir)
        return Path("runs") / datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _as_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


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


_FIELD_TYPES = {"int": int, "float": float, "str": str, "str | None": str}
_METAVARS = {"int": "N", "float": "X", "str": "TEXT", "str | None": "PATH"}


def add_config_arguments(parser: argparse.ArgumentParser, defaults: TrainConfig | None = None) -> None:
    """One flag per :class:`TrainConfig` field, plus ``--config``. Unset flags stay absent;
    ``defaults`` (TrainConfig's own if None) is what the help text quotes."""
    parser.add_argument(
        "--config", metavar="FILE.yaml", default=None,
        help="YAML file whose keys mirror these flags; explicit flags override it (default: none)",
    )
    defaults = defaults or TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        default = getattr(defaults, f.name)
        help_text = f.metadata["help"]
        if "(default:" not in help_text:  # fields whose default is None say what None means
            help_text = f"{help_text} (default: {default})"
        flags = (_as_flag(f.name), *f.metadata.get("aliases", ()))
        if f.type == "bool":
            parser.add_argument(
                *flags, dest=f.name, action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS, help=help_text,
            )
            continue
        choices = f.metadata.get("choices")
        metavar = f.metadata.get("metavar") or (None if choices else _METAVARS[str(f.type)])
        parser.add_argument(
            *flags, dest=f.name, type=_FIELD_TYPES[str(f.type)],
            default=argparse.SUPPRESS, choices=choices, metavar=metavar, help=help_text,
        )


    for name, (targets, kind, help_text) in SHORTHANDS.items():
        parser.add_argument(_as_flag(name), dest=targets[0], type=kind, action=_SetAll, targets=targets,
                            default=argparse.SUPPRESS, metavar=_METAVARS[kind.__name__], help=help_text)


class _SetAll(argparse.Action):
    """Stores the value into every option of ``targets`` (a shorthand such as --learning-rate)."""

    def __init__(self, *args: Any, targets: tuple[str, ...], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.targets = targets

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        for target in self.targets:
            setattr(namespace, target, values)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, overlaid by the YAML file (if any), overlaid by the flags given explicitly."""
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(load_yaml(Path(args.config)))
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values.update({k: v for k, v in vars(args).items() if k in names})
    return TrainConfig(**values)


def load_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping of option -> value; keys may use dashes or underscores."""
    from torchrec_tpu.structured_files import read_structured

    if not path.is_file():
        raise ConfigError(f"--config={str(path)!r}: no such file")
    try:
        raw = read_structured(path) or {}
    except ValueError as error:
        raise ConfigError(f"--config={str(path)!r}: {error}") from None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"--config={str(path)!r} must hold a mapping of option: value")
    names = {f.name: f for f in dataclasses.fields(TrainConfig)}
    aliases = {alias[2:].replace("-", "_"): f.name for f in names.values() for alias in f.metadata.get("aliases", ())}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = aliases.get(str(key).replace("-", "_"), str(key).replace("-", "_"))
        if name in SHORTHANDS:
            targets = SHORTHANDS[name][0]
            values.update({t: _coerce(names[t], value, path) for t in targets})
            continue
        if name not in names:
            raise ConfigError(
                f"--config={str(path)!r}: unknown option {key!r}; known: "
                + ", ".join(sorted(n.replace("_", "-") for n in names))
            )
        values[name] = _coerce(names[name], value, path)
    return values


def _coerce(f: dataclasses.Field, value: Any, path: Path) -> Any:
    """YAML gives ints for floats (``lr: 1``) and lists for layer sizes; normalise those."""
    if f.name in ("dense_arch", "over_arch", "num_embeddings_per_feature", "multi_hot_sizes") \
            and isinstance(value, list):
        return ",".join(str(v) for v in value)
    if f.type == "float" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    expected = {"int": int, "float": float, "bool": bool, "str": str}.get(str(f.type))
    wrong_type = expected is not None and not isinstance(value, expected)
    if wrong_type or (expected is int and isinstance(value, bool)):
        raise ConfigError(
            f"--config={str(path)!r}: {f.name.replace('_', '-')}={value!r} must be {f.type}"
        )
    return value
