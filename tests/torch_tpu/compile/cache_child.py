"""Child process for the persistent-cache test: compile one model, print the counters as JSON."""

import dataclasses
import json
import sys

import torch

import torch_tpu.compile as tc
from tests.torch_tpu.compile.models import DLRMDense

torch.manual_seed(0)
model = DLRMDense()
compiled = torch.compile(model, backend="tpu", dynamic=False)
out = compiled(torch.ones(4, 13), torch.ones(4, 4, 16))
out.sum().backward()
print(json.dumps({
    "cache": dataclasses.asdict(tc.cache_stats()),
    "dir": str(tc.cache_dir()),
    "out": out.tolist(),
}))
sys.stdout.flush()
