"""Every flag of TorchRec's dlrm_main.py works with its meaning or is refused with one line saying why.

The list is dlrm_main's ``parse_args`` (torchrec examples/dlrm, facebookresearch/dlrm torchrec_dlrm,
MLPerf training recommendation_v2/torchrec_dlrm), written out here by hand.
"""

from __future__ import annotations

import logging

import pytest

from torchrec_tpu.cli import build_parser, main
from torchrec_tpu.train.config import ConfigError, TrainConfig, config_from_args, log_notes
from torchrec_tpu.train.dlrm_main_flags import DLRM_MAIN_FLAGS

# dlrm_main flag -> (its arguments, the same run spelt with our flags)
MAPPED: dict[str, tuple[list[str], list[str]]] = {
    "--epochs": (["3"], ["--epochs", "3"]),
    "--limit_train_batches": (["7"], ["--limit-train-batches", "7"]),
    "--limit_val_batches": (["5"], ["--limit-val-batches", "5"]),
    "--num_embeddings": (["1000"], ["--num-embeddings", "1000"]),
    "--num_embeddings_per_feature": (["5,6"], ["--num-embeddings-per-feature", "5,6"]),
    "--dense_arch_layer_sizes": (["512,256,64"], ["--dense-arch", "512,256,64"]),
    "--over_arch_layer_sizes": (["512,512,256,1"], ["--over-arch", "512,512,256,1"]),
    "--embedding_dim": (["64"], ["--embedding-dim", "64"]),
    "--dcn_num_layers": (["3"], ["--dcn-num-layers", "3"]),
    "--dcn_low_rank_dim": (["512"], ["--dcn-low-rank-dim", "512"]),
    "--seed": (["4"], ["--seed", "4"]),
    "--mmap_mode": ([], ["--mmap-mode"]),
    "--in_memory_binary_criteo_path": (["/d"], ["--in-memory-binary-criteo-path", "/d"]),
    "--learning_rate": (["15.0"], ["--learning-rate", "15.0"]),  # SGD at 15.0: test_learning_rate_means_sgd_...
    "--shuffle_batches": ([], ["--shuffle-batches"]),
    "--validation_freq_within_epoch": (["100"], ["--eval-every", "100"]),
    "--validation_auroc": (["0.80275"], ["--target-auc", "0.80275"]),
    "--adagrad": ([], ["--sparse-optimizer", "adagrad", "--dense-optimizer", "adagrad"]),
    "--interaction_type": (["dcn"], ["--model", "dlrm_dcn"]),
    "--multi_hot_sizes": (["3,2"], ["--multi-hot-sizes", "3,2"]),
    "--lr_warmup_steps": (["10"], ["--lr-warmup-steps", "10"]),
    "--lr_decay_start": (["20"], ["--lr-decay-start", "20"]),
    "--lr_decay_steps": (["30"], ["--lr-decay-steps", "30"]),
    "--print_sharding_plan": ([], ["--print-sharding-plan"]),
    "--print_progress": ([], ["--progress"]),
}

# dlrm_main flag -> (its arguments, what the one-line refusal must name)
REFUSED: dict[str, tuple[list[str], str]] = {
    "--drop_last_training_batch": ([], "with several it is dropped"),
    "--limit_test_batches": (["3"], "--limit-val-batches caps the validation and the test"),
    "--dataset_name": (["criteo_1t"], "--data names the Parquet directory"),
    "--interaction_branch1_layer_sizes": (["2048,2048"], "DLRM_Projection"),
    "--interaction_branch2_layer_sizes": (["2048,2048"], "DLRM_Projection"),
    "--undersampling_rate": (["0.3"], "no undersampling"),
    "--synthetic_multi_hot_criteo_path": (["/d"], "--multi-hot-sizes expands"),
    "--shuffle_training_set": ([], "--shuffle-batches shuffles"),
    "--evaluate_on_epoch_end": ([], "every --eval-every N steps"),
    "--collect_multi_hot_freqs_stats": ([], "no statistics"),
    "--multi_hot_distribution_type": (["pareto"], "'pareto' is not offered"),
    "--change_lr": ([], "no step change of the learning rate"),
    "--lr_change_point": (["0.8"], "--lr-warmup-steps, --lr-decay-start, --lr-decay-steps"),
    "--lr_after_change_point": (["0.2"], "no step change of the learning rate"),
    "--print_lr": ([], "train/learning_rate/sparse"),
}


# dlrm_main flag -> its arguments: taken as given, changing nothing here (said in the one note line)
NOTED: dict[str, list[str]] = {
    "--pin_memory": [], "--num_workers": ["4"], "--evaluate_on_training_end": [], "--allow_tf32": [],
    "--multi_hot_distribution_type": ["uniform"],
}
# dlrm_main's per-rank sizes -> our global option they set (times the world size)
PER_RANK = {"--batch_size": "batch_size", "--test_batch_size": "eval_batch_size"}


def test_the_list_is_dlrm_mains_whole_flag_list() -> None:
    flags = {flag[2:] for flag in [*MAPPED, *REFUSED, *NOTED, *PER_RANK]}
    assert len(flags) == 46  # v2's 43 and MLPerf v1's --change_lr family
    assert flags == set(DLRM_MAIN_FLAGS)


def _parsed(command: str, argv: list[str]) -> dict:
    args, unknown = build_parser(command).parse_known_args([command, *argv])
    assert not unknown
    return {k: v for k, v in vars(args).items() if not k.startswith("_")}  # (not _run, the spellings noted)


@pytest.mark.parametrize("flag", sorted(MAPPED))
def test_flag_means_what_it_means_in_dlrm_main(flag: str) -> None:
    values, ours = MAPPED[flag]
    expected = _parsed("train", ours)
    assert expected != _parsed("train", []), ours  # the flag of ours sets something
    assert _parsed("train", [flag, *values]) == expected
    assert _parsed("train", [flag.replace("_", "-"), *values]) == expected  # dlrm_main's flag with dashes


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_flag_is_refused_with_one_line_saying_why(flag: str, capsys: pytest.CaptureFixture) -> None:
    values, named = REFUSED[flag]
    with pytest.raises(SystemExit) as exc:
        main(["train", flag, *values, "--epochs", "1"])
    assert exc.value.code == 2
    error = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(error) == 1 and flag in error[0] and named in error[0], error
    assert "did you mean" not in error[0]


def test_projection_interaction_is_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--interaction_type", "projection"])
    assert "--model dlrm (original) or dlrm_dcn (dcn)" in capsys.readouterr().err


def test_profile_takes_the_flags_that_shape_the_step_and_refuses_the_others(capsys: pytest.CaptureFixture) -> None:
    assert _parsed("profile", ["--dense_arch_layer_sizes", "64,16"])["dense_arch"] == "64,16"
    with pytest.raises(SystemExit):
        main(["profile", "--validation_freq_within_epoch", "5"])
    assert "sets --eval-every, which `torchrec-tpu profile` does not take" in capsys.readouterr().err


def test_a_typo_gets_our_flag_not_dlrm_mains_spelling(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--embeding_dim", "8"])
    assert "(did you mean --embedding-dim?)" in capsys.readouterr().err


def _config(argv: list[str], world_size: int = 1) -> tuple[TrainConfig, list[str]]:
    notes: list[str] = []
    args, unknown = build_parser("train").parse_known_args(["train", *argv])
    assert not unknown
    return config_from_args(args, world_size, notes), notes


def test_no_op_flags_are_taken_with_one_note_line(caplog: pytest.LogCaptureFixture) -> None:
    argv = [part for flag, values in NOTED.items() for part in (flag, *values)]
    config, notes = _config(argv)
    assert config == _config([])[0]  # nothing changed
    assert len(notes) == len(NOTED) and all(flag in text for flag, text in zip(NOTED, notes))
    with caplog.at_level(logging.INFO):
        log_notes(notes)
    said = [record.getMessage() for record in caplog.records]
    assert len(said) == 1 and said[0].startswith("note: ") and all(flag in said[0] for flag in NOTED), said


@pytest.mark.parametrize("world_size", [1, 4])
def test_per_rank_batch_sizes_are_the_global_ones_over_the_world(world_size: int) -> None:
    """dlrm_main's ``--batch_size`` is each rank's batch: here the global batch is it x the ranks."""
    config, notes = _config(["--batch_size", "32", "--test_batch_size", "64"], world_size)
    assert (config.data.batch_size, config.data.eval_batch_size) == (32 * world_size, 64 * world_size)
    assert f"--batch_size 32 is per rank (dlrm_main's): --batch-size {32 * world_size} here" in notes[0]
    agreeing, _ = _config(["--batch_size", "32", "--batch-size", str(32 * world_size)], world_size)
    assert agreeing.data.batch_size == 32 * world_size
    with pytest.raises(ConfigError, match=rf"--batch-size 100 \(global\) and dlrm_main's per-rank size x "
                                          rf"{world_size} rank\(s\) = {32 * world_size} disagree"):
        _config(["--batch_size", "32", "--batch-size", "100"], world_size)


def test_a_pasted_line_is_refused_whole_in_one_message(capsys: pytest.CaptureFixture) -> None:
    """Issue 77 ask 1: every refusal of the line (and the unknown flags) in one error line; flags
    refused for one reason named together."""
    with pytest.raises(SystemExit) as exc:
        main(["train", "--pin_memory", "--batch_size", "32", "--change_lr", "--lr_change_point", "0.8",
              "--lr_after_change_point", "0.2", "--multi_hot_distribution_type", "pareto", "--shuffle_training_set",
              "--frobnicate"])
    assert exc.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1, errors
    assert ("error: --change_lr, --lr_change_point, --lr_after_change_point (TorchRec dlrm_main's flags): no step "
            "change of the learning rate") in errors[0]
    for named in ("--multi_hot_distribution_type pareto (TorchRec dlrm_main's flag)", "--shuffle_training_set",
                  "unrecognized arguments: --frobnicate"):
        assert named in errors[0], errors[0]
    assert "--pin_memory" not in errors[0] and "--batch_size" not in errors[0]  # taken
