"""``train --zch``: raw ids remapped by managed collisions in the sparsecore job; a checkpoint
carries the remap state and a resumed run ends bit-identical to the uninterrupted one. On two
ranks (torchrun's environment, through the CLI), a managed table sharded row-wise and one
table-wise: each rank checkpoints the remaps of its own shards, a run resumed at two ranks ends
bit-identical too, and the checkpoint serves on one rank (``infer``'s model) with the remap
frozen as the ranks had it."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.train.cli_ranks import WORLD, launch_cli_ranks
from tests.train.conftest import SPARSECORE_TABLES, TINY_OPTIONS, as_flags, flat_checkpoint, tiny_config
from tests.train.plan_files import write_plan
from torchrec_tpu.inference.model import load_inference_model
from torchrec_tpu.train.checkpoint.dirs import resolve_checkpoint
from torchrec_tpu.train.config import ConfigError, TrainConfig
from torchrec_tpu.train.job import run_job

ZCH = "C2:lfu:2,C6:distance_lfu:3,C9:lru:1"  # 500-id vocabularies into 64-row tables: evictions every few steps
COMMON = dict(engine="sparsecore", epochs=1, zch=ZCH, num_embeddings_per_feature=",".join(
    "64" if f"C{i}" in ("C2", "C6", "C9") else "500" for i in range(1, 27)))


@pytest.mark.slow
def test_resume_reaches_the_uninterrupted_tables_and_remap(tiny_dataset: Path, tmp_path: Path) -> None:
    full = run_job(tiny_config(tiny_dataset, tmp_path / "full", max_steps=12, **COMMON))
    first = run_job(tiny_config(tiny_dataset, tmp_path / "first", max_steps=5, **COMMON))
    resumed = run_job(tiny_config(tiny_dataset, tmp_path / "resumed", max_steps=12,
                                  resume=str(first.checkpoint_dir), **COMMON))
    assert resumed.result.steps == 12
    expected = flat_checkpoint(full.checkpoint_dir, tmp_path / "full.pt")
    got = flat_checkpoint(resumed.checkpoint_dir, tmp_path / "resumed.pt")
    assert set(got) == set(expected)
    state_key = SPARSECORE_TABLES.replace("embedding_bags.", "zch_state")
    assert got[state_key] == expected[state_key]
    remap = torch.load(__import__("io").BytesIO(got[state_key]), weights_only=True)
    assert remap["t_C2._current_iter_tensor"].item() == 12
    assert (remap["t_C2._mch_sorted_raw_ids"] < 500).sum() == 63  # every slot but the default one taken
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    assert resumed.result.eval.auc == full.result.eval.auc


@pytest.mark.parametrize("options, fragment", [
    (dict(zch="C2", engine="torchrec"), "--zch='C2' needs --engine sparsecore"),
    (dict(zch="C2:fifo"), "policy 'fifo' of 'C2' is not one of"),
    (dict(zch="C2:lfu:0"), "eviction interval '0' of 'C2' must be an integer >= 1"),
    (dict(zch="C2:lfu:1:x"), "'C2:lfu:1:x' is not NAME[:POLICY[:INTERVAL]]"),
    (dict(zch_eviction_interval=0), "--zch-eviction-interval"),
])
def test_bad_zch_options_name_the_flag(options, fragment) -> None:
    with pytest.raises(ConfigError, match=__import__("re").escape(fragment)):
        TrainConfig.from_options(**{"engine": "sparsecore", **options})


def test_an_unknown_feature_is_named_with_a_suggestion() -> None:
    config = TrainConfig.from_options(engine="sparsecore", zch="C2,c6")
    with pytest.raises(ConfigError, match=r"'c6' is not a categorical feature of the data .*did you mean C6"):
        config.engine.zch_tables(tuple(f"C{i}" for i in range(1, 27)))


KINDS = {"t_C2": "row_wise", "t_C6": "table_wise"}


def _train(data: Path, run: Path, plan: Path, steps: int, resume: Path | None = None) -> dict:
    options = {**TINY_OPTIONS, **COMMON, "max_steps": steps}
    argv = ["train", "--plan", str(plan), "--data", str(data), "--log-dir", str(run / "logs"), *as_flags(options),
            *(["--resume", str(resume)] if resume else [])]
    out0, _ = launch_cli_ranks(argv, run)
    assert f"steps           {steps} " in out0
    return flat_checkpoint(resolve_checkpoint(run / "logs" / "checkpoint"), run / "ckpt.pt")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(1800)  # three 2-rank jobs one after another
def test_two_rank_zch_resume_equals_the_uninterrupted_run(tiny_dataset: Path, tmp_path: Path) -> None:
    config = tiny_config(tiny_dataset, tmp_path / "plan_logs", **COMMON)
    plan = write_plan(config, WORLD, KINDS, tmp_path / "plan.json")
    assert {t.name: t.sharding_type for t in plan.tables if t.name in KINDS} == KINDS
    full = _train(tiny_dataset, tmp_path / "full", tmp_path / "plan.json", 12)
    _train(tiny_dataset, tmp_path / "first", tmp_path / "plan.json", 5)
    resumed = _train(tiny_dataset, tmp_path / "resumed", tmp_path / "plan.json", 12,
                     resolve_checkpoint(tmp_path / "first" / "logs" / "checkpoint"))
    prefix = SPARSECORE_TABLES.replace("embedding_bags.", "")
    states = [torch.load(io.BytesIO(full[f"{prefix}zch_state.rank{r}_of_{WORLD}"]), weights_only=True)
              for r in range(WORLD)]
    for state in states:  # each rank remaps its half of the row-wise table's rows (32 of 64)
        assert state["t_C2._mch_sorted_raw_ids"].numel() == 32 and state["t_C2._current_iter_tensor"].item() == 12
        assert (state["t_C2._mch_sorted_raw_ids"] < 500).sum() == 31  # every slot but the default one taken
    assert sum("t_C6._mch_sorted_raw_ids" in state for state in states) == 1  # on its owner only
    assert set(resumed) == set(full)
    for key, value in full.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(resumed[key], value, rtol=0, atol=0, msg=key)
        elif "zch_state" in key:
            assert resumed[key] == value, key
    _infer_remaps_as_the_ranks(resolve_checkpoint(tmp_path / "full" / "logs" / "checkpoint"), states)


def _infer_remaps_as_the_ranks(checkpoint: Path, states: list[dict]) -> None:
    """Each id the ranks kept gets its row (rank r's slot k of the row-wise table is row r + 2k;
    ids route by id mod 2 in training); an unseen id its rank's default slot (its last)."""
    model = load_inference_model(checkpoint)
    kept = [(r, state["t_C2._mch_sorted_raw_ids"], state["t_C2._mch_remapped_ids_mapping"])
            for r, state in enumerate(states)]
    ids, rows = [], []
    for rank, sorted_ids, slots in kept:
        taken = sorted_ids < 500
        assert bool((sorted_ids[taken] % WORLD == rank).all())
        ids += sorted_ids[taken].tolist()
        rows += (rank + WORLD * slots[taken]).tolist()
    unseen = [10**12, 10**12 + 1, -7]
    ids += unseen
    rows += [0 + WORLD * 31, 1 + WORLD * 31, 1 + WORLD * 31]  # (-7 mod 2 = 1)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["C2", "C6", "C9"], values=torch.tensor(ids + [0, 0]),
                                              lengths=torch.tensor([len(ids), 1, 1]))
    remapped, _ = model.zch(kjt, training=False)
    assert remapped["C2"].values().tolist() == rows
