"""HSTU: plain PyTorch eager on CPU vs the project's stack, back to back.

Plain: the model with stock TorchRec's EmbeddingCollection and the padded ``[B, H, L, L]``
attention at every length (kernel ``padded``, as generative-recommenders' PyTorch kernels run), all
on the CPU. Stack: the same model (same weights) as ``torchrec-tpu train --model hstu`` runs it: its
tables on the sharded SparseCore EmbeddingCollection, the STU stack and heads on ``--dense-device``
(``tpu``, the default: stack, heads and Adam as one compiled program per step, attention by the
jagged op inside it; ``cpu``: CPU eager torch, attention by the jagged op on the tpu device, batches
shorter than ``CPU_JAGGED_FROM`` by the padded attention), its step the job's
(``hstu.train.step_function``; ``train``'s ``--dense-device auto`` picks the faster by timing
both). The first line says what is compared. Printed: steady training samples/s of each and the
ratio; the attention op alone (forward + backward) of each and the ratio, at ``--users`` sequences
(where the op's fixed per-call costs weigh most) and at the training batch (each the median of
``--repeats`` alternating rounds, the rounds' ratios printed); peak RSS of one attention forward +
backward at each ``--rss-lengths`` (each in a fresh process), and in parentheses its growth during
the step (over the process with its inputs made). Both run in one process, which starts as
``torchrec-tpu train`` starts a job's (``launcher.xla_cpu_env``: glibc's malloc and libgomp's spin
set for XLA:CPU; plain PyTorch's rate measured the same without them).
Run it on a quiet machine for figures.
Usage: .venv/bin/python bench/bench_hstu.py [--stu paper|dlrmv3] [--dense-device tpu|cpu] [--steps 20] [--repeats 3]
                                           [--batch 16] [--seq-len 256]
       .venv/bin/python bench/bench_hstu.py --rss-only [--rss-lengths 1024,4096]  (the RSS lines alone)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import quiet_box
import torch

import torch_tpu  # noqa: F401  (the tpu device)
from pipelines.sequences.reader import SequenceBatch
from torch_tpu.ops.hstu import jagged_hstu_attention
from torch_tpu.runtime.tensor import to_jax
from torchrec_tpu.hstu import HSTU, HSTUConfig, sharded_embeddings
from torchrec_tpu.hstu.attention import PADDED, describe, padded_attention
from torchrec_tpu.hstu.placement import random_batch
from torchrec_tpu.hstu.train import optimizers, step_function, step_layout
from torchrec_tpu.launcher import restart_with_xla_cpu_env
from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.distributed import DistEnv
from torchrec_tpu.train.engines.dense_placement import dense_device

HEADS, QK, DV = 2, 32, 32
OP_ROUND_S = 1.5  # the attention op's rounds: seconds of calls at least
StepFn = Callable[[SequenceBatch], torch.Tensor]


def _plain_step(model: HSTU) -> StepFn:
    """Plain PyTorch's training step: Adam on the stack and heads, Adagrad on the tables."""
    dense = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    adam, sparse = torch.optim.Adam(dense, lr=1e-3), torch.optim.Adagrad(model.embeddings.parameters())

    def step(batch: SequenceBatch) -> torch.Tensor:
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(batch.features), batch.labels)
        adam.zero_grad()
        sparse.zero_grad()
        loss.backward()
        adam.step()
        sparse.step()
        return loss

    return step


def _samples_per_s(step: StepFn, batches: list[SequenceBatch], steps: int, warmup: int) -> float:
    start, seen = 0.0, 0
    for i in range(warmup + steps):
        if i == warmup:
            start, seen = time.perf_counter(), 0
        batch = batches[i % len(batches)]
        float(step(batch).detach().cpu())  # wait for the device
        seen += batch.users
    return seen / (time.perf_counter() - start)


def _attention_inputs(users: int, seq: int, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(users + 1) * seq
    total = users * seq
    q, k = (torch.randn(total, HEADS, QK, generator=gen).to(device).requires_grad_() for _ in range(2))
    v = torch.randn(total, HEADS, DV, generator=gen).to(device).requires_grad_()
    ts = torch.randint(0, 60, (total,), generator=gen).cumsum(0).to(device)
    targets = torch.zeros(users, dtype=torch.int64).to(device)
    pos, tw = torch.zeros(seq).to(device).requires_grad_(), torch.zeros(129).to(device).requires_grad_()
    return q, k, v, offsets.to(device), ts, targets, pos, tw


def _attention_step(plain: bool, inputs, seq: int) -> None:
    q, k, v, offsets, ts, targets, pos, tw = inputs
    if plain:
        out = padded_attention(q, k, v, offsets, ts, targets, pos, tw, max_len=seq, max_seq_len=seq, alpha=QK ** -0.5)
    else:
        out = jagged_hstu_attention(q, k, v, offsets, ts, pos, tw, max_len=seq, max_seq_len=seq, alpha=QK ** -0.5,
                                    num_targets=targets)
    out.sum().backward()
    if not plain:
        to_jax(q.grad).block_until_ready()


def _attention_per_s(plain: bool, users: int, seq: int, steps: int, warmup: int) -> float:
    """Calls per second over at least ``steps`` calls and :data:`OP_ROUND_S` seconds (a call takes a
    few ms: 20 of them swung a round's ratio from 1.2x to 2.3x on a quiet host)."""
    inputs = _attention_inputs(users, seq, "cpu" if plain else "tpu")
    for _ in range(warmup):
        _attention_step(plain, inputs, seq)
    calls, start = 0, time.perf_counter()
    while calls < steps or time.perf_counter() - start < OP_ROUND_S:
        _attention_step(plain, inputs, seq)
        calls += 1
    return calls / (time.perf_counter() - start)


def _max_rss_mib() -> float:
    """This process's peak RSS: VmHWM, which starts afresh at exec (getrusage's ru_maxrss would carry
    the parent's RSS at fork over the exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rss_child(plain: bool, users: int, seq: int) -> None:
    inputs = _attention_inputs(users, seq, "cpu" if plain else "tpu")
    before = _max_rss_mib()
    _attention_step(plain, inputs, seq)
    print(json.dumps({"peak": _max_rss_mib(), "growth": _max_rss_mib() - before}))


def _peak_rss(plain: bool, users: int, seq: int) -> str:
    """``peak MiB (+growth over the inputs' process)`` of one fwd+bwd, in a fresh process."""
    out = subprocess.run([sys.executable, __file__, "--rss-child", str(seq), "--users", str(users)]
                         + (["--plain"] if plain else []), capture_output=True, text=True, check=True)
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    return f"{rss['peak']:.0f} MiB (+{rss['growth']:.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3,
                        help="alternating rounds of plain and stack; each ratio is their median (default: 3)")
    parser.add_argument("--batch", type=int, default=16, help="users per training batch")
    parser.add_argument("--seq-len", type=int, default=256, help="history + candidates per user (training)")
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--stu", choices=("paper", "dlrmv3"), default="paper", help="the STU layer (docs/HSTU.md)")
    parser.add_argument("--dense-device", choices=("tpu", "cpu"), default="tpu",
                        help="where the stack's STU layers and heads run (module docstring)")
    parser.add_argument("--rss-lengths", default="1024,4096", help="sequence lengths of the peak RSS runs")
    parser.add_argument("--users", type=int, default=2, help="sequences per attention / RSS run")
    parser.add_argument("--rss-only", action="store_true", help="print the peak RSS lines only (no timing)")
    parser.add_argument("--rss-child", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_child:
        _rss_child(args.plain, args.users, args.rss_child)
        return
    if not args.rss_only:
        _timings(args)
    for seq in (int(x) for x in args.rss_lengths.split(",") if x):
        print(f"peak RSS, attention fwd+bwd ({args.users} x {seq}): plain {_peak_rss(True, args.users, seq)}, "
              f"jagged op {_peak_rss(False, args.users, seq)}")


def _timings(args: argparse.Namespace) -> None:
    """The training-step and attention-op lines."""
    candidates = 4
    config = HSTUConfig(item_rows=args.items, action_rows=2, dim=64, heads=HEADS, qk_dim=QK, v_dim=DV,
                        max_seq_len=args.seq_len, kernel=PADDED, stu=args.stu)
    batches = [random_batch(args.batch, args.seq_len - candidates, candidates, args.items, 2, 1, seed)
               for seed in range(4)]
    torch.manual_seed(0)
    plain = HSTU(config)
    options = TrainConfig.from_options(model="hstu", dense_device=args.dense_device, dense_lr=1e-3)
    layout = step_layout(options, DistEnv(0, 1, 1), dense_device(args.dense_device))
    dense = layout.dense_device
    stack = HSTU(replace(config, kernel="xla"), dense_device=dense,
                 embeddings=sharded_embeddings(config, ec=plain.embeddings, local_batch=args.batch))
    stack.stack.load_state_dict(plain.stack.state_dict())
    stack.heads.load_state_dict(plain.heads.state_dict())
    program = "as one compiled program per step" if layout.one_program else "eager"
    print(f"compared: plain = stock TorchRec EmbeddingCollection, STU stack and heads, padded [B, H, L, L] "
          f"attention, all PyTorch eager on cpu; stack = sharded SparseCore EmbeddingCollection, STU stack and "
          f"heads on {dense.type} ({program}), attention by the {describe('xla', dense)}")
    plain_step, stack_step = _plain_step(plain), step_function(stack, *optimizers(options, stack), layout)
    warmup = max(args.warmup, len(batches))  # every batch's shapes compiled before a timed step
    train = _alternating(args.repeats, lambda: _samples_per_s(plain_step, batches, args.steps, warmup),
                         lambda: _samples_per_s(stack_step, batches, args.steps, warmup))
    print(f"train step (batch {args.batch}, seq {args.seq_len}): plain PyTorch CPU {train.plain:.1f} samples/s, "
          f"stack {train.stack:.1f} samples/s, ratio {train.describe()}")
    for users in dict.fromkeys((args.users, args.batch)):  # a few sequences (per-call costs), the training batch
        op = _alternating(args.repeats, lambda: _attention_per_s(True, users, args.seq_len, args.steps, args.warmup),
                          lambda: _attention_per_s(False, users, args.seq_len, args.steps, args.warmup))
        print(f"attention fwd+bwd ({users} x {args.seq_len}): plain {op.plain:.2f}/s, jagged op {op.stack:.2f}/s, "
              f"ratio {op.describe()}")


@dataclass(frozen=True)
class Rounds:
    """Rates of ``plain`` and ``stack`` over alternating rounds: the medians, and each round's ratio."""

    plains: list[float]
    stacks: list[float]

    @property
    def plain(self) -> float:
        return statistics.median(self.plains)

    @property
    def stack(self) -> float:
        return statistics.median(self.stacks)

    def describe(self) -> str:
        ratios = [s / p for p, s in zip(self.plains, self.stacks)]
        runs = ", ".join(f"{r:.2f}" for r in ratios)
        return f"{statistics.median(ratios):.2f}x (median of {len(ratios)} alternating rounds: {runs})"


def _alternating(repeats: int, plain: Callable[[], float], stack: Callable[[], float]) -> Rounds:
    """``repeats`` rounds of ``plain()`` then ``stack()`` (each a rate)."""
    plains, stacks = [], []
    for _ in range(repeats):
        plains.append(plain())
        stacks.append(stack())
    return Rounds(plains, stacks)

if __name__ == "__main__":
    restart_with_xla_cpu_env()
    quiet_box.run(main)
