"""``sparsecore.stacked_arrays`` holds the tables once: loading a stack table by table and reading
every table back raise the process's peak RSS by the stack plus a bounded working set (a table and
its chunks), under the malloc settings a training job runs with on XLA:CPU (``launcher.XLA_CPU_MALLOC``:
glibc serves large blocks from its heap). Before the heap's freed pages were handed back after each
chunk and table, every table's and chunk's freed copies stayed resident: ~2x the stack at its peak."""

import json
import os
import subprocess
import sys
from pathlib import Path

from sparsecore.stacked_arrays import CHUNK_BYTES
from torchrec_tpu.launcher import XLA_CPU_MALLOC

# MLPerf DLRM-DCNv2's 26 cardinalities capped at 375k rows (bench_scale's --caps 1500000, / 4): 10.1M / 4 rows
SIZES = (375000, 9765, 4323, 1856, 5066, 1, 1780, 385, 15, 375000, 375000, 101320, 2, 552, 2984, 38, 1, 244, 3,
         375000, 375000, 375000, 147538, 3243, 27, 9)
DIM = 32
SLACK = 96 << 20  # the put and gather programs' compilation, numpy's index arrays (measured: the load and
# read grew 562 MiB with the per-chunk release, 760 MiB without it, against a bound of 624 MiB)

CHILD = """
import json, sys
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacked_arrays import stacked_array, unstack_table
from sparsecore.stacking import plan_stacking

def stack_of(tables):
    features = [FeatureSpec("f" + t.name, t.name, 16) for t in tables]
    return plan_stacking(tables, features, SparseCoreTopology("v5p", 1)).stacks[0]

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

sizes, dim = json.loads(sys.argv[1]), int(sys.argv[2])
small = stack_of([TableSpec("w", 8, dim)])  # JAX's client started before the baseline
unstack_table(small, stacked_array(small, lambda name: TableSpec(name, 8, dim).init_weights(), row_slot=False), "w")
tables = {f"t{i}": TableSpec(f"t{i}", rows, dim) for i, rows in enumerate(sizes)}
stack = stack_of(list(tables.values()))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM from here
base = status("VmRSS:")
stacked = stacked_array(stack, lambda name: tables[name].init_weights(), row_slot=False)
for name in tables:  # as a checkpoint reads them: one at a time, each dropped before the next
    unstack_table(stack, stacked, name)
print(json.dumps({"grew": status("VmHWM:") - base, "stack": stacked.nbytes}))
"""


def test_loading_and_reading_a_stack_holds_it_once_plus_a_table():
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root, "GLIBC_TUNABLES": XLA_CPU_MALLOC}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(SIZES), str(DIM)], capture_output=True,
                          text=True, env=env, cwd=root, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    largest = max(SIZES) * DIM * 4
    assert result["stack"] >= sum(SIZES) * DIM * 4  # (the stack's rows padded)
    # the stack, one table's host rows and its gathered copy, a chunk on the host and on the device
    bound = result["stack"] + 2 * largest + 2 * CHUNK_BYTES + SLACK
    assert result["grew"] <= bound, (f"peak RSS grew {result['grew'] / 2**20:.0f} MiB loading and reading a "
                                     f"{result['stack'] / 2**20:.0f} MiB stack (bound {bound / 2**20:.0f} MiB)")
