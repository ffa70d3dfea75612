"""The managed-collision remap against stock TorchRec's ``ManagedCollisionCollection`` of
``MCHManagedCollisionModule``s: the same id stream and policy give the same slots, the same
evictions and the same identity table, batch after batch."""

from __future__ import annotations

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.mc_modules import LFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_tpu.sharding.zch import (
    INT64_MAX,
    MOD_ROUTING,
    TableRemap,
    ZchSpec,
    owner_ranks,
    resorted,
    select_evictions,
)
from torchrec_tpu.sharding.zch_collection import ZchCollection

# table -> (rows, features); t0 is shared by two features, f_free is not managed
TABLES = {"t0": (64, ["f0", "f1"]), "t1": (40, ["f2"])}
KEYS = ["f2", "f_free", "f0", "f1"]  # batch order differs from the tables' order


def _torchrec_mcc(spec: ZchSpec) -> ManagedCollisionCollection:
    configs = [EmbeddingBagConfig(name=name, embedding_dim=4, num_embeddings=rows, feature_names=feats)
               for name, (rows, feats) in TABLES.items()]
    modules = {name: MCHManagedCollisionModule(zch_size=rows, device=torch.device("cpu"),
                                               eviction_policy=spec.eviction_policy(),
                                               eviction_interval=spec.eviction_interval)
               for name, (rows, _) in TABLES.items()}
    return ManagedCollisionCollection(modules, configs)


def _ours(spec: ZchSpec) -> ZchCollection:
    return ZchCollection({name: (rows, spec) for name, (rows, _) in TABLES.items()},
                         {name: feats for name, (_, feats) in TABLES.items()})


def drifting_batch(step: int, generator: torch.Generator, batch: int = 16) -> KeyedJaggedTensor:
    """Zipf-like raw ids over a vocabulary that moves up by 7 ids a step, some negative, and the
    hostile extremes (2^63-1, TorchRec's empty-slot marker, and -2^63) on odd steps."""
    lengths = torch.randint(0, 4, (len(KEYS) * batch,), generator=generator)
    n = int(lengths.sum())
    rank = torch.floor(torch.exp(torch.rand(n, generator=generator) * 5.5)).to(torch.int64)
    ids = (rank + 7 * step) * 1_000_003 - 50_000_000
    if step % 2 and n >= 2:
        ids[:2] = torch.tensor([INT64_MAX, -INT64_MAX - 1])
    return KeyedJaggedTensor(keys=KEYS, values=ids, lengths=lengths)


def _assert_same_features(remapped: KeyedJaggedTensor, expected: KeyedJaggedTensor, given: KeyedJaggedTensor):
    """Every feature's ids equal TorchRec's (whose output holds its managed features only, in
    its tables' order); the unmanaged one passes through."""
    ours, theirs = remapped.to_dict(), expected.to_dict()
    assert remapped.keys() == given.keys() and set(theirs) == set(given.keys()) - {"f_free"}
    for key, jt in theirs.items():
        torch.testing.assert_close(ours[key].values(), jt.values(), rtol=0, atol=0)
        torch.testing.assert_close(ours[key].lengths(), jt.lengths(), rtol=0, atol=0)
    torch.testing.assert_close(ours["f_free"].values(), given.to_dict()["f_free"].values(), rtol=0, atol=0)


SPECS = [ZchSpec("lfu", 1), ZchSpec("lfu", 3), ZchSpec("lru", 2), ZchSpec("lru", 2, decay_exponent=2.0),
         ZchSpec("distance_lfu", 1), ZchSpec("distance_lfu", 4, decay_exponent=0.5),
         ZchSpec("lfu", 2, threshold="average"), ZchSpec("distance_lfu", 2, threshold="dynamic",
                                                          threshold_skew_multiplier=1.5)]


@pytest.mark.parametrize("spec", SPECS,
                         ids=lambda s: f"{s.policy}-{s.eviction_interval}-{s.decay_exponent}-{s.threshold}")
def test_slots_and_evictions_equal_torchrec_mch(spec):
    reference, ours = _torchrec_mcc(spec), _ours(spec)
    generator = torch.Generator().manual_seed(3)
    evictions = 0
    for step in range(30):
        kjt = drifting_batch(step, generator, batch=16 if step else 8)  # later batches overflow the history
        expected = reference(kjt)
        remapped, evicted = ours(kjt)
        _assert_same_features(remapped, expected, kjt)
        torchrec_evicted = reference.evict()
        for table in TABLES:
            want = torchrec_evicted[table]
            if want is None:
                assert table not in evicted
            else:
                torch.testing.assert_close(evicted[table], want.sort().values, rtol=0, atol=0)
                evictions += int(want.numel())
            module = reference._managed_collision_modules[table]
            remap = ours.remaps[table]
            torch.testing.assert_close(remap.sorted_ids, module._mch_sorted_raw_ids, rtol=0, atol=0)
            torch.testing.assert_close(remap.slot_of, module._mch_remapped_ids_mapping, rtol=0, atol=0)
            for name, value in remap.metadata.items():
                torch.testing.assert_close(value, getattr(module, f"_mch_{name}"), rtol=0, atol=0)
            assert remap.open_slots() == int(module.open_slots())
    assert evictions > 50  # the vocabulary drifted past the tables: slots changed hands


def test_frozen_lookup_sends_unseen_ids_to_torchrecs_default_slot():
    spec = ZchSpec("lfu", 1)
    reference, ours = _torchrec_mcc(spec), _ours(spec)
    generator = torch.Generator().manual_seed(5)
    for step in range(4):
        kjt = drifting_batch(step, generator)
        reference(kjt)
        ours(kjt)
    reference.eval()
    unseen = KeyedJaggedTensor(keys=KEYS, values=torch.tensor([123, 7, -5, INT64_MAX - 1]),
                               lengths=torch.tensor([1, 1, 1, 1]))
    seen = drifting_batch(3, torch.Generator().manual_seed(5))
    for kjt in (unseen, seen):
        before = ours.state_dict()
        expected = reference(kjt)
        remapped, evicted = ours(kjt, training=False)
        _assert_same_features(remapped, expected, kjt)
        assert evicted == {}
        assert all(torch.equal(before[k], v) for k, v in ours.state_dict().items())
    rows = {name: rows for name, (rows, _) in TABLES.items()}
    assert remapped_default(ours, unseen) == [rows["t1"] - 1, rows["t0"] - 1, rows["t0"] - 1]


def remapped_default(ours: ZchCollection, kjt: KeyedJaggedTensor) -> list[int]:
    """The slots of ``kjt``'s managed ids, frozen."""
    remapped, _ = ours(kjt, training=False)
    keep = torch.repeat_interleave(torch.tensor([k != "f_free" for k in kjt.keys()]),
                                   torch.tensor(kjt.length_per_key()))
    return remapped.values()[keep].tolist()


def test_mark_restores_the_state_of_an_earlier_batch_across_evictions():
    spec = ZchSpec("distance_lfu", 2)
    ours = _ours(spec)
    generator = torch.Generator().manual_seed(7)
    batches = [drifting_batch(step, generator) for step in range(12)]
    for kjt in batches[:5]:
        ours(kjt)
    marks, saved = ours.marks(), ours.state_dict()
    ahead = [ours(kjt)[0].values() for kjt in batches[5:9]]  # two evictions past the mark
    assert ours.state_dict()["t0._current_iter_tensor"].item() == 9
    torch.testing.assert_close(ours.state_dict(marks), saved, rtol=0, atol=0)
    again = _ours(spec)
    again.load_state_dict(ours.state_dict(marks))  # a checkpoint of the mark, resumed
    ours.restore(marks)
    for kjt, want in zip(batches[5:9], ahead):
        for collection in (ours, again):
            torch.testing.assert_close(collection(kjt)[0].values(), want, rtol=0, atol=0)
    torch.testing.assert_close(again.state_dict(), ours.state_dict(), rtol=0, atol=0)


def test_loads_a_torchrec_module_state_and_goes_on_like_it():
    spec = ZchSpec("lru", 1)
    reference, ours = _torchrec_mcc(spec), _ours(spec)
    generator = torch.Generator().manual_seed(11)
    for step in range(6):
        reference(drifting_batch(step, generator))
    for name, remap in ours.remaps.items():
        module = reference._managed_collision_modules[name]
        remap.load_state_dict({k: v for k, v in module.state_dict().items()})
    restarted = _torchrec_mcc(spec)
    restarted.load_state_dict(reference.state_dict())
    for step in range(6, 12):
        kjt = drifting_batch(step, generator)
        _assert_same_features(ours(kjt)[0], restarted(kjt), kjt)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"policy": "fifo"}, "zch policy must be one of"),
    ({"eviction_interval": 0}, "eviction_interval must be >= 1, got 0"),
    ({"threshold": "median"}, "zch threshold must be one of"),
    ({"policy": "lfu", "decay_exponent": 2.0}, "decay_exponent applies to lru and distance_lfu"),
])
def test_bad_specs_are_one_line_naming_the_option(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        ZchSpec(**kwargs)


def test_a_one_row_table_is_refused():
    with pytest.raises(ValueError, match="a zch table needs >= 2 rows"):
        TableRemap(1)


def test_missing_feature_is_named():
    ours = _ours(ZchSpec())
    kjt = KeyedJaggedTensor(keys=["f0"], values=torch.tensor([1]), lengths=torch.tensor([1]))
    with pytest.raises(ValueError, match=r"zch features \['f1', 'f2'\] are not in the batch"):
        ours(kjt)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
def test_selection_picks_what_torchrecs_full_sort_picks_ties_included(dtype):
    generator = torch.Generator().manual_seed(0)
    stock = LFU_EvictionPolicy()
    for trial in range(200):
        pivot, new = int(torch.randint(1, 30, (1,), generator=generator)), int(torch.randint(0, 30, (1,),
                                                                                          generator=generator))
        scores = torch.randint(0, 4 if trial % 2 else 1000, (pivot + new,), generator=generator).to(dtype)
        want = stock._compute_selected_eviction_and_replacement_indices(pivot, scores)
        got = select_evictions(pivot, scores)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_merged_resort_is_the_stable_argsort():
    generator = torch.Generator().manual_seed(1)
    for _ in range(100):
        n = int(torch.randint(2, 40, (1,), generator=generator))
        ids = torch.cat([torch.randperm(1000, generator=generator)[:n - 3].sort().values, torch.full((3,), INT64_MAX)])
        replaced = torch.randperm(n - 1, generator=generator)[:int(torch.randint(0, n - 1, (1,), generator=generator))]
        ids = ids.clone()
        ids[replaced] = 1000 + torch.randperm(1000, generator=generator)[:replaced.numel()]
        torch.testing.assert_close(resorted(ids, replaced), torch.argsort(ids, stable=True), rtol=0, atol=0)


@pytest.mark.parametrize("input_hash_size, expected", [
    # MOD_ROUTING (train's): every id by its value mod 2, a negative one as unsigned (2**64 + id)
    (MOD_ROUTING, [0, 1, 1, 1, 1, 0, 0]),
    # TorchRec's default range: blocks of 2**62 ids; a negative id lies past the range: mod 2
    (INT64_MAX, [0, 0, 1, 1, 1, 0, 0]),
])
def test_hostile_ids_route_to_the_rank_the_rule_names(input_hash_size, expected):
    ids = torch.tensor([0, 5, 2**62 + 1, INT64_MAX, -1, -4, -INT64_MAX - 1])
    assert owner_ranks(ids, input_hash_size, 2).tolist() == expected
