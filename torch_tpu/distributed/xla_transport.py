"""``XlaTransport``: ``tpu_dist`` collectives as jitted XLA collectives on the tensors' JAX arrays.

The group is a 1-D mesh (axis ``"r"``) of one device per member process, in group-rank order
(the processes must have joined ``jax.distributed``, see :mod:`torch_tpu.distributed.xla_join`).
Each call wraps this process's JAX array as its shard of a global array and runs one jitted
``shard_map`` program: ``psum`` / ``pmin`` / ``pmax``, ``all_gather``, ``psum_scatter``,
``all_to_all``, and ``ppermute`` for ``send`` / ``recv`` (a program over the pair's two
devices that both ranks run: matched in issue order, so tagged messages go to gloo). No host copy
is made: on a TPU slice the data rides ICI, on XLA:CPU JAX's gloo CPU
collectives. Reductions XLA has no collective for (PRODUCT, BAND, BOR, BXOR, and non-sum
reduce-scatter) gather every rank's block and reduce in rank order. Uneven ``all_to_all`` pads
each destination's rows to the largest split in the group (rounded up to a power of two, so few
programs compile; the split sizes, host integers, are exchanged first over the gloo group), and
slices the padding off.

CPU tensors (and mixed cpu/tpu calls) and tagged ``send`` / ``recv`` go to the gloo transport
the XLA transport wraps. The group's worker runs each call under the group timeout (the transport's
``deadline``), so a stalled peer raises instead of hanging (the stuck program is abandoned and the
group poisoned).
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torch_tpu.distributed.transport import GlooTransport, Transport, refused_receive
from torch_tpu.distributed.worker import Deadline
from torch_tpu.runtime import tensor as tensor_mod
from torch_tpu.runtime._jax import jax, jnp
from torch_tpu.runtime.dtypes import to_jax_dtype
from tpu_facts.sizes import power_of_two_bucket

RedOp = dist.ReduceOp.RedOpType
AXIS = "r"
_BLOCK = PartitionSpec(AXIS)
_NATIVE = {RedOp.SUM: lax.psum, RedOp.AVG: lax.psum, RedOp.PREMUL_SUM: lax.psum,
           RedOp.MIN: lax.pmin, RedOp.MAX: lax.pmax}
_ELEMENTWISE = {RedOp.PRODUCT: jnp.multiply, RedOp.BAND: jnp.bitwise_and,
                RedOp.BOR: jnp.bitwise_or, RedOp.BXOR: jnp.bitwise_xor}


def _kind(op: dist.ReduceOp) -> tuple[RedOp, float | None]:
    kind = op.op if isinstance(op, dist.ReduceOp) else op
    if kind not in _NATIVE and kind not in _ELEMENTWISE:
        raise ValueError(f"tpu_dist (xla transport): unsupported reduce op {kind}")
    return kind, float(op.factor) if kind == RedOp.PREMUL_SUM else None


def _opmath(x: jax.Array) -> jax.Array:
    """16-bit floats compute scaling in float32 and round once, as torch's CPU kernels do."""
    return x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x


def _premul(x: jax.Array, factor: float | None) -> jax.Array:
    if factor is None:
        return x
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"PREMUL_SUM needs a floating-point tensor, got {x.dtype}")
    return (_opmath(x) * factor).astype(x.dtype)


def _average(x: jax.Array, kind: RedOp, n: int) -> jax.Array:
    if kind != RedOp.AVG:
        return x
    if jnp.issubdtype(x.dtype, jnp.integer):
        return lax.div(x, jnp.asarray(n, x.dtype))  # truncates, as torch's rounding_mode="trunc"
    return (_opmath(x) / n).astype(x.dtype)


def _fold(rows: jax.Array, kind: RedOp) -> jax.Array:
    """Reduce axis 0 (one row per rank) in rank order."""
    return functools.reduce(_ELEMENTWISE[kind], [rows[i] for i in range(rows.shape[0])])


class _Programs:
    """Jitted shard_map collectives over one mesh, built once per (kind, static arguments)."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.n = mesh.size
        self.sharding = NamedSharding(mesh, _BLOCK)

    @functools.cache  # noqa: B019 -- one _Programs per transport, kept for its lifetime
    def get(self, name: str, *static: Any) -> Callable[[jax.Array], jax.Array]:
        body = getattr(self, f"_{name}")(*static)
        return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=_BLOCK, out_specs=_BLOCK))

    def _all_reduce(self, kind: RedOp, factor: float | None) -> Callable:
        n = self.n
        if kind in _ELEMENTWISE:
            return lambda x: _fold(lax.all_gather(x, AXIS), kind)
        return lambda x: _average(_NATIVE[kind](_premul(x, factor), AXIS), kind, n)

    def _broadcast(self, root: int) -> Callable:
        return lambda x: lax.all_gather(x, AXIS)[root]

    def _all_gather(self, out_shape: tuple[int, ...]) -> Callable:
        return lambda x: lax.all_gather(x.reshape(-1), AXIS, tiled=True).reshape(out_shape)

    def _reduce_scatter(self, kind: RedOp, factor: float | None, out_shape: tuple[int, ...]) -> Callable:
        n = self.n

        def body(x: jax.Array) -> jax.Array:
            chunks = x.reshape(n, -1)
            if kind in _ELEMENTWISE or kind in (RedOp.MIN, RedOp.MAX):
                mine = lax.all_to_all(chunks, AXIS, 0, 0, tiled=True)  # row r: rank r's chunk
                fold = _fold(mine, kind) if kind in _ELEMENTWISE else (
                    mine.min(0) if kind == RedOp.MIN else mine.max(0))
                return fold.reshape(out_shape)
            summed = lax.psum_scatter(_premul(chunks, factor), AXIS, scatter_dimension=0)
            return _average(summed, kind, n).reshape(out_shape)

        return body

    def _all_to_all(self) -> Callable:
        return lambda x: lax.all_to_all(x, AXIS, 0, 0, tiled=True)

    def _ppermute(self) -> Callable:
        """Device 0's block lands on device 1 (a mesh of a sender and its receiver)."""
        return lambda x: lax.ppermute(x, AXIS, [(0, 1)])

    def _pick_from(self, root: int, out_shape: tuple[int, ...]) -> Callable:
        """Block r of ``root``'s input lands on rank r (scatter)."""
        n = self.n
        return lambda x: lax.all_to_all(x.reshape(n, -1), AXIS, 0, 0, tiled=True)[root].reshape(out_shape)


@functools.partial(jax.jit, static_argnums=2)
def _pack(x: jax.Array, starts: jax.Array, width: int) -> jax.Array:
    """Block r: ``width`` rows of ``x`` from ``starts[r]`` (rows past a split are padding)."""
    padded = jnp.concatenate([x, jnp.zeros((width, *x.shape[1:]), x.dtype)])
    return jnp.concatenate(
        [lax.dynamic_slice_in_dim(padded, starts[r], width) for r in range(starts.shape[0])]
    )


@functools.partial(jax.jit, static_argnums=2)
def _unpack(blocks: jax.Array, offsets: jax.Array, rows: int) -> jax.Array:
    """``rows`` output rows: block r (padded) written at ``offsets[r]``, in rank order, so each
    block's padding is overwritten by the next block or cut off at the end."""
    n = offsets.shape[0]
    width = blocks.shape[0] // n
    out = jnp.zeros((rows + width, *blocks.shape[1:]), blocks.dtype)
    for r in range(n):
        out = lax.dynamic_update_slice_in_dim(out, blocks[r * width:(r + 1) * width], offsets[r], 0)
    return out[:rows]


def _offsets(splits: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(splits)[:-1]]).astype(np.int32)


_CLAIMED: set[tuple[int, ...]] = set()


def claimed(ranks: Sequence[int]) -> bool:
    """Whether a live XLA transport already runs programs over these ranks' devices."""
    return tuple(sorted(ranks)) in _CLAIMED


def _device_of(process: int) -> jax.Device:
    devices = [d for d in jax.devices() if d.process_index == process]
    if not devices:
        raise RuntimeError(f"tpu_dist (xla transport): JAX process {process} has no device")
    return min(devices, key=lambda d: d.id)


class XlaTransport(Transport):
    """tpu tensors through XLA collectives; CPU tensors and point-to-point through ``fallback``."""

    name = "xla"

    def __init__(
        self, fallback: GlooTransport, global_ranks: Sequence[int], timeout: datetime.timedelta
    ) -> None:
        self.rank, self.size = fallback.rank, fallback.size
        self._fallback = fallback
        self._devices = [_device_of(p) for p in global_ranks]
        self._local = jax.local_devices()[0]
        self._programs = _Programs(Mesh(np.array(self._devices), (AXIS,)))
        self._pairs: dict[tuple[int, int], _Programs] = {}
        self.deadline = Deadline(timeout, "XLA collective")
        self._ranks = tuple(sorted(global_ranks))
        _CLAIMED.add(self._ranks)

    # ---- plumbing ---------------------------------------------------------------------------

    @staticmethod
    def _on_device(*tensors: torch.Tensor) -> bool:
        return all(type(t) is tensor_mod.TpuTensor for t in tensors)

    def _global(self, local: jax.Array, programs: _Programs) -> jax.Array:
        local = jax.device_put(local, self._local)
        shape = (programs.n * local.shape[0], *local.shape[1:])
        return jax.make_array_from_single_device_arrays(shape, programs.sharding, [local])

    def _run(
        self,
        program: Callable[[jax.Array], jax.Array],
        local: jax.Array,
        programs: _Programs | None = None,
    ) -> jax.Array:
        """``program`` (one of ``programs``', default the group's) on every member's block; this
        process's output block, computed."""

        out = program(self._global(local, programs or self._programs)).addressable_data(0)
        return out.block_until_ready()

    def _pair(self, src: int, dst: int) -> _Programs:
        """Programs over the devices of group ranks ``src`` then ``dst``."""
        if (src, dst) not in self._pairs:
            mesh = Mesh(np.array([self._devices[src], self._devices[dst]]), (AXIS,))
            self._pairs[(src, dst)] = _Programs(mesh)
        return self._pairs[(src, dst)]

    @staticmethod
    def _value(t: torch.Tensor) -> jax.Array:
        """``t``'s elements, at least 1-D (a 0-d tensor is one row)."""
        value = tensor_mod.concrete_value(t)
        return value.reshape(1) if value.ndim == 0 else value

    @staticmethod
    def _store(t: torch.Tensor, value: jax.Array) -> None:
        tensor_mod.write(t, value.reshape(t.shape))

    # ---- collectives ------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp) -> None:
        if not self._on_device(tensor):
            return self._fallback.all_reduce(tensor, op)
        if tensor.numel():
            self._store(tensor, self._run(self._programs.get("all_reduce", *_kind(op)), self._value(tensor)))

    def reduce(self, tensor: torch.Tensor, root: int, op: dist.ReduceOp) -> None:
        if not self._on_device(tensor):
            return self._fallback.reduce(tensor, root, op)
        self.all_reduce(tensor, op)  # non-root values are unspecified: the full result is fine

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        if not self._on_device(tensor):
            return self._fallback.broadcast(tensor, root)
        if tensor.numel():
            self._store(tensor, self._run(self._programs.get("broadcast", root), self._value(tensor)))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if not self._on_device(output, input):
            return self._fallback.all_gather(output, input)
        if input.numel():
            program = self._programs.get("all_gather", (output.numel(),))
            self._store(output, self._run(program, self._value(input)))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp) -> None:
        if not self._on_device(output, input):
            return self._fallback.reduce_scatter(output, input, op)
        if output.numel():
            program = self._programs.get("reduce_scatter", *_kind(op), (output.numel(),))
            self._store(output, self._run(program, self._value(input).reshape(-1)))

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
    ) -> None:
        if not self._on_device(output, input):
            return self._fallback.all_to_all(output, input, output_splits, input_splits)
        x = self._value(input)
        if not input_splits:  # equal chunks on every rank: no padding, no split exchange
            if x.size:
                self._store(output, self._run(self._programs.get("all_to_all"), x))
            return
        matrix = self._split_matrix(input_splits)
        width = int(matrix.max())
        if not width:
            return
        if matrix.min() == width:  # every rank sends every rank the same rows: no padding needed
            self._store(output, self._run(self._programs.get("all_to_all"), x))
            return
        width = power_of_two_bucket(width)
        padded = _pack(x, _offsets(input_splits), width)
        received = self._run(self._programs.get("all_to_all"), padded)
        if output.numel():
            self._store(output, _unpack(received, _offsets(output_splits), output.shape[0]))

    def _split_matrix(self, input_splits: Sequence[int]) -> np.ndarray:
        """Every rank's input splits (row r: what rank r sends to each rank).

        Splits are host integers, so they go through the gloo group (no device round trip).
        """
        mine = torch.tensor(list(input_splits), dtype=torch.int64)
        gathered = torch.empty(self.size * self.size, dtype=torch.int64)
        self._fallback.all_gather(gathered, mine)
        return gathered.numpy().reshape(self.size, self.size)

    def gather(self, outputs: list[torch.Tensor] | None, input: torch.Tensor, root: int) -> None:
        tensors = [input, *(outputs or [])]
        if not self._on_device(*tensors):
            return self._fallback.gather(outputs, input, root)
        if not input.numel():
            return
        program = self._programs.get("all_gather", (self.size * input.numel(),))
        gathered = self._run(program, self._value(input))
        for r, out in enumerate(outputs or []):
            self._store(out, gathered[r * input.numel():(r + 1) * input.numel()])

    def scatter(self, output: torch.Tensor, inputs: list[torch.Tensor] | None, root: int) -> None:
        if not self._on_device(output, *(inputs or [])):
            return self._fallback.scatter(output, inputs, root)
        if not output.numel():
            return
        if inputs is None:
            blocks = jnp.zeros(self.size * output.numel(), tensor_mod.concrete_value(output).dtype)
        else:
            blocks = jnp.concatenate([self._value(t).reshape(-1) for t in inputs])
        program = self._programs.get("pick_from", root, (output.numel(),))
        self._store(output, self._run(program, blocks))

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        if tag or dst == self.rank or not self._on_device(tensor):
            return self._fallback.send(tensor, dst, tag)
        self._fallback.announce(tensor, dst, tag)
        if tensor.numel():
            pair = self._pair(self.rank, dst)
            self._run(pair.get("ppermute"), self._value(tensor).reshape(-1), pair)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        if tag or src == self.rank or not self._on_device(tensor):
            return self._fallback.recv(tensor, src, tag)
        sent = self._fallback.announced(tensor, src, tag)
        numel, dtype = sent or (tensor.numel(), tensor.dtype)
        if numel:  # the sender's program runs with what it sent, so this side runs the same
            pair = self._pair(src, self.rank)
            received = self._run(pair.get("ppermute"), jnp.zeros(numel, to_jax_dtype(dtype)), pair)
        if sent is not None:
            raise refused_receive(tensor, src, tag, sent)
        if numel:
            self._store(tensor, received)

    def barrier(self) -> None:
        token = jnp.zeros(1, jnp.int32)
        np.asarray(self._run(self._programs.get("all_reduce", RedOp.SUM, None), token))

    def shutdown(self) -> None:
        _CLAIMED.discard(self._ranks)
        self._fallback.shutdown()
