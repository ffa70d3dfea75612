"""Every flag of TorchRec's dlrm_main.py works with its meaning or is refused with one line saying why.

The list is dlrm_main's ``parse_args`` (torchrec examples/dlrm, facebookresearch/dlrm torchrec_dlrm,
MLPerf training recommendation_v2/torchrec_dlrm), written out here by hand.
"""

from __future__ import annotations

import pytest

from torchrec_tpu.cli import build_parser, main
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
    "--batch_size": (["32"], "--batch-size here is GLOBAL"),
    "--drop_last_training_batch": ([], "with several it is dropped"),
    "--test_batch_size": (["32"], "--eval-batch-size here is GLOBAL"),
    "--limit_test_batches": (["3"], "--limit-val-batches caps the validation and the test"),
    "--dataset_name": (["criteo_1t"], "--data names the Parquet directory"),
    "--num_workers": (["2"], "no DataLoader workers"),
    "--interaction_branch1_layer_sizes": (["2048,2048"], "DLRM_Projection"),
    "--interaction_branch2_layer_sizes": (["2048,2048"], "DLRM_Projection"),
    "--undersampling_rate": (["0.3"], "no undersampling"),
    "--pin_memory": ([], "no CUDA host-to-device copies"),
    "--synthetic_multi_hot_criteo_path": (["/d"], "--multi-hot-sizes expands"),
    "--shuffle_training_set": ([], "--shuffle-batches shuffles"),
    "--evaluate_on_epoch_end": ([], "every --eval-every N steps"),
    "--evaluate_on_training_end": ([], "always evaluates at the end"),
    "--collect_multi_hot_freqs_stats": ([], "no statistics"),
    "--multi_hot_distribution_type": (["pareto"], "'pareto' is not offered"),
    "--print_lr": ([], "train/learning_rate/sparse"),
    "--allow_tf32": ([], "--precision bf16"),
}


def test_the_list_is_dlrm_mains_whole_flag_list() -> None:
    assert len(MAPPED) + len(REFUSED) == 43
    assert {flag[2:] for flag in [*MAPPED, *REFUSED]} == set(DLRM_MAIN_FLAGS)


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
