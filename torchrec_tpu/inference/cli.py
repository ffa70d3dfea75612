"""``torchrec-tpu infer``: flags -> :func:`torchrec_tpu.inference.job.run_inference`."""

from __future__ import annotations

import argparse
import sys

from pipelines.flag_numbers import positive_int
from pipelines.output_paths import check_outputs_apart
from torchrec_tpu.inference.export_files import MODEL
from torchrec_tpu.inference.job import DEVICES
from torchrec_tpu.inference.table_dtypes import TABLE_DTYPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, help="Parquet file or directory to predict")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="DIR",
                        help="a model directory of 'torchrec-tpu export' (its tables at the dtype exported at), "
                             "instead of --checkpoint (default: none; one of the two is required)")
    source.add_argument("--checkpoint",
                        help="checkpoint of 'torchrec-tpu train': a checkpoint root (its latest) "
                             "or one version directory (meta.json + state/; HSTU's: meta.json + *-rank-*.pt, "
                             "whose --data is sequence rows and whose output has a row per candidate) (default: none; "
                             "this or --model is required)")
    parser.add_argument("--output", required=True,
                        help="output directory of prediction Parquet parts; rerun to resume")
    parser.add_argument("--key-columns", default="", metavar="A,B",
                        help="input columns copied into the output next to each prediction (default: none)")
    parser.add_argument("--row-id-column", default="row_id", metavar="NAME",
                        help="name of the global row index column ('' for none)")
    parser.add_argument("--table-dtype", choices=TABLE_DTYPES, default=None,
                        help="dtype the DLRM's embedding tables are held and looked up at: int8 / int4 row-wise "
                             "quantized with a per-row fp16 scale and bias as FBGEMM's inference TBE stores them "
                             "(TorchRec's quantize_inference_model), dequantized row by row in the lookup; fp16 / "
                             "bf16 a cast; HSTU checkpoints: fp32 only (default: fp32; --model: the dtype it was "
                             "exported at)")
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="where the model runs. tpu: as the trainer lays it out, the tables sharded on "
                             "the SparseCore ops and the towers (HSTU: the STU stack and heads) on the tpu device, "
                             "a DLRM's lookup and towers one compiled program per batch (fp32 tables, "
                             "--concurrency 1); cpu: eager torch on the host, the reference path (and the one for "
                             "quantized tables, exported models and several actors); auto: tpu when a TPU is "
                             "attached and the model is one it serves, or at several ranks under torchrun (the "
                             "tables sharded over them, each rank scoring its share of the parts), else cpu (on "
                             "XLA:CPU the compiled program is slower than eager torch); the choice and its reason "
                             "are logged. On the host a one-hot fp32 checkpoint's tables are one tensor, each batch's "
                             "ids gathered from it in one lookup; the rest go through TorchRec's EBC or FBGEMM's TBE")
    parser.add_argument("--plan", default=None, metavar="PLAN",
                        help="--device tpu: how the tables are sharded over the ranks, as train's --plan: a "
                             "'torchrec-tpu plan' JSON, or 'auto' (default: whole tables balanced over the ranks)")
    parser.add_argument("--batch-size", type=positive_int, default=4096, help="rows per forward pass")
    parser.add_argument("--concurrency", type=positive_int, default=1,
                        help="1: predict in this process, without Ray (nothing to start, the model loaded once, "
                             "no results shipped between processes: the fastest path on one host); more: that "
                             "many Ray actors, each holding one copy of the model")
    parser.add_argument("--num-cpus", type=positive_int, default=2,
                        help="CPU threads of the in-process predictor (--concurrency 1), else CPUs of the local "
                             "Ray instance, shared by its actors")
    parser.add_argument("--bad-values", choices=("error", "skip", "clamp"), default="error",
                        help="rows with a dense value that is infinite or beyond float32 (NaN is "
                             "missing, read as 0), or, with --label, a label outside [0, 1], as train: "
                             "error naming file, row and column (default); skip them (no prediction, "
                             "counted); or clamp into range")
    parser.add_argument("--label", action=argparse.BooleanOptionalAction, default=True,
                        help="copy the input's label column into the output next to each prediction when the "
                             "input has one, and report the output's offline AUC (HSTU: label_<task> and "
                             "prediction_<task>, an AUC per task)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="show a tqdm progress bar (not on a terminal: a progress line at least every 30 s)")


def run(args: argparse.Namespace) -> int:
    """Errors (Ray's wrappers of an actor's error included) go to ``torchrec_tpu.cli.main``: one
    ``torchrec-tpu infer: error:`` line, rc 2 for bad inputs, the traceback in a log file
    otherwise. A missing checkpoint or input is reported before torch and ray are imported."""
    from pathlib import Path

    from torchrec_tpu.train.checkpoint.dirs import resolve_checkpoint
    from torchrec_tpu.train.checkpoint.hstu_files import find_hstu_checkpoint, refuse_unserved
    from torchrec_tpu.train.preflight import check_parquet_input

    if args.model is not None:
        if args.table_dtype is not None:
            raise ValueError(f"--table-dtype {args.table_dtype}: an exported model (--model) keeps the dtype it "
                             "was exported at; export the checkpoint again at another")
        if not Path(args.model, MODEL).is_file():
            raise FileNotFoundError(f"--model={args.model!r} is not a model directory of 'torchrec-tpu export' "
                                    f"(no {MODEL})")
    elif find_hstu_checkpoint(Path(args.checkpoint)) is None:
        resolve_checkpoint(Path(args.checkpoint))  # FileNotFoundError: not a checkpoint
        refuse_unserved(Path(args.checkpoint))
    check_parquet_input("--data", args.data)
    if args.plan not in (None, "auto") and not Path(args.plan).is_file():
        raise FileNotFoundError(f"--plan={args.plan!r}: no such plan file (a 'torchrec-tpu plan' JSON, or 'auto')")
    check_outputs_apart([("--output", args.output)],
                        [("--data", args.data), ("--checkpoint", args.checkpoint), ("--model", args.model)])

    from torchrec_tpu.inference.job import DLRM, EXPORTED, InferenceConfig, run_inference

    config = InferenceConfig(
        data=args.data, checkpoint=args.model or args.checkpoint, model=EXPORTED if args.model else DLRM,
        output=args.output,
        key_columns=tuple(c for c in args.key_columns.split(",") if c),
        row_id_column=args.row_id_column or None, batch_size=args.batch_size,
        concurrency=args.concurrency, num_cpus=args.num_cpus, progress=args.progress,
        bad_values=args.bad_values, with_label=args.label, table_dtype=args.table_dtype or "fp32",
        device=args.device, plan=args.plan,
    )
    summary = run_inference(config)
    print(summary.format())
    return 0


if __name__ == "__main__":  # as ``torchrec-tpu infer``: the one entry point reports the errors
    from torchrec_tpu.cli import main

    sys.exit(main(["infer", *sys.argv[1:]]))
