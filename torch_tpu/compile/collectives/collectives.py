"""Collectives in compiled graphs: the graph split at each ``_c10d_functional`` collective.

Dynamo turns ``torch.distributed.all_reduce`` (and the functional collectives of
``torch.distributed._functional_collectives``) into ``_c10d_functional`` ops, which have no XLA
lowering here. A graph (forward, backward or inference, after AOTAutograd, so autograd is
untouched) that holds any becomes a :class:`SegmentedGraph`: the runs of ops between collectives
are compiled programs (:class:`~torch_tpu.compile.program.graph.CompiledGraph` each), and every collective
runs between them through the process group's eager path (``torch.distributed.all_reduce`` ... on
the tpu tensors: tpu_dist's XLA transport), waited for at once, so its ``wait_tensor`` is a no-op.

Safety: a compiled graph whose ranks disagree on its collectives would deadlock (or mix up data).
On its first call a segmented graph all-gathers, over each group it uses, the digest of its
collective sequence (op, shapes, dtypes, reduce op, group); a rank that sees another digest raises
:class:`CollectiveMismatchError` naming both sequences, on every rank of the group.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from torch_tpu.compile.program.fx_to_jax import is_collective


class CollectiveMismatchError(RuntimeError):
    """Ranks run compiled graphs with different collective sequences."""


def has_collectives(gm: torch.fx.GraphModule) -> bool:
    return any(is_collective(n) for n in gm.graph.nodes)


def _eager(node: torch.fx.Node, eager: set[torch.fx.Node]) -> bool:
    """Runs outside the programs: a collective, or an item taken from a collective's result list."""
    if is_collective(node):
        return True
    return (node.op == "call_function" and node.target is operator.getitem
            and node.args[0] in eager)


def bind_collective(op: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    names = [a.name for a in op._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def process_group_of(name: Any) -> dist.ProcessGroup:
    if isinstance(name, dist.ProcessGroup):
        return name
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _reduce_op(name: str) -> Any:
    return {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
            "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "band": dist.ReduceOp.BAND,
            "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}[name.lower()]


def run_collective(op: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """One ``_c10d_functional`` op on real tensors, through the process group's eager collective;
    the result is complete on return."""
    name = op._schema.name.split("::")[1]
    b = bind_collective(op, args, kwargs)
    if name == "wait_tensor":
        return b["tensor"]  # every collective here completed before returning its result
    single = {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast"}
    if name in single:
        x = b["input"].contiguous()
        pg = process_group_of(b["group_name"])
        rest = tuple(x.shape[1:])
        if name == "all_reduce":
            out = x.clone()
            dist.all_reduce(out, op=_reduce_op(b["reduce_op"]), group=pg)
        elif name == "broadcast":
            out = x.clone()
            dist.broadcast(out, group=pg, group_src=int(b["src"]))
        elif name == "all_gather_into_tensor":
            out = x.new_empty((x.shape[0] * int(b["group_size"]), *rest))
            dist.all_gather_single(out, x, group=pg)
        elif name == "reduce_scatter_tensor":
            out = x.new_empty((x.shape[0] // int(b["group_size"]), *rest))
            dist.reduce_scatter_single(out, x, op=_reduce_op(b["reduce_op"]), group=pg)
        else:
            out_splits = [int(s) for s in b["output_split_sizes"]] or None
            in_splits = [int(s) for s in b["input_split_sizes"]] or None
            rows = sum(out_splits) if out_splits else x.shape[0]
            out = x.new_empty((rows, *rest))
            dist.all_to_all_single(out, x, out_splits, in_splits, group=pg)
        return out
    # coalesced and other collectives: the op's own kernel (the device's path for it), waited for
    out = op(*args, **kwargs)
    wait = torch.ops._c10d_functional.wait_tensor.default
    if isinstance(out, torch.Tensor):
        return wait(out)
    return type(out)(wait(t) for t in out)


def _describe(value: Any) -> str:
    if isinstance(value, torch.fx.Node):
        val = value.meta.get("val")
        if isinstance(val, torch.Tensor):
            return f"{str(val.dtype).removeprefix('torch.')}{list(val.shape)}"
        return "?"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    return repr(value)


def collective_sequence(gm: torch.fx.GraphModule) -> list[str]:
    """Each collective of the graph (waits left out), in order: op, inputs and arguments."""
    seq = []
    for node in gm.graph.nodes:
        if is_collective(node) and node.target._schema.name != "_c10d_functional::wait_tensor":
            bound = bind_collective(node.target, node.args, node.kwargs)
            described = ", ".join(f"{k}={_describe(v)}" for k, v in bound.items())
            seq.append(f"{node.target._schema.name}({described})")
    return seq


def collective_groups(gm: torch.fx.GraphModule) -> list[Any]:
    """The process groups (by name) of the graph's collectives, in order of first use."""
    names: list[Any] = []
    for node in gm.graph.nodes:
        if is_collective(node):
            g = bind_collective(node.target, node.args, node.kwargs).get("group_name")
            if g is not None and g not in names:
                names.append(g)
    return names


def _all_gather_bytes(payload: bytes, pg: dist.ProcessGroup) -> list[bytes]:
    """Every rank's ``payload`` over ``pg`` (CPU tensors: the host lane)."""
    n = dist.get_world_size(pg)
    length = torch.tensor([len(payload)], dtype=torch.int64)
    lengths = torch.empty(n, dtype=torch.int64)
    dist.all_gather_single(lengths, length, group=pg)
    width = int(lengths.max())
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else mine[:0]
    every = torch.empty(n * width, dtype=torch.uint8)
    dist.all_gather_single(every, mine, group=pg)
    return [bytes(every[r * width: r * width + int(lengths[r])].tolist()) for r in range(n)]


def check_same_collectives(gm: torch.fx.GraphModule, kind: str, inputs: Sequence[str] = ()) -> str:
    """Raise :class:`CollectiveMismatchError` unless every rank of each group the graph uses runs
    the same collective sequence (and, for an SPMD program, the same ``inputs``: one line per
    input); returns this rank's digest."""
    return check_same_program(program_lines(gm, inputs), kind, collective_groups(gm))


def program_lines(gm: torch.fx.GraphModule, inputs: Sequence[str] = ()) -> list[str]:
    """What ranks running ``gm`` must agree on: its ``inputs`` (one line each) and collectives."""
    return [*(f"input {line}" for line in inputs), *collective_sequence(gm)]


def on_every_rank(flag: bool, group: dist.ProcessGroup) -> bool:
    """Whether ``flag`` holds on every rank of ``group`` (a collective: call on every rank)."""
    return all(payload == b"1" for payload in _all_gather_bytes(b"1" if flag else b"0", group))


def check_same_program(seq: Sequence[str], kind: str, groups: Sequence[Any]) -> str:
    """:func:`check_same_collectives` for a program described by ``seq`` (:func:`program_lines`,
    e.g. stored with it) over ``groups`` (process groups or their names)."""
    text = "\n".join(seq)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    for name in groups:
        pg = process_group_of(name)
        name = name if isinstance(name, str) else pg.group_name
        theirs = _all_gather_bytes(f"{digest}\n{text}".encode(), pg)
        me = dist.get_rank(pg)
        for r, payload in enumerate(theirs):
            other_digest, _, other_text = payload.decode().partition("\n")
            if other_digest != digest:
                raise CollectiveMismatchError(
                    f"torch_tpu: the compiled {kind} graph's collectives or inputs differ between "
                    f"ranks of group {name!r}: rank {me} (digest {digest}) runs\n  "
                    + "\n  ".join(seq or ["(none)"])
                    + f"\nbut rank {r} (digest {other_digest}) runs\n  "
                    + "\n  ".join(other_text.split("\n") if other_text else ["(none)"])
                    + "\nEvery rank must compile the same collectives in the same order (and an SPMD program "
                    "the same inputs)."
                )
    return digest


class Segment:
    """A run of ops between collectives, as its own graph: inputs (nodes defined before it) and the
    outputs later steps or the graph's output use."""

    def __init__(self, gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> None:
        inside = set(nodes)
        self.inputs: list[torch.fx.Node] = []
        attrs: list[torch.fx.Node] = []
        for n in nodes:
            for a in n.all_input_nodes:
                if a in inside or a in self.inputs or a in attrs:
                    continue
                (attrs if a.op == "get_attr" else self.inputs).append(a)
        # users come after their producers: a user outside the run is a later one
        self.outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        g = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for a in self.inputs:
            env[a] = g.placeholder(a.name)
            env[a].meta = dict(a.meta)
        for a in attrs:
            env[a] = g.get_attr(a.target)
            env[a].meta = dict(a.meta)
        for n in nodes:
            env[n] = g.node_copy(n, lambda x: env[x])
        g.output(tuple(env[n] for n in self.outputs))
        self.gm = torch.fx.GraphModule(gm, g)
        self.compiled: Any = None

    def example_inputs(self) -> list[Any]:
        return [a.meta.get("val") for a in self.inputs]

    def __call__(self, env: dict[torch.fx.Node, Any]) -> None:
        outs = self.compiled([env[a] for a in self.inputs])
        env.update(zip(self.outputs, outs))


def plan_steps(gm: torch.fx.GraphModule) -> list[Segment | torch.fx.Node]:
    """The graph in order as segments (runs of ops between collectives) and eager nodes
    (collectives, waits, items of a collective's result list)."""
    eager: set[torch.fx.Node] = set()
    plan: list[Any] = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        if _eager(n, eager):
            eager.add(n)
            plan.append(n)
        elif plan and isinstance(plan[-1], list):
            plan[-1].append(n)
        else:
            plan.append([n])
    return [Segment(gm, step) if isinstance(step, list) else step for step in plan]


class SegmentedGraph:
    """A graph with collectives: compiled segments, the collectives run eagerly between them.
    Boxed calling convention, as :class:`~torch_tpu.compile.program.graph.CompiledGraph`."""

    def __init__(self, gm: torch.fx.GraphModule, kind: str,
                 compile_graph: Callable[[torch.fx.GraphModule, list[Any]], Any],
                 steps: list[Segment | torch.fx.Node] | None = None) -> None:
        self.kind = kind
        self._gm = gm
        self._boxed_call = True
        self._placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self._output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        self.steps = plan_steps(gm) if steps is None else steps
        for step in self.steps:
            if isinstance(step, Segment):
                step.compiled = compile_graph(step.gm, step.example_inputs())
        self.segments = [s.compiled for s in self.steps if isinstance(s, Segment)]
        self.collectives = collective_sequence(gm)
        self.digest: str | None = None

    def __call__(self, args: list[Any]) -> list[Any]:
        env: dict[torch.fx.Node, Any] = dict(zip(self._placeholders, args))
        args.clear()
        if self.digest is None:
            self.digest = check_same_collectives(self._gm, self.kind)
        for step in self.steps:
            if isinstance(step, Segment):
                step(env)
            elif step.target is operator.getitem:
                env[step] = env[step.args[0]][step.args[1]]
            else:
                a, k = torch.fx.node.map_arg((step.args, step.kwargs), lambda n: env[n])
                env[step] = run_collective(step.target, a, k)
        out = torch.fx.node.map_arg(self._output.args[0], lambda n: env[n])
        return list(out) if isinstance(out, (list, tuple)) else [out]
