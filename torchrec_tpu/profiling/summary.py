"""A short text summary of a torch.profiler session: time per phase, then the top host ops."""

from __future__ import annotations

from dataclasses import dataclass

from torch.profiler import profile

from torchrec_tpu.profiling.phases import PHASES


@dataclass(frozen=True)
class OpTime:
    name: str
    calls: int
    total_ms: float  # CPU time including children (phases) or self time (ops)


def phase_times(prof: profile) -> list[OpTime]:
    """Total CPU time of each phase range (all threads), in :data:`PHASES` order."""
    by_name = {event.key: event for event in prof.key_averages()}
    return [
        OpTime(name, by_name[name].count, by_name[name].cpu_time_total / 1e3)
        for name in PHASES
        if name in by_name
    ]


# torch.profiler's names of events that say little, and what they are here
EVENT_NAMES = {
    # the dispatch of an op on a tensor subclass: the tpu device's eager ops (JAX per op)
    "PythonSubclass": "tpu eager ops (torch_tpu __torch_dispatch__ into JAX, one dispatch per op)",
}


def top_ops(prof: profile, limit: int = 10) -> list[OpTime]:
    """The ``limit`` ops with the most self CPU time (our phase ranges excluded; the step
    program's range, ``program: ...``, is the time of the compiled program itself)."""
    events = [e for e in prof.key_averages() if e.key not in PHASES and not e.key.startswith("step")]
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [OpTime(EVENT_NAMES.get(e.key, e.key), e.count, e.self_cpu_time_total / 1e3) for e in events[:limit]]


def format_summary(prof: profile, steps: int, limit: int = 10) -> str:
    lines = [f"profile of {steps} training steps (host CPU time)", "  phases:"]
    lines += [f"    {p.name:<16}{p.total_ms:>10.2f} ms  {p.calls:>6} calls" for p in phase_times(prof)]
    lines.append(f"  top {limit} ops by self time:")
    lines += [f"    {o.total_ms:>10.2f} ms  {o.calls:>6} calls  {o.name}" for o in top_ops(prof, limit)]  # names whole
    return "\n".join(lines)
