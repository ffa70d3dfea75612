"""End-to-end job on the tiny synthetic dataset: learning, TensorBoard files, checkpoint round trip."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.train.conftest import tiny_config, whole_tensor
from torchrec_tpu.train.checkpoint.dirs import write_manifest
from torchrec_tpu.train.checkpoint.rng import load_rng, rng_state, save_rng, set_rng_state
from torchrec_tpu.train.checkpoint.store import META_FILE, RNG_DIR, STATE_DIR, load_checkpoint
from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.data import open_data
from torchrec_tpu.train.distributed import process_group
from torchrec_tpu.train.engines.torchrec_engine import build_optimizer, shard_model
from torchrec_tpu.train.job import model_spec, run_job
from torchrec_tpu.train.metrics import evaluate
from torchrec_tpu.train.model import build_dlrm


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}



def test_learns_the_signal(trained) -> None:
    config, summary = trained
    result = summary.result
    assert result.steps == 2 * (16384 // config.data.batch_size)
    assert result.samples == result.steps * config.data.batch_size
    assert result.eval.samples == 8192
    assert result.eval.auc > 0.6
    losses = [v for _, v in _scalars(summary.log_dir)["train/loss"]]
    assert losses[-1] < losses[0] - 0.05, losses  # starts near ln 2 = 0.69


def test_tensorboard_event_files_hold_the_scalars(trained) -> None:
    config, summary = trained
    assert list(summary.log_dir.glob("events.out.tfevents.*"))
    scalars = _scalars(summary.log_dir)
    assert {"train/loss", "train/samples_per_sec", "eval/auc", "eval/loss"} <= set(scalars)
    steps = [step for step, _ in scalars["train/loss"]]
    assert steps == list(range(config.loop.log_every, summary.result.steps + 1, config.loop.log_every))
    assert all(rate > 0 for _, rate in scalars["train/samples_per_sec"])
    # --eval-every 64 over 128 steps: evaluated at 64 and once (not twice) at the end.
    assert [step for step, _ in scalars["eval/auc"]] == [64, 128]
    final_auc = scalars["eval/auc"][-1][1]
    assert final_auc == pytest.approx(summary.result.eval.auc, abs=1e-6)  # stored as float32


def test_checkpoint_meta(trained) -> None:
    config, summary = trained
    meta = json.loads((summary.checkpoint_dir / META_FILE).read_text())
    assert meta["step"] == summary.result.steps
    assert meta["world_size"] == 1
    assert TrainConfig.from_options(**meta["config"]) == config
    assert meta["metrics"]["eval_auc"] == pytest.approx(summary.result.eval.auc)


def test_checkpoint_reloads_into_a_fresh_model(trained, tmp_path: Path) -> None:
    config, summary = trained
    # Independent reading of the checkpoint: DCP's own converter to a plain torch.save file.
    flat = tmp_path / "flat.pt"
    dcp_to_torch_save(summary.checkpoint_dir / STATE_DIR, flat)
    saved = torch.load(flat, weights_only=False)
    fresh_config = config.with_options(seed=config.loop.seed + 1)
    with process_group() as env, open_data(fresh_config, env) as data:
        torch.manual_seed(fresh_config.loop.seed)
        spec = model_spec(fresh_config, data.schema.sparse, data.table_sizes, len(data.schema.dense))
        model = shard_model(build_dlrm(spec, torch.device("cpu")), env, torch.device("cpu"), config.optim,
                            config.data.batch_size)
        optimizer = build_optimizer(model, config.optim)
        table = "model.sparse_arch.embedding_bag_collection.embedding_bags.t_C2.weight"
        assert not torch.equal(whole_tensor(model.state_dict()[table]), saved["model"][table])

        meta = load_checkpoint(summary.checkpoint_dir, model, optimizer)

        assert meta["step"] == summary.result.steps
        state = model.state_dict()
        assert set(state) == set(saved["model"])
        for name, value in state.items():
            assert torch.equal(whole_tensor(value), saved["model"][name]), name
        fused_state = optimizer.state_dict()["state"][table]
        (accumulator_key,) = [k for k in fused_state if "sum" in k or "momentum" in k]
        assert torch.equal(whole_tensor(fused_state[accumulator_key]),
                           saved["optimizer"]["state"][table][accumulator_key])
        # Identical weights give the identical held-out AUC.
        reloaded = evaluate(model, data.held_out, torch.device("cpu"))
    assert reloaded.auc == pytest.approx(summary.result.eval.auc, abs=1e-6)
    assert reloaded.loss == pytest.approx(summary.result.eval.loss, rel=1e-5)


def test_resume_mid_epoch_reaches_the_uninterrupted_weights(trained, tiny_dataset: Path,
                                                            tmp_path: Path) -> None:
    config, summary = trained  # 2 epochs of 64 steps, uninterrupted
    first = run_job(tiny_config(tiny_dataset, tmp_path / "first", eval_every=64, max_steps=40))
    # Training draws no random numbers, so mark the saved generators to see them restored.
    rng_file = first.checkpoint_dir / RNG_DIR / "rank-00000.pt"
    marked = _seeded_rng_state(1234)
    _write_rng_state(marked, rng_file)
    write_manifest(first.checkpoint_dir)  # the checkpoint changed on purpose: record it
    resumed = run_job(tiny_config(tiny_dataset, tmp_path / "resumed", eval_every=64,
                                  resume=str(first.checkpoint_dir.parent)))  # the root: its latest
    meta = json.loads((first.checkpoint_dir / META_FILE).read_text())
    assert (meta["step"], meta["epoch"], meta["rank_rows"]) == (40, 0, 40 * config.data.batch_size)
    assert first.result.steps == 40
    assert resumed.result.steps == summary.result.steps == 128
    assert resumed.result.samples == (128 - 40) * config.data.batch_size
    flat = {}
    for name, directory in (("full", summary.checkpoint_dir), ("resumed", resumed.checkpoint_dir)):
        dcp_to_torch_save(directory / STATE_DIR, tmp_path / f"{name}.pt")
        flat[name] = torch.load(tmp_path / f"{name}.pt", weights_only=False)["model"]
    for key, value in flat["full"].items():
        torch.testing.assert_close(flat["resumed"][key], value, rtol=0, atol=0, msg=key)
    assert resumed.result.eval.auc == pytest.approx(summary.result.eval.auc, abs=1e-6)
    final_rng = _read_rng_state(resumed.checkpoint_dir / RNG_DIR / "rank-00000.pt")
    assert torch.equal(final_rng["torch"], marked["torch"])
    assert final_rng["python"] == marked["python"]
    np.testing.assert_array_equal(final_rng["numpy"][1], marked["numpy"][1])


def _write_rng_state(state: dict, path: Path) -> None:
    saved = rng_state()
    set_rng_state(state)
    save_rng(path)
    set_rng_state(saved)


def _read_rng_state(path: Path) -> dict:
    saved = rng_state()
    load_rng(path)
    state = rng_state()
    set_rng_state(saved)
    return state


def _seeded_rng_state(seed: int) -> dict:
    saved = rng_state()
    torch.manual_seed(seed), np.random.seed(seed), random.seed(seed)
    marked = rng_state()
    set_rng_state(saved)
    return marked
