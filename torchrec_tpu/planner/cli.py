"""``torchrec-tpu plan``: shard embedding tables onto a TPU slice from a laptop.

Examples::

    torchrec-tpu plan --tables tables.yaml --topology v5p-64 --batch-size 65536 \\
        --out plan.json --html plan.html
    torchrec-tpu plan --tables mymodel:make_ebc --pooling-factor 1 --compare v5p-64,v6e-64,tpu7x-64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipelines.flag_numbers import non_negative_int, positive_int
from pipelines.output_paths import check_outputs_apart
from tpu_facts import DEFAULT_MAX_IDS_PER_PARTITION, MAX_IDS_PER_PARTITION_CEILING


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tables", required=True,
                        help="tables file (.yaml/.json/.csv) or 'module:function' returning an EBC or "
                             "EmbeddingBagConfigs")
    parser.add_argument("--topology", default="v5p-64",
                        help="slice name (v5p-64 = 32 chips, v6e-64 = 64 chips, tpu7x-64 = 32 chips; v5e and v4 "
                             "slices are known but refused: no SparseCore jax-tpu-embedding drives) or topology file")
    parser.add_argument("--slices", type=positive_int, default=1, metavar="N",
                        help="number of slices joined by DCN (multislice)")
    parser.add_argument("--batch-size", type=positive_int, default=65536, metavar="N", help="global batch size")
    parser.add_argument("--dense-params", type=non_negative_int, default=0, metavar="N",
                        help="parameters of the data-parallel dense towers: the plan prices their float32 "
                             "gradient all-reduce, hierarchical with --slices > 1 (ICI within each slice, then "
                             "DCN across slices); it does not move tables (default: 0, not priced)")
    parser.add_argument("--pooling-factor", action="append", default=[], metavar="[TABLE=]F",
                        help="mean ids per sample: 'F' for every table or 'TABLE=F'; repeatable (default: the "
                             "tables file's pooling_factor, else 1)")
    parser.add_argument("--optimizer", default="sgd", help="optimizer for tables from a Python model")
    parser.add_argument("--max-ids-per-partition", type=positive_int, default=None, metavar="N",
                        help="SparseCore per-partition id limit of every table; a table's own "
                             "max_ids_per_partition (file column, sparsecore spec) takes precedence (default: per "
                             "table from its pooling factor and the batch, as FDO would set it, at most "
                             f"{MAX_IDS_PER_PARTITION_CEILING}; printed)")
    parser.add_argument("--fdo-stats", type=Path, metavar="FILE",
                        help="plan with the id limits `train --fdo` recorded (its <log-dir>/fdo_stats.json): each "
                             "table it names gets its stack's max_ids_per_partition, over the tables file's and "
                             "the estimate (default: none)")
    parser.add_argument("--compare", default="", metavar="TOPO,TOPO,...",
                        help="what-if: plan on each of these topologies and print a comparison "
                             "(default: only --topology)")
    parser.add_argument("--out", type=Path, metavar="PATH",
                        help="write the plan JSON here (default: not written)")
    parser.add_argument("--html", type=Path, metavar="PATH",
                        help="write a self-contained HTML report here; with --compare, the comparison here and "
                             "one report per topology next to it (default: not written)")
    parser.add_argument("--top", type=positive_int, default=20, metavar="N",
                        help="tables to list in the terminal table")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=False,
                        help="show a progress bar while costing tables")


def _pooling(values: list[str]) -> tuple[float | None, dict[str, float]]:
    default, per_table = None, {}
    for value in values:
        name, sep, number = value.rpartition("=")
        try:
            factor = float(number)
        except ValueError:
            raise ValueError(f"--pooling-factor {value!r}: {number!r} is not a number") from None
        if sep:
            per_table[name] = factor
        else:
            default = factor
    return default, per_table


ID_LIMITS_HEADER = ("max_ids_per_partition per table, from pooling factor and batch (--max-ids-per-partition N "
                    "sets one for all):")


def _suffixed(path: Path, topology: str) -> Path:
    return path.with_name(f"{path.stem}.{topology}{path.suffix}")


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from sparsecore.fdo_stats import read_stats
    from torchrec_tpu.errors import USER_ERROR, print_error, report_user_error
    from torchrec_tpu.planner.id_limits import auto_id_limits, describe_id_limits, fdo_id_limits, with_id_limits
    from torchrec_tpu.planner.partitioner import PlanningError, plan_tables
    from torchrec_tpu.planner.report import format_comparison, format_plan, render_comparison_html, render_html
    from torchrec_tpu.planner.tables import load_tables
    from torchrec_tpu.topology import resolve_topology

    try:
        check_outputs_apart([("--out", args.out), ("--html", args.html)],
                            [("--tables", args.tables), ("--topology", args.topology)])
        default_pf, per_table_pf = _pooling(args.pooling_factor)
        tables = load_tables(args.tables, per_table_pf, args.optimizer)
        if default_pf is not None:
            tables = [t if t.name in per_table_pf else replace(t, pooling_factor=default_pf) for t in tables]
        fdo = {} if args.fdo_stats is None else fdo_id_limits(
            tables, read_stats(args.fdo_stats, "--fdo-stats"), f"--fdo-stats {args.fdo_stats}")
        tables = with_id_limits(tables, fdo)
        names = [n.strip() for n in args.compare.split(",") if n.strip()] or [args.topology]
        topologies = [resolve_topology(n, args.slices) for n in names]
    except (ValueError, FileNotFoundError, ImportError, TypeError) as err:
        return report_user_error("plan", err)

    compare = len(names) > 1
    results = []
    # printed below the tables: a short line per topology (after FDO's, which hold on every one)
    id_limit_lines = [f"  from --fdo-stats {args.fdo_stats}: {describe_id_limits(fdo)}"] if fdo else []
    for name, topology in zip(names, topologies):
        try:
            planned = tables
            if args.max_ids_per_partition is None:
                limits = auto_id_limits(tables, topology, args.batch_size)
                planned = with_id_limits(tables, limits)
                if limits:
                    id_limit_lines.append(f"  {name}: {describe_id_limits(limits)}")
            limit = args.max_ids_per_partition or DEFAULT_MAX_IDS_PER_PARTITION
            results.append((name, plan_tables(planned, topology, args.batch_size, limit,
                                              progress=args.progress, dense_params=args.dense_params)))
        except (PlanningError, ValueError) as err:
            if not compare:  # the comparison table names every failure (printed once)
                return report_user_error("plan", err)
            results.append((name, str(err)))

    pages = {}
    for name, result in results:
        if isinstance(result, str):
            continue
        if not compare:
            print(format_plan(result, args.top))
            if id_limit_lines:
                print("\n".join(["", ID_LIMITS_HEADER, *id_limit_lines]))
        if args.out:
            out = _suffixed(args.out, name) if compare else args.out
            out.parent.mkdir(parents=True, exist_ok=True)
            result.save(out)
            print(f"wrote plan {out}")
        if args.html:
            html = _suffixed(args.html, name) if compare else args.html
            html.parent.mkdir(parents=True, exist_ok=True)
            html.write_text(render_html(result, f"torchrec-tpu plan: {len(tables)} tables on {result.topology.name}"))
            pages[name] = html.name  # written next to the comparison page
            print(f"wrote report {html}")
    if compare:
        print(format_comparison(results))
        if id_limit_lines:
            print("\n".join(["", ID_LIMITS_HEADER, *id_limit_lines]))
        if args.html:
            args.html.parent.mkdir(parents=True, exist_ok=True)
            args.html.write_text(render_comparison_html(results, f"torchrec-tpu plan: {len(tables)} tables on "
                                                                 f"{', '.join(names)}", pages))
            print(f"wrote comparison report {args.html}")
    failed = [name for name, result in results if isinstance(result, str)]
    if failed:
        print_error("plan", f"no plan for {', '.join(failed)} (reasons in the table above)")
        return USER_ERROR
    return 0


if __name__ == "__main__":  # as ``torchrec-tpu plan``: the one entry point reports the errors
    from torchrec_tpu.cli import main

    sys.exit(main(["plan", *sys.argv[1:]]))
