"""One table's SparseCore CSR buffers from our host preprocessing, with its torch.nn.EmbeddingBag
reference: the case the ``tpu::sparse_dense_matmul*`` op tests share."""

from __future__ import annotations

import numpy as np
import torch

from sparsecore import SGD as SGDSpec
from sparsecore import FeatureSpec, SparseCoreTopology, TableSpec, plan_stacking, preprocess
from sparsecore.csr_math import decode
from sparsecore.stacking import stack_rows, unstack_rows
from tests.sparsecore.helpers import random_kjt

VOCAB, DIM, BATCH = 256, 8, 32


class Case:
    def __init__(self, optimizer=SGDSpec(0.1), seed: int = 3):
        tables = [TableSpec("t", VOCAB, DIM, optimizer=optimizer)]
        features = [FeatureSpec("f", "t", BATCH, weighted=True)]
        self.plan = plan_stacking(tables, features, SparseCoreTopology("v5p", 1)).with_table_limits()
        self.stack = self.plan.stacks[0]
        self.kjt = random_kjt(self.plan, seed=seed, max_hot=5, id_range=40)  # duplicates on purpose
        csr = preprocess(self.kjt, self.plan).stacks["t"]
        self.csr = [torch.from_numpy(a) for a in (csr.row_pointers, csr.embedding_ids, csr.sample_ids, csr.gains)]
        self.raw_csr = csr
        self.limits = (BATCH, self.stack.max_ids_per_partition, self.stack.max_unique_ids_per_partition)
        self.weight = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(seed))
        self.table = self.stacked(self.weight)
        self.grad = torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(seed + 1))

    def stacked(self, per_table: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        return stack_rows(self.stack, {"t": per_table}, fill=fill)

    def logical(self, stacked: torch.Tensor) -> torch.Tensor:
        return unstack_rows(self.stack, stacked.cpu())["t"]

    def bag(self) -> torch.nn.EmbeddingBag:
        bag = torch.nn.EmbeddingBag(VOCAB, DIM, mode="sum")
        with torch.no_grad():
            bag.weight.copy_(self.weight)
        return bag

    def bag_forward(self, bag: torch.nn.EmbeddingBag) -> torch.Tensor:
        jt = self.kjt["f"]
        return bag(jt.values(), jt.offsets()[:-1], per_sample_weights=jt.weights())

    def torch_step(self, optimizer_cls, steps: int = 1,
                   **kwargs) -> tuple[torch.nn.EmbeddingBag, torch.optim.Optimizer]:
        bag = self.bag()
        opt = optimizer_cls(bag.parameters(), **kwargs)
        for _ in range(steps):
            opt.zero_grad()
            (self.bag_forward(bag) * self.grad).sum().backward()
            opt.step()
        return bag, opt

    def on(self, device: str) -> list[torch.Tensor]:
        return [t.to(device) for t in self.csr]

    def phys_rows(self) -> torch.Tensor:
        """The stacked table's rows the CSR buffers touch."""
        phys, _, _, valid = decode(*(t.numpy() for t in self.csr), self.table.shape[0], BATCH)
        return torch.from_numpy(np.asarray(phys)[np.asarray(valid)])
