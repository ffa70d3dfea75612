"""``train --ray-workers 2`` beside another Ray instance on the host: the job talks to its own
instance only (RAY_ADDRESS pinned in the driver and every worker), so Ray Train's placement-group
cleaner neither fails with "Found multiple active Ray instances" nor attaches to the other one;
the redirected log stays quiet (tests/train/test_quiet_logs.py's list)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.synthetic import SyntheticConfig, generate
from tests.train.conftest import REPO_ROOT, TINY_OPTIONS, as_flags
from tests.train.quiet import assert_quiet

# A driver holding a private local Ray instance (its own temp dir, cleaned up when it dies).
OTHER_INSTANCE = """
import sys, ray
from pipelines.ray_data import local_ray
with local_ray(num_cpus=1):
    print(ray.get_runtime_context().gcs_address, flush=True)
    sys.stdin.read()
"""


@pytest.mark.slow
def test_ray_train_beside_another_ray_instance(tmp_path: Path) -> None:
    data = tmp_path / "data"
    generate(SyntheticConfig(num_rows=3 * 1024, seed=3, max_cardinality=500, rows_per_file=1024,
                             row_group_size=1024), data, progress=False)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    other = subprocess.Popen([sys.executable, "-c", OTHER_INSTANCE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env, cwd=REPO_ROOT)
    try:
        assert other.stdout is not None
        other_address = other.stdout.readline().strip()
        assert other_address, "the other Ray instance did not start"
        log = tmp_path / "train.log"
        options = {**TINY_OPTIONS, "engine": "sparsecore", "epochs": 1, "batch_size": 64, "progress": True}
        with log.open("w") as out:
            rc = subprocess.run([sys.executable, "-m", "torchrec_tpu.cli", "train", "--data", str(data),
                                 "--log-dir", str(tmp_path / "run"), *as_flags(options), "--max-steps", "8",
                                 "--log-every", "4", "--ray-workers", "2", "--ray-max-failures", "0"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                                timeout=600).returncode
        text = log.read_text()
        assert rc == 0, text[-4000:]
        assert "multiple active Ray instances" not in text and other_address not in text, text[-4000:]
        assert "training finished" in text
        assert_quiet(text)
    finally:
        other.stdin.close()  # type: ignore[union-attr]
        other.wait(timeout=60)
