"""TorchRec TPU's README migration, TorchRec 1.9.2's ``torchrec.experimental.torch_tpu`` on the tpu
device of ``torch_tpu``: the same DLRM
trained "before" (stock TorchRec ``EmbeddingBagCollection`` on CPU, one SGD over every parameter)
and "after" (``SparseCoreFusedEmbeddingBagCollection`` on the tpu device, its SGD fused into
``loss.backward()``, a dense-only SGD). Started from the same weights, both give the same losses.

    .venv/bin/python examples/torchrec_tpu_api/dlrm_migration.py [--steps 3]
"""

from __future__ import annotations

import argparse

import torch
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import torch_tpu  # noqa: F401  (the tpu device, torch.tpu.ops and TorchRec TPU's preprocessing backend)

# isort: split
# the README's "after" imports (after torch_tpu, which serves their preprocessing backend)
from torchrec.experimental.torch_tpu.checkpoint.utils import stack_and_shard_global_tensor
from torchrec.experimental.torch_tpu.datasets.dataloader import SparseCoreBatch
from torchrec.experimental.torch_tpu.datasets.input_preprocessing import SparseCoreInputPreprocessor
from torchrec.experimental.torch_tpu.modules.embedding_configs import SparseCoreEmbeddingConfig
from torchrec.experimental.torch_tpu.modules.fused_embedding_modules import SparseCoreFusedEmbeddingBagCollection

BATCH_SIZE = 128
DENSE_IN, DENSE_ARCH, OVER_ARCH = 100, [64, 64], [32, 1]
LR = 0.1


def table_config() -> EmbeddingBagConfig:
    return EmbeddingBagConfig(name="t_user", embedding_dim=64, num_embeddings=4096, feature_names=["f_user"],
                              pooling=PoolingType.SUM)


def random_batches(steps: int, batch_size: int = BATCH_SIZE, seed: int = 0) -> list[Batch]:
    """``steps`` CPU batches: dense features, 0-3 user ids per sample, 0/1 labels."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        lengths = torch.randint(0, 4, (batch_size,), generator=g)
        ids = torch.randint(0, 4096, (int(lengths.sum()),), generator=g)
        batches.append(Batch(dense_features=torch.randn(batch_size, DENSE_IN, generator=g),
                             sparse_features=KeyedJaggedTensor(keys=["f_user"], values=ids, lengths=lengths),
                             labels=torch.randint(0, 2, (batch_size,), generator=g).float()))
    return batches


def before(batches: list[Batch]) -> tuple[DLRMTrain, list[float], dict[str, torch.Tensor]]:
    """Stock TorchRec on CPU: the trained model, its losses, and its initial weights."""
    ebc = EmbeddingBagCollection(tables=[table_config()])
    dlrm_model = DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE_IN, dense_arch_layer_sizes=DENSE_ARCH,
                      over_arch_layer_sizes=OVER_ARCH)
    train_model = DLRMTrain(dlrm_model)
    initial = {k: v.clone() for k, v in train_model.state_dict().items()}
    optimizer = torch.optim.SGD(train_model.parameters(), lr=LR)
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss, _ = train_model(batch)
        loss.backward()
        optimizer.step()  # updates both dense and embedding weights
        losses.append(float(loss.detach()))
    return train_model, losses, initial


def after(batches: list[Batch], initial: dict[str, torch.Tensor] | None = None,
          compiled: bool = False) -> tuple[DLRMTrain, list[float]]:
    """The migrated model on the tpu device (from ``before``'s ``initial`` weights when given);
    ``compiled``: its steps run as ``torch.compile(backend="tpu", fullgraph=True)`` graphs (the
    SparseCore update inside the backward graph)."""
    device = torch.device("tpu")
    # 1. wrap the table config
    sc_config = SparseCoreEmbeddingConfig(config=table_config(), max_ids_per_partition=256,
                                          max_unique_ids_per_partition=256)
    # 2. the fused SparseCore EBC
    ebc = SparseCoreFusedEmbeddingBagCollection(tables=[sc_config], optimizer_type=torch.optim.SGD,
                                                optimizer_kwargs={"lr": LR}, batch_size=BATCH_SIZE,
                                                global_device_count=1, num_sc_per_device=2)
    dlrm_model = DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE_IN, dense_arch_layer_sizes=DENSE_ARCH,
                      over_arch_layer_sizes=OVER_ARCH).to(device)
    train_model = DLRMTrain(dlrm_model)
    if initial is not None:
        copy_initial_weights(train_model, ebc, initial)
    # 3. optimize only the dense parameters
    dense_params = [p for name, p in train_model.named_parameters() if "embedding_bags" not in name]
    dense_optimizer = torch.optim.SGD(dense_params, lr=LR)
    # 4. host preprocessing
    preprocessor = SparseCoreInputPreprocessor(tables=[sc_config], batch_size=BATCH_SIZE)
    step = torch.compile(train_model, backend="tpu", fullgraph=True) if compiled else train_model
    losses = []
    for raw_batch in batches:
        dense_optimizer.zero_grad()
        tpu_batch = SparseCoreBatch.from_batch(raw_batch, preprocessor).to(device)
        loss, _ = step(tpu_batch)
        loss.backward()  # the SparseCore update of the table runs here
        dense_optimizer.step()
        losses.append(float(loss.detach()))
    return train_model, losses


def copy_initial_weights(train_model: DLRMTrain, ebc: SparseCoreFusedEmbeddingBagCollection,
                         initial: dict[str, torch.Tensor]) -> None:
    """Load the stock model's ``initial`` state: dense weights by name, the table MOD-sharded over the
    SparseCores with TorchRec TPU's checkpoint utils (its ``set_unstacked_table_weights`` takes
    tables already in sharded row order)."""
    prefix = "model.sparse_arch.embedding_bag_collection.embedding_bags."
    tables = {k[len(prefix):].removesuffix(".weight"): v for k, v in initial.items() if k.startswith(prefix)}
    own = train_model.state_dict()
    with torch.no_grad():
        for config in ebc.stacked_configs:
            ebc.table_weights[config.stack_name].copy_(stack_and_shard_global_tensor(tables, config, 2).to("tpu"))
        for name, value in initial.items():
            if not name.startswith(prefix):
                own[name].copy_(value.to(own[name].device))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help='run the "after" steps under torch.compile')
    args = parser.parse_args()
    batches = random_batches(args.steps)
    _, stock_losses, initial = before(batches)
    _, tpu_losses = after(batches, initial, compiled=args.compile)
    for step, (a, b) in enumerate(zip(stock_losses, tpu_losses)):
        print(f"step {step}: before (TorchRec, CPU) {a:.6f}   after (SparseCore, tpu) {b:.6f}")


if __name__ == "__main__":
    main()
