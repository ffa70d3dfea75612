"""The compiled preprocessing vs the numpy reference and jax-tpu-embedding's C++, byte for byte,
on random models given in any order (all combiners, weighted and not, drop and error policies,
1 to 64 SparseCores, both output forms)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore import native
from sparsecore.limits import PartitionOverflowError
from sparsecore.preprocess import preprocess, preprocess_inputs, preprocess_row_ordered
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking
from sparsecore.validation import feature_inputs

from .jte_check import assert_same_as_jte

pytestmark = pytest.mark.skipif(native.extension() is None, reason="the compiled extension did not build")

TOPOLOGIES = [("v5p", 1), ("v6e", 1), ("v5p", 2), ("tpu7x", 2), ("v6e", 8), ("v5p", 16)]  # 4 .. 64 SCs


def _random_model(rng: np.random.Generator, topology: SparseCoreTopology, max_ids: int, combiner: str | None = None):
    """3-6 tables (mixed dims and, unless ``combiner``, combiners: several stacks), 1-3 features
    each, given in a shuffled order."""
    n = topology.num_sparsecores
    combiners = ["sum", "mean", "sqrtn"]
    tables = [TableSpec(f"t{i}", int(rng.integers(1, 3000)), int(rng.choice([8, 16])),
                        combiner or combiners[int(rng.integers(3))],
                        max_ids_per_partition=max_ids, max_unique_ids_per_partition=max(4, max_ids // 2))
              for i in range(int(rng.integers(3, 7)))]
    batch = n * int(rng.choice([4, 8]))  # one KJT: one batch size for all features
    features = []
    for table in tables:
        for j in range(int(rng.integers(1, 4))):
            features.append(FeatureSpec(f"f_{table.name}_{j}", table.name, batch, weighted=bool(rng.integers(2))))
    tables = [tables[i] for i in rng.permutation(len(tables))]
    features = [features[i] for i in rng.permutation(len(features))]
    limits = dict(stack_to_max_ids_per_partition=lambda name, samples: max_ids,
                  stack_to_max_unique_ids_per_partition=lambda name, samples: max(4, max_ids // 2))
    return plan_stacking(tables, features, topology, **limits)


def _random_kjt(rng: np.random.Generator, plan, id_range: int | None, id_dtype=torch.int64) -> KeyedJaggedTensor:
    """Multi-hot ids (duplicates when ``id_range`` is small), keys in a shuffled order; unweighted
    when no feature is weighted."""
    values, lengths, weights = [], [], []
    order = [plan.features[i] for i in rng.permutation(len(plan.features))]
    for feature in order:
        n = rng.integers(0, 9, size=feature.batch_size)
        vocab = plan.tables[feature.table].vocab_size
        values.append(rng.integers(0, vocab if id_range is None else min(vocab, id_range), size=int(n.sum())))
        lengths.append(n)
        weights.append(rng.uniform(0.25, 2.0, size=int(n.sum())) if feature.weighted else np.ones(int(n.sum())))
    weighted = any(f.weighted for f in plan.features)
    return KeyedJaggedTensor(
        keys=[f.name for f in order], values=torch.from_numpy(np.concatenate(values)).to(id_dtype),
        lengths=torch.from_numpy(np.concatenate(lengths)).int(),
        weights=torch.from_numpy(np.concatenate(weights)).float() if weighted else None)


def _same_csr(theirs, ours):
    assert theirs.stacks.keys() == ours.stacks.keys()
    for name, a in theirs.stacks.items():
        b = ours.stacks[name]
        for field in ("row_pointers", "embedding_ids", "sample_ids", "gains"):
            x, y = getattr(a, field), getattr(b, field)
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), (name, field)
        _same_stats(a.stats, b.stats)


def _same_rows(theirs, ours):
    assert theirs.keys() == ours.keys()
    for name, a in theirs.items():
        b = ours[name]
        for field in ("phys", "sample", "gain"):
            x, y = getattr(a, field), getattr(b, field)
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), (name, field)
        _same_stats(a.stats, b.stats)


def _same_stats(a, b):
    for field in ("max_ids_per_partition", "max_unique_ids_per_partition", "required_buffer_size_per_sc"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert a.dropped_ids == b.dropped_ids


def _both(fn, *args, **kwargs):
    """fn with the numpy and the compiled engine: both results, or both overflow messages."""
    out = []
    for engine in ("numpy", "compiled"):
        try:
            out.append(fn(*args, engine=engine, **kwargs))
        except PartitionOverflowError as error:
            out.append(str(error))
    return out


@pytest.mark.parametrize("generation, chips", TOPOLOGIES)
def test_compiled_equals_numpy_on_random_models(generation, chips):
    rng = np.random.default_rng(chips * 7 + len(generation))
    topology = SparseCoreTopology(generation, chips)
    drops = 0
    for max_ids, id_range in ((256, None), (256, 40), (16, 40), (4, 3)):  # small limits and ranges: overflow
        plan = _random_model(rng, topology, max_ids)
        kjt = _random_kjt(rng, plan, id_range)
        inputs = feature_inputs(kjt, plan.features, plan.tables)
        for overflow in ("drop", "error"):
            numpy_csr, compiled_csr = _both(preprocess_inputs, inputs, plan, overflow=overflow)
            numpy_rows, compiled_rows = _both(preprocess_row_ordered, inputs, plan, overflow=overflow)
            if isinstance(numpy_csr, str):
                assert overflow == "error" and numpy_csr == compiled_csr == numpy_rows == compiled_rows
                continue
            _same_csr(numpy_csr, compiled_csr)
            _same_rows(numpy_rows, compiled_rows)
            drops += sum(s.dropped_ids for s in compiled_csr.stats.values())
    assert drops > 0  # the drop policy was exercised


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("generation, chips", [("v5p", 1), ("v6e", 8), ("v5p", 16)])
def test_compiled_matches_jax_tpu_embedding(combiner, generation, chips):
    rng = np.random.default_rng(len(combiner) + chips)
    topology = SparseCoreTopology(generation, chips)
    plan = _random_model(rng, topology, 256, combiner)
    for id_range in (None, 30):
        assert_same_as_jte(plan, _random_kjt(rng, plan, id_range), engine="compiled")


@pytest.mark.parametrize("max_ids", [8, 16])
def test_compiled_drop_policy_matches_jax_tpu_embedding(max_ids):
    rng = np.random.default_rng(max_ids)
    plan = _random_model(rng, SparseCoreTopology("v5p", 2), max_ids)
    kjt = _random_kjt(rng, plan, id_range=40)
    ours = assert_same_as_jte(plan, kjt, overflow="drop", engine="compiled")
    assert sum(s.dropped_ids for s in ours.stats.values()) > 0
    with pytest.raises(PartitionOverflowError, match="max_(unique_)?ids_per_partition"):
        preprocess(kjt, plan, engine="compiled")


def test_int32_ids_and_threads_give_the_same_bytes():
    """int32 KJT values are read in place (no int64 copy) and any thread count gives one result."""
    rng = np.random.default_rng(5)
    plan = _random_model(rng, SparseCoreTopology("v5p", 4), 256)
    kjt = _random_kjt(rng, plan, id_range=50, id_dtype=torch.int32)
    inputs = feature_inputs(kjt, plan.features, plan.tables)
    reference = preprocess_inputs(inputs, plan, engine="numpy")
    for threads in (1, 3, 16):
        _same_csr(reference, preprocess_inputs(inputs, plan, engine="compiled", threads=threads))
        _same_rows(preprocess_row_ordered(inputs, plan, engine="numpy"),
                   preprocess_row_ordered(inputs, plan, engine="compiled", threads=threads))


def test_compiled_reads_the_kjt_in_place():
    """No copy of a KJT's int64 ids or float32 weights between the tensor and the extension."""
    from sparsecore.preprocess_native import feature_buffers

    rng = np.random.default_rng(2)
    plan = _random_model(rng, SparseCoreTopology("v5p", 1), 256)
    kjt = _random_kjt(rng, plan, id_range=None)
    inputs = feature_inputs(kjt, plan.features, plan.tables)
    values, weights = kjt.values().numpy(), kjt.weights().numpy()
    for stack in plan.stacks:
        for ids, _, w, *_ in feature_buffers(stack, inputs, plan.topology.num_sparsecores):
            assert np.shares_memory(ids, values) and np.shares_memory(w, weights)


def test_unknown_engine_is_rejected():
    plan = _random_model(np.random.default_rng(0), SparseCoreTopology("v5p", 1), 256)
    with pytest.raises(ValueError, match="engine must be one of"):
        preprocess_inputs({}, plan, engine="fast")


def test_without_a_compiler_auto_falls_back_to_numpy_with_a_warning(tmp_path):
    """A fresh cache and no compiler: one warning, and preprocessing still works (numpy)."""
    script = (
        "import warnings, numpy as np\n"
        "from sparsecore import native\n"
        "from sparsecore.preprocess import preprocess_inputs\n"
        "from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec\n"
        "from sparsecore.stacking import plan_stacking\n"
        "from sparsecore.validation import FeatureInput\n"
        "plan = plan_stacking([TableSpec('t', 64, 8)], [FeatureSpec('f', 't', 4)], SparseCoreTopology('v5p', 1))\n"
        "x = FeatureInput(np.array([5, 9]), np.array([2, 0, 0, 0]), np.ones(2, np.float32))\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    for _ in range(2):\n"
        "        csr = preprocess_inputs({'f': x}, plan).stacks['t']\n"
        "print(len(caught), caught[0].message)\n"
        "print(csr.row_pointers[:8].tolist())\n"
        "try:\n"
        "    preprocess_inputs({'f': x}, plan, engine='compiled')\n"
        "except native.NativeUnavailable as e:\n"
        "    print('unavailable:', e)\n"
    )
    env = dict(os.environ, CXX="no-such-compiler-xyz", TORCHREC_TPU_NATIVE_CACHE=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("1 sparsecore: compiled preprocessing unavailable")
    assert "no-such-compiler-xyz" in lines[0]
    assert lines[1] == "[0, 2, 8, 8, 8, 8, 8, 8]"  # sample 0 (SC0): ids 5 and 9, both to SC1
    assert lines[2].startswith("unavailable: no C++ compiler")


def test_compiled_slot_form_equals_numpy():
    """The xla backend's gather form: slot k of row r = r's k-th entry, compiled as numpy."""
    from sparsecore.backends.xla_inputs import fill_slots

    rng = np.random.default_rng(3)
    rows, entries = 50, 400
    sample = rng.integers(0, rows, size=entries)
    phys, gain = rng.integers(0, 10_000, size=entries), rng.standard_normal(entries).astype(np.float32)
    counts = np.bincount(sample, minlength=rows)
    out = {}
    for engine in ("numpy", "compiled"):
        slot_rows = np.full((int(counts.max()), rows), -1, dtype=np.int32)
        slot_gains = np.zeros(slot_rows.shape, dtype=np.float32)
        fill_slots(sample, phys, gain, counts, slot_rows, slot_gains, engine=engine)
        out[engine] = slot_rows, slot_gains
    np.testing.assert_array_equal(out["numpy"][0], out["compiled"][0])
    np.testing.assert_array_equal(out["numpy"][1], out["compiled"][1])
    r = int(sample[7])  # hand check: row r's entries in order
    np.testing.assert_array_equal(out["compiled"][0][: counts[r], r], phys[sample == r])
    with pytest.raises(ValueError, match="outside the rows or the slots"):
        fill_slots(sample, phys, gain, counts, slot_rows[:1].copy(), slot_gains[:1].copy(), engine="compiled")


def test_large_chunks_equal_numpy():
    """Thousands of ids per SparseCore over a 2^21-row stack: the multi-pass 12-bit radix sorts."""
    topology = SparseCoreTopology("v5p", 1)
    tables = [TableSpec(f"t{i}", 1_000_000, 8, "mean", max_ids_per_partition=8192,
                        max_unique_ids_per_partition=8192) for i in range(2)]
    features = [FeatureSpec(f"f{i}", f"t{i % 2}", 4096, weighted=True) for i in range(4)]
    plan = plan_stacking(tables, features, topology, stack_to_max_ids_per_partition=lambda *_: 8192,
                         stack_to_max_unique_ids_per_partition=lambda *_: 8192)
    kjt = _random_kjt(np.random.default_rng(11), plan, id_range=None)
    inputs = feature_inputs(kjt, plan.features, plan.tables)
    assert max(s.vocab_size for s in plan.stacks) > 2**20 and kjt.values().numel() // 4 > 4096
    _same_csr(preprocess_inputs(inputs, plan, engine="numpy"), preprocess_inputs(inputs, plan, engine="compiled"))
    _same_rows(preprocess_row_ordered(inputs, plan, engine="numpy"),
               preprocess_row_ordered(inputs, plan, engine="compiled"))


@pytest.mark.slow
def test_concurrent_first_builds_share_one_module(tmp_path):
    """Two processes starting on an empty cache (e.g. two ranks) build once and both load it."""
    script = "from sparsecore import native; print(native.require_extension().__file__)"
    env = dict(os.environ, TORCHREC_TPU_NATIVE_CACHE=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    outputs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outputs]
    paths = {out.strip() for out, _ in outputs}
    assert len(paths) == 1 and Path(paths.pop()).parent == tmp_path
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".lock", ".so"]  # no temporary files left
