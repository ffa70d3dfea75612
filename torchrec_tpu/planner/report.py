"""Human-readable views of a plan: a terminal table and self-contained HTML reports (matplotlib
charts as inline SVG, :mod:`torchrec_tpu.planner.charts`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from html import escape

from torchrec_tpu.planner.plan import GRADIENT_BYTES, Plan
from tpu_facts import GIB, ShardingKind

KINDS = (ShardingKind.ROW_WISE, ShardingKind.TABLE_WISE, ShardingKind.COLUMN_WISE, ShardingKind.DATA_PARALLEL)


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
        f"batch      {plan.batch_size:,} global; max_ids_per_partition {_id_limits(plan)}",
        f"tables     {len(plan.tables)}: " + ", ".join(f"{kinds[k]} {k}" for k in KINDS if kinds[k]),
        f"stacks     {len(plan.stacks)} stacked tables",
        f"step time  {_us(plan.step_time_s)} (slowest device) vs lower bound {_us(plan.lower_bound_s)}: "
        f"{plan.quality:.3f}x",
        f"memory     max {_gib(plan.max_memory_bytes)} per device of {_gib(plan.usable_hbm_bytes_per_device)} usable",
        *_host_lines(plan),
        *_dense_lines(plan),
    ] + [f"warning    {w}" for w in plan.warnings]


def _id_limits(plan: Plan) -> str:
    """The one id limit of every table, or the range of their own limits."""
    limits = {t.max_ids_per_partition or plan.max_ids_per_partition for t in plan.tables}
    return str(limits.pop()) if len(limits) == 1 else f"per table, {min(limits)} to {max(limits)}"


def _host_lines(plan: Plan) -> list[str]:
    """The managed-collision remaps' host memory (none without --zch tables)."""
    if not plan.max_host_bytes:
        return []
    return [f"host       max {_gib(plan.max_host_bytes)} per device of managed-collision remaps (identity table, "
            f"slot map and policy metadata of each zch shard; host memory, beside the HBM above)"]


def _dense_lines(plan: Plan) -> list[str]:
    """The dense all-reduce's estimate, split into its ICI and DCN parts (none without dense params)."""
    if not plan.dense_params:
        return []
    topo, num_bytes = plan.topology, GRADIENT_BYTES * plan.dense_params
    order = "ICI within the slice" if topo.num_slices == 1 else \
        f"hierarchical: ICI within each slice, DCN across {topo.num_slices} slices"
    return [f"dense      {plan.dense_params:,} params: gradient all-reduce {_us(plan.dense_allreduce_s)} per step "
            f"({order}; ICI {_us(num_bytes * topo.allreduce_ici_seconds_per_byte)}, "
            f"DCN {_us(num_bytes * topo.allreduce_dcn_seconds_per_byte)}, "
            f"{topo.allreduce_phases} collective(s))"]


ALL_DEVICES_UP_TO = 16  # the terminal table lists every device up to this many, else a summary and the slowest
SLOWEST_DEVICES = 8
PLACEMENT_CHARS = 60
MB = 1e6


def _placement_text(plan: Plan, table_index: int, width: int = PLACEMENT_CHARS) -> str:
    """:func:`_placement` within ``width`` characters, cut between shards (``+N more``), never inside one."""
    text = _placement(plan, table_index)
    if len(text) <= width:
        return text
    parts = text.split(", ")
    shown: list[str] = []
    for part in parts:
        rest = len(parts) - len(shown) - 1
        if len(", ".join([*shown, part])) + len(f", +{rest} more") > width:
            break
        shown.append(part)
    return ", ".join(shown) + f", +{len(parts) - len(shown)} more"


def _device_lines(plan: Plan) -> list[str]:
    """Every device (up to ALL_DEVICES_UP_TO), else a spread summary and the slowest ones: memory
    and its share of the usable HBM, input (ids looked up) and output (pooled rows returned) MB per
    step, time split."""
    usable = plan.usable_hbm_bytes_per_device
    devices = sorted(plan.devices, key=lambda d: (-d.time_s, d.device))
    lines = [""]
    if len(devices) > ALL_DEVICES_UP_TO:
        times = sorted(d.time_s for d in devices)
        memory = sorted(d.memory_bytes for d in devices)
        fullest = max(devices, key=lambda d: (d.memory_bytes, -d.device))
        listed = devices[:SLOWEST_DEVICES]
        also = "" if fullest in listed else f" and the fullest (device {fullest.device})"
        lines += [f"devices    {len(devices)}: step time {_us(times[0])} min, {_us(times[len(times) // 2])} median, "
                  f"{_us(times[-1])} max; memory {_gib(memory[0])} min, {_gib(memory[-1])} max "
                  f"({100 * memory[-1] / usable:.0f}% of usable); the {SLOWEST_DEVICES} slowest{also}:"]
        devices = listed if fullest in listed else [*listed, fullest]
    lines.append(f"{'device':>6} {'chip':>5} {'memory':>10} {'usable':>7} {'in MB':>9} {'out MB':>9} {'lookup':>12} "
                 f"{'comm':>12} {'other':>12} {'total':>12}")
    for d in devices:
        lines.append(f"{d.device:>6} {d.chip:>5} {_gib(d.memory_bytes):>10} {100 * d.memory_bytes / usable:>6.1f}% "
                     f"{d.input_bytes / MB:>9,.1f} {d.output_bytes / MB:>9,.1f} {_us(d.lookup_s):>12} "
                     f"{_us(d.comm_s):>12} {_us(d.overhead_s):>12} {_us(d.time_s):>12}")
    return lines


def format_plan(plan: Plan, top: int = 20) -> str:
    """Summary, the ``top`` largest tables and the devices (all, or a summary and the slowest), as
    aligned text."""
    lines = summary_lines(plan) + ["", f"{'table':<24} {'rows':>13} {'dim':>5} {'sharding':<14} {'HBM':>10}  placement"]
    order = sorted(range(len(plan.tables)), key=lambda i: (-plan.tables[i].hbm_bytes, plan.tables[i].name))
    for i in order[:top]:
        t = plan.tables[i]
        lines.append(f"{t.name[:24]:<24} {t.rows:>13,} {t.dim:>5} {t.sharding_type:<14} {_gib(t.hbm_bytes):>10}  "
                     f"{_placement_text(plan, i)}")
    if len(order) > top:
        lines.append(f"... {len(order) - top} more tables (see the plan JSON / HTML report)")
    return "\n".join(lines + _device_lines(plan))


def format_comparison(results: Sequence[tuple[str, Plan | str]]) -> str:
    """One row per topology: step time (and its lookup / all-to-all split on the slowest device),
    throughput per chip, bound, quality, memory, or the reason it failed."""
    lines = [f"{'topology':<14} {'chips':>6} {'devices':>7} {'step time':>12} {'lookup':>12} {'all-to-all':>12} "
             f"{'samples/s/chip':>15} {'lower bound':>12} {'quality':>8} {'max memory':>11} {'usable':>10}"]
    for name, result in results:
        if isinstance(result, str):
            lines.append(f"{name:<14} no plan: {result}")
            continue
        p = result
        slowest = max(p.devices, key=lambda d: d.time_s)
        per_chip = p.batch_size / p.step_time_s / p.topology.num_chips
        lines.append(f"{name:<14} {p.topology.num_chips:>6} {len(p.devices):>7} {_us(p.step_time_s):>12} "
                     f"{_us(slowest.lookup_s):>12} {_us(slowest.comm_s):>12} {per_chip:>15,.0f} "
                     f"{_us(p.lower_bound_s):>12} {p.quality:>7.3f}x {_gib(p.max_memory_bytes):>11} "
                     f"{_gib(p.usable_hbm_bytes_per_device):>10}")
    return "\n".join(lines)


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; font-size: 13px; }
td, th { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
td.l, th.l { text-align: left; }
pre, li { white-space: pre-wrap; overflow-wrap: anywhere; }
ul.warnings li { color: #8a4b00; }
svg { width: 100%; height: auto; display: block; margin: 0.5em 0 1.5em; }
.row_wise { background: #dbe5f7; } .table_wise { background: #fbe3d5; }
.column_wise { background: #e0f4df; } .data_parallel { background: #eae1f1; }
"""


def _page(title: str, body: Sequence[str]) -> str:
    return ('<?xml version="1.0" encoding="utf-8"?>\n<!DOCTYPE html>\n<html xmlns="http://www.w3.org/1999/xhtml">'
            f'<head><meta charset="utf-8"/><title>{escape(title)}</title><style>{_CSS}</style></head>\n<body>\n'
            + "\n".join(body) + "\n</body></html>\n")


def _summary(plan: Plan) -> list[str]:
    lines = [line for line in summary_lines(plan) if not line.startswith("warning")]
    html = ["<pre>" + escape("\n".join(lines)) + "</pre>"]
    if plan.warnings:
        html += ['<ul class="warnings">', *(f"<li>{escape(w)}</li>" for w in plan.warnings), "</ul>"]
    return html


def render_html(plan: Plan, title: str = "torchrec-tpu sharding plan") -> str:
    """A self-contained XHTML page (no external assets, no scripts): summary and warnings, the
    devices (all, or the slowest and the fullest), matplotlib charts of per-device HBM and step time
    (with the usable HBM and the lower bound), the table x device placement heatmap, and every
    table's placement."""
    from torchrec_tpu.planner import charts

    rows = []
    for i, t in enumerate(plan.tables):
        rows.append(f'<tr class="{t.sharding_type}"><td class="l">{escape(t.name)}</td><td>{t.rows:,}</td>'
                    f'<td>{t.dim}</td><td class="l">{t.sharding_type}</td><td>{t.hbm_bytes / GIB:.3f}</td>'
                    f'<td>{t.ids_per_partition:.1f}</td><td class="l">{escape(t.stack)}</td>'
                    f'<td class="l">{escape(_placement(plan, i))}</td></tr>')
    body = [
        f"<h1>{escape(title)}</h1>",
        *_summary(plan),
        "<pre>" + escape("\n".join(_device_lines(plan)).strip()) + "</pre>",
        charts.to_svg(charts.memory_figure(plan), "memory"),
        charts.to_svg(charts.step_time_figure(plan), "step_time"),
        charts.to_svg(charts.placement_figure(plan), "placement"),
        "<h3>Tables</h3>",
        '<table><tr><th class="l">table</th><th>rows</th><th>dim</th><th class="l">sharding</th><th>HBM GiB</th>'
        '<th>ids/partition</th><th class="l">stack</th><th class="l">placement</th></tr>',
        *rows,
        "</table>",
    ]
    return _page(title, body)


def render_comparison_html(results: Sequence[tuple[str, Plan | str]], title: str,
                           pages: Mapping[str, str] | None = None) -> str:
    """The ``--compare`` page: links to each topology's own report (``pages``: topology -> its
    page, relative to this one), the comparison chart (when any topology has a plan), the
    comparison table, and why a topology has no plan."""
    from torchrec_tpu.planner import charts

    failures = [f"<li>{escape(name)}: {escape(r)}</li>" for name, r in results if isinstance(r, str)]
    body = [f"<h1>{escape(title)}</h1>"]
    if pages:
        body += ['<p class="pages">Each topology\'s report: ',
                 ", ".join(f'<a href="{escape(href)}">{escape(name)}</a>' for name, href in pages.items()), "</p>"]
    if len(failures) < len(results):  # no chart of nothing when no topology has a plan
        body.append(charts.to_svg(charts.comparison_figure(results), "comparison"))
    body.append("<pre>" + escape(format_comparison(results)) + "</pre>")
    if failures:
        body += ["<h3>No plan</h3>", '<ul class="warnings">', *failures, "</ul>"]
    return _page(title, body)
