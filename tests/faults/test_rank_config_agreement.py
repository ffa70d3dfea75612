"""Ranks launched with different flags (rank 1 `--num-embeddings 500`) are refused at start: every
rank fails at once, one line (said once) naming each differing option and the ranks' values, before
any model is built or checkpoint written, and before any collective: flags that change how the
ranks join the group (`--dense-device tpu` asks for the XLA transport) hung until the collective
timeout. Real ranks: two CLI processes joining one process group on loopback from the
environment torchrun gives its workers."""

from __future__ import annotations

import time

import pytest

from tests.faults.conftest import TRAIN_FLAGS
from tests.train.cli_ranks import TAIL, finish_cli_ranks, start_cli_ranks

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]  # two ranks start (~30 s on 2 busy cores)


@pytest.mark.parametrize("per_rank, expected", [
    ([["--num-embeddings", "1000"], ["--num-embeddings", "500", "--sparse-lr", "0.5"]],
     "--num-embeddings is 1000 on rank 0, 500 on rank 1; --sparse-lr is "),
    ([["--num-embeddings", "100", "--dense-device", "tpu"], ["--num-embeddings", "100", "--dense-device", "cpu"]],
     "--dense-device is 'tpu' on rank 0, 'cpu' on rank 1 ("),
])
def test_ranks_with_different_flags_all_fail_with_one_line_naming_the_options(tiny_dataset, tmp_path, per_rank,
                                                                              expected):
    flags = [f for f in TRAIN_FLAGS if f not in ("--num-embeddings", "100")]
    started = time.monotonic()
    ranks = start_cli_ranks(["train", "--data", str(tiny_dataset), *flags, "--log-dir", str(tmp_path / "run"),
                             "--collective-timeout", "120"], tmp_path / "ranks", per_rank=per_rank)
    results = [(rc, out.read_text()) for rc, (_, out) in zip(finish_cli_ranks(ranks, timeout=240), ranks)]
    assert time.monotonic() - started < 100, "refusing must not wait for the collective timeout"
    lines = []
    for rc, output in results:
        assert rc == 2 and "Traceback" not in output, output[-TAIL:]
        lines += [line for line in output.splitlines() if "error:" in line]
    (line,) = lines  # said once, by the first rank to fail
    assert f"the ranks were launched with different training options: {expected}" in line, line
    assert not (tmp_path / "run").exists()  # refused before claiming a directory
