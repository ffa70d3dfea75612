"""``train --zch``: raw ids remapped by managed collisions in the sparsecore job; a checkpoint
carries the remap state and a resumed run ends bit-identical to the uninterrupted one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.train.conftest import SPARSECORE_TABLES, flat_checkpoint, tiny_config
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
