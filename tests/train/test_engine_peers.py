"""The two engines are peers: nothing in ``torchrec_tpu/train`` branches on an engine's name (the
engine object, or its registry entry's traits, answer); the names appear only in the registry
(``train/engine_kinds.py``) and as each engine class's own ``name``."""

from __future__ import annotations

import ast
from pathlib import Path

from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.engine_kinds import ENGINES
from torchrec_tpu.train.engines import engine_for
from torchrec_tpu.train.optimizers import DENSE_OPTIMIZERS, SPARSE_OPTIMIZERS

TRAIN = Path(__file__).resolve().parents[2] / "torchrec_tpu" / "train"
REGISTRY = TRAIN / "engine_kinds.py"


def _engine_name_uses(path: Path) -> list[str]:
    """Comparisons (``==``, ``!=``, ``in``) and subscripts with an engine name as a literal."""
    names = set(ENGINES)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            literals = [c for o in operands for c in ast.walk(o) if isinstance(c, ast.Constant)]
        elif isinstance(node, ast.Subscript):
            literals = [node.slice] if isinstance(node.slice, ast.Constant) else []
        elif isinstance(node, ast.match_case):
            literals = [c for c in ast.walk(node.pattern) if isinstance(c, ast.Constant)]
        else:
            continue
        if any(c.value in names for c in literals):
            found.append(f"{path}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_nothing_in_train_branches_on_an_engine_name() -> None:
    offenders = [use for path in sorted(TRAIN.rglob("*.py")) if path != REGISTRY for use in _engine_name_uses(path)]
    assert not offenders, "branch on the engine object or its EngineKind traits instead:\n" + "\n".join(offenders)


def test_the_finder_sees_a_branch(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text('def f(config, table):\n'
                      '    if config.engine.kind == "sparsecore":\n'
                      '        return table["torchrec"]\n'
                      '    return config.engine.kind in ("torchrec", "other")\n')
    assert sorted(use.split(":")[1] for use in _engine_name_uses(sample)) == ["2", "3", "4"]


def test_registry_vocabularies_are_the_option_choices() -> None:
    from torchrec_tpu.train.config import OPTIONS

    def choices(name: str) -> tuple:
        return tuple(OPTIONS[name][1].metadata["choices"])

    assert choices("engine") == tuple(ENGINES)
    assert choices("sparse_optimizer") == tuple(SPARSE_OPTIMIZERS)
    assert choices("dense_optimizer") == tuple(DENSE_OPTIMIZERS)


def test_each_engine_answers_for_itself() -> None:
    for name, kind in ENGINES.items():
        engine = engine_for(TrainConfig.from_options(engine=name))
        assert engine.name == name and type(engine) is kind.load()
        assert engine.needs_device_tensors is False  # dense_device auto/cpu: host tensors
    tpu = engine_for(TrainConfig.from_options(engine="sparsecore", dense_device="tpu"))
    assert tpu.needs_device_tensors is True


def test_one_optimizer_vocabulary_for_both_engines() -> None:
    import torch
    from torchrec.optim import RowWiseAdagrad as TorchRecRowWise

    import sparsecore

    assert SPARSE_OPTIMIZERS["adagrad"].torch_class() is torch.optim.Adagrad
    assert SPARSE_OPTIMIZERS["rowwise_adagrad"].torch_class() is TorchRecRowWise
    for name, optimizer in SPARSE_OPTIMIZERS.items():
        spec = optimizer.sparsecore_spec(0.1)
        assert isinstance(spec, sparsecore.OptimizerSpec) and spec.name == name
        assert tuple(spec.slot_names) == (*optimizer.slots[0], *optimizer.slots[1])
    assert DENSE_OPTIMIZERS["adam"].torch_class() is torch.optim.Adam


# docs/architecture/training.md, "Training rooms": what each room may import from the rest of train/
ROOM_IMPORTS = {
    "engines": {"config", "model", "loop", "metrics", "learning_rate", "distributed", "plan_file", "engine_kinds",
                "optimizers"},
    "checkpoint": {"config", "loop", "model_kinds"},
    "streams": {"config"},
    # the options sit below the engines: only the leaves naming the engines, models and optimizers
    "config": {"engine_kinds", "model_kinds", "optimizers", "dlrm_main_flags", "spellings"},
    "spellings": {"dlrm_main_flags"},
    "engine_kinds": set(),
    "model_kinds": set(),
    "optimizers": set(),
    "dlrm_main_flags": set(),
}


def _train_modules_imported(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        modules = ([node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                   else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        out.update(m.split(".")[2] for m in modules if m.startswith("torchrec_tpu.train."))
    return out


def test_rooms_import_what_the_architecture_says() -> None:
    offenders = []
    for room, allowed in ROOM_IMPORTS.items():
        paths = sorted((TRAIN / room).rglob("*.py")) if (TRAIN / room).is_dir() else [TRAIN / f"{room}.py"]
        for path in paths:
            wrong = _train_modules_imported(path) - allowed - {room}
            if wrong:
                offenders.append(f"{path.relative_to(TRAIN)} imports train.{sorted(wrong)}")
    assert not offenders, "\n".join(offenders)


def _engine_circles(paths: list[Path]) -> list[str]:
    """Import circles among the modules ``paths`` (every import, lazy ones inside functions too),
    each as ``a -> b -> a``."""
    names = {f"torchrec_tpu.train.engines.{path.stem}": path for path in paths if path.stem != "__init__"}
    graph = {}
    for name, path in names.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
        graph[name] = sorted((imported & set(names)) - {name})
    circles, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in graph[node]:
            if nxt in path:
                circles.append(" -> ".join([*path[path.index(nxt):], nxt]))
            elif nxt not in done:
                visit(nxt, [*path, nxt])
        done.add(node)

    for name in sorted(graph):
        if name not in done:
            visit(name, [name])
    return circles


def test_the_engines_import_each_other_without_a_circle() -> None:
    """``--dense-device auto``'s calibration receives the engine's step builder rather than
    importing the engines (it was a 5-module circle: dense_placement -> dense_calibration ->
    sparsecore_engine / step_layout / dense_step -> dense_placement)."""
    circles = _engine_circles(sorted((TRAIN / "engines").glob("*.py")))
    assert not circles, "\n".join(circles)


def test_the_circle_finder_sees_a_lazy_circle(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from torchrec_tpu.train.engines.b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from torchrec_tpu.train.engines import a\n")
    (tmp_path / "c.py").write_text("import torchrec_tpu.train.engines.a\n")
    assert _engine_circles(sorted(tmp_path.glob("*.py"))) == [
        "torchrec_tpu.train.engines.a -> torchrec_tpu.train.engines.b -> torchrec_tpu.train.engines.a"]
