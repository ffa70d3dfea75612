"""Chip facts, the SparseCore engine and the planner import without starting JAX or the device."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DLRM_TABLES = REPO / "examples" / "planner" / "dlrm_dcnv2_tables.yaml"


def test_facts_engine_and_planner_leave_jax_and_the_device_alone(tmp_path):
    out = tmp_path / "plan.json"
    program = textwrap.dedent(f"""
        import sys
        import tpu_facts
        heavy = sorted(m for m in ("torch", "jax", "numpy") if m in sys.modules)
        assert not heavy, f"tpu_facts imported {{heavy}}"
        import sparsecore, torchrec_tpu.planner
        from torchrec_tpu.cli import main
        rc = main(["plan", "--tables", {str(DLRM_TABLES)!r}, "--topology", "v6e-16", "--batch-size", "4096",
                   "--max-ids-per-partition", "2048", "--out", {str(out)!r}])
        assert rc == 0, rc
        loaded = sorted(m for m in ("jax", "torch_tpu") if m in sys.modules)
        assert not loaded, f"sparsecore / torchrec-tpu plan imported {{loaded}}"
        import torch
        assert torch._C._get_privateuse1_backend_name() == "privateuseone", "the tpu device was registered"
    """)
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", program], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert out.exists()
