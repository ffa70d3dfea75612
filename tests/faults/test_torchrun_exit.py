"""torchrun running the CLI: a user error at 2 ranks is one line, and the job ends with the rank's
exit code and no ChildFailedError page (torchrun printed a traceback and a 20-line summary); a rank
that died of a signal keeps torchrun's report."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.faults.helpers import cli_env, error_lines, torchrun_train
from torchrec_tpu import torchrun_exit


@pytest.mark.slow  # two ranks start (~35 s on 2 busy cores)
@pytest.mark.multiprocess
def test_a_user_error_at_two_ranks_is_one_line_and_the_ranks_exit_code(tmp_path):
    proc = subprocess.run(torchrun_train("--data", str(tmp_path / "missing")), env=cli_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Traceback" not in output and "ChildFailedError" not in output and "FAILED" not in output, output
    assert "failed (exitcode" not in output and "closing signal" not in output, output
    (line,) = error_lines(output)
    assert line.startswith("torchrec-tpu train: error: --data=") and "missing" in line, output


def test_only_torchruns_running_the_cli_are_quieted():
    assert torchrun_exit.is_torchrun_of_the_cli(
        ["/v/bin/python", "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "torchrec_tpu.cli", "train"])
    assert torchrun_exit.is_torchrun_of_the_cli(["/v/bin/python", "/v/bin/torchrun", "--no-python", "torchrec-tpu"])
    assert not torchrun_exit.is_torchrun_of_the_cli(["/v/bin/python", "/v/bin/torchrun", "train.py"])
    assert not torchrun_exit.is_torchrun_of_the_cli(["/v/bin/python", "-m", "torchrec_tpu.cli", "train"])
    assert not torchrun_exit.is_torchrun_of_the_cli(["python", "-m", "pytest", "tests/x.py"])


def _page_of(exitcode: int) -> subprocess.CompletedProcess:
    """A process whose uncaught ChildFailedError names a rank that exited with ``exitcode``, with the
    hook installed as in torchrun's process."""
    code = ("import sys; from torchrec_tpu import torchrun_exit;"
            "from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure;"
            "sys.excepthook = torchrun_exit._quiet_exit(sys.excepthook);"
            f"raise ChildFailedError('torchrec_tpu.cli', {{0: ProcessFailure(0, 123, {exitcode}, '')}})")
    return subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # two fresh interpreters importing torch (~20 s on 2 busy cores)
def test_a_rank_that_said_its_error_ends_the_launcher_quietly_a_signal_keeps_the_page():
    said = _page_of(2)
    assert (said.returncode, said.stderr) == (2, "")
    killed = _page_of(-9)
    assert killed.returncode == 1 and "ChildFailedError" in killed.stderr and "SIGKILL" in killed.stderr
