"""One profiled training run on a tiny synthetic dataset, shared by the profiling tests."""

from __future__ import annotations

import pytest

from pipelines.synthetic import SyntheticConfig, generate
from torchrec_tpu.train.config import TrainConfig

PROFILED_STEPS = 4
DATA = SyntheticConfig(num_rows=3 * 1024, seed=2, max_cardinality=100, rows_per_file=1024,
                       row_group_size=256)


@pytest.fixture(scope="session", params=["sparsecore", "torchrec"])
def profiled(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """One profile run per engine (the CLI's default, sparsecore, and the torchrec reference).
    Sparsecore's towers go on the tpu device by flag, so its step is the one compiled program the
    tests expect: ``auto`` would time both placements, and at this tiny size they are a tie that
    load on the host decides."""
    from torchrec_tpu.profiling.job import profile_training

    data = tmp_path_factory.mktemp("profile_data")
    generate(DATA, data, progress=False)
    logs = tmp_path_factory.mktemp("profile_run")
    config = TrainConfig.from_options(
        engine=request.param, data=str(data), num_embeddings=100, embedding_dim=8, dense_arch="16,8",
        over_arch="16,1",
        batch_size=128, log_dir=str(logs), progress=False,
        **({"dense_device": "tpu"} if request.param == "sparsecore" else {}),
    )
    return profile_training(config, steps=PROFILED_STEPS, warmup=1, log_dir=logs / "profile")
