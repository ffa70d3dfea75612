"""A whole training step (forward, backward, optimizer update) three ways, same model, init and
batches, in one run: CPU eager torch, ``torch_tpu.compile.train_step`` on the tpu device, and the
same step written directly in JAX and jitted with donated buffers (the limit for the tpu path).

Workloads: ``dlrm`` is the DLRM dense step of the anchor config (TorchRec DLRM towers: dense
13-512-256-64, dot interaction with 26 pooled embeddings of dim 64, over 512-512-256-1, BCE;
batch 2048; Adagrad lr 0.01); ``mlp`` is a 64-256-256-1 MLP, BCE, batch 256, AdamW. Each variant
runs ``--rounds`` rounds of ``--steps`` steps, rounds interleaved (cpu, tpu, jax; then tpu, jax, cpu; ...) so
load on the shared box hits all alike; the median round is reported. The device variants block on the
last loss of a round (steps dispatch asynchronously, as in training). Here the tpu device is
XLA:CPU: the ratios measure our overhead and XLA:CPU's kernels against torch's, not a TPU.

Each workload runs at every ``--threads`` count of torch CPU threads (default 1 and 2); XLA:CPU keeps
its default thread pool throughout (as in bench_dense_device).

    .venv/bin/python bench/bench_train_step.py [--workload dlrm,mlp] [--steps 10] [--rounds 5] [--threads 1,2]
        [--precision fp32|bf16]
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import quiet_box
import torch
import torch.nn.functional as F
from torch import nn

import torch_tpu.compile as tc
from torch_tpu.runtime._jax import jax, jnp
from torchrec_tpu.train.engines.dense_step import DLRMDenseLoss
from torchrec_tpu.train.model import ModelSpec, build_dlrm

NUM_SPARSE, DIM, DENSE_IN = 26, 64, 13


# -- workloads: (torch module, loss_fn(model, *batch), torch optimizer factory, batches, jax step) --

def _dlrm_model(precision: str) -> nn.Module:
    spec = ModelSpec(feature_names=tuple(f"f{i}" for i in range(NUM_SPARSE)), table_sizes=(8,) * NUM_SPARSE,
                     embedding_dim=DIM, dense_in_features=DENSE_IN, dense_layers=(512, 256, DIM),
                     over_layers=(512, 512, 256, 1))
    return DLRMDenseLoss(build_dlrm(spec, dense_device=torch.device("cpu")), precision)


def _dlrm_batches(batch: int, count: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, DENSE_IN, generator=g), 0.1 * torch.randn(batch, NUM_SPARSE, DIM, generator=g),
             torch.randint(0, 2, (batch,), generator=g).float()) for _ in range(count)]


def _linears(module: nn.Module) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(m.weight.detach().numpy().copy(), m.bias.detach().numpy().copy())
            for m in module.modules() if isinstance(m, nn.Linear)]


def _bce(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return jnp.mean(jnp.maximum(logits, 0) - logits * labels + jnp.log1p(jnp.exp(-jnp.abs(logits))))


def _matmul(x: jax.Array, y: jax.Array, dtype) -> jax.Array:
    """``x @ y`` with operands in ``dtype`` (bf16: as autocast) accumulated and returned in fp32."""
    return jnp.matmul(x.astype(dtype), y.astype(dtype), preferred_element_type=jnp.float32)


def _mlp_jax(layers, x: jax.Array, relu_last: bool, dtype=jnp.float32) -> jax.Array:
    for i, (w, b) in enumerate(layers):
        x = _matmul(x, w.T, dtype) + b
        if relu_last or i < len(layers) - 1:
            x = jax.nn.relu(x)
    return x


def _dlrm_jax_loss(params, dense, pooled, labels, dtype=jnp.float32) -> jax.Array:
    """TorchRec's DLRM towers: DenseArch (ReLU after every layer), dot InteractionArch,
    OverArch (MLP with ReLU, then a plain Linear); matmul operands in ``dtype``."""
    x = _mlp_jax(params["dense"], dense, relu_last=True, dtype=dtype)
    combined = jnp.concatenate([x[:, None, :], pooled], axis=1)
    pairs = _matmul(combined, jnp.swapaxes(combined, 1, 2), dtype)
    rows, cols = np.triu_indices(NUM_SPARSE + 1, k=1)
    z = jnp.concatenate([x, pairs[:, rows, cols]], axis=1)
    z = _mlp_jax(params["over"][:-1], z, relu_last=True, dtype=dtype)
    w, b = params["over"][-1]
    return _bce((_matmul(z, w.T, dtype) + b)[:, 0], labels)


def _adagrad_jax(loss_fn: Callable, lr: float, eps: float = 1e-10) -> Callable:
    def step(params, sums, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        sums = jax.tree.map(lambda s, g: s + g * g, sums, grads)
        params = jax.tree.map(lambda p, g, s: p - lr * g / (jnp.sqrt(s) + eps), params, grads, sums)
        return loss, params, sums

    return jax.jit(step, donate_argnums=(0, 1))


def _mlp_jax_loss(params, x, y) -> jax.Array:
    return _bce(_mlp_jax(params, x, relu_last=False)[:, 0], y)


def _adamw_jax(loss_fn: Callable, lr: float, wd: float, b1: float = 0.9, b2: float = 0.999,
               eps: float = 1e-8) -> Callable:
    def step(params, state, *batch):
        m, v, t = state
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        t = t + 1
        m = jax.tree.map(lambda m_, g: b1 * m_ + (1 - b1) * g, m, grads)
        v = jax.tree.map(lambda v_, g: b2 * v_ + (1 - b2) * g * g, v, grads)
        c1, c2 = 1 - b1 ** t, jnp.sqrt(1 - b2 ** t)
        params = jax.tree.map(lambda p, m_, v_: p * (1 - lr * wd) - (lr / c1) * m_ / (jnp.sqrt(v_) / c2 + eps),
                              params, m, v)
        return loss, params, (m, v, t)

    return jax.jit(step, donate_argnums=(0, 1))


class Workload:
    def __init__(self, name: str, batch: int, precision: str = "fp32") -> None:
        torch.manual_seed(0)
        self.name = name
        if name == "dlrm":
            self.model = _dlrm_model(precision)
            self.loss_fn = lambda m, *b: m(*b)
            self.optimizer = lambda ps: torch.optim.Adagrad(ps, lr=0.01)
            self.batches = _dlrm_batches(batch, 4)
            layers = _linears(self.model)
            n_dense = 3
            self.jax_params = {"dense": layers[:n_dense], "over": layers[n_dense:]}
            self.jax_state = jax.tree.map(jnp.zeros_like, self.jax_params)
            dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32
            self.jax_step = _adagrad_jax(functools.partial(_dlrm_jax_loss, dtype=dtype), 0.01)
            self.describe = (f"DLRM dense step: dense {DENSE_IN}-512-256-{DIM}, {NUM_SPARSE} pooled x {DIM}, "
                             f"over 512-512-256-1, batch {batch}, Adagrad, {precision}")
        elif name == "mlp":
            if precision != "fp32":
                raise ValueError(f"--precision {precision} is for the dlrm workload (mlp runs fp32)")
            self.model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
            self.loss_fn = lambda m, x, y: F.binary_cross_entropy_with_logits(m(x).squeeze(-1), y)
            self.optimizer = lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01)
            g = torch.Generator().manual_seed(0)
            self.batches = [(torch.randn(batch, 64, generator=g), torch.randint(0, 2, (batch,), generator=g).float())
                            for _ in range(4)]
            self.jax_params = _linears(self.model)
            zeros = jax.tree.map(jnp.zeros_like, self.jax_params)
            self.jax_state = (zeros, jax.tree.map(jnp.zeros_like, self.jax_params), jnp.zeros((), jnp.float32))
            self.jax_step = _adamw_jax(_mlp_jax_loss, 1e-3, 0.01)
            self.describe = f"MLP 64-256-256-1, batch {batch}, AdamW"
        else:
            raise ValueError(f"workload {name!r} is not one of ['dlrm', 'mlp']")
        self.jax_params = jax.tree.map(jnp.asarray, self.jax_params)


# -- runners: each returns a function running ``n`` steps and the last loss as a float --------

def cpu_runner(w: Workload) -> Callable[[int], float]:
    model = copy.deepcopy(w.model)
    opt = w.optimizer(model.parameters())

    def run(n: int) -> float:
        for i in range(n):
            opt.zero_grad()
            loss = w.loss_fn(model, *w.batches[i % len(w.batches)])
            loss.backward()
            opt.step()
        return float(loss.detach())

    return run


def tpu_runner(w: Workload) -> Callable[[int], float]:
    model = copy.deepcopy(w.model).to("tpu")
    step = tc.train_step(model, w.optimizer(model.parameters()), w.loss_fn)
    batches = [tuple(t.to("tpu") for t in b) for b in w.batches]

    def run(n: int) -> float:
        for i in range(n):
            loss = step(*batches[i % len(batches)])
        return float(loss)

    return run


def jax_runner(w: Workload) -> Callable[[int], float]:
    state = {"params": w.jax_params, "opt": w.jax_state}
    batches = [tuple(jnp.asarray(t.numpy()) for t in b) for b in w.batches]

    def run(n: int) -> float:
        for i in range(n):
            loss, state["params"], state["opt"] = w.jax_step(state["params"], state["opt"], *batches[i % len(batches)])
        return float(loss)

    return run


RUNNERS = {"cpu eager": cpu_runner, "tpu train_step": tpu_runner, "jax jit": jax_runner}


# -- the compute bound: how fast the step's matmuls can run at all on this machine ------------

def step_matmul_gflop(w: Workload) -> float:
    """Matmul GFLOP of one training step (forward + backward), counted by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    model = copy.deepcopy(w.model)
    with FlopCounterMode(display=False) as counter:
        w.loss_fn(model, *w.batches[0]).backward()
    return counter.get_total_flops() / 1e9


def gemm_gflops(m: int, k: int, n: int, repeats: int = 20) -> dict[str, float]:
    """Best GFLOP/s of one (m x k) @ (k x n) float32 matmul: torch CPU (current threads) and
    ``jax.jit`` on XLA:CPU, the kernels each step variant's matmuls run on."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    ja, jb = jnp.asarray(a.numpy()), jnp.asarray(b.numpy())
    jit_mm = jax.jit(jnp.matmul)
    calls = {"torch": lambda: a @ b, "xla": lambda: jit_mm(ja, jb).block_until_ready()}
    best = {}
    for name, call in calls.items():
        call()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        best[name] = 2 * m * k * n / min(times) / 1e9
    return best


def print_compute_bound(w: Workload, ms: dict[str, float], shape: tuple[int, int, int]) -> None:
    """Each variant's matmul rate against the best either kernel reaches on the step's largest
    matmul: a step that is mostly matmuls cannot run faster than its matmuls at that rate."""
    gflop = step_matmul_gflop(w)
    peak = gemm_gflops(*shape)
    rates = ", ".join(f"{name} {gflop / (t / 1e3):.0f}" for name, t in ms.items())
    print(f"  compute bound: {gflop:.2f} matmul GFLOP/step; achieved GFLOP/s: {rates}; one {shape[0]}x{shape[1]}"
          f" @ {shape[1]}x{shape[2]} matmul alone: torch {peak['torch']:.0f}, XLA:CPU {peak['xla']:.0f} GFLOP/s; "
          f"1.5x cpu eager needs {1.5 * gflop / (ms['cpu eager'] / 1e3):.0f} GFLOP/s")


def bench(w: Workload, steps: int, rounds: int) -> dict[str, float]:
    """Median milliseconds per step of each runner."""
    runs = {name: make(w) for name, make in RUNNERS.items()}
    first = {name: run(3) for name, run in runs.items()}  # compiles; losses of the same 3 steps
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):  # the order rotates: no variant always runs just after CPU torch's threads
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            runs[name](steps)
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    spread = max(first.values()) - min(first.values())
    print(f"{w.describe}\n  loss after 3 steps: " + ", ".join(f"{n} {v:.6f}" for n, v in first.items())
          + f" (spread {spread:.1e})")
    return {name: statistics.median(t) for name, t in times.items()}


def thread_counts(text: str) -> list[int]:
    """``--threads`` as a list of torch CPU thread counts (each >= 1)."""
    counts = [int(t) for t in text.split(",") if t.strip()]
    if not counts or min(counts) < 1:
        raise ValueError(f"--threads must list thread counts >= 1, got {text!r}")
    return counts


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="dlrm,mlp", help="comma-separated: dlrm, mlp (default: both)")
    parser.add_argument("--steps", type=int, default=10, help="steps per round (default: 10)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per variant (default: 5)")
    parser.add_argument("--threads", default="1,2", help="torch CPU thread counts, comma-separated (default: 1,2)")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                        help="dlrm's towers: fp32, or bf16 autocast (cpu, tpu) / bf16 operands (jax) (default: fp32)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be >= 1")
    try:
        threads = thread_counts(args.threads)
    except ValueError as error:
        parser.error(str(error))
    batch_of = {"dlrm": 2048, "mlp": 256}
    largest_matmul = {"dlrm": (2048, 512, 512), "mlp": (256, 256, 256)}
    names = [n.strip() for n in args.workload.split(",") if n.strip()]
    unknown = [n for n in names if n not in batch_of]
    if unknown:
        parser.error(f"--workload {unknown} not in {list(batch_of)}")
    print(f"load average {os.getloadavg()[0]:.2f}; XLA:CPU at its default settings for every thread count")
    for name in names:
        for count in threads:
            torch.set_num_threads(count)
            workload = Workload(name, batch_of[name], args.precision if name == "dlrm" else "fp32")
            ms = bench(workload, args.steps, args.rounds)
            cpu, tpu, ref = ms["cpu eager"], ms["tpu train_step"], ms["jax jit"]
            print(f"  ms/step: cpu eager {cpu:.2f} | tpu train_step {tpu:.2f} | jax jit {ref:.2f}  "
                  f"(torch threads {count})")
            print(f"  train_step speedup vs cpu eager {cpu / tpu:.2f}x (target >= 1.5x); "
                  f"time vs hand-written jax {tpu / ref:.2f}x (target <= 1.25x)")
            print_compute_bound(workload, ms, largest_matmul[name])
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    quiet_box.run(main)
