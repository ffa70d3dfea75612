"""TorchRec ``dlrm_main.py``'s flags (torchrec_dlrm / MLPerf DLRM-DCNv2), spelt either way, on our parsers.

Each of its flags sets our equivalent with dlrm_main's meaning (``--dense_arch_layer_sizes`` ->
``--dense-arch``; the per-rank ``--batch_size`` -> the global ``--batch-size`` times the ranks), is
taken as given where it changes nothing here (``--pin_memory``; noted), or is refused naming our
equivalent or why there is none. A pasted line is parsed whole: every refusal comes in one error,
every note in one line (:mod:`torchrec_tpu.cli_help`). The spellings are hidden from ``--help`` and
from the close-match suggestions for typos.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Mapping, Union

from pipelines.flag_numbers import positive_int
from torchrec_tpu.cli_help import note, refuse_later


@dataclass(frozen=True)
class Same:
    """The flag is ours, ``flag``, with the same meaning and values."""

    flag: str


@dataclass(frozen=True)
class Sets:
    """The flag (``nargs=0``) or each of its values sets these options of ours (None: refused, ``why``)."""

    options: Mapping[str | None, Mapping[str, str] | None]
    why: str = ""


@dataclass(frozen=True)
class Refused:
    """No flag of ours means the same: ``why`` says what to use instead, or why there is none."""

    why: str


@dataclass(frozen=True)
class Noted:
    """The flag changes nothing here (``note`` says why): taken with a note. With ``values``, it
    takes one of them (others refused, ``why``); with ``takes_value``, any one value."""

    note: str
    values: tuple[str, ...] = ()
    takes_value: bool = False
    why: str = ""


@dataclass(frozen=True)
class PerRank:
    """dlrm_main's per-rank size; ``option`` of ours is global: the value times the world size."""

    option: str


Meaning = Union[Same, Sets, Refused, Noted, PerRank]
DLRM_MAIN = "TorchRec dlrm_main's flag"
PER_RANK = "_per_rank_"  # namespace attribute prefix of a PerRank flag's value (``_per_rank_batch_size``)

_PROJECTION = ("DLRM_Projection (--interaction_type projection) is not offered: --model dlrm (original) or "
               "dlrm_dcn (dcn)")

# Every flag of dlrm_main.py (torchrec examples/dlrm, facebookresearch/dlrm torchrec_dlrm, MLPerf
# recommendation_v2), by its underscore name.
DLRM_MAIN_FLAGS: dict[str, Meaning] = {
    "epochs": Same("--epochs"),
    "batch_size": PerRank("batch_size"),
    "drop_last_training_batch": Refused("no flag: with one rank the last short training batch is trained on, "
                                        "with several it is dropped (the ranks step in lock-step)"),
    "test_batch_size": PerRank("eval_batch_size"),
    "limit_train_batches": Same("--limit-train-batches"),
    "limit_val_batches": Same("--limit-val-batches"),
    "limit_test_batches": Refused("no separate limit: --limit-val-batches caps the validation and the test "
                                  "split alike"),
    "dataset_name": Refused("no equivalent: --data names the Parquet directory (from `torchrec-tpu data "
                            "convert`), or --in-memory-binary-criteo-path TorchRec's .npy days; their "
                            "columns say which Criteo it is"),
    "num_workers": Noted("no DataLoader workers: the readers prefetch batches on threads of their own",
                         takes_value=True),
    "num_embeddings": Same("--num-embeddings"),
    "num_embeddings_per_feature": Same("--num-embeddings-per-feature"),
    "dense_arch_layer_sizes": Same("--dense-arch"),
    "over_arch_layer_sizes": Same("--over-arch"),
    "embedding_dim": Same("--embedding-dim"),
    "interaction_branch1_layer_sizes": Refused(_PROJECTION),
    "interaction_branch2_layer_sizes": Refused(_PROJECTION),
    "dcn_num_layers": Same("--dcn-num-layers"),
    "dcn_low_rank_dim": Same("--dcn-low-rank-dim"),
    "undersampling_rate": Refused("no equivalent: every row is trained on (no undersampling of label-0 rows)"),
    "seed": Same("--seed"),
    "pin_memory": Noted("no CUDA host-to-device copies: batches go to the tpu device as they are"),
    "mmap_mode": Same("--mmap-mode"),
    "in_memory_binary_criteo_path": Same("--in-memory-binary-criteo-path"),
    "synthetic_multi_hot_criteo_path": Refused("no equivalent: MLPerf's pre-generated multi-hot .npz files are "
                                               "not read; --multi-hot-sizes expands one-hot ids on the fly"),
    "learning_rate": Same("--learning-rate"),
    "shuffle_batches": Same("--shuffle-batches"),
    "shuffle_training_set": Refused("no equivalent: rows are read in order; --shuffle-batches shuffles the "
                                    "order of the training batches each epoch"),
    "validation_freq_within_epoch": Same("--eval-every"),
    "validation_auroc": Same("--target-auc"),
    "evaluate_on_epoch_end": Refused("no equivalent: train validates at the end of training and every "
                                     "--eval-every N steps"),
    "evaluate_on_training_end": Noted("train always evaluates at the end (the test split too with --eval-files "
                                      "2 or more)"),
    "adagrad": Sets({None: {"sparse_optimizer": "adagrad", "dense_optimizer": "adagrad"}}),
    "interaction_type": Sets({"original": {"model": "dlrm"}, "dcn": {"model": "dlrm_dcn"}, "projection": None},
                             why=_PROJECTION),
    "collect_multi_hot_freqs_stats": Refused("no equivalent: no statistics of embedding-row access are "
                                             "collected"),
    "multi_hot_sizes": Same("--multi-hot-sizes"),
    "multi_hot_distribution_type": Noted("uniform is what --multi-hot-sizes does (fixed uniformly random offsets "
                                         "of each id)", values=("uniform",),
                                         why="--multi-hot-sizes adds uniformly random offsets (dlrm_main's "
                                             "'uniform'); 'pareto' is not offered"),
    "lr_warmup_steps": Same("--lr-warmup-steps"),
    "lr_decay_start": Same("--lr-decay-start"),
    "lr_decay_steps": Same("--lr-decay-steps"),
    "print_lr": Refused("no equivalent: each step's learning rates go to TensorBoard "
                        "(train/learning_rate/sparse and /dense), not the console"),
    "allow_tf32": Noted("TF32 is an NVIDIA GPU mode: the towers' matmuls stay fp32 (--precision bf16 is the "
                        "TPU's reduced-precision matmul)"),
    "print_sharding_plan": Same("--print-sharding-plan"),
    "print_progress": Same("--progress"),
    # MLPerf v1's dlrm_main (its results table's lines): a step change of the learning rate
    **dict.fromkeys(("change_lr", "lr_change_point", "lr_after_change_point"), Refused(
        "no step change of the learning rate (MLPerf v1's --change_lr family): the schedules here are "
        "TorchRec's warm-up and quadratic decay, --lr-warmup-steps, --lr-decay-start, --lr-decay-steps "
        "(--engine torchrec)")),
}


def add_dlrm_main_flags(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` (whose own flags are added already) every :data:`DLRM_MAIN_FLAGS` flag, in
    both spellings, hidden from ``--help``; a flag whose equivalent ``parser`` lacks is refused."""
    ours = parser._option_string_actions
    for name, meaning in DLRM_MAIN_FLAGS.items():
        spellings = [s for s in dict.fromkeys((f"--{name}", f"--{name.replace('_', '-')}")) if s not in ours]
        if not spellings:
            continue
        if isinstance(meaning, Same) and isinstance(ours.get(meaning.flag), argparse.BooleanOptionalAction):
            parser.add_argument(*spellings, dest=ours[meaning.flag].dest, action="store_const", const=True,
                                default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # dlrm_main's store_true
        elif isinstance(meaning, Same) and meaning.flag in ours:
            for spelling in spellings:  # the same action: the same type, choices and checks as ours
                ours[spelling] = ours[meaning.flag]
        elif isinstance(meaning, Same):
            parser.add_argument(*spellings, action=_Refuse, nargs="?", help=argparse.SUPPRESS,
                                why=f"sets {meaning.flag}, which `{parser.prog}` does not take")
        elif isinstance(meaning, PerRank):
            parser.add_argument(*spellings, dest=PER_RANK + meaning.option, type=positive_int,
                                default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        elif isinstance(meaning, Noted):
            parser.add_argument(*spellings, action=_Note, meaning=meaning, help=argparse.SUPPRESS,
                                nargs=None if meaning.values or meaning.takes_value else 0)
        elif isinstance(meaning, Sets):
            parser.add_argument(*spellings, action=_Set, meaning=meaning, help=argparse.SUPPRESS,
                                nargs=0 if None in meaning.options else None,
                                choices=None if None in meaning.options else list(meaning.options))
        else:
            parser.add_argument(*spellings, action=_Refuse, nargs="?", help=argparse.SUPPRESS, why=meaning.why)


def options_set_by(action: argparse.Action) -> tuple[str, ...] | None:
    """The options of ours a dlrm_main flag's action sets for us (None: not such a flag)."""
    if not isinstance(action, _Set):
        return None
    return tuple(dict.fromkeys(o for options in action.meaning.options.values() for o in options or {}))


class _Refuse(argparse.Action):
    """An error naming the flag (dlrm_main's) and ``why``."""

    def __init__(self, *args: Any, why: str, **kwargs: Any) -> None:
        super().__init__(*args, default=argparse.SUPPRESS, **kwargs)
        self.why = why

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        refuse_later(namespace, str(option_string), self.why, DLRM_MAIN)


class _Meant(argparse.Action):
    """An action doing what ``meaning`` (a :data:`Meaning`) says; it sets no default."""

    def __init__(self, *args: Any, meaning: Any, **kwargs: Any) -> None:
        super().__init__(*args, default=argparse.SUPPRESS, **kwargs)
        self.meaning = meaning


class _Note(_Meant):
    """Takes the flag (and its value) as given, noting that it changes nothing here."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given = f"{option_string} {values}" if self.nargs != 0 else str(option_string)
        if self.meaning.values and values not in self.meaning.values:
            refuse_later(namespace, given, self.meaning.why, DLRM_MAIN)
        else:
            note(namespace, f"{given} changes nothing here ({self.meaning.note})")


class _Set(_Meant):
    """Sets the options of :class:`Sets` for the value given (or for the flag, without one)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        options = self.meaning.options[None if self.nargs == 0 else values]
        if options is None:
            refuse_later(namespace, f"{option_string} {values}", self.meaning.why, DLRM_MAIN)
            return
        for option, value in options.items():
            setattr(namespace, option, value)


def per_rank_options(args: argparse.Namespace, world_size: int) -> tuple[dict[str, int], list[str]]:
    """Our global options that dlrm_main's per-rank flags set (the value times ``world_size``), and
    a note on each."""
    values: dict[str, int] = {}
    notes = []
    for name, meaning in DLRM_MAIN_FLAGS.items():
        per_rank = getattr(args, PER_RANK + meaning.option, None) if isinstance(meaning, PerRank) else None
        if per_rank is not None:
            values[meaning.option] = per_rank * world_size
            notes.append(f"--{name} {per_rank} is per rank (dlrm_main's): --{meaning.option.replace('_', '-')} "
                         f"{per_rank * world_size} here, global over {world_size} rank(s)")
    return values, notes
