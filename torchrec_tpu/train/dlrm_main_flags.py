"""TorchRec ``dlrm_main.py``'s flags (torchrec_dlrm / MLPerf DLRM-DCNv2), spelt either way, on our parsers.

Each of its flags either sets our equivalent with dlrm_main's meaning (``--dense_arch_layer_sizes``
-> ``--dense-arch``) or is refused with one line naming our equivalent or why there is none.
The spellings are hidden from ``--help`` and from the close-match suggestions for typos.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Mapping, Union


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


Meaning = Union[Same, Sets, Refused]

_PROJECTION = ("DLRM_Projection (--interaction_type projection) is not offered: --model dlrm (original) or "
               "dlrm_dcn (dcn)")

# Every flag of dlrm_main.py (torchrec examples/dlrm, facebookresearch/dlrm torchrec_dlrm, MLPerf
# recommendation_v2), by its underscore name.
DLRM_MAIN_FLAGS: dict[str, Meaning] = {
    "epochs": Same("--epochs"),
    "batch_size": Refused("it is per rank; --batch-size here is GLOBAL: give it the "
                          "per-rank size times the number of ranks"),
    "drop_last_training_batch": Refused("no flag: with one rank the last short training batch is trained on, "
                                        "with several it is dropped (the ranks step in lock-step)"),
    "test_batch_size": Refused("it is per rank; --eval-batch-size here is GLOBAL "
                               "(the per-rank size times the number of ranks) and serves validation and test"),
    "limit_train_batches": Same("--limit-train-batches"),
    "limit_val_batches": Same("--limit-val-batches"),
    "limit_test_batches": Refused("no separate limit: --limit-val-batches caps the validation and the test "
                                  "split alike"),
    "dataset_name": Refused("no equivalent: --data names the Parquet directory (from `torchrec-tpu data "
                            "convert`), or --in-memory-binary-criteo-path TorchRec's .npy days; their "
                            "columns say which Criteo it is"),
    "num_workers": Refused("no equivalent: the readers prefetch batches on threads of their own (no "
                           "DataLoader workers)"),
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
    "pin_memory": Refused("not needed: no CUDA host-to-device copies (batches go to the tpu device as they are)"),
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
    "evaluate_on_training_end": Refused("not needed: train always evaluates at the end, the test split too "
                                        "when --eval-files is 2 or more"),
    "adagrad": Sets({None: {"sparse_optimizer": "adagrad", "dense_optimizer": "adagrad"}}),
    "interaction_type": Sets({"original": {"model": "dlrm"}, "dcn": {"model": "dlrm_dcn"}, "projection": None},
                             why=_PROJECTION),
    "collect_multi_hot_freqs_stats": Refused("no equivalent: no statistics of embedding-row access are "
                                             "collected"),
    "multi_hot_sizes": Same("--multi-hot-sizes"),
    "multi_hot_distribution_type": Refused("no choice: --multi-hot-sizes adds fixed uniformly random offsets of "
                                           "each id (dlrm_main's 'uniform'); 'pareto' is not offered"),
    "lr_warmup_steps": Same("--lr-warmup-steps"),
    "lr_decay_start": Same("--lr-decay-start"),
    "lr_decay_steps": Same("--lr-decay-steps"),
    "print_lr": Refused("no equivalent: each step's learning rates go to TensorBoard "
                        "(train/learning_rate/sparse and /dense), not the console"),
    "allow_tf32": Refused("no equivalent: TF32 is an NVIDIA GPU mode; --precision bf16 is the TPU's "
                          "reduced-precision matmul"),
    "print_sharding_plan": Same("--print-sharding-plan"),
    "print_progress": Same("--progress"),
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
        raise argparse.ArgumentError(None, f"{option_string} (TorchRec dlrm_main's flag): {self.why}")


class _Set(argparse.Action):
    """Sets the options of :class:`Sets` for the value given (or for the flag, without one)."""

    def __init__(self, *args: Any, meaning: Sets, **kwargs: Any) -> None:
        super().__init__(*args, default=argparse.SUPPRESS, **kwargs)
        self.meaning = meaning

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        options = self.meaning.options[None if self.nargs == 0 else values]
        if options is None:
            raise argparse.ArgumentError(None, f"{option_string} {values} (TorchRec dlrm_main's flag): "
                                               f"{self.meaning.why}")
        for option, value in options.items():
            setattr(namespace, option, value)
