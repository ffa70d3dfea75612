"""The batch size's three meanings: the conversions against hand-counted sizes, and a rule that
the modules handling more than one of them never say the bare, ambiguous ``batch_size``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tpu_facts import global_batch_of, local_batch_of, padded_local_batch_of

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("global_batch", "world_size", "expected"), [(8, 1, 8), (8, 2, 4), (4096, 4, 1024), (3, 3, 1)])
def test_local_batch_is_an_even_share(global_batch: int, world_size: int, expected: int) -> None:
    assert local_batch_of(global_batch, world_size) == expected
    assert global_batch_of(expected, world_size) == global_batch


def test_an_uneven_split_names_the_sizes_and_the_nearest_multiples() -> None:
    with pytest.raises(ValueError, match=r"global batch of 10 does not split over 4 ranks \(nearest multiples: 8, 12"):
        local_batch_of(10, 4)
    with pytest.raises(ValueError, match="both must be >= 1"):
        local_batch_of(0, 2)


@pytest.mark.parametrize(("local_batch", "sparsecores", "world_size", "expected"), [
    (6, 4, 1, 8),      # one v5p chip: 4 SparseCores split 8, not 6
    (8, 4, 1, 8),      # already a multiple
    (6, 4, 2, 6),      # 2 ranks x 6 = 12 samples split over 4 SparseCores
    (5, 4, 2, 6),      # 2 x 5 = 10 does not; 2 x 6 = 12 does
    (3, 4, 4, 3),      # 4 ranks x 3 = 12
    (1, 16, 4, 4),     # 4 ranks x 4 = 16
    (7, 2, 8, 7),      # 8 ranks x 7 = 56 over 2
])
def test_padded_local_batch_is_the_smallest_that_the_sparsecores_split(
        local_batch: int, sparsecores: int, world_size: int, expected: int) -> None:
    padded = padded_local_batch_of(local_batch, sparsecores, world_size)
    assert padded == expected
    assert global_batch_of(padded, world_size) % sparsecores == 0
    assert all(global_batch_of(smaller, world_size) % sparsecores for smaller in range(local_batch, padded))


def test_padded_local_batch_refuses_empty_sizes() -> None:
    with pytest.raises(ValueError, match=r"padded_local_batch_of\(0, 4, 1\)"):
        padded_local_batch_of(0, 4, 1)


# Modules that handle more than one of the meanings: they say global_batch / local_batch /
# padded_local_batch.
NAMED_MODULES = ("torchrec_tpu/sharding/ebc.py", "torchrec_tpu/sharding/ec.py", "torchrec_tpu/sharding/step_lookup.py",
                 "torchrec_tpu/pipeline/prefetch.py", "torchrec_tpu/train/engines/dense_step.py",
                 "torchrec_tpu/train/engines/sparsecore_engine.py", "torchrec_tpu/train/engines/torchrec_engine.py",
                 "torchrec_tpu/train/engines/step_layout.py", "torchrec_tpu/train/engines/plan_loading.py",
                 "torchrec_tpu/train/engines/dense_placement.py", "torchrec_tpu/train/engines/dense_calibration.py",
                 "torchrec_tpu/train/streams.py", "torchrec_tpu/train/distributed.py", "torchrec_tpu/train/data.py",
                 *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "torchrec_tpu" / "hstu").rglob("*.py")))
# Where the bare name stays: DataConfig's (``data.batch_size``: --batch-size, the global batch), a
# reader's (``split.batch_size``, ``reader.batch_size``, HSTU's ``t.train.batch_size``: one rank's, the
# pipelines' public name), the public parameters of ``ShardedSparseCoreEBC.specs_of`` / ``from_torchrec``
# (``ShardedSparseCoreEC``'s too) and TorchRec's planner's keyword. A FeatureSpec's batch is read
# where the sharded modules take their features (``sharded_tables.given_local_batch``: this rank's)
# and set by meaning (``features_at(features, padded_local_batch)``).
OWNERS = {"data", "split", "reader", "train"}
PUBLIC_FUNCTIONS = {"specs_of", "from_torchrec"}
PUBLIC_KEYWORDS = {"EmbeddingShardingPlanner"}


def _bare_batch_sizes(path: Path) -> list[str]:
    found = []

    def visit(node: ast.AST, function: str | None) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        public = function in PUBLIC_FUNCTIONS
        if isinstance(node, ast.Attribute) and node.attr == "batch_size":
            owner = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", None)
            if owner not in OWNERS:
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
        elif isinstance(node, (ast.Name, ast.arg)) and getattr(node, "id", getattr(node, "arg", None)) == "batch_size":
            if not public:
                found.append(f"{path.name}:{node.lineno} batch_size")
        elif isinstance(node, ast.Call):
            for keyword in node.keywords:
                callee = ast.unparse(node.func)
                if keyword.arg == "batch_size" and callee not in PUBLIC_KEYWORDS and not public:
                    found.append(f"{path.name}:{keyword.value.lineno} {callee}(batch_size=...)")
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(path.read_text()), None)
    return found


def test_modules_name_each_batch_by_its_meaning() -> None:
    found = [hit for module in NAMED_MODULES for hit in _bare_batch_sizes(ROOT / module)]
    assert not found, f"say global_batch, local_batch or padded_local_batch (tpu_facts.batches): {found}"


def test_the_rule_catches_a_bare_batch_size(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def forward(self, kjt):\n    return kjt.stride() == self.batch_size\n"
                      "def specs_of(ebc, batch_size):\n    return [f.batch_size for f in ebc.features], batch_size\n"
                      "def pad(f, n):\n    return replace(f, batch_size=n)\n")
    assert _bare_batch_sizes(module) == ["m.py:2 self.batch_size", "m.py:4 f.batch_size",
                                         "m.py:6 replace(batch_size=...)"]
