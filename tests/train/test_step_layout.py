"""The step layout decides once whether the embedding lookup runs inside the step program, and
says so in its log line; the places after it take the layout instead of re-deciding or sniffing
the towers' device from their parameters."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import torch_tpu  # noqa: F401  (registers the tpu device)
from torchrec_tpu.train.config import EngineConfig, OptimConfig
from torchrec_tpu.train.engines.step_layout import lookup_outside, sparsecore_layout

TPU = torch.device("tpu", 0)
ENGINES = Path(__file__).resolve().parents[2] / "torchrec_tpu" / "train" / "engines"


def _layout(local_batch: int, backend: str = "auto"):
    return sparsecore_layout(EngineConfig(sparse_backend=backend), OptimConfig(), 1, local_batch, TPU)


def test_a_batch_the_sparsecores_split_runs_the_lookup_inside():
    layout = _layout(64)
    assert layout.one_program and layout.lookup_in_step and layout.sparse_backend == "ops"
    assert "one compiled program per step and rank (embedding lookup and update inside)" in layout.describe()


@pytest.mark.parametrize("local_batch", [6, 30, 65])
def test_a_batch_the_sparsecores_do_not_split_says_the_lookup_runs_outside(local_batch):
    """(A v5p chip's 4 SparseCores: a per-rank batch not a multiple of 4 is padded, which the
    step program cannot take.) The layout line says so, with the flag that changes it."""
    layout = _layout(local_batch)
    assert layout.one_program and not layout.lookup_in_step and not layout.uniform_ranks
    line = layout.describe()
    assert f"a per-rank batch of {local_batch} is not a multiple of 4" in line
    assert "the embedding lookup and update outside it" in line and "--batch-size a multiple of 4" in line
    assert "(embedding lookup and update inside)" not in line


def test_the_other_reasons_name_their_flag():
    assert "--sparse-backend xla" in _layout(64, "xla").lookup_outside
    assert "--sparse-optimizer adam" in lookup_outside("ops", "adam", False, 4, 1, 64)
    # 4 SparseCores over 2 ranks: each rank's batch a multiple of 2, the global one of 4
    assert lookup_outside("ops", "adagrad", True, 4, 2, 6) == ""
    assert "--batch-size a multiple of 4" in lookup_outside("ops", "adagrad", True, 4, 2, 7)


def test_an_eager_step_has_no_lookup_in_it():
    layout = sparsecore_layout(EngineConfig(), OptimConfig(), 1, 64, torch.device("cpu"))
    assert not layout.one_program and not layout.lookup_in_step and "an eager step" in layout.describe()


def _functions(path: Path) -> dict[str, ast.AST]:
    return {node.name: node for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def test_the_layout_is_the_only_source_of_the_dense_device():
    """No parameter's device is read to learn where the towers run (the layout says it)."""
    for path in ENGINES.glob("*.py"):
        assert "dense_device_of" not in path.read_text(), path.name
    optimizer = _functions(ENGINES / "sparsecore_engine.py")["build_dense_optimizer"]
    evaluation = _functions(ENGINES / "dense_step.py")["CompiledDenseEval"]
    for node in (optimizer, evaluation):  # e.g. ``p.device`` of a parameter ``p``
        reads = [n.value.id for n in ast.walk(node) if isinstance(n, ast.Attribute) and n.attr == "device"
                 and isinstance(n.value, ast.Name) and n.value.id not in ("torch", "self")]
        assert reads == [], (node.name, reads)


def test_nothing_after_the_layout_falls_back_silently():
    """The lookup is built only where the layout says it runs inside, and then cannot come back
    None (a condition it fails raises, naming it)."""
    lookup = _functions(Path(__file__).resolve().parents[2] / "torchrec_tpu" / "sharding" / "step_lookup.py")
    of = next(n for n in ast.walk(lookup["PooledLookup"]) if isinstance(n, ast.FunctionDef) and n.name == "of")
    assert not any(isinstance(n, ast.Return) and isinstance(n.value, ast.Constant) and n.value.value is None
                   for n in ast.walk(of))
    engine = (ENGINES / "sparsecore_engine.py").read_text()
    assert "except UniformityError" in engine and "build(False)" not in engine
    step = ast.get_source_segment((ENGINES / "dense_step.py").read_text(), _functions(ENGINES / "dense_step.py")[
        "CompiledDenseStep"]) or ""
    assert "if layout.lookup_in_step" in step
