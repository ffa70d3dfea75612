"""Human-readable views of a plan: a terminal table and a self-contained HTML report (inline SVG)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from html import escape

from torchrec_tpu.planner.plan import Plan

GIB = 1024**3
KINDS = ("row_wise", "table_wise", "column_wise", "data_parallel")


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} us"


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


def _placement(plan: Plan, table_index: int) -> str:
    t = plan.tables[table_index]
    if t.shards[0].device is None:
        return f"all {len(plan.devices)} devices, {t.shards[0].rows:,} rows each"
    return ", ".join(f"dev {s.device} [{s.column_offset}:{s.column_offset + s.columns}]" for s in t.shards)


def summary_lines(plan: Plan) -> list[str]:
    topo = plan.topology
    kinds = Counter(t.sharding_type for t in plan.tables)
    return [
        f"topology   {topo.name} ({topo.shape_str}, {len(plan.devices)} devices, "
        f"{topo.chip.sparsecores_per_chip} SparseCores/chip)",
        f"batch      {plan.batch_size:,} global; max_ids_per_partition {plan.max_ids_per_partition}",
        f"tables     {len(plan.tables)}: " + ", ".join(f"{kinds[k]} {k}" for k in KINDS if kinds[k]),
        f"stacks     {len(plan.stacks)} stacked tables",
        f"step time  {_us(plan.step_time_s)} (slowest device) vs lower bound {_us(plan.lower_bound_s)}: "
        f"{plan.quality:.3f}x",
        f"memory     max {_gib(plan.max_memory_bytes)} per device of {_gib(plan.usable_hbm_bytes_per_device)} usable",
    ] + [f"warning    {w}" for w in plan.warnings]


def format_plan(plan: Plan, top: int = 20) -> str:
    """Summary, the ``top`` largest tables and the slowest devices, as aligned text."""
    lines = summary_lines(plan) + ["", f"{'table':<24} {'rows':>13} {'dim':>5} {'sharding':<14} {'HBM':>10}  placement"]
    order = sorted(range(len(plan.tables)), key=lambda i: (-plan.tables[i].hbm_bytes, plan.tables[i].name))
    for i in order[:top]:
        t = plan.tables[i]
        lines.append(f"{t.name[:24]:<24} {t.rows:>13,} {t.dim:>5} {t.sharding_type:<14} {_gib(t.hbm_bytes):>10}  "
                     f"{_placement(plan, i)[:60]}")
    if len(order) > top:
        lines.append(f"... {len(order) - top} more tables (see the plan JSON / HTML report)")
    lines += ["", f"{'device':>6} {'chip':>5} {'memory':>10} {'lookup':>12} {'comm':>12} {'other':>12} {'total':>12}"]
    slowest = sorted(plan.devices, key=lambda d: (-d.time_s, d.device))
    for d in slowest[: min(top, 8)]:
        lines.append(f"{d.device:>6} {d.chip:>5} {_gib(d.memory_bytes):>10} {_us(d.lookup_s):>12} {_us(d.comm_s):>12} "
                     f"{_us(d.allreduce_s + d.overhead_s):>12} {_us(d.time_s):>12}")
    return "\n".join(lines)


def format_comparison(results: Sequence[tuple[str, Plan | str]]) -> str:
    """One row per topology: step time, bound, quality, memory, or the reason it failed."""
    lines = [f"{'topology':<14} {'chips':>6} {'devices':>7} {'step time':>14} {'lower bound':>14} {'quality':>8} "
             f"{'max memory':>11} {'usable':>10}"]
    for name, result in results:
        if isinstance(result, str):
            lines.append(f"{name:<14} no plan: {result}")
            continue
        p = result
        chips = len({d.chip for d in p.devices})
        lines.append(f"{name:<14} {chips:>6} {len(p.devices):>7} {_us(p.step_time_s):>14} {_us(p.lower_bound_s):>14} "
                     f"{p.quality:>7.3f}x {_gib(p.max_memory_bytes):>11} {_gib(p.usable_hbm_bytes_per_device):>10}")
    return "\n".join(lines)


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; font-size: 13px; }
td, th { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
td.l, th.l { text-align: left; }
.row_wise { fill: #4878d0; background: #dbe5f7; } .table_wise { fill: #ee854a; background: #fbe3d5; }
.column_wise { fill: #6acc64; background: #e0f4df; } .data_parallel { fill: #956cb4; background: #eae1f1; }
.s0 { fill: #4878d0; } .s1 { fill: #ee854a; } .s2 { fill: #956cb4; } .s3 { fill: #8c8c8c; } .limit { stroke: #d62728; stroke-width: 1.5; stroke-dasharray: 4 2; }
"""


def _bar_chart(title: str, series: Sequence[tuple[str, str, Sequence[float]]], limit: float, unit: str,
               limit_label: str) -> str:
    """Stacked bars, one per device; ``series`` = (label, css class, value per device)."""
    width, height, pad = 900.0, 180.0, 40.0
    count = len(series[0][2])
    totals = [sum(values[i] for _, _, values in series) for i in range(count)]
    top = max(max(totals, default=0.0), limit) or 1.0
    bar = (width - pad) / max(count, 1)
    parts = [f"<h3>{escape(title)}</h3>",
             f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height + 34:.0f}" role="img">']
    for i in range(count):
        base = height
        for label, css, values in series:
            h = height * values[i] / top
            base -= h
            parts.append(f'<rect class="{css}" x="{pad + i * bar:.2f}" y="{base:.2f}" width="{max(bar - 1, 0.5):.2f}" '
                         f'height="{h:.2f}"><title>device {i} {escape(label)}: {values[i]:.3f} {escape(unit)}</title></rect>')
    y = height - height * limit / top
    parts.append(f'<line class="limit" x1="{pad}" x2="{width}" y1="{y:.2f}" y2="{y:.2f}"/>')
    parts.append(f'<text x="{pad}" y="{max(y - 3, 10):.2f}" font-size="11">{escape(limit_label)}</text>')
    parts.append(f'<text x="0" y="12" font-size="11">{top:.3g} {escape(unit)}</text>')
    parts.append(f'<text x="{pad}" y="{height + 14:.0f}" font-size="11">device 0 .. {count - 1}</text>')
    x = pad + 140
    for label, css, _ in series:
        parts.append(f'<rect class="{css}" x="{x:.0f}" y="{height + 22:.0f}" width="10" height="10"/>'
                     f'<text x="{x + 14:.0f}" y="{height + 31:.0f}" font-size="11">{escape(label)}</text>')
        x += 14 + 7 * len(label) + 20
    parts.append("</svg>")
    return "\n".join(parts)


def render_html(plan: Plan, title: str = "torchrec-tpu sharding plan") -> str:
    """A self-contained XHTML page (no external assets): summary, per-device HBM and step-time
    bars with the HBM limit and the lower bound, and every table's placement."""
    memory = [("parameters + slots", "s0", [d.hbm_bytes / GIB for d in plan.devices]),
              ("activation + all-to-all buffers", "s1", [d.buffer_bytes / GIB for d in plan.devices])]
    times = [("SparseCore lookups", "s0", [d.lookup_s * 1e6 for d in plan.devices]),
             ("all-to-all", "s1", [d.comm_s * 1e6 for d in plan.devices]),
             ("all-reduce", "s2", [d.allreduce_s * 1e6 for d in plan.devices]),
             ("overheads", "s3", [d.overhead_s * 1e6 for d in plan.devices])]
    rows = []
    for i, t in enumerate(plan.tables):
        rows.append(f'<tr class="{t.sharding_type}"><td class="l">{escape(t.name)}</td><td>{t.rows:,}</td>'
                    f'<td>{t.dim}</td><td class="l">{t.sharding_type}</td><td>{t.hbm_bytes / GIB:.3f}</td>'
                    f'<td>{t.ids_per_partition:.1f}</td><td class="l">{escape(t.stack)}</td>'
                    f'<td class="l">{escape(_placement(plan, i))}</td></tr>')
    body = [
        f"<h1>{escape(title)}</h1>",
        "<pre>" + escape("\n".join(summary_lines(plan))) + "</pre>",
        _bar_chart("HBM per device (parameters, optimizer slots, buffers)", memory,
                   plan.usable_hbm_bytes_per_device / GIB, "GiB", "usable HBM"),
        _bar_chart("Estimated embedding step time per device", times, plan.lower_bound_s * 1e6, "us",
                   "lower bound (perfect balance)"),
        "<h3>Tables</h3>",
        '<table><tr><th class="l">table</th><th>rows</th><th>dim</th><th class="l">sharding</th><th>HBM GiB</th>'
        '<th>ids/partition</th><th class="l">stack</th><th class="l">placement</th></tr>',
        *rows,
        "</table>",
    ]
    return ('<?xml version="1.0" encoding="utf-8"?>\n<!DOCTYPE html>\n<html xmlns="http://www.w3.org/1999/xhtml">'
            f'<head><meta charset="utf-8"/><title>{escape(title)}</title><style>{_CSS}</style></head>\n<body>\n'
            + "\n".join(body) + "\n</body></html>\n")
