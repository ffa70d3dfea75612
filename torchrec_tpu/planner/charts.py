"""Charts of a plan drawn with matplotlib (axes, ticks, legends outside the data), as inline SVG.

Each ``*_figure`` function returns a :class:`matplotlib.figure.Figure` (no pyplot, no global
backend); :func:`to_svg` turns one into an ``<svg>`` element for the self-contained HTML report.
matplotlib is imported here only, so planning without ``--html`` never loads it.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from torchrec_tpu.planner.plan import Plan
from tpu_facts import GIB

HEATMAP_TABLES = 40  # the largest tables shown in the placement heatmap
COLORS = ("#4878d0", "#ee854a", "#956cb4", "#8c8c8c")
LIMIT_COLOR = "#d62728"


def to_svg(figure: Figure, name: str) -> str:
    """The figure as one ``<svg>`` element as wide as the page (its height from its ``viewBox``'s
    aspect ratio, not a fixed size in points): text kept as text, no date, and every id (and each
    reference to one) prefixed with ``name``, so several charts can share a page."""
    from matplotlib import rc_context

    buffer = io.StringIO()
    with rc_context({"svg.fonttype": "none", "svg.hashsalt": name}):
        figure.savefig(buffer, format="svg", metadata={"Date": None}, bbox_inches="tight")
    text = buffer.getvalue()
    text = text[text.index("<svg"):]
    root_end = text.index(">")
    root = re.sub(r'\s(width|height)="[^"]*"', "", text[:root_end])
    text = root + ' width="100%"' + text[root_end:]
    text = re.sub(r'\bid="([^"]+)"', rf'id="{name}-\1"', text)
    return re.sub(r'(url\(#|href="#)([^)"]+)', rf"\1{name}-\2", text)


def _device_axis(ax, count: int) -> None:
    ax.set_xlabel("device")
    ax.set_xlim(-0.5, count - 0.5)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=16, integer=True))
    ax.margins(y=0.05)
    ax.grid(axis="y", alpha=0.3)


def _stacked_device_bars(title: str, ylabel: str, series: Sequence[tuple[str, Sequence[float]]],
                         limit: float, limit_label: str) -> Figure:
    count = len(series[0][1])
    figure = Figure(figsize=(10, 3.6), layout="constrained")
    ax = figure.add_subplot()
    bottom = [0.0] * count
    width = 0.8 if count <= 64 else 1.0  # many devices: touching bars, not hairlines
    for (label, values), color in zip(series, COLORS):
        ax.bar(range(count), values, bottom=bottom, width=width, color=color, label=label, linewidth=0)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(limit, color=LIMIT_COLOR, linestyle="--", linewidth=1.2, label=limit_label)
    ax.set_title(title, loc="left")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, max(max(bottom, default=0.0), limit) * 1.08 or 1.0)
    _device_axis(ax, count)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9)
    return figure


def memory_figure(plan: Plan) -> Figure:
    """HBM per device, parameters + slots and buffers stacked, against the usable HBM."""
    return _stacked_device_bars(
        "HBM per device", "GiB",
        [("parameters + optimizer slots", [d.hbm_bytes / GIB for d in plan.devices]),
         ("activation + all-to-all buffers", [d.buffer_bytes / GIB for d in plan.devices])],
        plan.usable_hbm_bytes_per_device / GIB, "usable HBM")


def step_time_figure(plan: Plan) -> Figure:
    """Estimated embedding step time per device by component, against the balance lower bound."""
    return _stacked_device_bars(
        "Estimated embedding step time per device", "time per step (us)",
        [("SparseCore lookups", [d.lookup_s * 1e6 for d in plan.devices]),
         ("all-to-all", [d.comm_s * 1e6 for d in plan.devices]),
         ("overheads", [d.overhead_s * 1e6 for d in plan.devices])],
        plan.lower_bound_s * 1e6, "lower bound (perfect balance)")


def placement_matrix(plan: Plan, max_tables: int = HEATMAP_TABLES) -> tuple[list[str], list[list[float]]]:
    """(table names, GiB of each table on each device) for the ``max_tables`` largest tables.
    Row-wise and data-parallel tables hold an equal share on every device."""
    order = sorted(plan.tables, key=lambda t: (-t.hbm_bytes, t.name))[:max_tables]
    devices = len(plan.devices)
    rows = []
    for t in order:
        row = [0.0] * devices
        for shard in t.shards:
            if shard.device is None:
                row = [t.hbm_bytes / devices / GIB] * devices
            else:
                row[shard.device] += t.hbm_bytes * shard.columns / t.padded_dim / GIB
        rows.append(row)
    return [t.name for t in order], rows


def placement_figure(plan: Plan) -> Figure:
    """Table x device heatmap of where each table's HBM lives."""
    import numpy as np
    from matplotlib.colors import LogNorm

    names, rows = placement_matrix(plan)
    values = np.ma.masked_less_equal(np.array(rows), 0.0)  # empty cells stay blank
    figure = Figure(figsize=(10, 1.6 + 0.2 * len(names)), layout="constrained")
    ax = figure.add_subplot()
    low, high = (float(values.min()), float(values.max())) if values.count() else (1.0, 1.0)
    norm = LogNorm(vmin=low, vmax=high) if high > low else None  # log: a few huge tables dwarf the rest
    image = ax.imshow(values, aspect="auto", cmap="viridis", interpolation="nearest", norm=norm)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=16, integer=True))
    ax.set_xlabel("device")
    shown = (f"the {len(names)} largest of {len(plan.tables)} tables" if len(names) < len(plan.tables)
             else f"all {len(names)} tables")
    ax.set_title(f"Placement: HBM of each table on each device ({shown})", loc="left")
    figure.colorbar(image, ax=ax, label="GiB", pad=0.01)
    return figure


def _slowest(plan: Plan):
    return max(plan.devices, key=lambda d: d.time_s)


def samples_per_s_per_chip(plan: Plan) -> float:
    """Global batch over the slowest device's step time, per chip of the slice(s): slices of
    different sizes compared for what each chip delivers."""
    return plan.batch_size / plan.step_time_s / plan.topology.num_chips


USABLE_LINE_FROM = 70.0  # % of usable HBM from which the comparison's memory panel draws the 100% line


def comparison_figure(results: Sequence[tuple[str, Plan | str]]) -> Figure:
    """Each topology's step time (the slowest device: lookup, all-to-all, overheads), throughput per
    chip, peak memory (share of usable HBM) and balance (step time over the lower bound, axis from
    just below the best); a topology without a plan is marked where its bars would be."""
    names = [name for name, _ in results]
    plans = [r if isinstance(r, Plan) else None for _, r in results]
    # 2 x 2 panels: about a landscape page's proportions, so the chart fills the page's width
    # without leaving most of its height blank
    figure = Figure(figsize=(12, 6.6), layout="constrained")
    axes = list(figure.subplots(2, 2).ravel())
    x = range(len(names))
    parts = (("lookup", lambda d: d.lookup_s), ("all-to-all", lambda d: d.comm_s),
             ("overheads", lambda d: d.overhead_s))
    bottom = [0.0] * len(plans)
    for (label, part), color in zip(parts, COLORS):
        heights = [part(_slowest(p)) * 1e6 if p else 0.0 for p in plans]
        axes[0].bar(x, heights, bottom=bottom, color=color, width=0.6, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    axes[0].legend(fontsize=8, loc="upper left", ncols=3, frameon=False)  # in the headroom above the bars
    panels = (
        (axes[0], "Step time (slowest device)", "step time (µs)", bottom),
        (axes[1], "Throughput per chip", "k samples/s per chip", [samples_per_s_per_chip(p) / 1e3 if p else 0.0
                                                                  for p in plans]),
        (axes[2], "Peak HBM per device", "peak HBM (% of usable)",
         [100 * p.max_memory_bytes / p.usable_hbm_bytes_per_device if p else 0.0 for p in plans]),
        (axes[3], "Balance (step time / lower bound)", "step time / lower bound (1 = balanced)",
         [p.quality if p else 0.0 for p in plans]),
    )
    for ax, title, ylabel, values in panels:
        if ax is not axes[0]:
            ax.bar(x, values, color=COLORS[0], width=0.6)
        planned = [v for v, p in zip(values, plans) if p]
        low, top = 0.0, max(planned, default=0.0) or 1.0
        if ax is axes[3]:  # quality sits near 1: start the axis just below the best, not at 0
            low = max(0.0, min(planned, default=1.0) - 0.05 * max(top - min(planned, default=1.0), 0.2))
        if ax is axes[2] and top >= USABLE_LINE_FROM:  # the limit line where a bar comes near it;
            ax.axhline(100, color=LIMIT_COLOR, linestyle="--", linewidth=1.2)  # else the axis would be mostly
            top = max(top, 100)  # empty above bars far below it (the y axis says the share)
        ax.set_ylim(low, low + (top - low) * (1.3 if ax is axes[0] else 1.15))
        for i, p in enumerate(plans):
            if p is None:  # no plan: say so where the bar would be
                ax.text(i, low + (top - low) * 0.04, "no plan", rotation=90, ha="center", va="bottom",
                        color=LIMIT_COLOR, fontsize=9)
        ax.set_title(title, loc="left", fontsize=10)
        ax.set_ylabel(ylabel)
        ax.set_xticks(x, names, rotation=30 if len(names) > 3 else 0,
                      ha="right" if len(names) > 3 else "center", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    feasible = sum(p is not None for p in plans)
    figure.suptitle(f"Topologies compared: {feasible} of {len(plans)} have a plan (red: no plan)", x=0.01,
                    ha="left", fontsize=11)
    return figure
