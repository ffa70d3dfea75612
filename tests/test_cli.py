"""The `torchrec-tpu` dispatcher: every subcommand is reachable and documents itself."""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from torchrec_tpu.cli import SUBCOMMANDS, main


def test_top_level_help_lists_every_subcommand_without_importing_jobs():
    code = (
        "import sys\n"
        "from torchrec_tpu.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'top-level --help must not import torch'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    for name in SUBCOMMANDS:
        assert name in out.stdout


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_subcommand_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    assert f"torchrec-tpu {command}" in capsys.readouterr().out


def test_unknown_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["no-such-job"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["infer", "profile"])
def test_a_subcommand_module_run_as_a_script_is_the_subcommand(command, tmp_path):
    """``python -m torchrec_tpu.<job>.cli`` runs ``torchrec-tpu <job>``: its errors are one line, rc 2."""
    module = SUBCOMMANDS[command][0]
    missing = str(tmp_path / "missing")
    flags = {"infer": ["--data", missing, "--checkpoint", missing, "--output", str(tmp_path / "out")],
             "profile": ["--data", missing]}[command]
    done = subprocess.run([sys.executable, "-m", module, *flags], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(f"torchrec-tpu {command}: error:"), done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def _entry_points(path: Path) -> list[str]:
    """What in the module at ``path`` is an entry point of its own: a top-level ``main`` or a
    parser built outside the dispatcher (``argparse.ArgumentParser(...)``)."""
    tree = ast.parse(path.read_text())
    found = [f"def {node.name}" for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main"]
    found += [ast.unparse(node.func) for node in ast.walk(tree)
              if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("ArgumentParser")]
    return found


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_subcommand_runs_through_the_one_entry_point(command):
    """A subcommand module gives ``add_arguments`` and ``run``; parsing, logging and error lines
    are ``torchrec_tpu.cli.main``'s alone (the planner kept a ``main`` of its own)."""
    path = Path(importlib.util.find_spec(SUBCOMMANDS[command][0]).origin)
    tree = ast.parse(path.read_text())
    functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert {"add_arguments", "run"} <= functions, path
    assert _entry_points(path) == [], path


def test_the_entry_point_finder_sees_a_main_and_a_parser(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import argparse\ndef main():\n    parser = argparse.ArgumentParser(prog='x')\n")
    assert _entry_points(module) == ["def main", "argparse.ArgumentParser"]
