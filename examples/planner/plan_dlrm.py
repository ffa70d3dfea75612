"""Plan the MLPerf DLRM-DCNv2 tables on a few slices with the Python API, then load the plan back
as training would and convert it to a TorchRec ShardingPlan.

    .venv/bin/python examples/planner/plan_dlrm.py [--max-ids-per-partition 2048]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from torchrec_tpu.planner import PlanningError, load_plan, load_tables, plan_tables, to_torchrec_sharding_plan
from torchrec_tpu.planner.report import format_comparison
from torchrec_tpu.topology import parse_accelerator_type
from torchrec_tpu.train.model import EBC_PATH

TABLES = Path(__file__).with_name("dlrm_dcnv2_tables.yaml")
SLICES = ("v5p-64", "v5p-128", "v6e-64", "v6e-256", "tpu7x-64", "tpu7x-128")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=65536)
    parser.add_argument("--max-ids-per-partition", type=int, default=2048)
    args = parser.parse_args()
    tables = load_tables(str(TABLES))
    results = []
    for name in SLICES:
        try:
            results.append((name, plan_tables(tables, parse_accelerator_type(name), args.batch_size,
                                              args.max_ids_per_partition)))
        except PlanningError as err:
            results.append((name, str(err)))
    print(format_comparison(results))

    name, plan = next((n, p) for n, p in results if not isinstance(p, str))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        plan.save(path)
        loaded = load_plan(path)
    sharding = to_torchrec_sharding_plan(loaded, EBC_PATH)  # the EBC of torchrec_tpu's DLRMTrain
    module_plan = next(iter(sharding.plan.values()))
    c1 = module_plan["C1"]
    print(f"\n{name}: C1 -> {c1.sharding_type} on ranks {c1.ranks[:8]}{' ...' if len(c1.ranks) > 8 else ''}")


if __name__ == "__main__":
    main()
