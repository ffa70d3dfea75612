"""Sharded EBC checkpoints over two ranks (loopback processes, tpu_dist): every rank writes only the
pieces it holds, fresh ranks load them back exactly (and unshard them with ``to_torchrec()``),
and a plain CPU TorchRec EBC loads the full tables from the same files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torch_tpu.distributed import launch_local

from .checkpoint_ranks import UNIFORM, load_into_fresh, save_after_training
from .rank_checks import LAYOUTS
from .reference import CONFIGS, reference_ebc

WORLD, LOCAL_BATCH, STEPS = 2, 8, 3
# every layout, and table-wise with each rank's tables padded to one shape (pads are never saved)
SAVED = [*LAYOUTS, "table_wise" + UNIFORM]
pytestmark = pytest.mark.slow  # two 2-rank launches, each compiling every layout's lookups: > 30 s


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("sharded_checkpoints")
    results = launch_local(save_after_training, WORLD, str(directory), SAVED, STEPS, LOCAL_BATCH,
                           timeout_s=120)
    return directory, results


def _equal(got, expected) -> None:
    weights, slots, steps = expected
    assert got[2] == steps
    assert got[0].keys() == weights.keys() and got[1].keys() == slots.keys()
    for name, weight in weights.items():
        assert torch.equal(got[0][name], weight), name
    for table, by_slot in slots.items():
        for slot, value in by_slot.items():
            assert torch.equal(got[1][table][slot], value), (table, slot)


def _chunks(directory: Path, key: str) -> dict[tuple[int, ...], tuple[tuple[int, ...], str]]:
    """Offsets -> (sizes, file) of each piece DCP stored for ``key``."""
    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    files = {index.offset: info.relative_path for index, info in metadata.storage_data.items() if index.fqn == key}
    return {tuple(c.offsets): (tuple(c.sizes), files[c.offsets]) for c in metadata.state_dict_metadata[key].chunks}


@pytest.mark.multiprocess
def test_each_rank_writes_only_the_pieces_it_holds(saved) -> None:
    directory, results = saved
    rank_file = {rank: f"__{rank}_0.distcp" for rank in range(WORLD)}
    # row-wise (ranks hold rows r mod 2): contiguous row blocks, half of the table per rank
    chunks = _chunks(directory / "row_wise", "ebc.embedding_bags.t_user.weight")
    assert chunks == {(0, 0): ((20, 8), rank_file[0]), (20, 0): ((20, 8), rank_file[1])}
    assert _chunks(directory / "row_wise", "ebc.optimizer_slots.t_item.accumulator") == {
        (0,): ((15,), rank_file[0]), (15,): ((15,), rank_file[1])}  # a row slot: one value per row
    # column-wise t_user over ranks (1, 0): columns 0-3 on rank 1, 4-7 on rank 0
    chunks = _chunks(directory / "column_wise", "ebc.optimizer_slots.t_user.accumulator")
    assert chunks == {(0, 0): ((40, 4), rank_file[1]), (0, 4): ((40, 4), rank_file[0])}
    # table-wise: the owner alone; data-parallel replicas: written once
    assert _chunks(directory / "table_wise", "ebc.embedding_bags.t_item.weight") == {(0, 0): ((30, 16), rank_file[1])}
    assert len(_chunks(directory / "data_parallel", "ebc.embedding_bags.t_user.weight")) == 1
    # padded ranks (ops backend) trained the tables as the unpadded ones (xla backend)
    torch.testing.assert_close(results[0]["table_wise" + UNIFORM][0], results[0]["table_wise"][0],
                               rtol=1e-5, atol=1e-6)
    # both ranks reassembled the same trained state
    for layout in SAVED:
        _equal(results[1][layout], results[0][layout])


@pytest.mark.multiprocess
def test_fresh_ranks_load_tables_slots_and_step_count(saved) -> None:
    directory, saved_results = saved
    loaded = launch_local(load_into_fresh, WORLD, str(directory), SAVED, LOCAL_BATCH, timeout_s=120)
    for layout in SAVED:
        expected = saved_results[0][layout]
        for rank in range(WORLD):
            before, after, unsharded = loaded[rank][layout]
            assert not torch.equal(before[0]["t_user"], expected[0]["t_user"])  # really overwritten
            _equal(after, expected)
            for name, weight in expected[0].items():
                assert torch.equal(unsharded[name], weight), (layout, name)


def test_a_plain_torchrec_ebc_loads_the_full_tables(saved) -> None:
    directory, results = saved
    for layout in SAVED:
        plain = reference_ebc(seed=2)
        state = {"ebc": {f"embedding_bags.{c.name}.weight": plain.embedding_bags[c.name].weight for c in CONFIGS}}
        with torch.no_grad():
            dcp.load(state, checkpoint_id=str(directory / layout))
        for name, weight in results[0][layout][0].items():
            assert torch.equal(plain.embedding_bags[name].weight.detach(), weight), (layout, name)
