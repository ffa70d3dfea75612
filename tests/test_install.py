"""The README's pip install line works in a fresh virtual environment (slow: it installs the stack)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from torchrec_tpu import __version__

REPO_ROOT = Path(__file__).resolve().parents[1]


def documented_install_command() -> list[str]:
    """The one ``pip install`` line of the README's "Install with pip" section."""
    section = (REPO_ROOT / "README.md").read_text().split("## Install with pip", 1)[1]
    lines = re.findall(r"^pip install .+$", section, flags=re.MULTILINE)
    assert len(lines) >= 1, "README 'Install with pip' has no `pip install` line"
    return shlex.split(lines[0])


def test_readme_install_line_names_the_alias_and_the_project():
    assert documented_install_command() == ["pip", "install", "./packaging/fbgemm-gpu-cpu-alias", "."]


def test_version_flag_prints_the_package_version():
    out = subprocess.run([sys.executable, "-m", "torchrec_tpu.cli", "--version"],
                         capture_output=True, text=True, check=True, cwd=REPO_ROOT).stdout
    assert out.strip() == f"torchrec-tpu {__version__}"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_documented_pip_install_trains_in_a_fresh_venv(tmp_path):
    source = tmp_path / "src"
    shutil.copytree(REPO_ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".venv", ".git", "runs", "build", "*.egg-info", "__pycache__", ".pytest_cache"))
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    command = documented_install_command()
    subprocess.run([str(python), "-m", *command, "--disable-pip-version-check", "-q"],
                   cwd=source, check=True, timeout=1500)
    # Run from outside the source tree: the installed package, not the checkout, must serve.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    imports = "import fbgemm_gpu, jax, matplotlib, pyarrow, ray, torch, torchrec, torchrec_tpu, sparsecore, pipelines"
    subprocess.run([str(python), "-c", imports], cwd=run_dir, check=True, timeout=300)
    version = subprocess.run([str(env_dir / "bin" / "torchrec-tpu"), "--version"], cwd=run_dir,
                             capture_output=True, text=True, check=True).stdout
    assert version.strip() == f"torchrec-tpu {__version__}"
    train = subprocess.run(
        [str(env_dir / "bin" / "torchrec-tpu"), "train", "--data", "sample", "--max-steps", "5",
         "--log-dir", str(run_dir / "log"), "--no-progress"],
        cwd=run_dir, capture_output=True, text=True, timeout=600)
    assert train.returncode == 0, train.stderr[-3000:]
    assert "eval AUC" in train.stdout
    assert (run_dir / "log" / "checkpoint" / "latest").exists()


def test_alias_pins_the_fbgemm_gpu_cpu_of_the_project():
    """pip resolves the one fbgemm-gpu-cpu both name at once (no download of a newer release first)."""
    import tomllib

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    alias = tomllib.loads((REPO_ROOT / "packaging" / "fbgemm-gpu-cpu-alias" / "pyproject.toml").read_text())
    pin = next(d for d in project if d.startswith("fbgemm-gpu-cpu"))
    assert pin == "fbgemm-gpu-cpu==1.8.0" and alias["project"]["dependencies"] == [pin]
