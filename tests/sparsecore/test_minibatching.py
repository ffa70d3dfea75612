"""Minibatching: the layout equals jax-tpu-embedding's own host code; k passes equal one pass."""

import numpy as np
import pytest

from sparsecore.csr_format import row_pointers_per_sc
from sparsecore.highway_hash import highway_hash_int32
from sparsecore.limits import PartitionOverflowError
from sparsecore.minibatching import (
    MAX_MINIBATCHES,
    jte_buffers,
    minibatch_of_bucket,
    pass_bucket,
    preprocess_minibatched,
    split_of,
)
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking
from sparsecore.validation import feature_inputs

from .helpers import random_kjt


def _plan(topology, max_ids=16, max_unique=None, batch=64, combiner="sum"):
    limits = dict(max_ids_per_partition=max_ids, max_unique_ids_per_partition=max_unique or max_ids)
    tables = [TableSpec("ta", 3000, 8, combiner, **limits), TableSpec("tb", 970, 8, combiner, **limits)]
    features = [FeatureSpec("fa", "ta", batch), FeatureSpec("fb", "tb", batch, weighted=True),
                FeatureSpec("fa2", "ta", batch, weighted=True)]
    return plan_stacking(tables, features, topology, stack_to_max_ids_per_partition=lambda *_: max_ids,
                         stack_to_max_unique_ids_per_partition=lambda *_: max_unique or max_ids)


def test_highway_hash_matches_the_published_test_vector():
    """HighwayHash's reference vector for the 4 bytes 00 01 02 03 under key 00 01 .. 1f."""
    key = (0x0706050403020100, 0x0F0E0D0C0B0A0908, 0x1716151413121110, 0x1F1E1D1C1B1A1918)
    assert int(highway_hash_int32(np.array([0x03020100]), key)[0]) == 0xF205A46893007EDA


def test_split_tree_of_jax_tpu_embedding_s_example():
    """jax-tpu-embedding's documented example (8 buckets, limit 7) scaled into 64 buckets: the
    pairs fit, the quads and above split."""
    counts = np.zeros(MAX_MINIBATCHES, dtype=np.int64)
    counts[:8] = [2, 5, 1, 6, 3, 4, 2, 0]
    split = split_of(counts, 7)
    minibatch = minibatch_of_bucket(split)
    # buckets {0,1} {2,3} {4,5} {6,7} are minibatches 0..3 (by hand: each pair sums to <= 7)
    np.testing.assert_array_equal(minibatch[:8], [0, 0, 1, 1, 2, 2, 3, 3])
    assert minibatch[8:].max() == 3 and split.bit_count() + 1 == 4


@pytest.mark.parametrize("generation, chips, max_ids, max_unique", [
    ("v5p", 1, 16, 16), ("v5p", 2, 8, 8), ("v6e", 1, 24, 16), ("tpu7x", 1, 16, 12)])
@pytest.mark.parametrize("combiner", ["sum", "sqrtn"])
def test_layout_equals_jax_tpu_embedding_s_minibatching(generation, chips, max_ids, max_unique, combiner):
    embedding = pytest.importorskip("jax_tpu_embedding.sparsecore.lib.nn.embedding", exc_type=ImportError)
    from sparsecore.jte_interop import jte_feature_specs, jte_inputs

    plan = _plan(SparseCoreTopology(generation, chips), max_ids, max_unique, combiner=combiner)
    devices, s = plan.topology.num_devices, plan.topology.sparsecores_per_device
    ks = set()
    for seed in range(3):
        kjt = random_kjt(plan, seed, max_hot=14, id_range=None if seed == 0 else 300)
        inputs = feature_inputs(kjt, plan.features, plan.tables)
        ours = preprocess_minibatched(inputs, plan)
        pre, stats = embedding.preprocess_sparse_dense_matmul_input(
            *jte_inputs(inputs, plan), jte_feature_specs(plan), local_device_count=devices,
            global_device_count=devices, num_sc_per_device=s, enable_minibatching=True)
        theirs = pre.sparse_dense_matmul_input
        k = int(pre.num_minibatches[0])
        for stack in plan.stacks:
            mb = ours[stack.name]
            assert mb.num_minibatches == k
            csr = jte_buffers(stack, mb.entries, devices, s)
            width = row_pointers_per_sc(stack)
            pointers = np.asarray(theirs.lhs_row_pointers[stack.name]).reshape(devices, -1)
            ids = np.asarray(theirs.lhs_embedding_ids[stack.name]).reshape(devices, -1)
            ours_pointers = csr.row_pointers.reshape(devices, -1)
            assert ours_pointers.shape == pointers.shape and csr.embedding_ids.size == ids.size
            np.testing.assert_array_equal(ours_pointers[:, :s * k * width], pointers[:, :s * k * width])
            for d in range(devices):
                used = slice(0, int(pointers[d, s * k * width - 1]))  # past it: left uninitialised there
                for ours_array, theirs_array in ((csr.embedding_ids, ids), (csr.sample_ids, theirs.lhs_sample_ids),
                                                 (csr.gains, theirs.lhs_gains)):
                    assert ours_array.reshape(devices, -1)[d, used].tobytes() == \
                        np.asarray(theirs_array if theirs_array is ids else theirs_array[stack.name]).reshape(
                            devices, -1)[d, used].tobytes()
            np.testing.assert_array_equal(mb.stats.max_ids_per_partition, stats.max_ids_per_partition[stack.name])
            np.testing.assert_array_equal(mb.stats.max_unique_ids_per_partition,
                                          stats.max_unique_ids_per_partition[stack.name])
            assert stats.id_drop_counters[stack.name] == 0
        ks.add(k)
    assert max(ks) > 1  # the configs overflow: the comparison covers real splits


def test_each_pass_fits_the_limits_and_k_is_bucketed():
    plan = _plan(SparseCoreTopology("v5p", 1), max_ids=16)
    kjt = random_kjt(plan, 1, max_hot=14, id_range=300)
    batches = preprocess_minibatched(feature_inputs(kjt, plan.features, plan.tables), plan)
    for stack in plan.stacks:
        mb = batches[stack.name]
        assert mb.num_minibatches > 1 and len(mb.passes) == pass_bucket(mb.num_minibatches)
        assert len(mb.passes) & (len(mb.passes) - 1) == 0
        n = stack.num_sparsecores
        for csr in mb.passes:
            ends = csr.row_pointers.reshape(-1, row_pointers_per_sc(stack))[:, :n]
            starts = np.concatenate([np.zeros((ends.shape[0], 1), np.int64), -(-ends[:, :-1] // 8) * 8], axis=1)
            assert (ends - starts).max() <= stack.max_ids_per_partition


def test_one_hot_row_over_the_limit_cannot_be_split():
    """A row in more samples of one source SparseCore than max_ids: its ids share a bucket."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    plan = plan_stacking([TableSpec("t", 640, 8, max_ids_per_partition=8, max_unique_ids_per_partition=8)],
                         [FeatureSpec("f", "t", 64)], SparseCoreTopology("v5p", 1))
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.full((64,), 7), lengths=torch.ones(64, dtype=torch.int32))
    with pytest.raises(PartitionOverflowError, match=r"16 ids in one minibatch > max_ids_per_partition 8 .*64 buckets"):
        preprocess_minibatched(feature_inputs(kjt, plan.features, plan.tables), plan)


def _opt_specs():
    from sparsecore import optimizers as opt

    return [opt.SGD(0.05), opt.Adagrad(0.05), opt.RowWiseAdagrad(0.05), opt.Adam(0.01), opt.FTRL(0.05)]


def _pass_cases():
    """Every optimizer at 1 and 2 chips; SGD on one chip runs by default, the rest are slow."""
    for chips in (1, 2):
        for spec in _opt_specs():
            marks = () if (chips, spec.name) == (1, "sgd") else (pytest.mark.slow,)
            yield pytest.param(SparseCoreTopology("v5p", chips), spec, marks=marks,
                               id=f"{type(spec).__name__}-{chips}chip")


@pytest.mark.parametrize("topology, spec", list(_pass_cases()))
def test_k_passes_equal_one_pass_with_large_limits(topology, spec):
    """Lookup (fp32 within 1e-6) and fused update (SGD bit-equal, every optimizer within 1e-6)
    over the k minibatches equal one pass over the same batch with limits large enough."""
    import jax
    import jax.numpy as jnp

    from sparsecore.minibatching import lookup_passes, stacked_passes, update_passes
    from sparsecore.optimizer_rules import rule_of
    from sparsecore.preprocess import preprocess_inputs

    small = _plan(topology, max_ids=16, combiner="mean")
    big = _plan(topology, max_ids=512, combiner="mean")
    inputs = feature_inputs(random_kjt(small, 1, max_hot=14, id_range=300), small.features, small.tables)
    minibatched = preprocess_minibatched(inputs, small)
    one_pass = preprocess_inputs(inputs, big, engine="numpy")
    rule = rule_of(spec)
    name = spec.name
    for stack in small.stacks:
        mb = minibatched[stack.name]
        assert mb.num_minibatches > 1 and mb.stats.dropped_ids == 0
        rng = np.random.default_rng(0)
        table = jnp.asarray(rng.normal(size=(stack.vocab_size, stack.dim)).astype(np.float32))
        batch = stack.total_sample_count
        csr = one_pass.stacks[stack.name]
        buffers = (csr.row_pointers, csr.embedding_ids, csr.sample_ids, csr.gains)
        from sparsecore import csr_math

        reference = jax.jit(csr_math.sparse_dense_matmul, static_argnums=5)(*buffers, table, batch)
        passes = stacked_passes(mb.passes)
        lookup = jax.jit(lookup_passes, static_argnums=5)(*passes, table, batch)
        np.testing.assert_allclose(np.asarray(lookup), np.asarray(reference),
                                   rtol=1e-6, atol=1e-6)
        grad = jnp.asarray(rng.normal(size=(batch, stack.dim)).astype(np.float32))
        slots = [jnp.full((stack.vocab_size,) if s in spec.row_slots else (stack.vocab_size, stack.dim),
                          spec.slot_initial_values()[s], jnp.float32) for s in spec.slot_names]
        hypers = rule.op_hypers(spec, 1)
        # (hypers stay Python numbers: Adam's betas are never traced)
        expected = jax.jit(lambda *a: csr_math.fused_update(name, *a[:5], list(a[5]), a[6], hypers))(
            *buffers, table, slots, grad)
        got = jax.jit(lambda *a: update_passes(name, *a, hypers))(*passes, table, slots, grad)
        expected, got = (x if isinstance(x, tuple) else (x,) for x in (expected, got))
        for e, g in zip(expected, got):
            if name == "sgd":
                assert np.asarray(g).tobytes() == np.asarray(e).tobytes()
            else:
                np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-6, atol=1e-6)
        assert not np.array_equal(np.asarray(got[0]), np.asarray(table))  # the update did change rows


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_xla_backend_minibatch_policy_equals_large_limits(optimizer):
    """The xla backend under overflow="minibatch": 0 ids dropped, forward and the update equal
    (bit for bit: the same entries) a backend whose limits were large enough; "error" refuses
    the same batch and "drop" loses ids."""
    import torch

    from sparsecore import optimizers as opt
    from sparsecore.backends import make_backend
    from sparsecore.preprocess import preprocess_row_ordered

    spec = opt.SGD(0.1) if optimizer == "sgd" else opt.Adagrad(0.1)
    topology = SparseCoreTopology("v5p", 1)
    small, big = (plan_stacking([TableSpec("ta", 3000, 8, "mean", spec, max_ids_per_partition=m,
                                           max_unique_ids_per_partition=m)],
                                [FeatureSpec("fa", "ta", 64), FeatureSpec("fa2", "ta", 64, weighted=True)], topology,
                                stack_to_max_ids_per_partition=lambda *_: m,
                                stack_to_max_unique_ids_per_partition=lambda *_: m) for m in (16, 1024))
    inputs = feature_inputs(random_kjt(small, 1, max_hot=14, id_range=300), small.features, small.tables)
    with pytest.raises(PartitionOverflowError):
        preprocess_row_ordered(inputs, small, overflow="error")
    assert sum(e.stats.dropped_ids for e in preprocess_row_ordered(inputs, small, overflow="drop").values()) > 0
    backends = [make_backend("xla", small, seed=3, overflow="minibatch"), make_backend("xla", big, seed=3)]
    outs = []
    for backend in backends:
        activations, context = backend.forward(inputs)
        grads = {name: torch.full_like(a, 0.5) + a for name, a in activations.items()}
        backend.backward(context, grads)
        outs.append((activations, backend.table_weights()))
        assert backend.last_stats[small.stacks[0].name].dropped_ids == 0
    for name in outs[0][0]:
        assert torch.equal(outs[0][0][name], outs[1][0][name])
    for name in outs[0][1]:
        assert torch.equal(outs[0][1][name], outs[1][1][name])


def test_one_pass_consumers_refuse_the_minibatch_policy():
    from sparsecore.preprocess import preprocess_inputs

    plan = _plan(SparseCoreTopology("v5p", 1))
    inputs = feature_inputs(random_kjt(plan, 0), plan.features, plan.tables)
    with pytest.raises(ValueError, match=r"overflow policy of one pass of CSR buffers .* must be one of "
                                         r"\('error', 'drop'\), got 'minibatch'"):
        preprocess_inputs(inputs, plan, overflow="minibatch")
