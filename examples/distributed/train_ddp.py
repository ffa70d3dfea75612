"""Data-parallel training on tpu tensors with ``tpu_dist``, launched by torchrun.

One process per tpu device (here: per local process; on XLA:CPU each one is a "device")::

    torchrun --standalone --nproc-per-node=2 examples/distributed/train_ddp.py --steps 20
    torchrun --standalone --nproc-per-node=2 examples/distributed/train_ddp.py --strategy fsdp2

torchrun sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; ``init_process_group("tpu_dist")``
reads them. With TPU_TOPOLOGY (and TPU_ACCELERATOR_TYPE) set, ``--mesh-dims dp=2`` lays the mesh
onto the slice with ``topology_aware_mesh``; without it a plain 1-D mesh is used.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

import torch_tpu  # noqa: F401 -- the "tpu" device
import torch_tpu.distributed as tpu_dist


def build_mesh(device: str, mesh_dims: str | None) -> dist.device_mesh.DeviceMesh:
    from torch.distributed.device_mesh import init_device_mesh

    if mesh_dims is None:
        return init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("dp",))
    dims = {name: int(size) for name, size in (d.split("=") for d in mesh_dims.split(","))}
    layout = tpu_dist.topology_aware_mesh(dims)
    if dist.get_rank() == 0:
        print(f"mesh {layout.mesh_shape} {layout.mesh_dim_names} on axes {layout.physical_axes}")
    return layout.device_mesh(device)


def main() -> None:
    parser = argparse.ArgumentParser(description="DDP / FSDP2 on tpu tensors over tpu_dist")
    parser.add_argument("--strategy", choices=["ddp", "fsdp2"], default="ddp")
    parser.add_argument("--device", choices=["tpu", "cpu"], default="tpu")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--mesh-dims", help="e.g. dp=4 (needs TPU_TOPOLOGY)")
    args = parser.parse_args()

    dist.init_process_group("tpu_dist")  # before the device's first use: joins jax.distributed
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"tpu_dist transport: {tpu_dist.active_transport()}")
    torch.manual_seed(0)  # same init everywhere (DDP also broadcasts rank 0's weights)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(args.device)
    if args.strategy == "ddp":
        model = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    else:
        from torch.distributed.fsdp import fully_shard

        mesh = build_mesh(args.device, args.mesh_dims)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of the data
    x = torch.randn(64, 32, generator=gen)
    x, y = x.to(args.device), x.sum(dim=1, keepdim=True).to(args.device)
    for step in range(args.steps):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"step {step:3d}  loss (mean over {world} ranks) {mean_loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
