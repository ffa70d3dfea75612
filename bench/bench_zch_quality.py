"""AUC of managed collisions (ZCH) against modulo hashing and stock TorchRec's MCH, on drifting vocabularies.

The synthetic data's signal features (each id has its own hidden effect on the click) with
``--vocabulary-drift``: every id moves up by ``--drift`` windows of ``--window`` live ids over
the rows, so new ids keep arriving and old ones fade. Three models with the same tables (each
feature's table ``--table-rows`` x its live window, so at least as large as the window), the
same initial weights, Adagrad, and a linear head, trained online over the same batches:

- ``modulo``: raw id modulo the table's rows, a plain TorchRec ``EmbeddingBagCollection``;
- ``torchrec_mch``: stock TorchRec's ``ManagedCollisionCollection`` of ``MCHManagedCollisionModule``s
  in front of it, the evicted rows reset as TorchRec's sharded MC-EBC resets them (weights drawn
  afresh, optimizer state zeroed);
- ``zch``: the project's ``ShardedSparseCoreEBC`` with ``manage_collisions`` (the same policy).

The AUC is progressive validation: each batch is scored before the model trains on it, over
the batches after the first ``--warmup`` share (the data drifts, so there is no fixed test
set). Prints each model's AUC per seed, the mean, and the two differences the issue asks for
(ZCH - modulo on the same data, clearly above its spread over the seeds; |ZCH - TorchRec MCH|
<= 0.002). AUC is not a
timing: a busy box gives the same figures.

    .venv/bin/python bench/bench_zch_quality.py [--window 2000 --drift 10 --rows 262144 --batch 1024
        --policy lru --interval 4 --seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch
from torchmetrics.functional.classification import binary_auroc
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from torchrec.modules.mc_modules import ManagedCollisionCollection, MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipelines.synthetic import SyntheticConfig, SyntheticGenerator
from sparsecore import Adagrad
from torchrec_tpu.sharding import ShardedSparseCoreEBC, TableSharding
from torchrec_tpu.sharding.zch import ZchSpec

ARMS = ("modulo", "torchrec_mch", "zch")


def batches(args: argparse.Namespace, seed: int) -> tuple[list[KeyedJaggedTensor], list[torch.Tensor], list[int]]:
    """The data's signal features as raw-id KJTs of ``--batch`` samples (a missing value: no id),
    the labels, and each feature's live window."""
    config = SyntheticConfig(num_rows=args.rows, seed=seed, max_cardinality=args.window,
                             vocabulary_drift=args.drift, row_group_size=args.batch * 16)
    features = config.signal_sparse
    windows = [config.table_sizes[config.schema.sparse.index(f)] for f in features]
    groups = list(SyntheticGenerator(config).row_groups())
    labels = np.concatenate([g.column("label").to_numpy() for g in groups]).astype(np.float32)
    columns = [np.concatenate([g.column(f).to_numpy(zero_copy_only=False) for g in groups]) for f in features]
    kjts, targets = [], []
    for start in range(0, args.rows - args.batch + 1, args.batch):
        parts = [c[start:start + args.batch] for c in columns]
        present = [~np.isnan(p) for p in parts]
        values = np.concatenate([p[m].astype(np.int64) for p, m in zip(parts, present)])
        lengths = np.concatenate([m.astype(np.int64) for m in present])
        kjts.append(KeyedJaggedTensor(keys=list(features), values=torch.from_numpy(values),
                                      lengths=torch.from_numpy(lengths)))
        targets.append(torch.from_numpy(labels[start:start + args.batch]))
    return kjts, targets, windows


def tables(features: list[str], rows: list[int], dim: int, seed: int) -> EmbeddingBagCollection:
    torch.manual_seed(seed)
    configs = [EmbeddingBagConfig(num_embeddings=n, embedding_dim=dim, name=f"t_{f}", feature_names=[f],
                                  pooling=PoolingType.SUM) for f, n in zip(features, rows)]
    return EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))


def run_arm(arm: str, args: argparse.Namespace, seed: int) -> float:
    """Progressive-validation AUC of ``arm`` on seed ``seed``'s data."""
    kjts, labels, windows = batches(args, seed)
    features = kjts[0].keys()
    rows = [max(2, int(args.table_rows * w)) for w in windows]
    ebc = tables(features, rows, args.dim, seed)
    head = torch.nn.Linear(args.dim * len(features), 1)
    spec = ZchSpec(args.policy, args.interval)
    dense_opt = torch.optim.Adagrad(head.parameters(), lr=args.lr)
    weights = {f"t_{f}": ebc.embedding_bags[f"t_{f}"].weight for f in features}
    if arm == "zch":
        plan = {name: TableSharding("table_wise", (0,)) for name in weights}
        optimizer = Adagrad(args.lr, initial_accumulator_value=0.0, eps=1e-10)  # torch's Adagrad's defaults
        sparse = ShardedSparseCoreEBC.from_torchrec(ebc, args.batch, plan, optimizer, backend="fbgemm")
        sparse.manage_collisions(dict.fromkeys(weights, spec))
        embed, table_opt = (lambda kjt: sparse(kjt).values()), None
    else:
        table_opt = torch.optim.Adagrad(list(weights.values()), lr=args.lr)
        mcc = ManagedCollisionCollection(
            {name: MCHManagedCollisionModule(zch_size=w.shape[0], device=torch.device("cpu"),
                                             eviction_policy=spec.eviction_policy(),
                                             eviction_interval=spec.eviction_interval) for name, w in weights.items()},
            ebc.embedding_bag_configs()) if arm == "torchrec_mch" else None
        modulo = torch.tensor(rows)

        def embed(kjt: KeyedJaggedTensor) -> torch.Tensor:
            if mcc is None:
                table_rows = torch.repeat_interleave(modulo, torch.tensor(kjt.length_per_key()))
                kjt = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values() % table_rows, lengths=kjt.lengths())
                return ebc(kjt).values()
            remapped = mcc(kjt)
            for name, evicted in mcc.evict().items():
                if evicted is not None and evicted.numel():
                    reset(weights[name], table_opt, evicted)
            return ebc(remapped).values()

    scores, seen = [], []
    start = int(args.warmup * len(kjts))
    for step, (kjt, label) in enumerate(zip(kjts, labels)):
        logits = head(embed(kjt)).squeeze(1)
        if step >= start:
            scores.append(logits.detach())
            seen.append(label)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, label)
        for opt in (dense_opt, table_opt):
            if opt is not None:
                opt.zero_grad()
        loss.backward()
        for opt in (dense_opt, table_opt):
            if opt is not None:
                opt.step()
    return float(binary_auroc(torch.cat(scores), torch.cat(seen).to(torch.int64)))


@torch.no_grad()
def reset(weight: torch.Tensor, optimizer: torch.optim.Optimizer, rows: torch.Tensor) -> None:
    """As TorchRec's sharded MC-EBC resets evicted rows: fresh weights from the table's default
    initializer (uniform in +-1/sqrt(rows)), optimizer state zeroed."""
    bound = weight.shape[0] ** -0.5
    weight[rows] = torch.empty(rows.numel(), weight.shape[1]).uniform_(-bound, bound)
    for state in optimizer.state[weight].values():
        if state.dim() == 2:
            state[rows] = 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=2000, help="live ids per feature at any row (the data's "
                        "--max-cardinality)")
    parser.add_argument("--drift", type=float, default=10.0, help="windows the ids move over the rows")
    parser.add_argument("--rows", type=int, default=262_144)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--table-rows", type=float, default=2.0, help="each table's rows per live id (>= 1)")
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--policy", default="lru", choices=("lfu", "lru", "distance_lfu"))
    parser.add_argument("--interval", type=int, default=4, help="batches between evictions")
    parser.add_argument("--warmup", type=float, default=0.1, help="share of batches before the AUC counts")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"drifting vocabulary: window {args.window} ids, drift {args.drift} windows over {args.rows} rows, batch "
          f"{args.batch}, tables {args.table_rows} x window, {args.policy} every {args.interval} batches")
    aucs: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for seed in args.seeds:
        for arm in ARMS:
            aucs[arm].append(run_arm(arm, args, seed))
        print(f"seed {seed}: " + ", ".join(f"{arm} {aucs[arm][-1]:.4f}" for arm in ARMS), flush=True)
    mean = {arm: statistics.mean(v) for arm, v in aucs.items()}
    gain = [z - m for z, m in zip(aucs["zch"], aucs["modulo"])]
    gap = [z - t for z, t in zip(aucs["zch"], aucs["torchrec_mch"])]
    print("mean AUC: " + ", ".join(f"{arm} {mean[arm]:.4f}" for arm in ARMS))
    print(f"zch - modulo: {statistics.mean(gain):+.4f} (per seed, same data: {', '.join(f'{g:+.4f}' for g in gain)})")
    print(f"zch - torchrec_mch: {statistics.mean(gap):+.4f} (per seed {', '.join(f'{g:+.4f}' for g in gap)}; "
          f"target within 0.002)")


if __name__ == "__main__":
    main()
