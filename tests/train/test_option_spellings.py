"""One option, one value: two spellings of an option (dash/underscore, an alias, a dlrm_main flag)
with different values are refused naming both, on the command line and in a YAML file, and the
order of YAML keys never decides. TorchRec dlrm_main's ``--learning_rate`` means what it means
there: SGD for both optimizers unless ``--adagrad``."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from torchrec_tpu.cli import main
from torchrec_tpu.train.config import ConfigError, TrainConfig, add_config_arguments, config_from_args


def _config(*argv: str) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


@pytest.mark.parametrize("argv, first, second", [
    (["--embedding_dim", "8", "--embedding-dim", "16"], "--embedding_dim 8", "--embedding-dim 16"),
    (["--validation-freq", "3", "--eval-every", "4"], "--validation-freq 3", "--eval-every 4"),
    (["--dense_arch_layer_sizes", "8,4", "--dense-arch", "16,8"], "--dense_arch_layer_sizes 8,4",
     "--dense-arch 16,8"),
    (["--adagrad", "--dense-optimizer", "adam"], "--adagrad (--dense-optimizer adagrad)", "--dense-optimizer adam"),
    (["--interaction_type", "dcn", "--model", "dlrm"], "--interaction_type (--model dlrm_dcn)", "--model dlrm"),
    (["--print_progress", "--no-progress"], "--print_progress", "--no-progress"),
    (["--learning_rate", "0.1", "--learning-rate", "0.2"], "--learning_rate 0.1", "--learning-rate 0.2"),
])
def test_two_spellings_with_different_values_are_refused_naming_both(argv, first, second, capsys) -> None:
    with pytest.raises(ConfigError) as raised:
        _config(*argv)
    assert str(raised.value).startswith(f"{first} and {second} set the same option"), raised.value
    assert main(["train", *argv]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1 and first in errors[0] and second in errors[0], errors


def test_two_spellings_agreeing_and_one_spelling_repeated_are_fine() -> None:
    assert _config("--embedding_dim", "16", "--embedding-dim", "16").model.embedding_dim == 16
    assert _config("--adagrad", "--sparse-optimizer", "adagrad").optim.sparse_optimizer == "adagrad"
    assert _config("--eval-every", "3", "--eval-every", "5").loop.eval_every == 5  # argparse's rule: the last


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, named", [
    ("embedding_dim: 8\nembedding-dim: 16\n", "embedding-dim: 16 and embedding_dim: 8"),
    ("validation_freq: 3\neval_every: 4\n", "eval_every: 4 and validation_freq: 3"),
    ("embedding_dim: 8\nbatch_size: 4\nembedding_dim: 16\n", "key 'embedding_dim' is given twice (lines 1 and 3)"),
])
def test_a_yaml_file_giving_one_option_twice_is_refused(tmp_path, text, named) -> None:
    with pytest.raises(ConfigError, match="give it once") as raised:
        _config("--config", _yaml(tmp_path, text))
    assert named in str(raised.value)


@pytest.mark.parametrize("text", ["sparse_lr: 0.1\nlearning_rate: 0.5\n", "learning_rate: 0.5\nsparse_lr: 0.1\n"])
def test_yaml_key_order_never_decides(tmp_path, text) -> None:
    """The option named beats the shorthand setting it, in either order."""
    optim = _config("--config", _yaml(tmp_path, text)).optim
    assert (optim.sparse_lr, optim.dense_lr) == (0.1, 0.5)


def test_flag_order_never_decides() -> None:
    for argv in (["--dense-lr", "0.1", "--learning-rate", "0.3"], ["--learning-rate", "0.3", "--dense-lr", "0.1"]):
        optim = _config(*argv).optim
        assert (optim.sparse_lr, optim.dense_lr) == (0.3, 0.1)


def test_learning_rate_is_sgd_without_adagrad_as_in_dlrm_main(tmp_path) -> None:
    """dlrm_main: ``optimizer = Adagrad if args.adagrad else SGD`` for the embeddings and the dense
    part alike, both at ``--learning_rate``."""
    sgd = _config("--learning_rate", "5.0").optim
    assert (sgd.sparse_optimizer, sgd.dense_optimizer, sgd.sparse_lr, sgd.dense_lr) == ("sgd", "sgd", 5.0, 5.0)
    adagrad = _config("--learning_rate", "5.0", "--adagrad").optim
    assert (adagrad.sparse_optimizer, adagrad.dense_optimizer) == ("adagrad", "adagrad")
    # an optimizer named anywhere (flag or YAML) is kept; only the unnamed one is implied
    mixed = _config("--learning-rate", "0.1", "--dense-optimizer", "adam").optim
    assert (mixed.sparse_optimizer, mixed.dense_optimizer) == ("sgd", "adam")
    named_in_yaml = _config("--config", _yaml(tmp_path, "sparse_optimizer: adagrad\ndense_optimizer: adagrad\n"),
                            "--learning_rate", "0.01").optim
    assert (named_in_yaml.sparse_optimizer, named_in_yaml.dense_optimizer) == ("adagrad", "adagrad")
    default = _config().optim  # no --learning_rate: our defaults, Adagrad
    assert (default.sparse_optimizer, default.dense_optimizer) == ("adagrad", "adagrad")


def test_dense_sgd_is_torchs_sgd() -> None:
    import torch

    from torchrec_tpu.train.optimizers import dense_optimizer

    params = [torch.nn.Parameter(torch.tensor([1.0, -2.0]))]
    params[0].grad = torch.tensor([0.5, 0.25])
    dense_optimizer("sgd").build(params, lr=0.1).step()
    torch.testing.assert_close(params[0].detach(), torch.tensor([1.0 - 0.05, -2.0 - 0.025]))
