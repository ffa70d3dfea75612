"""``infer`` of a ``train --zch`` checkpoint: raw ids go through the frozen remap the checkpoint
holds, as TorchRec's ``MCHManagedCollisionModule`` in eval mode maps them (an id training never
kept: the table's last row), then the stock EmbeddingBagCollection."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from torchrec.modules.mc_modules import MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipelines.arrow_batch import RAW_IDS
from pipelines.parquet_reader import ParquetBatchReader
from pipelines.schema import CRITEO
from tests.train.conftest import flat_checkpoint
from torchrec_tpu.inference.model import load_inference_model
from torchrec_tpu.inference.zch_remap import SAVED_KEY
from torchrec_tpu.sharding.zch import ZchSpec
from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.job import run_job

ROWS = 48  # the C2 and C9 tables' rows: the data's 200-id vocabularies overflow them


@pytest.mark.slow
def test_unseen_and_kept_ids_score_as_torchrecs_frozen_remap(train_data: Path, tmp_path: Path) -> None:
    sizes = ",".join(str(ROWS) if name in ("C2", "C9") else "200" for name in CRITEO.sparse)
    config = TrainConfig.from_options(
        engine="sparsecore", data=str(train_data), num_embeddings_per_feature=sizes, embedding_dim=8,
        dense_arch="16,8", over_arch="16,1", batch_size=256, eval_batch_size=1024, epochs=1, max_steps=6,
        log_dir=str(tmp_path / "logs"), progress=False, zch="C2:lfu:2,C9:lru:1")
    checkpoint = run_job(config).checkpoint_dir
    served = load_inference_model(checkpoint)
    saved = torch.load(io.BytesIO(flat_checkpoint(checkpoint, tmp_path / "flat.pt")[f"model.{SAVED_KEY}"]),
                       weights_only=True)
    reference = {}
    for name, spec in (("C2", ZchSpec("lfu", 2)), ("C9", ZchSpec("lru", 1))):
        module = MCHManagedCollisionModule(zch_size=ROWS, device=torch.device("cpu"),
                                           eviction_policy=spec.eviction_policy(), eviction_interval=1)
        module.load_state_dict({k[len(f"t_{name}."):]: v for k, v in saved.items() if k.startswith(f"t_{name}.")},
                               strict=False)
        reference[name] = module.eval()
    raw = ParquetBatchReader(sorted(train_data.glob("*.parquet"))[-1:], 64, [RAW_IDS if n in ("C2", "C9") else 200
                                                                               for n in CRITEO.sparse], CRITEO)
    batch = next(iter(raw))
    per_key = batch.sparse_features.to_dict()
    unseen = 10**15 + 3
    c2 = per_key["C2"].values().clone()
    c2[0] = unseen
    per_key["C2"] = type(per_key["C2"])(values=c2, lengths=per_key["C2"].lengths())
    given = KeyedJaggedTensor.from_jt_dict(per_key)
    remapped = given.to_dict()
    for name, module in reference.items():
        out = module({f"t_{name}": remapped[name]})[f"t_{name}"]
        remapped[name] = out
        assert name != "C2" or out.values()[0].item() == ROWS - 1  # the miss: TorchRec's default slot
    expected = torch.sigmoid(served.dlrm(batch.dense_features, KeyedJaggedTensor.from_jt_dict(remapped)).squeeze(-1))
    torch.testing.assert_close(served.predict(batch.dense_features, given), expected, rtol=0, atol=0)
    assert served.table_sizes[CRITEO.sparse.index("C2")] == RAW_IDS and served.step == 6
