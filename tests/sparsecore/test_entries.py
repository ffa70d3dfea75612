"""The one SparseCore core (``sparsecore.entries``): its lookup and update against hand-computed
values and torch, its two producers (host row order, CSR decode) giving one record, and the rule
that the core's pieces are written once."""

import ast
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from sparsecore import csr_math
from sparsecore import optimizers as opt
from sparsecore.backends.xla import XlaBackend
from sparsecore.csr_sizes import CsrFitter, headroom
from sparsecore.entries import Buckets, Entries, GatherSlots, lookup, pack_row_ordered, update
from sparsecore.optimizer_rules import rule_of
from sparsecore.preprocess import preprocess_inputs, preprocess_row_ordered
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking
from sparsecore.validation import feature_inputs
from tests.sparsecore.helpers import random_kjt, step_alike
from tests.sparsecore.reference import reference_forward
from tpu_facts import power_of_two_bucket

REPO = Path(__file__).resolve().parents[2]
TABLE = np.arange(12, dtype=np.float32).reshape(4, 3)  # row r = [3r, 3r + 1, 3r + 2]
# entries of rows 1, 1, 3 (touched rows 1 and 3, then a padding row 4), activation rows 0, 1, 1
HAND = Entries(jnp.asarray([1, 3, 4]), jnp.asarray([0, 0, 1, 2]), jnp.asarray([0, 1, 1, 0]),
               jnp.asarray([2.0, 0.5, 1.0, 0.0], jnp.float32))


def test_lookup_sums_gain_times_row_per_activation_row_both_strategies() -> None:
    expected = np.stack([2.0 * TABLE[1], 0.5 * TABLE[1] + TABLE[3]])
    np.testing.assert_array_equal(np.asarray(lookup(HAND, jnp.asarray(TABLE), 2)), expected)
    # the gather strategy: slot k of activation row r holds its k-th entry; empty slots read past the table
    slots = GatherSlots(jnp.asarray([[1, 1], [4, 3]]), jnp.asarray([[2.0, 0.5], [0.0, 1.0]], jnp.float32))
    np.testing.assert_array_equal(np.asarray(lookup(HAND, jnp.asarray(TABLE), 2, slots)), expected)


def test_update_applies_the_rule_to_each_touched_row_once_with_its_summed_gradient() -> None:
    grad = np.asarray([[1.0, 0.0, -1.0], [4.0, 2.0, 0.0]], np.float32)
    accumulator = np.full((4, 3), 0.5, np.float32)
    table, (acc,) = (lambda out: (out[0], out[1:]))(update(
        HAND, jnp.asarray(TABLE), (jnp.asarray(accumulator),), lambda rows: jnp.asarray(grad)[rows],
        rule_of(opt.Adagrad(0.1)), (0.1, 0.0), 3))
    g = {1: 2.0 * grad[0] + 0.5 * grad[1], 3: 1.0 * grad[1]}  # summed over each row's entries
    want_table, want_acc = TABLE.copy(), accumulator.copy()
    for row, gr in g.items():
        want_acc[row] += gr * gr
        want_table[row] -= 0.1 * gr / np.sqrt(want_acc[row])
    np.testing.assert_allclose(np.asarray(acc), want_acc, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(table), want_table, rtol=1e-6)
    assert np.array_equal(np.asarray(table)[[0, 2]], TABLE[[0, 2]])  # untouched rows stay


def _plan(optimizer: opt.OptimizerSpec = opt.SGD(0.1), combiner: str = "mean"):
    tables = [TableSpec("ta", 300, 8, "sum", optimizer), TableSpec("tb", 70, 8, combiner, optimizer)]
    features = [FeatureSpec("fa", "ta", 16, weighted=True), FeatureSpec("fb", "tb", 16), FeatureSpec("fa2", "ta", 16)]
    return plan_stacking(tables, features, SparseCoreTopology("v5p", 2))


@pytest.mark.parametrize("seed", [0, *(pytest.param(s, marks=pytest.mark.slow) for s in (1, 2))])
def test_both_producers_make_one_record_and_the_lookup_equals_embedding_bag(seed: int) -> None:
    plan = _plan(combiner="sum")  # one stack: two lookups to compile
    inputs = feature_inputs(random_kjt(plan, seed=seed, max_hot=5, id_range=40), plan.features, plan.tables)
    weights = {name: spec.init_weights(seed=seed) for name, spec in plan.tables.items()}
    want = reference_forward(plan, weights, inputs)
    row_ordered, batch = preprocess_row_ordered(inputs, plan), preprocess_inputs(inputs, plan)
    for stack in plan.stacks:
        _check_stack(plan, stack, row_ordered[stack.name], batch.stacks[stack.name], weights, want)


def _check_stack(plan, stack, ro, csr, weights, want) -> None:
    host = pack_row_ordered(ro.phys, ro.sample, ro.gain, stack.vocab_size).unpack()
    buffers = (csr.row_pointers, csr.embedding_ids, csr.sample_ids, csr.gains)
    phys = csr_math.decode(*buffers, stack.vocab_size, stack.total_sample_count, xp=np)[0]
    touched = csr_math.touched_rows(phys, stack.vocab_size, xp=np)
    decoded = csr_math.csr_entries(*map(jnp.asarray, buffers), stack.vocab_size, stack.total_sample_count,
                                   touched=jnp.asarray(touched))

    def real(e: Entries) -> np.ndarray:
        rows = np.asarray(e.rows)[np.asarray(e.segment)]
        keep = rows < stack.vocab_size
        return np.stack([rows[keep], np.asarray(e.activation)[keep], np.asarray(e.gain)[keep].view(np.int32)])

    np.testing.assert_array_equal(real(host), real(decoded))  # the same entries in the same order
    table = np.zeros((stack.vocab_size, stack.dim), np.float32)
    for name in {t.table for t in stack.tables}:
        table[stack.physical_rows(name, np.arange(plan.tables[name].vocab_size))] = weights[name].numpy()
    out = [np.asarray(jax.jit(lookup, static_argnums=2)(e, jnp.asarray(table), stack.total_sample_count))
           for e in (host, decoded)]
    assert out[0].tobytes() == out[1].tobytes()
    # torch's reference (EmbeddingBag per feature), at the chunk-major rows the SparseCores write
    chunks = plan.topology.num_sparsecores
    for fp in stack.features:
        per_chunk = fp.samples // chunks
        i = np.arange(fp.samples)
        rows = (i // per_chunk) * (stack.total_sample_count // chunks) + fp.sample_offset // chunks + i % per_chunk
        np.testing.assert_allclose(out[0][rows], want[fp.feature].numpy(), rtol=1e-5, atol=1e-6)


def test_the_host_producer_pads_to_the_bucket_it_is_given() -> None:
    phys = np.asarray([2, 2, 5, 9, 9, 9], np.int64)
    packed = pack_row_ordered(phys, np.arange(6), np.ones(6, np.float32), 10, ODD)
    e = packed.unpack()
    assert (e.touched, e.gain.shape[0]) == (4, 8)  # 3 rows + a padding row -> 4; 6 entries + 1 -> 8
    np.testing.assert_array_equal(e.rows, [2, 5, 9, 10])
    np.testing.assert_array_equal(e.segment, [0, 0, 1, 2, 2, 2, 3, 3])
    packed = pack_row_ordered(phys, np.arange(6), np.ones(6, np.float32), 10)
    assert (packed.unpack().touched, packed.gains.shape[0]) == (64, 64)


# --- the rule: each piece of the core is written once ---------------------------------------------

CORE = "sparsecore/entries.py"


@functools.cache
def _engine_calls() -> dict[str, set[str]]:
    """Per file of the engine (sparsecore/, torchrec_tpu/sharding/, torch_tpu/ops/sparsecore*), the
    names it calls (functions, or methods ``.name``); an optimizer rule's ``.update(rows, slots,
    grad, hypers, row_dims)`` (five arguments) as ``rule.update``."""
    files = [*(REPO / "sparsecore").rglob("*.py"), *(REPO / "torchrec_tpu" / "sharding").rglob("*.py"),
             *(REPO / "torch_tpu" / "ops").glob("sparsecore*.py")]
    out = {}
    for path in sorted(files):
        calls = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                calls.add("rule.update" if name == "update" and len(node.args) == 5 else name)
        out[str(path.relative_to(REPO))] = calls
    return out


@pytest.mark.parametrize("piece, call", [
    ("the segment sums (lookup, update, dense gradient)", "segment_sum"),
    ("the write-back of updated rows", "scatter_rows"),
    ("the gather strategy's slot sum", "fori_loop"),
    ("an optimizer rule's update of touched rows", "rule.update"),
])
def test_the_core_s_math_is_written_once(piece: str, call: str) -> None:
    assert [path for path, calls in _engine_calls().items() if call in calls] == [CORE], piece


# --- the bucket policy: a parameter of both producers, changing sizes, never bits --------------

ODD = Buckets(entries=power_of_two_bucket, rows=power_of_two_bucket, partition=power_of_two_bucket,
              slots=lambda n: 2 * power_of_two_bucket(n))


@pytest.mark.slow
def test_the_xla_backend_pads_to_its_buckets_with_the_same_bits() -> None:
    plan = _plan(opt.Adagrad(0.1, initial_accumulator_value=0.1))
    weights = {name: spec.init_weights(seed=1) for name, spec in plan.tables.items()}
    backends = [XlaBackend(plan, weights), XlaBackend(plan, weights, buckets=ODD)]
    gen = torch.Generator().manual_seed(2)
    for step, hot in enumerate((5, 1)):  # (1: the gather strategy)
        inputs = feature_inputs(random_kjt(plan, seed=step, max_hot=hot, id_range=40), plan.features, plan.tables)
        grads = {f.name: torch.randn(f.batch_size, 8, generator=gen) for f in plan.features}
        row_ordered = preprocess_row_ordered(inputs, plan)
        (packed, _), = [x for st, x in zip(plan.stacks, backends[1].prepare(inputs).arrays) if st.name == "ta"]
        entries = row_ordered["ta"].phys
        assert packed.gains.shape[0] == power_of_two_bucket(entries.size + 1)
        assert packed.unpack().touched == power_of_two_bucket(np.unique(entries).size + 1)
        step_alike(backends, inputs, grads, step)
    for name in plan.tables:
        assert backends[0].table_value(name).numpy().tobytes() == backends[1].table_value(name).numpy().tobytes()


@pytest.mark.slow
def test_the_csr_fitter_cuts_to_its_buckets_with_the_same_bits() -> None:
    plan = _plan()
    inputs = feature_inputs(random_kjt(plan, seed=3, max_hot=5), plan.features, plan.tables)
    batch = preprocess_inputs(inputs, plan)
    chunks = plan.topology.num_sparsecores
    out = []
    for fitter in (CsrFitter(plan), CsrFitter(plan, ODD)):
        cut = fitter.cut(batch)
        touched = fitter.touched(cut)
        out.append([np.asarray(csr_math.sparse_dense_matmul(*c, jnp.asarray(np.ones((st.vocab_size, st.dim), np.float32)
                                                                             * np.arange(st.vocab_size)[:, None]),
                                                            st.total_sample_count, touched=t))
                    for st, c, t in zip(plan.stacks, cut, touched)])
    for st, c, t in zip(plan.stacks, cut, touched):
        # a first batch's sizes: the bucket of its need plus headroom (csr_sizes.grown)
        need = int(batch.stacks[st.name].stats.max_ids_per_partition.max())
        limit = c[1].size // (chunks * st.num_sparsecores)
        assert limit == min(st.max_ids_per_partition, max(8, power_of_two_bucket(need + headroom(need))))
        used = csr_math.touched_count(t, c[1].size)
        assert t.size - 2 * c[1].size == min(c[1].size, power_of_two_bucket(used + headroom(used)))
    for a, b in zip(*out):
        assert a.tobytes() == b.tobytes()
