"""``torchrec-tpu data``: prepare datasets (``convert`` text logs to Parquet, ``generate`` synthetic,
``sequences``: HSTU sequence Parquet in time windows).

Follows the CLI contract: ``add_arguments(parser)`` and ``run(args) -> int``; pyarrow, numpy and
the rest are imported inside ``run`` so ``--help`` stays fast. Errors propagate to
``torchrec_tpu.cli.main``, which prints them as ``torchrec-tpu data convert: error: ...`` (rc 2).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipelines.flag_numbers import non_negative_float, non_negative_int, positive_int
from pipelines.output_paths import check_outputs_apart


def _add_output_arguments(parser: argparse.ArgumentParser, rows_per_file: int, row_group_size: int) -> None:
    parser.add_argument("--output", "-o", type=Path, required=True, help="empty output directory")
    parser.add_argument("--rows-per-file", type=positive_int, default=rows_per_file, metavar="N",
                        help="rows per Parquet file")
    parser.add_argument("--row-group-size", type=positive_int, default=row_group_size, metavar="N",
                        help="rows per Parquet row group")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="show a tqdm progress bar")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="data_command", required=True, metavar="DATA_COMMAND")

    convert = commands.add_parser(
        "convert", formatter_class=parser.formatter_class,
        help="convert Criteo TSV (headerless) / CSV (with header) logs to Parquet",
        description="Convert Criteo text logs to Parquet, streaming, with every row accounted for.",
    )
    convert.add_argument("inputs", nargs="+", type=Path, help="text files (.gz etc. are decompressed)")
    _add_output_arguments(convert, rows_per_file=1 << 22, row_group_size=1 << 17)
    convert.add_argument(
        "--format", choices=("auto", "tsv", "csv"), default="auto",
        help="auto: *.csv has a header, anything else is headerless TSV",
    )
    convert.add_argument(
        "--on-bad-row", choices=("error", "skip"), default="error",
        help="stop at the first malformed row or count and skip such rows",
    )
    convert.add_argument(
        "--max-line-bytes", type=positive_int, metavar="N",
        help="longest input line read; a longer one stops the conversion (default: 64 MiB)",
    )

    generate = commands.add_parser(
        "generate", formatter_class=parser.formatter_class,
        help="write a synthetic Criteo-like dataset (Zipf ids, missing values, learnable labels)",
        description="Write a deterministic synthetic Criteo-like dataset as Parquet.",
    )
    _add_output_arguments(generate, rows_per_file=1 << 18, row_group_size=1 << 16)
    generate.add_argument("--rows", type=positive_int, default=1_000_000, metavar="N",
                          help="rows to generate")
    generate.add_argument("--seed", type=non_negative_int, default=0, metavar="N", help="random seed")
    generate.add_argument(
        "--max-cardinality", type=positive_int, default=100_000,
        metavar="N", help="cap on each MLPerf DLRM-DCNv2 table size",
    )
    generate.add_argument("--zipf-exponent", type=non_negative_float, default=1.05, metavar="X",
                          help="Zipf exponent of the id distributions")
    generate.add_argument("--vocabulary-drift", type=non_negative_float, default=0.0, metavar="X",
                          help="every id moves up by X table sizes over the rows: new ids appear, old ones fade "
                               "(train them raw: train --zch)")
    generate.add_argument(
        "--multi-hot", default="", metavar="C1,C2,...",
        help="comma-separated categorical columns stored as list<int64> of Poisson lengths "
             "(default: none)"
    )
    generate.add_argument(
        "--multi-hot-sizes", default="", metavar="K,K,...",
        help="MLPerf DLRM-DCNv2 multi-hot: exactly K ids per row for each categorical column "
             "(one K per column, or one for all; K > 1 makes the column list<int64>) (default: one-hot)",
    )


    sequences = commands.add_parser(
        "sequences", formatter_class=parser.formatter_class,
        help="write HSTU sequence Parquet in time windows from MovieLens, Yambda or synthetic events",
        description="Write a sequence dataset (one Parquet file per time window, meta.json) for "
                    "`torchrec-tpu train --model hstu`: train on window T, evaluate on T + 1.",
    )
    sequences.add_argument("source", choices=("movielens", "yambda", "synthetic", "movielens-sample"),
                           help="movielens: ml-1m ratings.dat or ml-20m ratings.csv; yambda: its Parquet "
                                "(file or directory); synthetic: generated; movielens-sample: the bundled "
                                "200 real rows")
    sequences.add_argument("input", nargs="?", type=Path, default=None,
                           help="the source file or directory (movielens, yambda)")
    sequences.add_argument("--output", "-o", type=Path, required=True, help="empty output directory")
    sequences.add_argument("--windows", type=positive_int, default=4, metavar="N",
                           help="time windows of equal event counts")
    sequences.add_argument("--max-history", type=positive_int, default=200, metavar="N",
                           help="history events kept before each row's candidates")
    sequences.add_argument("--candidates", type=positive_int, default=4, metavar="N",
                           help="candidates per row (a user's next events in the window)")
    sequences.add_argument("--max-item-rows", type=positive_int, default=None, metavar="N",
                           help="item ids must lie below N: the item table's rows (default: 2^24 = 16,777,216)")
    sequences.add_argument("--users", type=positive_int, default=2000, metavar="N", help="synthetic: users")
    sequences.add_argument("--items", type=positive_int, default=1000, metavar="N", help="synthetic: items")
    sequences.add_argument("--events-per-user", type=positive_int, default=60, metavar="N",
                           help="synthetic: mean events per user")
    sequences.add_argument("--seed", type=non_negative_int, default=0, metavar="N", help="synthetic: random seed")


def _multi_hot_sizes(text: str, count: int) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--multi-hot-sizes={text!r} must be comma-separated integers") from None
    sizes = sizes * count if len(sizes) == 1 else sizes
    if len(sizes) != count or min(sizes) < 1:
        raise ValueError(f"--multi-hot-sizes={text!r} needs one size >= 1 per categorical column ({count}), "
                         "or one for all")
    return sizes


def _convert(args: argparse.Namespace) -> int:
    from pipelines.convert import convert_to_parquet
    from pipelines.text_reader import CSV, TSV

    check_outputs_apart([("--output", args.output)], [("input", path) for path in args.inputs])
    text_format = {"auto": None, "tsv": TSV, "csv": CSV}[args.format]
    report = convert_to_parquet(  # malformed rows (BadRowError), a bad header, files: the CLI's one error line
        args.inputs,
        args.output,
        text_format=text_format,
        on_bad_row=args.on_bad_row,
        rows_per_file=args.rows_per_file,
        row_group_size=args.row_group_size,
        progress=args.progress,
        **({} if args.max_line_bytes is None else {"max_line_bytes": args.max_line_bytes}),
    )
    print(report.summary())
    for bad_row in report.bad_rows:
        print(f"  skipped {bad_row}")
    if report.rows_skipped > len(report.bad_rows):
        print(f"  ... and {report.rows_skipped - len(report.bad_rows)} more")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from pipelines.schema import CRITEO
    from pipelines.synthetic import SyntheticConfig, generate

    if args.zipf_exponent < 0:
        raise ValueError(f"--zipf-exponent {args.zipf_exponent}: must be >= 0")
    multi_hot = tuple(name for name in args.multi_hot.split(",") if name)
    unknown = sorted(set(multi_hot) - set(CRITEO.sparse))
    if unknown:
        raise ValueError(f"--multi-hot {args.multi_hot}: {', '.join(unknown)} not categorical columns "
                         f"(C1 .. C{len(CRITEO.sparse)})")
    config = SyntheticConfig(
        multi_hot_sizes=_multi_hot_sizes(args.multi_hot_sizes, len(CRITEO.sparse)),
        num_rows=args.rows,
        seed=args.seed,
        max_cardinality=args.max_cardinality,
        zipf_exponent=args.zipf_exponent,
        vocabulary_drift=args.vocabulary_drift,
        multi_hot=multi_hot,
        rows_per_file=args.rows_per_file,
        row_group_size=args.row_group_size,
    )
    files = generate(config, args.output, progress=args.progress)
    print(f"wrote {config.num_rows:,} rows to {len(files)} Parquet files in {args.output}")
    print(f"table sizes (num_embeddings_per_feature): {','.join(map(str, config.table_sizes))}")
    return 0


def _sequences(args: argparse.Namespace) -> int:
    from pipelines.sequences import read_movielens, read_yambda, synthetic_events, write_sequences
    from pipelines.sequences.sources import MAX_ITEM_ROWS

    needs_input = args.source in ("movielens", "yambda")
    if needs_input != (args.input is not None):
        raise ValueError(f"data sequences {args.source}: " + ("name the input file or directory" if needs_input
                                                              else f"takes no input (got {args.input})"))
    max_item_rows = args.max_item_rows or MAX_ITEM_ROWS
    check_outputs_apart([("--output", args.output)], [("input", args.input)])
    if args.source == "synthetic":
        if args.items > max_item_rows:
            raise ValueError(f"data sequences synthetic: --items {args.items} is above --max-item-rows {max_item_rows}")
        events = synthetic_events(args.users, args.items, args.events_per_user, args.seed)
    elif args.source == "movielens-sample":
        from pipelines.sample_data import movielens_sample_csv

        events = read_movielens(movielens_sample_csv())
    else:
        events = (read_movielens if args.source == "movielens" else read_yambda)(args.input, max_item_rows)
    meta = write_sequences(events, args.output, windows=args.windows, max_history=args.max_history,
                           candidates=args.candidates)
    print(f"wrote {sum(meta.rows):,} rows of {len(events):,} {meta.source} events to {args.output}: "
          f"{meta.windows} windows ({', '.join(f'{n:,}' for n in meta.rows)} rows), tasks {', '.join(meta.tasks)}, "
          f"{meta.item_rows:,} item rows")
    return 0


def run(args: argparse.Namespace) -> int:
    return {"convert": _convert, "generate": _generate, "sequences": _sequences}[args.data_command](args)
