"""The plan reports: matplotlib charts (axes, ticks, legends, no overlapping text), the placement
heatmap's numbers, the --compare page, the plan JSON Schema, and rendering in headless Chromium."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import jsonschema
import pytest

from torchrec_tpu.cli import main
from torchrec_tpu.planner import load_plan

REPO = Path(__file__).resolve().parents[2]
DLRM_TABLES = REPO / "examples" / "planner" / "dlrm_dcnv2_tables.yaml"
SCHEMA = json.loads((REPO / "torchrec_tpu" / "planner" / "plan.schema.json").read_text())
SVG = "{http://www.w3.org/2000/svg}"
GIB = 1024**3
TOPOLOGIES = ("v5p-64", "v6e-16", "tpu7x-64", "v6e-256")  # v6e-16 has no plan at an id limit of 400


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """One `plan --compare` run: per-topology plan JSON and HTML, and the comparison page."""
    out = tmp_path_factory.mktemp("plans")
    code = main(["plan", "--tables", str(DLRM_TABLES), "--compare", ",".join(TOPOLOGIES), "--batch-size", "65536",
                 "--max-ids-per-partition", "400",
                 "--out", str(out / "plan.json"), "--html", str(out / "plan.html")])
    assert code == 2  # one topology has no plan
    return out


def _figures(plan):
    from torchrec_tpu.planner import charts

    return {"memory": charts.memory_figure(plan), "step_time": charts.step_time_figure(plan),
            "placement": charts.placement_figure(plan)}


def _overlapping_texts(figure) -> list[tuple[str, str]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    renderer = FigureCanvasAgg(figure).get_renderer()
    figure.draw(renderer)
    tick_labels, drawn = set(), []
    for ax in figure.axes:
        for axis, (low, high) in ((ax.xaxis, sorted(ax.get_xlim())), (ax.yaxis, sorted(ax.get_ylim()))):
            for tick in axis.get_major_ticks():
                tick_labels.add(tick.label1)
                if low <= tick.get_loc() <= high:  # ticks outside the view are not drawn
                    drawn.append(tick.label1)
    texts = [t for t in figure.findobj(Text) if t not in tick_labels] + drawn
    texts = [t for t in texts if t.get_visible() and t.get_text().strip()]
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    return [(a, b) for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2) if box_a.overlaps(box_b)]


@pytest.mark.parametrize("topology", ["v5p-64", "v6e-256"])
def test_charts_have_axes_ticks_and_no_overlapping_text(compared, topology):
    plan = load_plan(compared / f"plan.{topology}.json")
    figures = _figures(plan)
    for name, figure in figures.items():
        ax = figure.axes[0]
        assert ax.get_xlabel() == "device", name
        assert 4 <= len([t for t in ax.get_xticklabels() if t.get_text()]) <= 20, name  # readable, not 256
        assert _overlapping_texts(figure) == [], name
    memory = figures["memory"].axes[0]
    assert memory.get_ylabel() == "GiB" and memory.get_legend() is not None
    # many devices: bars touch instead of becoming hairlines
    widths = {round(p.get_width(), 3) for p in memory.patches}
    assert widths == ({1.0} if len(plan.devices) > 64 else {0.8})


def test_comparison_figure_marks_the_topology_without_a_plan(compared):
    from torchrec_tpu.planner import charts

    results = [(n, "no plan" if n == "v6e-16" else load_plan(compared / f"plan.{n}.json")) for n in TOPOLOGIES]
    figure = charts.comparison_figure(results)
    assert len(figure.axes) == 4  # step time split, throughput per chip, peak HBM, balance
    for ax in figure.axes:
        assert [t.get_text() for t in ax.get_xticklabels()] == list(TOPOLOGIES)
        assert [t.get_text() for t in ax.texts] == ["no plan"]
    assert [t.get_text() for t in figure.axes[0].get_legend().get_texts()] == ["lookup", "all-to-all", "overheads"]
    assert figure.axes[3].get_ylim()[0] > 0.9  # balance sits near 1: no axis from 0
    # each y label names the quantity and its unit, not a bare unit ("us", "x")
    assert [ax.get_ylabel() for ax in figure.axes] == [
        "step time (µs)", "k samples/s per chip", "peak HBM (% of usable)", "step time / lower bound (1 = balanced)"]
    plans = [r for _, r in results if not isinstance(r, str)]
    heights = [bar.get_height() for bar in figure.axes[1].patches]
    chips = {p.topology.name: p.topology.num_chips for p in plans}
    assert chips["v6e-256"] == 256 and chips["v5p-64"] == 32  # normalised per chip, not per slice
    assert [h for h in heights if h] == pytest.approx([charts.samples_per_s_per_chip(p) / 1e3 for p in plans])
    assert _overlapping_texts(figure) == []


def test_placement_matrix_puts_each_tables_memory_on_its_devices(compared):
    from torchrec_tpu.planner.charts import placement_matrix

    plan = load_plan(compared / "plan.v5p-64.json")
    names, rows = placement_matrix(plan, max_tables=len(plan.tables))
    for name, row in zip(names, rows):
        table = plan.table(name)
        assert sum(row) == pytest.approx(table.hbm_bytes / GIB)  # all of it, once
        placed = {s.device for s in table.shards}
        if placed != {None}:
            assert {d for d, v in enumerate(row) if v > 0} == placed
    assert names[0] == max(plan.tables, key=lambda t: t.hbm_bytes).name


def test_reports_are_xhtml_with_three_charts_and_the_compare_page(compared):
    for name in ("v5p-64", "tpu7x-64", "v6e-256"):
        root = ET.parse(compared / f"plan.{name}.html").getroot()
        svgs = root.findall(f".//{SVG}svg")
        assert len(svgs) == 3
        ids = [[e.get("id") for e in s.iter() if e.get("id")] for s in svgs]
        assert not set(ids[0]) & set(ids[1]) and not set(ids[1]) & set(ids[2])  # one page, unique ids
        assert root.find(".//{http://www.w3.org/1999/xhtml}script") is None
    assert not (compared / "plan.v6e-16.html").exists()
    page = compared / "plan.html"
    root = ET.parse(page).getroot()
    assert len(root.findall(f".//{SVG}svg")) == 1
    text = page.read_text()
    assert "v6e-16: table &#x27;C10&#x27;" in text and "tpu7x-64" in text


def test_charts_are_sized_to_the_page(compared):
    """Every chart is as wide as the page (no fixed size in points, no narrow body), its height from
    its viewBox; the comparison chart is about a landscape page's shape (2 x 2 panels), not a
    strip 3.4 times as wide as high that leaves most of the page blank."""
    for page in (compared / "plan.html", compared / "plan.v5p-64.html"):
        root = ET.parse(page).getroot()
        svgs = root.findall(f".//{SVG}svg")
        assert svgs and all(s.get("width") == "100%" and s.get("height") is None for s in svgs)
        css = page.read_text().split("<style>")[1].split("</style>")[0]
        assert "max-width" not in css.split("body {")[1].split("}")[0]
        assert "svg { width: 100%; height: auto;" in css
    comparison = ET.parse(compared / "plan.html").getroot().find(f".//{SVG}svg")
    _, _, width, height = (float(v) for v in comparison.get("viewBox").split())
    assert 1.4 < width / height < 2.2


def test_plan_json_matches_the_schema(compared, tmp_path):
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    for name in ("v5p-64", "tpu7x-64", "v6e-256"):
        jsonschema.validate(json.loads((compared / f"plan.{name}.json").read_text()), SCHEMA,
                            cls=jsonschema.Draft202012Validator)
    out = tmp_path / "multi.json"
    assert main(["plan", "--tables", str(DLRM_TABLES), "--topology", "v5p-8", "--slices", "4", "--batch-size", "16384",
                 "--max-ids-per-partition", "4096", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    jsonschema.validate(plan, SCHEMA, cls=jsonschema.Draft202012Validator)
    plan["tables"][0]["sharding_type"] = "diagonal"
    with pytest.raises(jsonschema.ValidationError, match="diagonal"):
        jsonschema.validate(plan, SCHEMA, cls=jsonschema.Draft202012Validator)


CHROMIUM = shutil.which("chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--enable-logging=stderr", "--v=0"]


def _chromium(page: Path, profile: Path, *action: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *action, page.as_uri()],
                          capture_output=True, text=True, timeout=120)


def _js_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_report_renders_in_headless_chromium(compared, tmp_path):
    # the harness sees a page's JS errors
    broken = tmp_path / "broken.html"
    broken.write_text("<html><body><script>undefinedFunction();</script></body></html>")
    assert _js_errors(_chromium(broken, tmp_path / "p0", "--dump-dom").stderr)
    for page in (compared / "plan.v6e-256.html", compared / "plan.html"):
        shot = tmp_path / f"{page.stem}.png"
        result = _chromium(page, tmp_path / "p1", "--window-size=1300,2400", f"--screenshot={shot}")
        assert result.returncode == 0, result.stderr[-2000:]
        assert _js_errors(result.stderr) == []
        from PIL import Image

        image = Image.open(shot).convert("L")
        assert image.size == (1300, 2400)
        assert len(set(image.crop((0, 0, 1300, 900)).getdata())) > 16  # charts drawn, not a blank page
        dom = _chromium(page, tmp_path / "p2", "--dump-dom").stdout
        assert "parsererror" not in dom and "This page contains the following errors" not in dom
        assert dom.count("<svg") == (3 if page.stem != "plan" else 1)
        if page.stem == "plan":  # the compare page: slices of different sizes side by side per chip
            assert "samples/s per chip" in dom


def test_compare_page_without_any_plan_has_no_chart(tmp_path):
    from torchrec_tpu.planner.report import render_comparison_html

    page = render_comparison_html([("v5e-16", "no SparseCore"), ("v4-8", "no SparseCore")], "none")
    assert "<svg" not in page and "v5e-16: no SparseCore" in page


def test_compare_page_links_each_topologys_report(compared):
    root = ET.parse(compared / "plan.html").getroot()
    links = {a.text: a.get("href") for a in root.iter("{http://www.w3.org/1999/xhtml}a")}
    assert links == {name: f"plan.{name}.html" for name in ("v5p-64", "tpu7x-64", "v6e-256")}  # v6e-16: no plan
    assert all((compared / href).is_file() for href in links.values())


def test_compare_memory_panel_is_not_mostly_empty(compared):
    """Peak memory far below the usable HBM: the panel's axis ends just above the highest bar, not
    at 100% (which left most of it blank)."""
    from torchrec_tpu.planner import charts

    plans = [(name, load_plan(compared / f"plan.{name}.json")) for name in ("v5p-64", "tpu7x-64", "v6e-256")]
    shares = [100 * p.max_memory_bytes / p.usable_hbm_bytes_per_device for _, p in plans]
    assert max(shares) < charts.USABLE_LINE_FROM  # the case this checks
    axes = charts.comparison_figure(plans).axes[2]
    assert axes.get_ylim()[1] <= max(shares) * 1.2
    assert not [line for line in axes.get_lines() if list(line.get_ydata()) == [100, 100]]


def test_single_report_lists_the_fullest_device(tmp_path):
    """v5p-64 at the example's batch: the device holding the most HBM is not among the 8 slowest,
    and both the terminal table and the HTML report list it."""
    from torchrec_tpu.planner.report import format_plan

    assert main(["plan", "--tables", str(DLRM_TABLES), "--topology", "v5p-64", "--batch-size", "65536",
                 "--out", str(tmp_path / "p.json"), "--html", str(tmp_path / "p.html")]) == 0
    plan = load_plan(tmp_path / "p.json")
    fullest = max(plan.devices, key=lambda d: d.memory_bytes)
    slowest = sorted(plan.devices, key=lambda d: (-d.time_s, d.device))[:8]
    assert fullest.device not in [d.device for d in slowest]  # the case this checks
    text = format_plan(plan)
    assert f"the 8 slowest and the fullest (device {fullest.device}):" in text
    rows = [line.split() for line in text.splitlines() if line.strip().endswith(" us")]
    assert [int(r[0]) for r in rows] == [d.device for d in slowest] + [fullest.device]
    assert f"the 8 slowest and the fullest (device {fullest.device})" in (tmp_path / "p.html").read_text()


def test_id_limit_lines_come_below_the_tables_short(capsys):
    """Below the tables: one header, then a short summary line per topology (not 380 characters
    listing every table)."""
    assert main(["plan", "--tables", str(DLRM_TABLES), "--topology", "v5p-64", "--batch-size", "65536"]) == 0
    lines = capsys.readouterr().out.splitlines()
    limits = [i for i, line in enumerate(lines) if line.startswith("max_ids_per_partition per table")]
    devices = [i for i, line in enumerate(lines) if line.strip().endswith(" us")]
    assert len(limits) == 1 and devices and min(limits) > max(devices)
    assert lines[limits[0] + 1] == ("  v5p-64: 128 to 4096: C21 4096, C22 3456, C20 1536, C23 1280, "
                                    "22 more from 128 to 1152")
    main(["plan", "--tables", str(DLRM_TABLES), "--compare", "v5p-64,tpu7x-64", "--batch-size", "65536"])
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("topology "))
    limits = next(i for i, line in enumerate(lines) if line.startswith("max_ids_per_partition per table"))
    assert limits > header + 2 and [line.split(":")[0] for line in lines[limits + 1:limits + 3]] == \
        ["  v5p-64", "  tpu7x-64"]
    assert max(len(line) for line in lines[limits:]) <= 110
